#!/usr/bin/env bash
# A CPU-only node doing the trainers' preprocessing: two hosts made with network namespaces and a
# veth pair (10.214.R.1 and 10.214.R.2). Host A runs `cohort launch --nproc-per-node 2` (the
# ranks, no data workers of their own), host B `cohort launch --nproc-per-node 0 --data-workers 2`.
#  1. the job trains: result.json once, both ranks in sync; host B's data worker k served rank k's
#     "train" stream over TCP (from 10.214.R.2 to host A's address);
#  2. the loss and accuracy equal those of the same job on host A alone (preprocessing inline):
#     where the preprocessing ran does not change the batches;
#  3. host B running another build of the program: its data workers refuse to serve, naming it,
#     and both launchers fail.
# Usage: cpu_node_test.sh COHORT_BINARY DATA_DIR. Needs root (ip netns); cleans up on exit.
set -uo pipefail
cli="$1"
data="$2"
name=cpu_node_test
subnet=214
source "$(dirname "$0")/two_hosts.sh"

# launch NS NNODES NODE NAME LAUNCH_ARGS...: one host's launcher in the background ($launched).
train_args=(train --model cnn --data-dir "$data" --test-examples 1000 --batch-size 16 --epochs 1 --max-steps 12 --seed 5
            --storage-path "$work" --quiet)
launch() {
  local ns="$1" nnodes="$2" node="$3" name="$4"
  shift 4
  ip netns exec "$ns" "$cli" launch --nnodes "$nnodes" --node-rank "$node" --master "$net.1:29410" \
    --rdzv-timeout 30 --heartbeat-timeout 5 "$@" -- "${program:-$cli}" "${train_args[@]}" --name "$name" \
    >"$work/$name-$node.log" 2>&1 &
  launched=$!
  pids+=("$launched")
}

# 1. Host A trains, host B preprocesses.
launch "$a" 2 0 split --nproc-per-node 2
pa=$launched
launch "$b" 2 1 split --nproc-per-node 0 --data-workers 2
pb=$launched
wait_for_launchers split 150
[ "$ca" = 0 ] && [ "$cb" = 0 ] || fail "launchers exited $ca and $cb"
python3 "$(dirname "$0")/check_result.py" "$work/split/result.json" 2 12 "CPU-only node" || fail "result.json"
[ "$(find "$work" -name result.json | wc -l)" = 1 ] || fail "result.json written more than once"
grep -q "started data workers 0-1 of 2" "$work/split-1.log" || fail "host B did not start 2 data workers"
for k in 0 1; do
  grep -q "cohort data worker $k (pid [0-9]* on .*): serving rank $k's 'train' stream at $net.1:" "$work/split-1.log" ||
    fail "data worker $k on host B did not serve rank $k over TCP"
done

# 2. The same job on host A alone.
launch "$a" 1 0 alone --nproc-per-node 2
pa=$launched
wait_for "$pa" 150; ca=$status
[ "$ca" = 0 ] || { cat "$work/alone-0.log"; fail "the single-host launcher exited $ca"; }
python3 - "$work/split/result.json" "$work/alone/result.json" <<'EOF' || fail "the runs differ"
import json, sys
split, alone = (json.load(open(p)) for p in sys.argv[1:3])
for key in ("train_loss", "test_accuracy", "steps"):
    print(f"{key}: CPU-only node {split[key]}, one host {alone[key]}")
    assert split[key] == alone[key], key
EOF

# 3. Host B runs another build (the same binary with another build id; the job id is given, as
#    the default one differs with the program's path).
"$(dirname "$0")/other_build.sh" "$cli" "$work/cohort-other" || fail "cannot make another build"
launch "$a" 2 0 other --nproc-per-node 2 --job-id "other$$"
pa=$launched
program="$work/cohort-other" launch "$b" 2 1 other --nproc-per-node 0 --data-workers 2 --job-id "other$$"
pb=$launched
wait_for_launchers other 150
[ "$ca" = 1 ] && [ "$cb" = 1 ] || fail "with another build on host B the launchers exited $ca and $cb, not 1 and 1"
grep -q "cohort data worker [01] .*: it runs a different program (.*) than rank 0 (.*): deploy the same build" \
  "$work/other-1.log" || fail "host B's data workers did not name the different build"
grep -q "the job failed: node 1 (.*): data worker [01] (pid [0-9]*) exited with code 1" "$work/other-0.log" ||
  fail "host A's launcher did not name host B's data worker"
echo "cpu_node_test: PASS"
