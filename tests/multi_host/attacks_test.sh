#!/usr/bin/env bash
# The attack table of issue 39: two hosts made with network namespaces (10.215.R.1 and .2), a
# 2-node `cohort launch` job training the cnn. While it trains, processes without the job's secret
# attack its rendezvous store and its coordinator, from host B (another network namespace) and from
# host A (another process on the same host): a message without a proof, a wrong proof, an oversized
# frame, a malformed line, a connection that says nothing. Every such connection must be closed
# within the handshake deadline without an answer, and the job must end with the same losses and
# accuracy as the same job undisturbed. Prints the table.
# Usage: attacks_test.sh COHORT_BINARY TINY_DATA_DIR. Needs root (ip netns); cleans up on exit.
set -uo pipefail
cli="$1"
data="$2"
name=attacks_test
subnet=215
source "$(dirname "$0")/two_hosts.sh"
attacker="$(dirname "$0")/attacker.py"

# launch NS NODE PORT NAME: one host's launcher in the background ($launched).
launch() {
  local ns="$1" node="$2" port="$3" name="$4"
  ip netns exec "$ns" "$cli" launch --nnodes 2 --node-rank "$node" --master "$net.1:$port" \
    --nproc-per-node 1 --rdzv-timeout 60 --heartbeat-timeout 10 --job-id "$name" -- \
    "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --batch-size 16 --epochs 1 \
    --max-steps 1200 --seed 11 --storage-path "$work" --name "$name" \
    >"$work/$name-$node.log" 2>&1 &
  launched=$!
  pids+=("$launched")
}

# run NAME PORT: both hosts' launchers, waited for; fails unless both succeed.
run() {
  wait_for "$pa" 300; local ca=$status
  wait_for "$pb" 60; local cb=$status
  [ "$ca" = 0 ] && [ "$cb" = 0 ] || { cat "$work/$1-0.log" "$work/$1-1.log"; fail "$1: launchers exited $ca and $cb"; }
}

# 1. Undisturbed.
launch "$a" 0 29500 calm; pa=$launched
launch "$b" 1 29500 calm; pb=$launched
run calm

# 2. The same job, attacked while it trains.
launch "$a" 0 29501 attacked; pa=$launched
launch "$b" 1 29501 attacked; pb=$launched
for _ in $(seq 1200); do
  grep -q "first training step" "$work/attacked-0.log" 2>/dev/null && break
  kill -0 "$pa" 2>/dev/null || break
  sleep 0.1
done
grep -q "first training step" "$work/attacked-0.log" || { cat "$work/attacked-0.log"; fail "training did not start"; }
coordinator="$(ip netns exec "$a" python3 "$attacker" coordinator "$net.1:29501" attacked)" \
  || fail "a member could not read the coordinator's address from the store"
table="$work/table.md"
echo "| target | from | attack | outcome |" >"$table"
echo "| --- | --- | --- | --- |" >>"$table"
attackers=()
for target in "store $net.1:29501" "coordinator $coordinator"; do
  set -- $target
  ip netns exec "$b" python3 "$attacker" attack "$1" "$2" "host B (another network namespace)" \
    >"$work/rows-$1-b" 2>&1 &
  attackers+=($!)
  ip netns exec "$a" python3 "$attacker" attack "$1" "$2" "host A (another process)" \
    >"$work/rows-$1-a" 2>&1 &
  attackers+=($!)
done
closed=0
for p in "${attackers[@]}"; do wait "$p" || closed=1; done
cat "$work"/rows-* >>"$table"
run attacked
cat "$table"
[ "$closed" = 0 ] || fail "a connection without the secret was answered or left open (table above)"
for node in 0 1; do
  grep -q "refused this process\|could not prove" "$work/attacked-$node.log" &&
    fail "a rank of the attacked job was refused: $(grep -m1 'refused' "$work/attacked-$node.log")"
done
grep -q "closed a connection from $net.2:.*did not prove it holds the job secret" "$work/attacked-0.log" ||
  fail "host A's log does not name a refused connection from host B"
python3 - "$work/calm/result.json" "$work/attacked/result.json" <<'EOF' || fail "the attacked job's result differs"
import json, sys
calm, attacked = (json.load(open(p)) for p in sys.argv[1:3])
assert calm["error"] is None and attacked["error"] is None, (calm["error"], attacked["error"])
keys = sorted(k for k in calm if isinstance(calm[k], (int, float)) and ("loss" in k or "accuracy" in k))
assert keys, sorted(calm)
for k in keys:
    assert calm[k] == attacked[k], (k, calm[k], attacked[k])
assert calm["steps"] == attacked["steps"] == 1200, (calm["steps"], attacked["steps"])
print("attacks_test: the attacked job ended as the undisturbed one: " +
      ", ".join("%s %s" % (k, calm[k]) for k in keys))
EOF
echo "attacks_test: PASS"
