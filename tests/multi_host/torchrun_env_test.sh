#!/usr/bin/env bash
# torchrun-style variables set by hand: two `cohort train` processes become a 2-rank group
# (rank 0 serves the rendezvous on MASTER_ADDR:MASTER_PORT and hands rank 1 the job secret through
# the storage path, past a stale one), a job restarted after a kill restores from its in-memory
# snapshot, ranks given `--rdzv etcd://` rendezvous in a real etcd instead, and inconsistent
# variables are named.
# Usage: torchrun_env_test.sh COHORT_BINARY DATA_DIR [ETCD_BINARY]
set -uo pipefail
cli="$1"
data="$2"
etcd="${3:-}"
fail() { echo "torchrun_env_test: FAIL: $*" >&2; exit 1; }
work="$(mktemp -d)"
pids=()
trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done; rm -rf "$work"' EXIT
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
# No COHORT_JOB_SECRET: rank 0 writes a fresh secret under the storage path for rank 1. A file an
# earlier job left there (another secret) does not keep rank 1 out: refused, it reads it again.
unset COHORT_JOB_SECRET COHORT_JOB_SECRET_FILE COHORT_INSECURE
(umask 077 && echo "an earlier job's secret, stale" >"$work/.job-secret-default")
for rank in 0 1; do
  RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout -k 5 120 "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --epochs 1 --max-steps 8 --batch-size 16 \
    --storage-path "$work" --name env --quiet >"$work/rank$rank.log" 2>&1 &
  pids+=($!)
done
wait "${pids[0]}"; c0=$?
wait "${pids[1]}"; c1=$?
cat "$work/rank0.log" "$work/rank1.log"
[ "$c0" = 0 ] && [ "$c1" = 0 ] || fail "ranks exited $c0 and $c1"
python3 "$(dirname "$0")/check_result.py" "$work/env/result.json" 2 8 torchrun-style || fail "result.json"
[ ! -e "$work/.job-secret-default" ] || fail "rank 0 left the job secret's file behind once every rank joined"
# In-memory snapshots under this launcher: rank 1 killed once a snapshot is whole ends the job;
# every rank started again, as torchrun restarts a failed job (TORCHELASTIC_RESTART_COUNT=1),
# restores from the snapshot (newer than any checkpoint: there is none yet), the run's history
# goes on, and the run's snapshots go when it ends.
snapshot_run() {  # snapshot_run ROUND: both ranks in the background, their pids in snap_pids
  local port
  port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  snap_pids=()
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      TORCHELASTIC_RESTART_COUNT=$1 timeout -k 5 180 "$cli" train --model cnn --data-dir "$data" \
      --test-examples 1000 --epochs 1 --max-steps 300 --batch-size 16 --storage-path "$work" \
      --name snap --snapshot-every-steps 5 --snapshot-dir "$work/shm" --log-every-steps 1 \
      >"$work/snap$1-rank$rank.log" 2>&1 &
    pids+=($!); snap_pids+=($!)
  done
}
snapshot_run 0
for _ in $(seq 1200); do
  compgen -G "$work/shm/*/snapshot_*/checkpoint/meta.json" >/dev/null && break
  kill -0 "${snap_pids[0]}" 2>/dev/null || break
  sleep 0.1
done
compgen -G "$work/shm/*/snapshot_*/checkpoint/meta.json" >/dev/null ||
  { cat "$work/snap0-rank0.log"; fail "no whole snapshot"; }
pkill -KILL -P "${snap_pids[1]}"  # rank 1 itself, not the timeout that runs it
wait "${snap_pids[0]}"; c0=$?
[ "$c0" != 0 ] || fail "rank 0 ended well though rank 1 was killed"
snapshot_run 1
wait "${snap_pids[0]}"; c0=$?
wait "${snap_pids[1]}"; c1=$?
cat "$work/snap1-rank0.log"
[ "$c0" = 0 ] && [ "$c1" = 0 ] || fail "started again, the ranks exited $c0 and $c1"
grep -q "cohort: restoring from the in-memory snapshot snapshot_" "$work/snap1-rank0.log" ||
  fail "the restarted job did not restore from the snapshot"
[ -z "$(ls -A "$work/shm")" ] || fail "the run's snapshots stayed: $(ls -R "$work/shm")"
python3 -c "import json,sys; s=[json.loads(l)['step'] for l in open(sys.argv[1])]; sys.exit(s[0] != 1)" \
  "$work/snap/steps.jsonl" || fail "the restarted job's steps.jsonl lost the first round's steps"
# The ranks rendezvous in etcd (`--rdzv etcd://`): nothing serves on MASTER_PORT, and the job's keys
# are in etcd under /cohort/<job id>/. Without a secret in their environment they are refused.
if [ -x "$etcd" ]; then
  free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
  eport=$(free_port)
  source "$(dirname "$0")/etcd.sh"
  start_etcd "$etcd" "127.0.0.1:$eport" "$(free_port)"
  etcd_pids=()
  secret="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  for rank in 0 1; do
    RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) \
      COHORT_JOB_ID=in-etcd COHORT_JOB_SECRET="$secret" \
      timeout -k 5 120 "$cli" train --model cnn --data-dir "$data" --test-examples 1000 --epochs 1 --max-steps 8 \
      --batch-size 16 --storage-path "$work" --name in-etcd --quiet --rdzv "etcd://127.0.0.1:$eport" \
      >"$work/etcd-rank$rank.log" 2>&1 &
    pids+=($!); etcd_pids+=($!)
  done
  wait "${etcd_pids[0]}"; c0=$?
  wait "${etcd_pids[1]}"; c1=$?
  cat "$work/etcd-rank0.log" "$work/etcd-rank1.log"
  [ "$c0" = 0 ] && [ "$c1" = 0 ] || fail "ranks in etcd exited $c0 and $c1"
  python3 "$(dirname "$0")/check_result.py" "$work/in-etcd/result.json" 2 8 "torchrun-style in etcd" ||
    fail "result.json of the ranks in etcd"
  python3 - "$eport" <<'PY' || fail "the job's keys are not in etcd"
import base64, json, sys, urllib.request
key = base64.b64encode(b"/cohort/in-etcd/").decode()
end = base64.b64encode(b"/cohort/in-etcd0").decode()
request = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v3/kv/range",
                                 json.dumps({"key": key, "range_end": end, "count_only": True}).encode())
count = int(json.load(urllib.request.urlopen(request, timeout=10)).get("count", 0))
print(f"etcd holds {count} keys of job in-etcd")
sys.exit(0 if count > 0 else 1)
PY
  out=$(RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$cli" train --data-dir "$data" \
    --rdzv "etcd://127.0.0.1:$eport" 2>&1)
  [ $? = 2 ] || fail "ranks in etcd without a secret did not exit 2: $out"
  grep -q "ranks that rendezvous in etcd need the job secret from their environment" <<<"$out" ||
    fail "the missing secret is not named: $out"
else
  echo "torchrun_env_test: the etcd case is skipped: no etcd binary given (scripts/setup.sh unpacks it)"
fi
out=$(RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$cli" train --data-dir "$data" 2>&1)
[ $? = 2 ] || fail "RANK=2 WORLD_SIZE=2 did not exit 2: $out"
grep -q "RANK=2 must be < WORLD_SIZE=2" <<<"$out" || fail "unnamed: $out"
out=$(RANK=0 WORLD_SIZE=2 MASTER_PORT=$port timeout 60 "$cli" train --data-dir "$data" 2>&1)
grep -q "MASTER_ADDR is not set" <<<"$out" || fail "missing MASTER_ADDR not named: $out"
out=$(RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 60 "$cli" train --workers 3 --data-dir "$data" 2>&1)
grep -q "num_workers=3 but the launcher started 2" <<<"$out" || fail "worker mismatch not named: $out"
# A rank built differently (here: the same program with another build id, as the linker gives
# any other build) is refused at join.
"$(dirname "$0")/other_build.sh" "$cli" "$work/cohort-other" || fail "cannot make another build"
port=$(python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
mismatch=()
for rank in 0 1; do
  program="$cli"; [ "$rank" = 1 ] && program="$work/cohort-other"
  RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    timeout -k 5 90 "$program" train --data-dir "$data" --test-examples 1000 --epochs 1 --max-steps 8 --batch-size 16 \
    --storage-path "$work" --name mismatch --quiet >"$work/mismatch$rank.log" 2>&1 &
  pids+=($!); mismatch+=($!)
done
wait "${mismatch[0]}"; c0=$?
wait "${mismatch[1]}"; c1=$?
cat "$work/mismatch0.log" "$work/mismatch1.log"
# Rank 0 refuses (exit 2). Rank 1 refuses too, or finds the store gone with rank 0: either way it fails.
[ "$c0" = 2 ] && [ "$c1" != 0 ] || fail "different binaries: ranks exited $c0 and $c1, expected 2 and a failure"
grep -q "rank 1 runs a different program .* than rank 0 .*deploy the same build on every node" "$work/mismatch0.log" ||
  fail "rank 0 did not name the different program"
echo "torchrun_env_test: PASS"
