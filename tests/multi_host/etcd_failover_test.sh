#!/usr/bin/env bash
# The etcd rendezvous (`cohort launch --rdzv etcd://`) on two hosts made with network namespaces
# (two_hosts.sh). A real etcd (Debian's etcd-server) runs on host B. The job trains on both hosts,
# rank 0 on host A (node 0, which without etcd would hold the rendezvous); then host A is lost
# whole (its launcher and its rank, SIGKILL). Host B's launcher finds node 0 lost, re-rendezvouses
# in etcd without it as round 1 (--min-nodes 1), and the run goes on with one rank from its last
# checkpoint and finishes (exit 0). Prints how long after the kill the job completed a step again.
# Usage: etcd_failover_test.sh COHORT_BINARY TINY_DATA_DIR ETCD_BINARY. Needs root (ip netns);
# cleans up on exit.
set -uo pipefail
cli="$1"
data="$2"
etcd="$3"
name=etcd_failover_test
subnet=214
source "$(dirname "$0")/two_hosts.sh"
[ -x "$etcd" ] || skip "no etcd at $etcd: scripts/setup.sh unpacks Debian's etcd-server into .tools/"

# etcd on host B, serving its clients on B's address.
source "$(dirname "$0")/etcd.sh"
start_etcd "$etcd" "$net.2:2379" 2380 "$b"

# launch NS NODE: one host's launcher in the background ($launched: its pid), output to
# $work/failover-NODE.log. Both hosts share $work, as nodes share a run directory.
launch() {
  local ns="$1" node="$2"
  ip netns exec "$ns" "$cli" launch --rdzv "etcd://$net.2:2379" --nnodes 2 --min-nodes 1 \
    --node-rank "$node" --nproc-per-node 1 --rdzv-timeout 30 --heartbeat-timeout 3 \
    --max-restarts 1 --job-id "failover-$$" -- \
    "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --batch-size 16 \
    --train-examples 6400 --epochs 2 --min-workers 1 --checkpoint-every-steps 20 \
    --log-every-steps 1 --storage-path "$work" --name failover --quiet \
    >"$work/failover-$node.log" 2>&1 &
  launched=$!
  pids+=("$launched")
}
launch "$a" 0
pa=$launched
launch "$b" 1
pb=$launched

# A step checkpoint is on disk: then host A goes, with rank 0 and the run's coordinator.
for _ in $(seq 1200); do
  compgen -G "$work/failover/checkpoint_*/meta.json" >/dev/null && break
  kill -0 "$pa" 2>/dev/null || break
  sleep 0.1
done
compgen -G "$work/failover/checkpoint_*/meta.json" >/dev/null ||
  { cat "$work/failover-0.log" "$work/failover-1.log"; fail "no checkpoint before the kill"; }
grep -q "round 0: started ranks 0-0 of 2" "$work/failover-0.log" || fail "rank 0 is not on host A"
killed_at=$(date +%s.%N)
for p in $(ip netns pids "$a"); do kill -9 "$p" 2>/dev/null; done
# Rank 0 (on host A) wrote steps.jsonl: what it holds now is round 0's.
cp "$work/failover/steps.jsonl" "$work/steps-at-kill"

# The first step completed after the kill: a line of steps.jsonl that round 0 did not write (round 1
# keeps round 0's lines up to its checkpoint, then logs its own).
continued=""
deadline=$(( $(date +%s) + 120 ))
while [ -z "$continued" ] && [ "$(date +%s)" -lt "$deadline" ] && kill -0 "$pb" 2>/dev/null; do
  if grep -qvxFf "$work/steps-at-kill" "$work/failover/steps.jsonl" 2>/dev/null; then
    continued=$(python3 -c "import sys; print(round($(date +%s.%N) - $killed_at, 1))")
  fi
  sleep 0.05
done
wait_for "$pb" 300
cb=$status
cat "$work/failover-1.log"
[ "$cb" = 0 ] || fail "host B's launcher exited $cb after host A was lost"
grep -q "node 0 (.*)'s launcher sent no heartbeat .*: node 0 is lost" "$work/failover-1.log" || fail "host B did not name the lost node 0"
grep -q "restarting as round 1 of at most 1" "$work/failover-1.log" || fail "no round 1"
grep -q "round 1: started ranks 0-0 of 1" "$work/failover-1.log" || fail "round 1 did not run alone"
grep -q "resuming .* from $work/failover/checkpoint_" "$work/failover-1.log" ||
  fail "round 1 did not resume from the checkpoint"
python3 - "$work/failover/result.json" <<'PY' || fail "result.json after the loss of node 0"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["error"] is None and r["epochs"] == 2 and r["world_size"] == 1, r
PY
[ -n "$continued" ] || fail "no step completed after the kill"
echo "$name: the job completed a step again ${continued} s after host A (node 0, rank 0) was killed"
echo "$name: PASS"
