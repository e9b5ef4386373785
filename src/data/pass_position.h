// The place of a stream's pass in its epoch, kept alike by DataIterator and DataLoader: where a
// resumed run said to start, the position of the pass begun last, and who hears of it.
#pragma once
#include <cstdint>
#include <functional>
#include <utility>

#include "cohort/data/epoch_position.h"

namespace cohort::data {

// The start of the pass of `epoch` from a resumed run's `resume` (which applies once, so it is
// cleared); none for another epoch.
inline EpochStart take_start(EpochStart& resume, int64_t epoch) {
  return resume.epoch == epoch ? std::exchange(resume, EpochStart{}) : EpochStart{};
}

struct PassPosition {
  EpochPosition position;
  std::function<void(const EpochPosition&)> on_position;

  // The consumer took a batch of `rows`; the pass ended.
  void took(int64_t rows) {
    position.yielded_rows += rows;
    tell();
  }
  void finished() {
    position.finished = true;
    tell();
  }

 private:
  void tell() const {
    if (on_position) on_position(position);
  }
};

}  // namespace cohort::data
