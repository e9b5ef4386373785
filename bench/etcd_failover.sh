#!/usr/bin/env bash
# Seconds for a two-node job to complete a step again after its rank-0 node is killed, with the
# etcd rendezvous (`cohort launch --rdzv etcd://`): each run is tests/multi_host/etcd_failover_test.sh
# (two hosts made with network namespaces, a real etcd on host B, host A killed whole after a step
# checkpoint; host B re-rendezvouses in etcd as round 1 and resumes from the checkpoint). Prints
# each run's figure and the median. With the built-in store, which lives in rank 0's launcher,
# the same loss ends the job.
# Usage: bench/etcd_failover.sh [BUILD_DIR] [RUNS]   (as root: ip netns; scripts/setup.sh puts
# Debian's etcd-server under .tools/)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-$root/build}"
runs="${2:-3}"
cli="$build/cohort"
etcd="$root/.tools/etcd"
data=/usr/share/datasets/fashion-mnist
[ -x "$cli" ] || { echo "build $cli first (scripts/setup.sh)" >&2; exit 2; }
[ -x "$etcd" ] || { echo "no etcd at $etcd: scripts/setup.sh unpacks Debian's etcd-server there" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "run as root: the two hosts are network namespaces" >&2; exit 2; }
case "$runs" in '' | *[!0-9]* | 0) echo "RUNS '$runs' must be a whole number >= 1" >&2; exit 2 ;; esac

figures=()
printf '%-4s %12s  %s\n' run continue_s outcome
for run in $(seq 1 "$runs"); do
  log="$(mktemp)"
  timeout -k 10 420 "$root/tests/multi_host/etcd_failover_test.sh" "$cli" "$data" "$etcd" >"$log" 2>&1
  rc=$?
  seconds=$(sed -n 's/.*completed a step again \([0-9.]*\) s after.*/\1/p' "$log" | tail -1)
  if [ "$rc" = 0 ] && [ -n "$seconds" ]; then
    figures+=("$seconds")
    printf '%-4s %12s  %s\n' "$run" "$seconds" "continued on host B, finished"
  else
    printf '%-4s %12s  %s\n' "$run" "-" "FAILED (exit $rc): $(grep -m1 -E 'FAIL|SKIPPED' "$log")"
  fi
  rm -f "$log"
done
[ "${#figures[@]}" -gt 0 ] || exit 1
median=$(printf '%s\n' "${figures[@]}" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}')
echo "two-node job, rank-0 node killed, etcd rendezvous: a step again after ${median} s (median of ${#figures[@]})"
