#!/usr/bin/env bash
# The fault tests under launchers other than cohort's driver: for each launcher and fault (a rank
# killed, throwing, stopped with SIGSTOP, never joining), the job must end within its deadline
# with the coordinator's message naming rank 1.
# Usage: launched_faults_test.sh PROGRAM COHORT_BINARY LAUNCHER...  (LAUNCHER: mpirun | launch)
set -uo pipefail
program="$1"
cli="$2"
shift 2
fail() { echo "launched_faults_test: FAIL: $*" >&2; exit 1; }
work="$(mktemp -d)"
pids=()
cleanup() {
  # A stopped rank of a launcher that already gave up on it: nothing may outlive the test.
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  pkill -KILL -f "$program .* $work/" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# The heartbeat timeout (2 s) and the setup deadline (5 s) are the program's; every job is given
# 40 s in all before the test calls it a hang.
expected() {
  case "$1" in
    kill) echo "rank 1 ended without finishing" ;;
    throw) echo "rank 1 failed: injected failure" ;;
    stop) echo "rank 1 sent no heartbeat for 2 s: it hangs or was stopped" ;;
    never_join) echo "ranks [1] of 2 did not join the rendezvous" ;;
  esac
}

run_job() {  # launcher fault out
  local launcher="$1" fault="$2" out="$3" dir="$work/$1"
  mkdir -p "$dir"
  case "$launcher" in
    mpirun)
      command -v mpirun >/dev/null || fail "mpirun is missing: scripts/setup.sh installs openmpi-bin"
      setsid timeout -k 5 40 mpirun -np 2 --oversubscribe --bind-to none --mca btl self,tcp \
        --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \
        "$program" "$fault" "$dir/" 2 >"$out" 2>&1 &
      ;;
    launch)
      local port=$((20000 + RANDOM % 20000))
      setsid timeout -k 5 40 "$cli" launch --nnodes 1 --node-rank 0 --master "127.0.0.1:$port" \
        --nproc-per-node 2 -- "$program" "$fault" "$dir/" 2 >"$out" 2>&1 &
      ;;
    *) fail "unknown launcher $launcher" ;;
  esac
  local pid=$!
  pids+=("$pid")
  wait "$pid"
}

for launcher in "$@"; do
  for fault in kill throw stop never_join; do
    out="$work/$launcher-$fault.log"
    start=$(date +%s%N)
    run_job "$launcher" "$fault" "$out"
    status=$?
    took_ms=$((($(date +%s%N) - start) / 1000000))
    want="$(expected "$fault")"
    # timeout's own statuses (124, or 137 after -k) are also a rank's death by SIGKILL: the clock
    # tells them apart.
    [ "$took_ms" -lt 39000 ] || { cat "$out"; fail "$launcher/$fault: still running after 40 s"; }
    [ "$status" != 0 ] || { cat "$out"; fail "$launcher/$fault: the job succeeded"; }
    # The coordinator's verdict, printed by rank 0 or by a rank it stopped (a rank that never
    # joined: the rendezvous deadline on rank 0).
    said="$(grep -E "coordinator stops the job: |rank [0-9]+ stops: |result: " "$out" | grep -F "$want" | head -1)"
    [ -n "$said" ] || { cat "$out"; fail "$launcher/$fault: no message of the coordinator with '$want'"; }
    # A rank that hangs: rank 0 writes its flight recorder and says what the ranks' records tell.
    if [ "$fault" = stop ]; then
      grep -qF "flight recorder (" "$out" ||
        { cat "$out"; fail "$launcher/$fault: no flight recorder report"; }
      ls "$work/$launcher"/*/flight/rank-0.json >/dev/null 2>&1 ||
        { cat "$out"; fail "$launcher/$fault: rank 0 wrote no flight/rank-0.json"; }
    fi
    echo "launched_faults_test: $launcher/$fault: exit $status after ${took_ms} ms: $said"
    grep -hF "cohort: flight recorder (" "$out" | head -1 | cut -c1-400
  done
done
echo "launched_faults_test: PASS"
