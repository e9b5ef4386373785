#!/usr/bin/env bash
# OpenMPI's mpirun -np 2 on this host starts the unchanged `cohort train`: it finds its rank from
# OMPI_COMM_WORLD_*, trains as 2 ranks in sync and rank 0 writes result.json.
# Usage: mpirun_test.sh COHORT_BINARY DATA_DIR. Runs as root (the flags that needs are set).
set -uo pipefail
cli="$1"
data="$2"
fail() { echo "mpirun_test: FAIL: $*" >&2; exit 1; }
command -v mpirun >/dev/null || fail "mpirun is missing: scripts/setup.sh installs openmpi-bin"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# timeout sends TERM, which mpirun passes to its ranks before it exits.
timeout -k 10 180 mpirun -np 2 --oversubscribe --bind-to none --mca btl self,tcp --mca btl_tcp_if_include lo \
  --mca oob_tcp_if_include lo \
  "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --epochs 1 --max-steps 10 --batch-size 16 \
  --storage-path "$work" --name mpi --quiet
status=$?
[ "$status" = 0 ] || fail "mpirun exited $status"
python3 "$(dirname "$0")/check_result.py" "$work/mpi/result.json" 2 10 mpirun || fail "result.json"
echo "mpirun_test: PASS"
