#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "cohort/comm/flight_recorder.h"
#include "cohort/comm/store.h"
#include "cohort/timeouts.h"

namespace cohort::comm {

/// How a collective combines the ranks' values (kAvg: the sum over the world size).
enum class ReduceOp { kSum, kAvg, kMax, kMin };

/// Which transport runs a group's collectives.
enum class Backend {
  /// Gloo for CPU tensors, NCCL for CUDA tensors (Gloo's CUDA path where libtorch has no NCCL).
  kAuto,
  /// Gloo for every tensor, CUDA ones through Gloo's CUDA path: e.g. several ranks sharing one GPU,
  /// which NCCL refuses.
  kGloo,
  /// NCCL only: CUDA tensors only.
  kNccl,
};
/// "auto", "gloo" or "nccl".
const char* to_string(Backend backend);
/// "auto", "gloo" or "nccl"; anything else is a UsageError naming the value.
Backend backend_from_string(const std::string& name);
/// Whether this libtorch can run NCCL collectives (a CUDA build with c10d's NCCL group).
bool nccl_available();

/// How ProcessGroup::create() joins: the interface, deadlines, threads, key prefix and backend.
struct ProcessGroupOptions {
  /// Address of this host's interface that the transport binds to.
  std::string interface_address = "127.0.0.1";
  /// Deadline for every rank to join the group.
  std::chrono::milliseconds setup_timeout = kDefaultSetupTimeout;
  /// Deadline of each collective.
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  /// Transport threads of the backend; 1 keeps them from competing with compute on small hosts.
  int threads = 1;
  /// Keys of this group live under this prefix in the store, so several groups share one store.
  std::string prefix = "pg";
  Backend backend = Backend::kAuto;  ///< which transport runs the collectives
  /// Asked about every 100 ms while a collective on CPU tensors is waited for: true ends the wait
  /// with PeerFailureError. The group is unusable then (the collective still runs inside it until
  /// its deadline: keep the group alive, its destructor would wait for it). Live recovery sets it
  /// to "a peer was lost since the group was made", which a transport does not always notice.
  std::function<bool()> aborted;
  /// Where the group records its collectives and point-to-point operations (flight_recorder.h).
  /// Null: create() makes one of `flight_recorder_entries`; sub-groups share their parent's.
  std::shared_ptr<FlightRecorder> flight_recorder;
  /// The operations the recorder create() makes keeps; 0: the group records nothing.
  size_t flight_recorder_entries = kDefaultFlightRecorderEntries;
};

/// An in-flight collective. For CPU tensors wait() blocks until the result is there. For CUDA
/// tensors it is stream-ordered: the caller's current stream waits for the collective, the host
/// does not (call synchronize() to block the host too).
class Work {
 public:
  struct State;  ///< opaque; defined in src/comm/process_group.cpp
  Work() = default;
  /// A handle of `state` (the process group makes them).
  explicit Work(std::shared_ptr<State> state) : state_(std::move(state)) {}
  /// Completes the collective (see above). Throws TimeoutError past the group's timeout naming
  /// the collective, PeerFailureError when a peer died or closed its connection.
  void wait();
  /// wait(), then blocks the host until the device work is done as well.
  void synchronize();
  /// Whether the collective has finished (without waiting).
  bool completed() const;
  /// Whether it is a handle of a collective (false: default-constructed).
  bool valid() const { return state_ != nullptr; }
  /// Runs `fn` in wait(), after the collective completed (e.g. to decompress a result).
  Work& then(std::function<void()> fn);

 private:
  std::shared_ptr<State> state_;
};

/// A group of ranks that run collectives together (Gloo and NCCL underneath, by tensor device).
/// Passed by value: copies refer to the same group. Every collective must be called by every
/// rank of the group in the same order; tensors of one call share dtype and device.
///
/// A peer that dies fails the collectives that wait on it (PeerFailureError). So that writing to
/// its closed socket cannot kill this process instead, the first Gloo group sets SIGPIPE to
/// "ignore" when it is at its default (a handler the program installed is kept).
class ProcessGroup {
 public:
  /// An empty handle; use create() or new_group().
  ProcessGroup() = default;
  /// Joins the group of `world_size` ranks as `rank` through `store` (a collective: every rank
  /// calls it within options.setup_timeout). Throws TimeoutError naming the ranks that never came.
  static ProcessGroup create(Store store, int rank, int world_size,
                             const ProcessGroupOptions& options = {});

  /// Whether it is a group (false: default-constructed, or new_group() for a non-member).
  bool valid() const { return state_ != nullptr; }
  /// This process's rank in the group, and the group's size.
  int rank() const;
  /// The number of ranks.
  int world_size() const;
  /// Each collective's deadline.
  std::chrono::milliseconds timeout() const;
  /// Whether ProcessGroupOptions::aborted says the group was aborted (a peer lost): work that
  /// leads up to a collective (a backward whose gradients feed one) can stop early rather than
  /// compute what no collective will take. False without that option.
  bool aborted() const;
  /// The transport of its collectives.
  Backend backend() const;
  /// The address of this host's interface that the group's transport binds to (other services
  /// between the same ranks, e.g. parameter servers, listen there too).
  const std::string& interface_address() const;
  /// The job secret its store was joined with: what services between the same ranks (parameter
  /// servers) check as well.
  const JobSecret& secret() const;
  /// The flight recorder of its operations (shared with the groups made from it): what a rank
  /// writes out when a collective times out or the coordinator declares a hang. Null when
  /// ProcessGroupOptions::flight_recorder_entries was 0.
  const std::shared_ptr<FlightRecorder>& flight_recorder() const;

  /// Sub-groups. Every rank of this group calls new_group with the same ranks (ranks of this
  /// group), in the same order as its other new_group/split calls; members get the new group,
  /// the others an empty handle (valid() false). Ranks that repeat or do not exist are a
  /// UsageError naming them.
  ProcessGroup new_group(const std::vector<int>& ranks, const ProcessGroupOptions& options);
  /// new_group() with this group's options.
  ProcessGroup new_group(const std::vector<int>& ranks);
  /// Splits this group into disjoint groups that cover all of its ranks (e.g. the data-parallel
  /// groups of a mesh); every rank calls it with the same partition and gets its own group.
  /// `name` (e.g. "dp") goes into the parts' names, which the stall inspector quotes.
  ProcessGroup split(const std::vector<std::vector<int>>& partition, const std::string& name = "");
  /// The ranks of the first group (the one made by create()) that form this group, by group rank.
  const std::vector<int>& global_ranks() const;
  /// The rank of the first group that is `group_rank` here.
  int global_rank(int group_rank) const;
  /// This group's rank of a rank of the first group, or -1 when it is not a member.
  int group_rank(int global_rank) const;

  /// Asynchronous in-place all-reduce of tensors of one dtype and device.
  Work allreduce_async(std::vector<at::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  /// allreduce_async(), waited for.
  void allreduce(std::vector<at::Tensor>& tensors, ReduceOp op = ReduceOp::kSum);
  /// Asynchronous broadcast of `root`'s tensors into every rank's, in place.
  Work broadcast_async(std::vector<at::Tensor>& tensors, int root);
  /// broadcast_async(), waited for.
  void broadcast(std::vector<at::Tensor>& tensors, int root);
  /// Gathers one tensor of the same shape from every rank, ordered by rank.
  std::vector<at::Tensor> allgather(const at::Tensor& tensor);
  /// Asynchronous all-gather: `outputs` (world_size() tensors of input's shape) get every rank's
  /// input.
  Work allgather_async(std::vector<at::Tensor>& outputs, const at::Tensor& input);
  /// All-gather into one tensor: `output` holds world_size() x input.numel() elements, rank r's
  /// input at [r * n, (r + 1) * n).
  Work allgather_into_async(at::Tensor& output, const at::Tensor& input);
  /// allgather_into_async(), waited for.
  void allgather_into(at::Tensor& output, const at::Tensor& input);
  /// Reduce-scatter: rank r gets op over every rank's inputs[r] (world_size() inputs, each of
  /// output's shape).
  Work reduce_scatter_async(at::Tensor& output, std::vector<at::Tensor>& inputs,
                            ReduceOp op = ReduceOp::kSum);
  /// reduce_scatter_async(), waited for.
  void reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                      ReduceOp op = ReduceOp::kSum);
  /// Reduce-scatter from one tensor of world_size() x output.numel() elements: rank r gets op
  /// over every rank's [r * n, (r + 1) * n).
  Work reduce_scatter_tensor_async(at::Tensor& output, const at::Tensor& input,
                                   ReduceOp op = ReduceOp::kSum);
  /// reduce_scatter_tensor_async(), waited for.
  void reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input,
                             ReduceOp op = ReduceOp::kSum);
  /// All-to-all along dim 0: input's i-th split goes to rank i, output's j-th split comes from
  /// rank j. Empty split sizes: equal splits (dim 0 divisible by world_size()).
  Work all_to_all_async(at::Tensor& output, const at::Tensor& input,
                        const std::vector<int64_t>& output_split_sizes = {},
                        const std::vector<int64_t>& input_split_sizes = {});
  /// all_to_all_async(), waited for.
  void all_to_all(at::Tensor& output, const at::Tensor& input,
                  const std::vector<int64_t>& output_split_sizes = {},
                  const std::vector<int64_t>& input_split_sizes = {});
  /// Point to point, by group rank; a send matches the recv of the same tag on `peer`.
  Work send_async(const at::Tensor& tensor, int peer, int tag = 0);
  /// send_async(), waited for.
  void send(const at::Tensor& tensor, int peer, int tag = 0);
  /// Asynchronous receive of `peer`'s send of `tag` into `tensor` (of the sent shape and dtype).
  Work recv_async(at::Tensor& tensor, int peer, int tag = 0);
  /// recv_async(), waited for.
  void recv(at::Tensor& tensor, int peer, int tag = 0);
  /// Waits until every rank of the group got here (within the timeout).
  void barrier();

  /// How many collectives this rank has entered, and the name of the last: what a stall
  /// inspector compares across ranks to name those that did not enter a collective.
  int64_t collectives_entered() const;
  /// What this rank does with the group beyond the collective's name, e.g. "pipeline stage 1,
  /// recv activation of micro-batch 3": errors of the collectives that follow and the stall
  /// inspector quote it. Empty (the default): nothing more to say.
  void set_activity(std::string activity);
  /// The name of the last collective this rank entered ("" before any).
  std::string last_collective() const;
  /// Payload bytes this rank has sent through this group and the sub-groups made from it, counted
  /// as the bandwidth-optimal algorithms send them (what NCCL's tests call bus bytes): of B bytes,
  /// an all-reduce sends 2(N-1)/N B, a broadcast (N-1)/N B, a reduce-scatter (N-1)/N of its input,
  /// an all-gather N-1 times its input, an all-to-all what goes to other ranks, a send B.
  int64_t bytes_sent() const;
  /// Counts bytes sent to the group's ranks outside its collectives (a parameter server's
  /// sockets) into bytes_sent().
  void add_bytes_sent(int64_t bytes);
  /// Bytes of the buffers this group keeps from collective to collective, free or in use: Gloo's
  /// all-gather into one tensor and its reduce-scatter stage their data through them (none with
  /// NCCL). A collective takes the smallest free buffer that fits, so that collectives of many
  /// sizes, repeated step after step (ZeRO-3's units), reuse the buffers of the first step.
  int64_t scratch_bytes() const;

  struct State;  ///< defined in src/comm/process_group.cpp

 private:
  explicit ProcessGroup(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

/// What one process group of this process has done, for the stall inspector: its name (its key
/// prefix in the store, the same on every member), its members by global rank, how many
/// collectives this rank entered in it, the last one's name and what it was doing
/// (ProcessGroup::set_activity).
struct GroupActivity {
  std::string name;               ///< the group's key prefix, the same on every member
  std::vector<int> global_ranks;  ///< its members, by global rank
  int64_t entered = 0;            ///< collectives this rank entered in it
  std::string last;               ///< the last one's name
  std::string activity;           ///< ProcessGroup::set_activity's text
};
/// Every process group of this process that is still in use, sub-groups included, oldest first.
std::vector<GroupActivity> group_activity();

}  // namespace cohort::comm
