#!/usr/bin/env bash
# Two hosts made with network namespaces and a veth pair (10.213.R.1 and 10.213.R.2, nothing
# else reachable), `cohort launch` on each with 2 workers training the cnn:
#  1. both hosts' ranks end in sync (replica_spread 0), result.json is written once, by rank 0;
#  2. SIGKILL of host B's launcher mid-run: host A's launcher fails within its deadline, naming
#     the lost node 1;
#  3. with --max-restarts 1, SIGKILL of a rank on host B after the first epoch's checkpoint: both
#     launchers restart the job as round 1, which resumes after epoch 1 and finishes (exit 0);
#  4. the same with in-memory snapshots (--snapshot-every-steps, each host its own
#     --snapshot-dir as each node its own tmpfs): each host keeps buddy copies of the other host's
#     ranks' files, round 1 restores from the snapshot (newer than the epoch's checkpoint), and
#     the run's snapshots go when it ends;
#  5. with --recovery live, SIGKILL of a rank on host B: rank 0 regroups the ranks, host B's
#     launcher starts the replacement, and the job finishes without a restart.
# PART says which: `training` (1, and the parameter server across the hosts: Gloo and cohort's
# data between two hosts), `failures` (2-5: cohort's launcher and recovery) or `all` (the
# default). ctest runs the two parts as two tests, multi_host.two_hosts and
# multi_host.two_hosts_failures; CI's libtorch 2.x lane runs the first only.
# Usage: two_hosts_test.sh COHORT_BINARY TINY_DATA_DIR [PART]. Needs root (ip netns); cleans up
# on exit.
set -uo pipefail
cli="$1"
data="$2"
part="${3:-all}"
case "$part" in
  training | failures | all) ;;
  *) echo "two_hosts_test: unknown part '$part': choose training, failures or all" >&2; exit 2 ;;
esac
name="two_hosts_test ($part)"
subnet=213
source "$(dirname "$0")/two_hosts.sh"

# launch NS NODE PORT NAME EXTRA...: starts one host's launcher in the background (ip netns exec
# execs it: $launched is the launcher's own pid), output to $work/NAME-NODE.log.
launch() {
  local ns="$1" node="$2" port="$3" name="$4"
  shift 4
  ip netns exec "$ns" "$cli" launch --nnodes 2 --node-rank "$node" --master "$net.1:$port" \
    --nproc-per-node 2 --rdzv-timeout 30 --heartbeat-timeout 3 ${restarts:+--max-restarts $restarts} \
    ${job:+--job-id $job} -- \
    "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --batch-size 16 --storage-path "$work" --name "$name" --quiet "$@" \
    >"$work/$name-$node.log" 2>&1 &
  launched=$!
  pids+=("$launched")
}

# kill_a_rank_of_b NAME: SIGKILLs one rank of host B's launcher ($pb; $victim: its pid), then
# wait_for_launchers NAME.
kill_a_rank_of_b() {
  victim=$(pgrep -P "$pb" | head -n 1)
  [ -n "$victim" ] || fail "no rank of host B to kill"
  kill -9 "$victim"
  wait_for_launchers "$1" 180
}

# wait_for_first_report NAME: until run NAME reported once (its metrics.jsonl), or host A's
# launcher ($pa) ended; fails the test after 120 s.
wait_for_first_report() {
  for _ in $(seq 1200); do
    [ -s "$work/$1/metrics.jsonl" ] && return 0
    kill -0 "$pa" 2>/dev/null || break
    sleep 0.1
  done
  cat "$work/$1-0.log" "$work/$1-1.log"
  fail "$1: no first report"
}

if [ "$part" != failures ]; then
  # 1. Train a few steps across the two hosts.
  launch "$a" 0 29400 sync --epochs 1 --max-steps 12
  pa=$launched
  launch "$b" 1 29400 sync --epochs 1 --max-steps 12
  pb=$launched
  wait_for_launchers sync 120
  [ "$ca" = 0 ] && [ "$cb" = 0 ] || fail "launchers exited $ca and $cb"
  [ -f "$work/sync/result.json" ] || fail "no result.json"
  [ "$(find "$work" -name result.json | wc -l)" = 1 ] || fail "result.json written more than once"
  python3 "$(dirname "$0")/check_result.py" "$work/sync/result.json" 4 12 "two hosts" || fail "result.json"
  grep -q "ranks 2-3 of 4" "$work/sync-1.log" || fail "host B did not run ranks 2-3"

  # The asynchronous parameter server across the hosts: a server in each of the 4 ranks, every
  # worker pushing to the servers of both hosts over the veth pair.
  launch "$a" 0 29403 ps --epochs 1 --max-steps 12 --sync async-ps:2 --parameter-servers 4
  pa=$launched
  launch "$b" 1 29403 ps --epochs 1 --max-steps 12 --sync async-ps:2 --parameter-servers 4
  pb=$launched
  wait_for_launchers ps 120
  [ "$ca" = 0 ] && [ "$cb" = 0 ] || fail "parameter server: launchers exited $ca and $cb"
  python3 "$(dirname "$0")/check_result.py" "$work/ps/result.json" 4 12 "two hosts" || fail "ps result.json"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['staleness_max'] >= 0, r" \
    "$work/ps/result.json" || fail "the parameter server's result has no staleness"
fi
[ "$part" = training ] && { echo "two_hosts_test (training): PASS"; exit 0; }

# 2. Host B's launcher is killed while training: host A must fail fast and name node 1.
launch "$a" 0 29401 lost --epochs 50
pa=$launched
launch "$b" 1 29401 lost --epochs 50
pb=$launched
for _ in $(seq 600); do
  grep -q "first training step" "$work/lost-0.log" 2>/dev/null && break
  kill -0 "$pa" 2>/dev/null || break
  sleep 0.1
done
grep -q "first training step" "$work/lost-0.log" || { cat "$work/lost-0.log" "$work/lost-1.log"; fail "training did not start"; }
kill -9 "$pb"
start=$(date +%s.%N)
wait_for "$pa" 60; ca=$status
took=$(python3 -c "import sys; print(round($(date +%s.%N) - $start, 1))")
cat "$work/lost-0.log"
[ "$ca" = 1 ] || fail "host A's launcher exited $ca, not 1"
grep -q "node 1 .* is lost" "$work/lost-0.log" || fail "the error does not name the lost node 1"
echo "host A noticed the lost node and ended in ${took} s"
python3 -c "import sys; sys.exit(0 if $took < 30 else 1)" || fail "took ${took} s"
# No worker of either host is left.
for ns in "$a" "$b"; do
  for _ in $(seq 50); do [ -z "$(ip netns pids "$ns")" ] && break; sleep 0.1; done
  [ -z "$(ip netns pids "$ns")" ] || fail "processes left in $ns: $(ip netns pids "$ns")"
done

# 3. A rank on host B dies after the first epoch's checkpoint; restarts are allowed.
restarts=1 launch "$a" 0 29402 again --epochs 3 --train-examples 6400
pa=$launched
restarts=1 launch "$b" 1 29402 again --epochs 3 --train-examples 6400
pb=$launched
wait_for_first_report again
kill_a_rank_of_b again
[ "$ca" = 0 ] && [ "$cb" = 0 ] || fail "after a restart the launchers exited $ca and $cb"
for node in 0 1; do
  grep -q "restarting as round 1 of at most 1" "$work/again-$node.log" || fail "node $node did not restart the job"
done
# Host A names it first: host A's own ranks fail after it (then node 0 ...), or are stopped first.
grep -q "round failed (node 1 (.*): rank [23] (pid $victim) was killed by signal 9 (Killed)" \
  "$work/again-0.log" || fail "host A did not name the rank killed on host B as the cause"
grep -q "resuming after epoch 1 from $work/again/checkpoint_" "$work/again-0.log" || fail "round 1 did not resume"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['epochs'] == 3 and r['error'] is None, r" \
  "$work/again/result.json" || fail "result.json after the restart"
# 4. In-memory snapshots across the hosts; a rank on host B dies after a snapshot of epoch 2. The
# hosts' command lines differ (their --snapshot-dir): the job is named, not derived from them.
restarts=1 job=snapshots launch "$a" 0 29404 snap --epochs 2 --train-examples 6400 --snapshot-every-steps 10 \
  --snapshot-dir "$work/shm-a"
pa=$launched
restarts=1 job=snapshots launch "$b" 1 29404 snap --epochs 2 --train-examples 6400 --snapshot-every-steps 10 \
  --snapshot-dir "$work/shm-b"
pb=$launched
# whole_snapshot DIR RANK...: whether the node of DIR holds a whole snapshot of the second epoch
# with buddy copies of RANK... (checked in one go: older snapshots are pruned as newer ones come).
whole_snapshot() {
  python3 - "$@" <<'PY'
import glob, json, os, sys
folder, copies = sys.argv[1], sys.argv[2:]
for meta in glob.glob(os.path.join(folder, "*", "snapshot_*", "checkpoint", "meta.json")):
    snapshot = os.path.dirname(os.path.dirname(meta))
    try:
        whole = json.load(open(meta))["metrics"]["epoch"] == 2 and all(
            os.path.exists(os.path.join(snapshot, "copies", r + ".json")) for r in copies)
    except (OSError, ValueError, KeyError):
        continue
    if whole:
        sys.exit(0)
sys.exit(1)
PY
}
# Each host keeps the copies of the other's ranks (their buddies: 0 and 2, 1 and 3).
for _ in $(seq 1200); do
  whole_snapshot "$work/shm-a" 2 3 && whole_snapshot "$work/shm-b" 0 1 && break
  kill -0 "$pa" 2>/dev/null || break
  sleep 0.1
done
whole_snapshot "$work/shm-a" 2 3 || { cat "$work/snap-0.log" "$work/snap-1.log";
  fail "host A holds no whole snapshot of epoch 2 with copies of host B's ranks 2 and 3"; }
whole_snapshot "$work/shm-b" 0 1 ||
  fail "host B holds no whole snapshot of epoch 2 with copies of host A's ranks 0 and 1"
kill_a_rank_of_b snap
[ "$ca" = 0 ] && [ "$cb" = 0 ] || fail "with snapshots, after a restart the launchers exited $ca and $cb"
grep -q "cohort: restoring from the in-memory snapshot snapshot_" "$work/snap-0.log" ||
  fail "round 1 did not restore from the in-memory snapshot"
[ -z "$(ls -A "$work/shm-a")" ] && [ -z "$(ls -A "$work/shm-b")" ] ||
  fail "the run's snapshots stayed after it ended: $(ls -R "$work/shm-a" "$work/shm-b")"
# 5. Live recovery across the hosts: a rank on host B killed after the first epoch; nothing
# restarts. The job host (on host A) decides, host B's launcher starts the replacement, which
# takes its state from a survivor over the veth pair, and the job finishes in round 0. The states
# the survivors heal with stay in the hosts' --snapshot-dir (named jobs, as in 4).
job=live launch "$a" 0 29405 live --epochs 2 --train-examples 6400 --recovery live \
  --snapshot-dir "$work/shm-a"
pa=$launched
job=live launch "$b" 1 29405 live --epochs 2 --train-examples 6400 --recovery live \
  --snapshot-dir "$work/shm-b"
pb=$launched
wait_for_first_report live
kill_a_rank_of_b live
[ "$ca" = 0 ] && [ "$cb" = 0 ] || fail "live: the launchers exited $ca and $cb"
grep -q "started the replacement of rank [23] as rank [23] of 4" "$work/live-1.log" ||
  fail "live: host B's launcher started no replacement"
# (--quiet: rank 0 says no more than where the regrouped loop resumes, from the live state.)
grep -q "resuming epoch [0-9]* after step [0-9]* from .*/live_" "$work/live-0.log" ||
  fail "live: rank 0 did not resume from the live state of a regroup"
! grep -q "restarting as round 1" "$work/live-0.log" "$work/live-1.log" || fail "live: the job restarted"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['error'] is None and r['epochs'] == 2 and r['failures'][0]['live'], r" \
  "$work/live/result.json" || fail "live: result.json"
echo "two_hosts_test ($part): PASS"
