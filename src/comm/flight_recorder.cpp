#include "cohort/comm/flight_recorder.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <set>

namespace cohort::comm {
namespace {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

const char* to_string(FlightState state) {
  switch (state) {
    case FlightState::kCompleted:
      return "completed";
    case FlightState::kFailed:
      return "failed";
    case FlightState::kTimedOut:
      return "timed out";
    case FlightState::kAborted:
      return "aborted";
    case FlightState::kStarted:
      break;
  }
  return "started";
}

namespace {

// A slot's text capacities, reserved when the recorder is made: a group's name, an operation's,
// and the transport with the group's activity ("gloo, ZeRO-3 all-gather of unit 'blocks.11'
// (prefetch for backward)" is 67). A dtype's name fits the string itself. Longer texts grow
// their slot once.
constexpr size_t kNameBytes = 48, kDetailBytes = 128;

}  // namespace

FlightRecorder::FlightRecorder(size_t capacity)
    : capacity_(std::max<size_t>(1, capacity)), ring_(capacity_) {
  // Every slot's buffers now, while the process sets up, and refilled in place from then on:
  // a recorder that allocated the strings of each operation as it ran would leave a few small
  // blocks, each operation's, among a step's activations for the slot's lifetime, and the heap
  // would grow by what no longer fits between them (the zoo's GPT under ZeRO-3: the peak
  // resident memory 980 MB after 10 steps where it was 838 MB without a recorder).
  for (auto& slot : ring_) {
    slot.group.reserve(kNameBytes);
    slot.op.reserve(kNameBytes);
    slot.detail.reserve(kDetailBytes);
  }
}

void FlightRecorder::add_group(const std::string& name, const std::vector<int>& global_ranks) {
  std::lock_guard lock(mutex_);
  for (auto& [known, group] : groups_) {
    if (known == name) {
      group.ranks = global_ranks;
      return;
    }
  }
  groups_.push_back({name, Group{.ranks = global_ranks}});
}

int64_t FlightRecorder::begin(const FlightEntry& entry) {
  const double started_s = unix_seconds();
  std::lock_guard lock(mutex_);
  const int64_t id = next_id_++;
  for (auto& [name, group] : groups_) {
    if (name == entry.group) group.entered = std::max(group.entered, entry.seq);
  }
  // Copied, not moved: the slot's strings keep their buffers.
  auto& slot = ring_[static_cast<size_t>(id - 1) % capacity_];
  slot = entry;
  slot.id = id;
  slot.started_s = started_s;
  return id;
}

void FlightRecorder::end(int64_t id, FlightState state) {
  const double now = unix_seconds();
  std::lock_guard lock(mutex_);
  auto& entry = ring_[static_cast<size_t>(id - 1) % capacity_];
  if (entry.id != id || entry.ended_s != 0) return;  // dropped, or ended already
  entry.ended_s = now;
  entry.state = state;
}

void FlightRecorder::note_control(const std::string& type, const std::string& direction) {
  const int64_t id = begin(FlightEntry{.group = "control", .op = type, .detail = direction});
  end(id, FlightState::kCompleted);
}

std::vector<FlightEntry> FlightRecorder::entries() const {
  std::lock_guard lock(mutex_);
  std::vector<FlightEntry> out;
  const int64_t first = std::max<int64_t>(1, next_id_ - static_cast<int64_t>(capacity_));
  for (int64_t id = first; id < next_id_; ++id)
    out.push_back(ring_[static_cast<size_t>(id - 1) % capacity_]);
  return out;
}

int64_t FlightRecorder::dropped() const {
  std::lock_guard lock(mutex_);
  return std::max<int64_t>(0, next_id_ - 1 - static_cast<int64_t>(capacity_));
}

Json FlightRecorder::to_json(int rank, const std::string& reason) const {
  Json groups = Json::object();
  {
    std::lock_guard lock(mutex_);
    for (const auto& [name, group] : groups_)
      groups[name] = Json{{"ranks", group.ranks}, {"entered", group.entered}};
  }
  Json entries = Json::array();
  for (const auto& e : this->entries()) {
    Json entry{{"id", e.id},
               {"group", e.group},
               {"seq", e.seq},
               {"op", e.op},
               {"state", to_string(e.state)},
               {"started_s", e.started_s},
               {"ended_s", e.ended_s}};
    if (!e.dtype.empty()) {
      entry["dtype"] = e.dtype;
      entry["numel"] = e.numel;
      entry["tensors"] = e.tensors;
    }
    if (e.peer >= 0) entry["peer"] = e.peer;
    if (!e.detail.empty()) entry["detail"] = e.detail;
    entries.push_back(std::move(entry));
  }
  return Json{{"rank", rank},
              {"pid", static_cast<int64_t>(::getpid())},
              {"reason", reason},
              {"written_at_s", unix_seconds()},
              {"capacity", static_cast<int64_t>(capacity_)},
              {"dropped", dropped()},
              {"groups", std::move(groups)},
              {"entries", std::move(entries)}};
}

// ---------------------------------------------------------------------------------------------
// flight_divergence

namespace {

// One rank's written records of one group: its count of operations, and those the ring kept, by
// number.
struct GroupRecords {
  int64_t entered = 0;
  std::map<int64_t, const Json*> by_seq;
  const Json* last_overall = nullptr;  // the rank's newest operation of any group
  double written_at_s = 0;
};

std::string what_of(const Json& entry) {
  if (entry.value("group", std::string()) == "control") {
    return "control message " + entry.value("op", std::string("?")) + " (" +
           entry.value("detail", std::string("?")) + ")";
  }
  std::string out = entry.value("op", std::string("?"));
  if (entry.contains("dtype")) {
    out += " (" + entry.value("dtype", std::string()) + ", " +
           std::to_string(entry.value("numel", int64_t{0})) + " elements";
    if (entry.value("tensors", 1) > 1) out += " x " + std::to_string(entry.value("tensors", 1));
    out += ")";
  }
  if (entry.contains("peer")) out += " with group rank " + std::to_string(entry.value("peer", -1));
  return out;
}

// Whether two records are the same call: the same operation on tensors of the same kind and size.
bool same_call(const Json& a, const Json& b) {
  return a.value("op", "") == b.value("op", "") && a.value("dtype", "") == b.value("dtype", "") &&
         a.value("numel", int64_t{0}) == b.value("numel", int64_t{0}) &&
         a.value("tensors", 0) == b.value("tensors", 0);
}

bool point_to_point(const Json& entry) {
  const std::string op = entry.value("op", std::string());
  return op == "send" || op == "recv";
}

// Whether two ranks' records of one number match: the same call, or a send and the recv it feeds.
bool matching(const Json& a, const Json& b) {
  if (same_call(a, b)) return true;
  return point_to_point(a) && point_to_point(b) && a.value("op", "") != b.value("op", "") &&
         a.value("dtype", "") == b.value("dtype", "") &&
         a.value("numel", int64_t{0}) == b.value("numel", int64_t{0});
}

std::string state_of(const Json& entry, double written_at_s) {
  const std::string state = entry.value("state", std::string("?"));
  if (state != "started") return state;
  const double waited = written_at_s - entry.value("started_s", 0.0);
  char text[64];
  std::snprintf(text, sizeof text, "still in it, %.1f s after it began", waited);
  return text;
}

// Whether `value` is a whole number in [lo, hi] (lo <= 0 <= hi).
bool integer_in(const Json& value, int64_t lo, int64_t hi) {
  if (!value.is_number_integer()) return false;
  if (value.is_number_unsigned()) return value.get<uint64_t>() <= static_cast<uint64_t>(hi);
  const int64_t number = value.get<int64_t>();
  return number >= lo && number <= hi;
}
// Whether `object[key]` is absent or a whole number in [lo, hi].
bool integer_or_absent(const Json& object, const char* key, int64_t lo, int64_t hi) {
  const auto it = object.find(key);
  return it == object.end() || integer_in(*it, lo, hi);
}
bool string_or_absent(const Json& object, const char* key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_string();
}
bool number_or_absent(const Json& object, const char* key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_number();
}

// Whether a written entry has every field of the type to_json() gives it: records are read back
// from files a failing rank wrote, and a malformed one must not end the reader.
bool well_formed_entry(const Json& entry) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  return entry.is_object() && string_or_absent(entry, "group") && string_or_absent(entry, "op") &&
         string_or_absent(entry, "dtype") && string_or_absent(entry, "state") &&
         string_or_absent(entry, "detail") && integer_or_absent(entry, "seq", 0, kMax) &&
         integer_or_absent(entry, "numel", 0, kMax) &&
         integer_or_absent(entry, "tensors", 0, kMaxInt) &&
         integer_or_absent(entry, "peer", -1, kMaxInt) && number_or_absent(entry, "started_s");
}

// Whether a written group is {"ranks": [rank, ...], "entered": n}.
bool well_formed_group(const Json& group) {
  if (!group.is_object() ||
      !integer_or_absent(group, "entered", 0, std::numeric_limits<int64_t>::max()))
    return false;
  const auto ranks = group.find("ranks");
  if (ranks == group.end()) return true;
  if (!ranks->is_array()) return false;
  for (const Json& rank : *ranks) {
    if (!integer_in(rank, 0, std::numeric_limits<int>::max())) return false;
  }
  return true;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return "[" + out + "]";
}

}  // namespace

std::string flight_divergence(const std::vector<Json>& records_by_rank) {
  // The groups in the order they first appear, with their members; each rank's records.
  std::vector<std::string> order;
  std::map<std::string, std::vector<int>> members;
  std::vector<std::map<std::string, GroupRecords>> of_rank(records_by_rank.size());
  for (size_t r = 0; r < records_by_rank.size(); ++r) {
    const Json& records = records_by_rank[r];
    if (!records.is_object() || !records.contains("groups") || !records["groups"].is_object() ||
        !records.contains("entries") || !records["entries"].is_array() ||
        !number_or_absent(records, "written_at_s"))
      continue;
    bool well_formed = true;
    for (const auto& [name, group] : records["groups"].items())
      well_formed = well_formed && well_formed_group(group);
    for (const Json& entry : records["entries"])
      well_formed = well_formed && well_formed_entry(entry);
    if (!well_formed) continue;  // malformed: this rank's records tell nothing
    try {
      const double written = records.value("written_at_s", 0.0);
      for (const auto& [name, group] : records["groups"].items()) {
        if (!members.count(name)) {
          order.push_back(name);
          members[name] = group.value("ranks", std::vector<int>{});
        }
        of_rank[r][name] =
            GroupRecords{.entered = group.value("entered", int64_t{0}), .written_at_s = written};
      }
      const Json* newest = nullptr;
      for (const Json& entry : records["entries"]) {
        if (!entry.is_object()) continue;
        newest = &entry;
        const auto it = of_rank[r].find(entry.value("group", std::string()));
        if (it != of_rank[r].end()) it->second.by_seq[entry.value("seq", int64_t{0})] = &entry;
      }
      for (auto& [name, group] : of_rank[r]) group.last_overall = newest;
    } catch (const Json::exception&) {
      of_rank[r].clear();  // malformed: this rank's records tell nothing
    }
  }

  std::vector<std::pair<double, std::string>> found;  // by when the diverging operation began
  for (const auto& name : order) {
    std::vector<int> known, unknown;
    for (int m : members[name]) {
      const bool has = m >= 0 && static_cast<size_t>(m) < of_rank.size() &&
                       of_rank[static_cast<size_t>(m)].count(name);
      (has ? known : unknown).push_back(m);
    }
    if (known.empty()) continue;
    auto records = [&](int m) -> const GroupRecords& {
      return of_rank[static_cast<size_t>(m)].at(name);
    };
    int64_t lo = records(known[0]).entered, hi = lo;
    bool sends_or_receives = false;
    for (int m : known) {
      lo = std::min(lo, records(m).entered);
      hi = std::max(hi, records(m).entered);
      for (const auto& [seq, entry] : records(m).by_seq)
        sends_or_receives = sends_or_receives || point_to_point(*entry);
    }
    std::string line;
    std::optional<double> began;
    auto note_began = [&](const Json* entry) {
      if (entry == nullptr) return;
      const double at = entry->value("started_s", 0.0);
      began = began ? std::min(*began, at) : at;
    };
    auto entry_at = [&](int m, int64_t seq) -> const Json* {
      const auto& by_seq = records(m).by_seq;
      const auto it = by_seq.find(seq);
      return it == by_seq.end() ? nullptr : it->second;
    };
    // The first number, of those every member entered, whose records do not match (of those the
    // rings kept: a written count may be anything).
    std::set<int64_t> kept;
    for (int m : known) {
      for (const auto& [seq, entry] : records(m).by_seq)
        if (seq >= 1 && seq <= lo) kept.insert(seq);
    }
    std::string differs;
    for (const int64_t seq : kept) {
      if (!differs.empty()) break;
      const Json* first = nullptr;
      int first_rank = -1;
      for (int m : known) {
        const Json* entry = entry_at(m, seq);
        if (entry == nullptr) continue;
        if (first == nullptr) {
          first = entry;
          first_rank = m;
        } else if (!matching(*first, *entry)) {
          note_began(first);
          note_began(entry);
          differs = "collective #" + std::to_string(seq) + " differs: rank " +
                    std::to_string(first_rank) + " called " + what_of(*first) + ", rank " +
                    std::to_string(m) + " " + what_of(*entry);
          break;
        }
      }
    }
    if (sends_or_receives && !differs.empty()) {
      // A pipeline's members legitimately send and receive in different orders: name who waits
      // in what.
      std::string waits;
      for (int m : known) {
        for (const auto& [seq, entry] : records(m).by_seq) {
          if (entry->value("state", std::string()) == "completed") continue;
          note_began(entry);
          waits += (waits.empty() ? "" : ", ") + std::string("rank ") + std::to_string(m) +
                   " in #" + std::to_string(seq) + " " + what_of(*entry) + " (" +
                   state_of(*entry, records(m).written_at_s) + ")";
        }
      }
      if (!waits.empty()) line = "unfinished point-to-point operations: " + waits;
    } else if (!differs.empty()) {
      line = differs;
    } else if (lo < hi) {
      // The first call some members entered and others did not.
      const int64_t seq = lo + 1;
      std::vector<int> entered, missing;
      std::string what, in, out;
      for (int m : known) {
        if (records(m).entered >= seq) {
          entered.push_back(m);
          const Json* entry = entry_at(m, seq);
          note_began(entry);
          if (entry != nullptr && what.empty()) what = what_of(*entry);
          in += (in.empty() ? "" : ", ") + std::string("rank ") + std::to_string(m) + " " +
                (entry ? state_of(*entry, records(m).written_at_s) : "kept no record of it");
        } else {
          missing.push_back(m);
          const Json* last = entry_at(m, records(m).entered);
          const Json* newest = records(m).last_overall;
          out += (out.empty() ? "" : ", ") + std::string("rank ") + std::to_string(m) +
                 " (its last: #" + std::to_string(records(m).entered) + " " +
                 (last ? what_of(*last) + ", " + state_of(*last, records(m).written_at_s)
                       : std::string("not kept")) +
                 (newest != nullptr && newest != last
                      ? "; then " +
                            (newest->value("group", std::string()) == "control"
                                 ? std::string()
                                 : newest->value("group", std::string()) + " ") +
                            what_of(*newest) + ", " + state_of(*newest, records(m).written_at_s)
                      : "") +
                 ")";
        }
      }
      line = "collective #" + std::to_string(seq) + (what.empty() ? "" : " " + what) + ": ranks " +
             rank_list(entered) + " entered it (" + in + "); ranks " + rank_list(missing) +
             " did not: " + out;
    } else {
      // Every member entered as many calls: the last one, when some finished it and others not.
      if (hi > 0) {
        std::vector<int> done, waiting;
        std::string what, how;
        for (int m : known) {
          const Json* entry = entry_at(m, hi);
          if (entry == nullptr) continue;
          if (what.empty()) what = what_of(*entry);
          if (entry->value("state", std::string()) == "completed") {
            done.push_back(m);
          } else {
            waiting.push_back(m);
            note_began(entry);
            how += (how.empty() ? "" : ", ") + std::string("rank ") + std::to_string(m) + " " +
                   state_of(*entry, records(m).written_at_s);
          }
        }
        if (!done.empty() && !waiting.empty()) {
          line = "collective #" + std::to_string(hi) + " " + what + ": ranks " + rank_list(done) +
                 " completed it, ranks " + rank_list(waiting) + " did not (" + how + ")";
        } else if (!waiting.empty() && !unknown.empty()) {
          // The others wrote nothing: where these wait is all there is to say.
          line = "collective #" + std::to_string(hi) + " " + what + ": ranks " +
                 rank_list(waiting) + " did not finish it (" + how + ")";
        }
      }
    }
    if (line.empty()) continue;
    if (!unknown.empty()) line += "; no records from ranks " + rank_list(unknown);
    found.emplace_back(began.value_or(0.0), "group " + name + ": " + line);
  }
  std::stable_sort(found.begin(), found.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string report;
  for (const auto& [at, line] : found) report += (report.empty() ? "" : "; ") + line;
  return report;
}

}  // namespace cohort::comm
