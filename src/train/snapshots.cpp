#include "train/snapshots.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include <torch/torch.h>

#include "cohort/error.h"
#include "cohort/hash.h"
#include "train/model_file.h"

namespace cohort::train {
namespace {

// "<prefix><token>_<index>" -> whether it has the prefix.
bool has_prefix(const std::string& name, const std::string& prefix) {
  return name.rfind(prefix, 0) == 0;
}

constexpr const char* kSnapshotPrefix = "snapshot_";
constexpr const char* kStagingPrefix = "staging_";

at::Tensor bytes_tensor(const std::string& bytes) {
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                          torch::kUInt8);
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return "[" + out + "]";
}

// The ranks (of a world of `world`) that `held` has no files of.
std::vector<int> missing_ranks(const std::set<int>& held, int world) {
  std::vector<int> missing;
  for (int r = 0; r < world; ++r)
    if (held.count(r) == 0) missing.push_back(r);
  return missing;
}

// Links `from` as `to`, or copies it where links cannot be made; an existing `to` stays.
void link_or_copy(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (std::filesystem::exists(to)) return;
  std::filesystem::create_directories(to.parent_path());
  std::error_code error;
  std::filesystem::create_hard_link(from, to, error);
  if (error) std::filesystem::copy_file(from, to);
}

}  // namespace

std::filesystem::path snapshot_run_folder(const std::filesystem::path& root,
                                          const std::filesystem::path& run_dir) {
  const auto absolute = std::filesystem::weakly_canonical(std::filesystem::absolute(run_dir));
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx",
                static_cast<unsigned long long>(fnv1a(absolute.string())));
  return root / (absolute.filename().string() + "-" + hash);
}

std::string snapshot_name(const std::string& token, int64_t index) {
  return kSnapshotPrefix + token + "_" + std::to_string(index);
}

std::string snapshot_staging_name(const std::string& token, int64_t index) {
  return kStagingPrefix + token + "_" + std::to_string(index);
}

std::vector<int> snapshot_buddies(const std::vector<int>& node_of_rank) {
  const int world = static_cast<int>(node_of_rank.size());
  std::map<int, std::vector<int>> ranks_of_node;
  for (int r = 0; r < world; ++r) ranks_of_node[node_of_rank[static_cast<size_t>(r)]].push_back(r);
  std::vector<int> nodes;
  for (const auto& [node, ranks] : ranks_of_node) nodes.push_back(node);
  std::vector<int> buddy(static_cast<size_t>(world), -1);
  if (world < 2) return buddy;
  for (size_t n = 0; n < nodes.size(); ++n) {
    const auto& here = ranks_of_node[nodes[n]];
    for (size_t i = 0; i < here.size(); ++i) {
      if (nodes.size() == 1) {
        buddy[static_cast<size_t>(here[i])] = here[(i + 1) % here.size()];
      } else {
        const auto& next = ranks_of_node[nodes[(n + 1) % nodes.size()]];
        buddy[static_cast<size_t>(here[i])] = next[i % next.size()];
      }
    }
  }
  return buddy;
}

void SendsInFlight::wait() {
  for (auto& work : works) work.wait();
  works.clear();
  tensors.clear();
}

SendsInFlight send_files_async(comm::ProcessGroup& group, int peer, const CapturedFiles& files,
                               const std::set<std::string>& except, const KeptTensorFiles* kept) {
  auto sent = files.files();
  sent.erase(std::remove_if(sent.begin(), sent.end(),
                            [&](const auto& file) { return except.count(file.first) > 0; }),
             sent.end());
  // A header (each file's name and size, and for a kept file the sizes of the parts it comes
  // in), its length, then each file's bytes (or parts): the receiver allocates as it learns the
  // sizes.
  Json header = Json::array();
  for (const auto& [name, bytes] : sent)
    header.push_back({{"name", name}, {"size", bytes->size()}});
  // A kept file: its prefix (safetensors::write's), then each tensor's bytes, the tensor's own
  // memory, in the order they lie in memory: the tensors of one buffer (a flat optimizer's
  // parameters or state) then lie in the file as in that buffer, so that the receiver's model
  // and optimizer take the received bytes as their memory (adopt_kept_state).
  std::vector<at::Tensor> parts;
  if (kept != nullptr) {
    for (const auto& [name, file] : *kept) {
      if (except.count(name) > 0) continue;
      std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> layout;
      std::vector<std::pair<uintptr_t, std::string>> by_address;
      for (const auto& [tensor_name, tensor] : file.tensors) {
        layout[tensor_name] = {tensor.scalar_type(), tensor.sizes().vec()};
        by_address.emplace_back(reinterpret_cast<uintptr_t>(tensor.data_ptr()), tensor_name);
      }
      std::stable_sort(by_address.begin(), by_address.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      std::vector<std::string> order;
      for (const auto& entry : by_address) order.push_back(entry.second);
      int64_t data_bytes = 0;
      const auto prefix = safetensors::file_prefix(layout, file.metadata, data_bytes, order);
      Json sizes = Json::array({prefix.size()});
      parts.push_back(bytes_tensor(prefix).clone());
      for (const auto& tensor_name : order) {
        const auto& tensor = file.tensors.at(tensor_name);
        const int64_t bytes = tensor.numel() * static_cast<int64_t>(tensor.element_size());
        sizes.push_back(bytes);
        parts.push_back(torch::from_blob(tensor.data_ptr(), {bytes}, torch::kUInt8));
      }
      header.push_back({{"name", name},
                        {"size", static_cast<int64_t>(prefix.size()) + data_bytes},
                        {"parts", sizes}});
    }
  }
  SendsInFlight sends;
  const std::string text = header.dump();
  sends.tensors.push_back(torch::tensor({static_cast<int64_t>(text.size())}, torch::kInt64));
  auto header_bytes = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  std::memcpy(header_bytes.data_ptr(), text.data(), text.size());
  sends.tensors.push_back(header_bytes);
  for (const auto& [name, bytes] : sent)
    if (!bytes->empty()) sends.tensors.push_back(bytes_tensor(*bytes));
  for (const auto& part : parts)
    if (part.numel() > 0) sends.tensors.push_back(part);
  for (const auto& tensor : sends.tensors) sends.works.push_back(group.send_async(tensor, peer));
  return sends;
}

std::vector<std::pair<std::string, std::string>> receive_files(comm::ProcessGroup& group,
                                                               int peer) {
  auto length = torch::empty({1}, torch::kInt64);
  group.recv(length, peer);
  auto header_bytes = torch::empty({length.item<int64_t>()}, torch::kUInt8);
  group.recv(header_bytes, peer);
  const Json header = Json::parse(std::string(static_cast<const char*>(header_bytes.data_ptr()),
                                              static_cast<size_t>(header_bytes.numel())));
  std::vector<std::pair<std::string, std::string>> files;
  for (const auto& entry : header) {
    // A name that would leave the folder it is written into is no file of a checkpoint.
    const std::filesystem::path name = entry.at("name").get<std::string>();
    for (const auto& part : name) {
      if (name.is_absolute() || part == ".." || name.empty()) {
        throw RuntimeError("rank " + std::to_string(peer) + " sent a snapshot file named '" +
                           name.string() + "', which is not a path inside a checkpoint");
      }
    }
    std::string bytes(entry.at("size").get<size_t>(), '\0');
    if (entry.contains("parts")) {
      // Received part by part into their places in the file.
      size_t at = 0;
      for (const auto& part : entry.at("parts")) {
        const auto size = part.get<size_t>();
        if (size == 0) continue;
        if (at + size > bytes.size())
          throw RuntimeError("rank " + std::to_string(peer) + " sent the parts of " +
                             name.string() + " past its size of " + std::to_string(bytes.size()));
        auto into =
            torch::from_blob(bytes.data() + at, {static_cast<int64_t>(size)}, torch::kUInt8);
        group.recv(into, peer);
        at += size;
      }
    } else if (!bytes.empty()) {
      auto into = bytes_tensor(bytes);
      group.recv(into, peer);
    }
    files.emplace_back(entry.at("name").get<std::string>(), std::move(bytes));
  }
  return files;
}

void to_json(Json& j, const HeldSnapshot& s) {
  j = Json{{"name", s.name},   {"saved_ns", s.saved_ns}, {"world_size", s.world_size},
           {"steps", s.steps}, {"own", s.own},           {"copies", s.copies}};
}

void from_json(const Json& j, HeldSnapshot& s) {
  s.name = j.at("name");
  s.saved_ns = j.at("saved_ns");
  s.world_size = j.at("world_size");
  s.steps = j.value("steps", int64_t{-1});
  s.own = j.at("own").get<std::vector<int>>();
  s.copies = j.at("copies").get<std::vector<int>>();
}

std::vector<HeldSnapshot> held_snapshots(const std::filesystem::path& run_folder) {
  std::vector<HeldSnapshot> held;
  std::error_code error;
  if (!std::filesystem::is_directory(run_folder, error)) return held;
  for (const auto& entry : std::filesystem::directory_iterator(run_folder, error)) {
    const auto name = entry.path().filename().string();
    if (!has_prefix(name, kSnapshotPrefix)) continue;
    const auto meta_file = entry.path() / kSnapshotCheckpointDir / kMetaFile;
    if (!std::filesystem::exists(meta_file)) continue;
    HeldSnapshot s;
    s.name = name;
    try {
      const auto meta = read_json(meta_file);
      s.saved_ns = meta.at("saved_ns");
      s.world_size = meta.at("world_size");
      s.steps = meta.value("metrics", Json::object()).value("steps", int64_t{-1});
    } catch (const std::exception&) {
      continue;  // not one of ours, or altered: never restored from
    }
    for (const auto& [dir, ranks] :
         {std::pair{kSnapshotRanksDir, &s.own}, std::pair{kSnapshotCopiesDir, &s.copies}}) {
      for (const auto& file : std::filesystem::directory_iterator(entry.path() / dir, error)) {
        if (file.path().extension() != ".json") continue;
        try {
          ranks->push_back(std::stoi(file.path().stem().string()));
        } catch (const std::exception&) {
        }
      }
      std::sort(ranks->begin(), ranks->end());
    }
    held.push_back(std::move(s));
  }
  std::sort(held.begin(), held.end(),
            [](const auto& a, const auto& b) { return a.saved_ns > b.saved_ns; });
  return held;
}

SnapshotChoice choose_snapshot(const std::vector<std::vector<HeldSnapshot>>& by_rank, int rank,
                               std::optional<int64_t> disk_saved_ns) {
  // Every snapshot newer than the disk's that some node holds, newest first.
  std::map<int64_t, std::string, std::greater<>> candidates;
  for (const auto& held : by_rank)
    for (const auto& s : held)
      if (!disk_saved_ns || s.saved_ns > *disk_saved_ns) candidates[s.saved_ns] = s.name;
  SnapshotChoice choice;
  // How the snapshot compares with the disk, and what the disk gives instead.
  const std::string newer =
      disk_saved_ns ? ", newer than the latest checkpoint on disk" : " (no checkpoint on disk yet)";
  const std::string otherwise = disk_saved_ns ? "restoring from the latest checkpoint on disk"
                                              : "starting from the beginning";
  for (const auto& [saved_ns, name] : candidates) {
    // What each rank's node holds of it, and all of them together.
    std::set<int> union_of_nodes;
    std::vector<int> incomplete;  // ranks whose node lacks some rank's files
    std::optional<HeldSnapshot> mine;
    int world = 0;
    for (size_t r = 0; r < by_rank.size(); ++r) {
      std::optional<HeldSnapshot> found;
      for (const auto& s : by_rank[r])
        if (s.name == name) found = s;
      std::set<int> here;
      if (found) {
        world = found->world_size;
        here.insert(found->own.begin(), found->own.end());
        here.insert(found->copies.begin(), found->copies.end());
        union_of_nodes.insert(here.begin(), here.end());
      }
      if (!found || missing_ranks(here, found->world_size).size() > 0)
        incomplete.push_back(static_cast<int>(r));
      if (static_cast<int>(r) == rank) mine = found;
    }
    const std::string steps =
        mine && mine->steps >= 0 ? " (step " + std::to_string(mine->steps) + ")" : "";
    if (incomplete.empty()) {
      const auto copied =
          mine ? missing_ranks({mine->own.begin(), mine->own.end()}, world) : std::vector<int>{};
      choice.snapshot = mine;
      choice.why =
          "restoring from the in-memory snapshot " + name + steps + newer +
          (copied.empty() ? ""
                          : ", rank " + std::to_string(rank) +
                                "'s node with the buddy copies of ranks " + ranks_text(copied));
      return choice;
    }
    // The newest one's reason is said; older candidates may still be whole.
    if (!choice.why.empty()) continue;
    const auto lost = missing_ranks(union_of_nodes, world);
    choice.why = "the in-memory snapshot " + name + newer + " cannot be restored from: " +
                 (lost.empty() ? "the nodes of ranks " + ranks_text(incomplete) +
                                     " do not each hold every rank's files (restoring one "
                                     "spread over nodes is not built)"
                               : "no surviving node holds the files of ranks " + ranks_text(lost)) +
                 "; ";
  }
  if (!choice.why.empty()) choice.why += otherwise;
  return choice;
}

std::optional<int64_t> saved_ns_of(const std::filesystem::path& checkpoint) {
  try {
    const auto meta = read_json(checkpoint / kMetaFile);
    if (meta.contains("saved_ns")) return meta["saved_ns"].get<int64_t>();
    if (meta.contains("timestamp")) return meta["timestamp"].get<int64_t>() * 1000000000;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

std::filesystem::path snapshot_checkpoint(const std::filesystem::path& run_folder,
                                          const HeldSnapshot& held, int rank) {
  const auto dir = run_folder / held.name;
  const auto own = dir / kSnapshotCheckpointDir;
  const std::set<int> own_ranks(held.own.begin(), held.own.end());
  if (missing_ranks(own_ranks, held.world_size).empty()) return own;
  // Each restoring rank of the node makes its own: nothing to agree on between them.
  const auto made = dir / ("restored-rank" + std::to_string(rank));
  remove_tree(made);
  for (const auto& entry : std::filesystem::recursive_directory_iterator(own)) {
    if (!entry.is_regular_file()) continue;
    const auto relative = std::filesystem::relative(entry.path(), own);
    if (relative == kManifestFile) continue;
    link_or_copy(entry.path(), made / relative);
  }
  for (int w : missing_ranks(own_ranks, held.world_size)) {
    const auto copy = dir / kSnapshotCopiesDir / std::to_string(w);
    if (!std::filesystem::is_directory(copy)) continue;  // a rank without files
    for (const auto& entry : std::filesystem::recursive_directory_iterator(copy)) {
      if (entry.is_regular_file())
        link_or_copy(entry.path(), made / std::filesystem::relative(entry.path(), copy));
    }
  }
  write_manifest(made);
  return made;
}

void prune_snapshots(const std::filesystem::path& run_folder, size_t keep,
                     const std::string& token) {
  const auto held = held_snapshots(run_folder);
  for (size_t i = keep; i < held.size(); ++i) remove_tree(run_folder / held[i].name);
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(run_folder, error)) {
    const auto name = entry.path().filename().string();
    if (has_prefix(name, kStagingPrefix) &&
        !has_prefix(name, std::string(kStagingPrefix) + token + "_"))
      remove_tree(entry.path());
  }
}

}  // namespace cohort::train
