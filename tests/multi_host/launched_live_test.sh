#!/usr/bin/env bash
# Live recovery under `cohort launch` (--recovery live): a rank killed with SIGKILL inside an
# epoch, rank 0 among them, or stopped with SIGSTOP (it hangs: its launcher kills it at the job
# host's word). Its launcher starts a replacement when the job host, which keeps the run and its
# coordinator, asks for one; the survivors go on in the same processes, and the run ends bit for
# bit as one that nobody interrupted (the last checkpoint's model file equal byte for byte).
# Without replacements (--no-replace-lost --min-workers 2) the survivors go on alone. The job
# host's loss ends the round, and the launcher's restart (--max-restarts 1) resumes the run.
# With ETCD_BINARY, a job that rendezvouses in a real etcd (--rdzv etcd://) recovers alike.
# Usage: launched_live_test.sh COHORT_BINARY DATA_DIR [ETCD_BINARY]
set -uo pipefail
cli="$1"
data="$2"
etcd="${3:-}"
fail() { echo "launched_live_test: FAIL: $*" >&2; exit 1; }
[ -f "$data/train-images-idx3-ubyte" ] || [ -f "$data/train-images-idx3-ubyte.gz" ] ||
  { echo "launched_live_test: SKIP: no Fashion-MNIST in $data (apt install dataset-fashion-mnist)"; exit 77; }
work="$(mktemp -d)"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
free_port() {
  python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

# 3 ranks, 2 epochs of 200 steps each (a kill aimed at step 15 lands inside the first, also on a
# loaded machine); the whole job is given 240 s.
launch() {  # launch NAME LOG [LAUNCH_ARGS...] -- [TRAIN_ARGS...]: in the background, pid in $job
  local name="$1" log="$2"
  shift 2
  local launch_args=()
  while [ "$#" -gt 0 ] && [ "$1" != -- ]; do launch_args+=("$1"); shift; done
  shift
  setsid timeout -k 5 240 "$cli" launch --nnodes 1 --node-rank 0 --master "127.0.0.1:$(free_port)" \
    --nproc-per-node 3 "${launch_args[@]}" -- \
    "$cli" train --model mlp --data-dir "$data" --train-examples 9600 --test-examples 500 \
    --batch-size 16 --epochs 2 --workers 3 --seed 5 --storage-path "$work" --name "$name" \
    --log-every-steps 1 --recovery live --snapshot-dir "$work/shm" "$@" >"$log" 2>&1 &
  job=$!
  pids+=("$job")
}

# The last step rank 0 logged (steps.jsonl), or 0: read often, so without starting a program
# that takes long on a loaded machine.
last_step() {
  local step
  step=$(grep -o '"step":[0-9]*' "$work/$1/steps.jsonl" 2>/dev/null | tail -n 1 | cut -d: -f2)
  echo "${step:-0}"
}

# Sends SIGNAL (KILL by default) to the launched rank RANK (from its environment; "host": the job
# host) once rank 0 logged step AT.
kill_rank_at() {  # kill_rank_at NAME LAUNCHER_PID RANK AT [SIGNAL]
  local name="$1" launcher="$2" rank="$3" at="$4" signal="${5:-KILL}" deadline=$((SECONDS + 120))
  while [ "$(last_step "$name")" -lt "$at" ]; do
    [ "$SECONDS" -lt "$deadline" ] || fail "$name: step $at not reached within 120 s"
    kill -0 "$launcher" 2>/dev/null || fail "$name: the job ended before step $at"
    sleep 0.02
  done
  local child victim="" mark="RANK=$rank"
  [ "$rank" = host ] && mark="COHORT_ROLE=job-host"
  for child in $(pgrep -P "$(pgrep -P "$launcher" -f "cohort launch" || echo "$launcher")"); do
    if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx "$mark"; then victim=$child; fi
  done
  [ -n "$victim" ] || fail "$name: no process of rank $rank"
  kill "-$signal" "$victim"
  echo "launched_live_test: $name: SIG$signal to rank $rank (pid $victim) after step $(last_step "$name")"
}

final_model() {  # the model file of the run's last checkpoint
  ls -d "$work/$1"/checkpoint_[0-9]* | sort | tail -n 1 | sed 's|$|/model.safetensors|'
}

result_field() {  # result_field NAME EXPRESSION (of r, the result.json)
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print($2)" "$work/$1/result.json"
}

# 1. Nobody interrupted.
launch plain "$work/plain.log" --
wait "$job" || { cat "$work/plain.log"; fail "the uninterrupted job failed"; }

# 2. Rank 1 killed in the first epoch, replaced.
launch replaced "$work/replaced.log" --
kill_rank_at replaced "$job" 1 15
wait "$job" || { cat "$work/replaced.log"; fail "the job with a replacement failed"; }
for said in "started the job host" "the job host (pid" "keeps the run directory" \
  "the job goes on without it (live recovery)" "started the replacement of rank 1 as rank 1 of 3" \
  "live recovery: 3 workers go on after step" "live recovery: training again"; do
  grep -qF "$said" "$work/replaced.log" || { cat "$work/replaced.log"; fail "replaced: nobody said '$said'"; }
done
cmp -s "$(final_model plain)" "$(final_model replaced)" ||
  { cat "$work/replaced.log"; fail "replaced: the last checkpoint's model differs from the uninterrupted run's"; }
[ "$(result_field replaced "len(r['failures']), r['failures'][0]['live'], r['failures'][0]['recovery_s'] is not None, r['steps']")" = \
  "1 True True $(result_field plain "r['steps']")" ] ||
  fail "replaced: result.json: $(result_field replaced "r['failures'], r['steps']")"
echo "launched_live_test: replaced: equal bit for bit to the uninterrupted run"

# 2b. Rank 1 stopped (SIGSTOP: it hangs): the job host's coordinator hears nothing from it for 2 s
# and asks its launcher to kill it; then as above.
launch hung "$work/hung.log" -- --heartbeat-timeout 2
kill_rank_at hung "$job" 1 15 STOP
wait "$job" || { cat "$work/hung.log"; fail "the job with a hung rank failed"; }
for said in "rank 1 sent no heartbeat for 2 s: it hangs or was stopped" \
  "its launcher kills it, and the others go on (live recovery)" "killing it at the job host's word" \
  "started the replacement of rank 1 as rank 1 of 3"; do
  grep -qF "$said" "$work/hung.log" || { cat "$work/hung.log"; fail "hung: nobody said '$said'"; }
done
cmp -s "$(final_model plain)" "$(final_model hung)" ||
  { cat "$work/hung.log"; fail "hung: the last checkpoint's model differs from the uninterrupted run's"; }
echo "launched_live_test: hung: killed, replaced, equal bit for bit to the uninterrupted run"

# 2c. The same in an etcd rendezvous (--rdzv etcd://): the decisions and the launcher's keys in
# etcd.
if [ -x "$etcd" ]; then
  eport=$(free_port)
  source "$(dirname "$0")/etcd.sh"
  start_etcd "$etcd" "127.0.0.1:$eport" "$(free_port)"
  launch in-etcd "$work/in-etcd.log" --rdzv "etcd://127.0.0.1:$eport" --
  kill_rank_at in-etcd "$job" 1 15
  wait "$job" || { cat "$work/in-etcd.log"; fail "the job in etcd with a replacement failed"; }
  grep -qF "started the replacement of rank 1 as rank 1 of 3" "$work/in-etcd.log" ||
    { cat "$work/in-etcd.log"; fail "in-etcd: no replacement"; }
  cmp -s "$(final_model plain)" "$(final_model in-etcd)" ||
    { cat "$work/in-etcd.log"; fail "in-etcd: the last checkpoint's model differs from the uninterrupted run's"; }
  echo "launched_live_test: in-etcd: replaced, equal bit for bit to the uninterrupted run"
else
  echo "launched_live_test: in-etcd: not run: no etcd binary given (scripts/setup.sh unpacks one into .tools/)"
fi

# 3. Rank 2 killed, no replacement: the 2 survivors go on.
launch shrunk "$work/shrunk.log" -- --no-replace-lost --min-workers 2
kill_rank_at shrunk "$job" 2 15
wait "$job" || { cat "$work/shrunk.log"; fail "the job without a replacement failed"; }
grep -qF "live recovery: 2 workers go on after step" "$work/shrunk.log" ||
  { cat "$work/shrunk.log"; fail "shrunk: the survivors did not go on alone"; }
[ "$(result_field shrunk "r['error'], r['world_size']")" = "None 2" ] ||
  fail "shrunk: result.json: $(result_field shrunk "r['error'], r['world_size']")"
echo "launched_live_test: shrunk: 2 survivors finished the run"

# 4. Rank 0 killed: a rank as any, replaced (the job host keeps the run and its coordinator).
launch rank0 "$work/rank0.log" --
kill_rank_at rank0 "$job" 0 15
wait "$job" || { cat "$work/rank0.log"; fail "the job whose rank 0 was killed failed"; }
for said in "started the replacement of rank 0 as rank 0 of 3" "live recovery: training again"; do
  grep -qF "$said" "$work/rank0.log" || { cat "$work/rank0.log"; fail "rank0: nobody said '$said'"; }
done
cmp -s "$(final_model plain)" "$(final_model rank0)" ||
  { cat "$work/rank0.log"; fail "rank0: the last checkpoint's model differs from the uninterrupted run's"; }
[ "$(result_field rank0 "len(r['failures']), r['failures'][0]['rank'], r['failures'][0]['live'], r['error']")" = \
  "1 0 True None" ] || fail "rank0: result.json: $(result_field rank0 "r['failures'], r['error']")"
echo "launched_live_test: rank0: replaced, equal bit for bit to the uninterrupted run"

# 4b. The job host killed: the round ends, the launcher restarts the job, which resumes from its
# last checkpoint (one every 10 steps).
launch host "$work/host.log" --max-restarts 1 -- --checkpoint-every-steps 10
kill_rank_at host "$job" host 15
wait "$job" || { cat "$work/host.log"; fail "the job whose job host was killed did not finish after a restart"; }
grep -qF "it hosts the coordinator of live recovery, so the job cannot go on without it" \
  "$work/host.log" || { cat "$work/host.log"; fail "host: the launcher did not say why the round ends"; }
grep -qF "restarting as round 1" "$work/host.log" || { cat "$work/host.log"; fail "host: no restart"; }
grep -qE "resuming epoch 1 after step [1-9][0-9]* from .*checkpoint_" "$work/host.log" ||
  { cat "$work/host.log"; fail "host: the restarted job did not resume from a checkpoint"; }
[ "$(result_field host "r['error'], r['steps']")" = "None 400" ] ||
  fail "host: result.json: $(result_field host "r['error'], r['steps']")"
echo "launched_live_test: host: restarted, resumed from a checkpoint and finished"
# 5. Under another launcher (torchrun-style variables) live recovery is refused, naming the fallback.
RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
  timeout -k 5 60 "$cli" train --model mlp --data-dir "$data" --train-examples 320 --workers 1 \
  --storage-path "$work" --name refused --recovery live >"$work/refused.log" 2>&1
status=$?
[ "$status" = 2 ] && grep -qF "needs cohort's local driver or cohort launch" "$work/refused.log" &&
  grep -qF "use --recovery restart, with --snapshot-every-steps K" "$work/refused.log" ||
  { cat "$work/refused.log"; fail "torchrun-style: --recovery live exited $status without the refusal"; }
echo "launched_live_test: torchrun-style: refused with exit 2"
echo "launched_live_test: PASS"
