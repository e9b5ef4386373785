#!/usr/bin/env bash
# Under mpirun -np 2, rank 1 stops itself (SIGSTOP) after step 2: prints the seconds from the stop
# until rank 0 printed the coordinator's message naming rank 1 (the other ranks stop with it), per
# run, beside the goal (the heartbeat timeout plus one interval).
# Usage: bench/launched_hang.sh [BUILD_DIR] [RUNS] [HEARTBEAT_TIMEOUT_S]   (as root, or any user
# mpirun runs for)
set -uo pipefail
build="${1:-build}"
runs="${2:-3}"
timeout_s="${3:-3}"
program="$build/tests/launched_fault_program"
[ -x "$program" ] || { echo "build $program first (ninja -C $build launched_fault_program)" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d)"
trap 'pkill -KILL -f "$program stop $work" 2>/dev/null; rm -rf "$work"' EXIT
interval=$(python3 -c "print(min(1.0, max(0.01, $timeout_s / 5)))")
echo "heartbeat timeout ${timeout_s} s, interval ${interval} s: goal $(python3 -c "print($timeout_s + $interval)") s"
printf '%-4s %10s  %s\n' run detect_s message
for run in $(seq 1 "$runs"); do
  dir="$work/$run/"
  mkdir -p "$dir"
  timeout -k 5 60 mpirun -np 2 --oversubscribe --bind-to none --mca btl self,tcp \
    --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \
    "$program" stop "$dir" "$timeout_s" 2>&1 |
    while IFS= read -r line; do echo "$(date +%s.%N) $line"; done >"$work/$run.log"
  injected=$(cat "$dir/stop/injected_at" 2>/dev/null)
  # The time the coordinator's message came out, and the message.
  said=$(grep "coordinator stops the job: rank 1 sent no heartbeat" "$work/$run.log" | head -1)
  if [ -z "$said" ] || [ -z "$injected" ]; then
    printf '%-4s %10s  %s\n' "$run" "-" "NO MESSAGE"
    continue
  fi
  printf '%-4s %10.2f  %s\n' "$run" "$(python3 -c "print(${said%% *} - $injected)")" \
    "$(grep -o "rank 1 sent no heartbeat[^;]*" <<<"$said")"
done
