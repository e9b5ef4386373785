#!/usr/bin/env bash
# examples/own_model as a user runs it: a model of its own on a CSV of its own, pp 2 x dp 2,
# ZeRO-1 inside dp, bf16, 2 accumulated batches per step. A run stopped inside its first epoch
# and run again resumes with the batches it had not seen: it ends with the same steps and, to the
# last digit, the same test loss as a run never stopped. --config and --deepspeed files set the
# program's options and plan. A bad plan and an unknown config key are one line with exit code 2.
# Usage: own_model_example_test.sh PROGRAM
set -euo pipefail
program="$1"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
# 640 rows of 4 features; the class follows from them (so that the model learns it).
awk 'BEGIN { srand(7); print "a,b,c,d,label";
  for (i = 0; i < 640; i++) { a = rand() * 2 - 1; b = rand() * 2 - 1; c = rand() * 2 - 1; d = rand();
    printf "%.4f,%.4f,%.4f,%.4f,%d\n", a, b, c, d, (c > 0.5) ? 2 : (a + b > 0) }}' > "$dir/data.csv"
run() { timeout 240 "$program" --data "csv:$dir/data.csv" --label label --storage-path "$dir/runs" "$@" 2>&1; }
last() { grep -E '^steps ' <<<"$1" | tail -1; }
whole="$(run --name whole)"
printf '%s\n' "$whole"
stopped="$(run --name resumed --max-steps 4)"
printf '%s\n' "$stopped"
resumed="$(run --name resumed)"
printf '%s\n' "$resumed"
fail() { echo "own_model_example_test: $*" >&2; exit 1; }
[[ "$(last "$stopped")" == "steps 4 "* ]] || fail "the stopped run did not stop after 4 steps"
grep -q 'resuming from .*/resumed/checkpoint_000000' <<<"$resumed" || fail "the second run did not resume"
[[ "$(last "$whole")" == "steps 18 "* ]] || fail "an uninterrupted run is 2 epochs of 9 steps"
[[ "$(last "$resumed")" == "$(last "$whole")" ]] ||
  fail "resumed: '$(last "$resumed")', never stopped: '$(last "$whole")'"
accuracy="$(last "$whole" | awk '{ print $4 }')"
awk -v a="$accuracy" 'BEGIN { exit !(a >= 0.7) }' || fail "accuracy $accuracy < 0.7"
# A config file of the program's options (2 workers, no pipeline: 9 steps an epoch) and a
# DeepSpeed file's batches (8 rows, 2 accumulated: 18 steps an epoch on 2 replicas).
echo '{"workers": 2, "pp": 1, "zero-stage": 2, "epochs": 1}' > "$dir/config.json"
configured="$(run --name configured --config "$dir/config.json")"
[[ "$(last "$configured")" == "steps 9 "* ]] || fail "--config: $configured"
echo '{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
  "zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}' \
  > "$dir/ds.json"
deepspeed="$(run --name deepspeed --deepspeed "$dir/ds.json" --epochs 1)"
[[ "$(last "$deepspeed")" == "steps 18 "* ]] || fail "--deepspeed: $deepspeed"
set +e
echo '{"workerz": 2}' > "$dir/typo.json"
typo="$(run --name typo --config "$dir/typo.json")"
status=$?
[[ $status -eq 2 ]] || fail "an unknown config key: exit code $status, not 2"
grep -q "unknown key 'workerz': it is no option of \`own_model\`" <<<"$typo" || fail "typo: $typo"
optimizer="$(run --name optimizer --optimizer rmsprop)"
status=$?
[[ $status -eq 2 ]] || fail "--optimizer rmsprop: exit code $status, not 2"
grep -q "unknown optimizer 'rmsprop' (--optimizer" <<<"$optimizer" || fail "rmsprop: $optimizer"
bad="$(run --name bad --pp 3)"
status=$?
set -e
[[ $status -eq 2 ]] || fail "--pp 3 with 4 workers: exit code $status, not 2"
grep -q -- '--pp 3 --tp 1 makes groups of 3 workers, which does not divide --workers 4' <<<"$bad" ||
  fail "--pp 3: $bad"
echo "own_model_example_test: passed"
