#include "launch_command.h"

#include "cohort/comm/address.h"
#include "cohort/error.h"

namespace cohort::cli {

CLI::App* add_launch_command(CLI::App& app, LaunchOptions& o) {
  auto* cmd = app.add_subcommand(
      "launch",
      "Start this node's workers of a multi-node job (run it once on every node): "
      "cohort launch --nnodes 2 --node-rank 0 --master HOST:PORT --nproc-per-node 2 -- ./program "
      "args");
  cmd->add_option("--nnodes", o.node.nnodes, "nodes in the job")->capture_default_str();
  cmd->add_option("--node-rank", o.node.node_rank, "this node's index, 0 .. nnodes-1")
      ->capture_default_str();
  cmd->add_option("--master", o.master,
                  "HOST:PORT of node 0, whose launcher serves the rendezvous there")
      ->capture_default_str();
  cmd->add_option("--rdzv", o.rdzv,
                  "etcd://HOST:PORT: keep the rendezvous in etcd (Debian's etcd-server) so that "
                  "the job outlives any node, node 0 included; --master is then not used");
  cmd->add_option("--min-nodes", o.node.min_nodes,
                  "with --rdzv etcd://: the fewest nodes a round restarted after losing a node may "
                  "have (default: --nnodes)");
  cmd->add_option("--nproc-per-node", o.node.nproc_per_node,
                  "train workers (ranks) on this node; 0: a CPU-only node")
      ->capture_default_str();
  cmd->add_option("--data-workers", o.node.data_workers,
                  "preprocessing processes on this node, serving the trainers' dataset over TCP")
      ->capture_default_str();
  cmd->add_option("--max-restarts", o.node.max_restarts,
                  "restarts of the whole job after a failure (a job that recovers live, cohort "
                  "train --recovery live, replaces a lost rank without one; its job host's loss "
                  "restarts it)")
      ->capture_default_str();
  cmd->add_option("--rdzv-timeout", o.rendezvous_timeout_s,
                  "seconds for every node to join a round")
      ->capture_default_str();
  cmd->add_option("--heartbeat-timeout", o.heartbeat_timeout_s,
                  "seconds of silence after which a node is lost")
      ->capture_default_str();
  cmd->add_option("--job-id", o.node.job_id,
                  "checked when nodes join (default: derived from the command)");
  cmd->add_flag("--insecure", o.node.insecure,
                "run without a job secret: any process that reaches a port of the job may join it");
  cmd->add_flag(
      "--quiet", [&o](int64_t) { o.node.verbose = 0; }, "no launcher messages");
  cmd->add_option("command", o.node.command, "the program and its arguments, after --")->required();
  return cmd;
}

int run_launch_command(LaunchOptions o) {
  const auto master = comm::parse_host_port(o.master, "--master");
  o.node.master_addr = master.host;
  o.node.master_port = master.port;
  o.node.etcd = o.rdzv;
  if (o.rendezvous_timeout_s <= 0 || o.heartbeat_timeout_s <= 0) {
    throw UsageError("--rdzv-timeout and --heartbeat-timeout must be > 0 seconds");
  }
  o.node.rendezvous_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.rendezvous_timeout_s * 1000));
  o.node.heartbeat_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(o.heartbeat_timeout_s * 1000));
  return runtime::launch_node(o.node);
}

}  // namespace cohort::cli
