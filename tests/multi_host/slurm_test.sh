#!/usr/bin/env bash
# A one-host Slurm (munged, slurmctld and slurmd from Debian's packages, in a temporary folder
# with their own ports, socket and key), then `srun -n 2` of the unchanged `cohort train`:
#  1. the ranks find themselves from SLURM_* (rank 0 says "(slurm)"), train in sync, and rank 0
#     writes result.json once;
#  2. the same srun again with --epochs 2 (what a requeued job does) resumes after epoch 1 from
#     the checkpoint in the shared storage path;
#  3. `srun -n 2` with `--workers 3` fails at once naming ScalingConfig.num_workers and srun -n.
# Usage: slurm_test.sh COHORT_BINARY DATA_DIR. Needs root; stops the daemons on exit.
set -uo pipefail
cli="$1"
data="$2"
fail() { echo "slurm_test: FAIL: $*" >&2; exit 1; }
for tool in munged mungekey slurmctld slurmd srun sinfo; do
  command -v "$tool" >/dev/null || fail "$tool is missing: scripts/setup.sh installs munge, slurmctld, slurmd, slurm-client"
done
[ "$(id -u)" = 0 ] || { echo "slurm_test: SKIPPED: needs root to run slurmd (run the tests as root)" >&2; exit 77; }

work="$(mktemp -d)"
chmod 755 "$work"
daemons=()
cleanup() {
  for p in "${daemons[@]}"; do kill "$p" 2>/dev/null; done
  sleep 0.5
  for p in "${daemons[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT

# wait_until SECONDS WHAT COMMAND...: polls COMMAND until it succeeds, failing at the deadline.
wait_until() {
  local deadline=$(( $(date +%s) + $1 )) what="$2"
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { tail -n 20 "$work"/log/* >&2; fail "$what"; }
    sleep 0.2
  done
}

mkdir -p "$work/munge" "$work/state" "$work/spool" "$work/log"
mungekey -c -k "$work/munge/key" || fail "mungekey"
chmod 400 "$work/munge/key"
munged -F -f --socket="$work/munge/socket" --key-file="$work/munge/key" --log-file="$work/log/munged.log" \
  --pid-file="$work/munge/pid" --seed-file="$work/munge/seed" >/dev/null 2>&1 &
daemons+=($!)
wait_until 20 "munged did not start" munge -S "$work/munge/socket" -n

port=$(( 20000 + ($$ % 2000) * 2 ))
host="$(hostname)"
export SLURM_CONF="$work/slurm.conf"
cat >"$SLURM_CONF" <<CONF
ClusterName=cohorttest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$(( port + 1 ))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$work/munge/socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/log/slurmctld.log
SlurmdLogFile=$work/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
NodeName=$host NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
slurmctld -D -i -f "$SLURM_CONF" >"$work/log/slurmctld.out" 2>&1 &
daemons+=($!)
slurmd -D -f "$SLURM_CONF" >"$work/log/slurmd.out" 2>&1 &
daemons+=($!)
wait_until 60 "the node did not come up idle" bash -c "sinfo -h -o %t | grep -qx idle"

# Rank 0's host is the first of the step's nodes, as cohort derives it; where this host's name
# does not resolve, say so and give the address.
extra=()
getent hosts "$host" >/dev/null || { echo "($host does not resolve: MASTER_ADDR=127.0.0.1)"; extra=(--export=ALL,MASTER_ADDR=127.0.0.1); }

# 1. Two ranks under srun.
timeout -k 10 180 srun -n 2 "${extra[@]}" "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --epochs 1 --max-steps 12 \
  --batch-size 16 --storage-path "$work" --name slurm >"$work/train.log" 2>&1
status=$?
cat "$work/train.log"
[ "$status" = 0 ] || fail "srun exited $status"
grep -q "rank 0 of 2 (slurm)" "$work/train.log" || fail "the ranks did not find themselves from SLURM_*"
python3 "$(dirname "$0")/check_result.py" "$work/slurm/result.json" 2 12 "srun -n 2" || fail "result.json"
[ "$(find "$work/slurm" -name result.json | wc -l)" = 1 ] || fail "result.json written more than once"

# 2. Run again, as `srun --requeue` would, with more steps: it resumes from the latest checkpoint,
# inside the epoch where --max-steps stopped the first run.
timeout -k 10 180 srun -n 2 "${extra[@]}" "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --epochs 1 --max-steps 15 \
  --batch-size 16 --storage-path "$work" --name slurm >"$work/again.log" 2>&1
status=$?
cat "$work/again.log"
[ "$status" = 0 ] || fail "the second srun exited $status"
grep -q "resuming epoch 1 after step 12 from $work/slurm/checkpoint_" "$work/again.log" || fail "the second run did not resume"
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); assert r['steps'] == 15 and r['epoch_step'] == 15 and r['error'] is None, r" \
  "$work/slurm/result.json" || fail "result.json after the resumed run"

# 3. A world size that does not match what srun started.
timeout -k 10 120 srun -n 2 "${extra[@]}" "$cli" train --model cnn --data-dir "$data" --workers 3 --epochs 1 \
  --max-steps 2 --storage-path "$work" --name wrong >"$work/wrong.log" 2>&1
status=$?
cat "$work/wrong.log"
[ "$status" != 0 ] || fail "a mismatched --workers was accepted"
grep -q "ScalingConfig.num_workers=3 but the launcher started 2 processes" "$work/wrong.log" || fail "the mismatch is not named"
echo "slurm_test: PASS"
