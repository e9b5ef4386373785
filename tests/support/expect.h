// Assertions on error messages: bad input must be named, not only rejected.
#pragma once
#include <gtest/gtest.h>

#include <string>

namespace cohort::testing {

// Expects `f()` to throw E whose message contains `fragment`.
template <typename E, typename F>
void expect_error(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << fragment << "'";
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace cohort::testing
