#!/usr/bin/env bash
# A `cohort train` run and a `cohort tune` experiment write TensorBoard files that an independent
# reader (check_events.py: Debian's protobuf, its own CRC-32C) decodes whole and finds to match
# metrics.jsonl and steps.jsonl, with histograms and the hparams plugin's experiment and sessions.
# Usage: tensorboard_test.sh COHORT_CLI
set -euo pipefail
cli="$1"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
storage="$(mktemp -d)"
trap 'rm -rf "$storage"' EXIT
small=(--epochs 2 --train-examples 512 --test-examples 256 --storage-path "$storage" --quiet)

"$cli" train --workers 2 --tensorboard-histograms --log-every-steps 4 --name run "${small[@]}"
/usr/bin/python3 "$here/check_events.py" run "$storage/run" --histograms

# The reader is not fooled: one flipped bit in the file is named.
cp -r "$storage/run" "$storage/flipped"
file="$(ls "$storage"/flipped/tensorboard/events.out.tfevents.*)"
printf '\xff' | dd of="$file" bs=1 seek=100 count=1 conv=notrunc status=none
if /usr/bin/python3 "$here/check_events.py" run "$storage/flipped" 2>"$storage/err"; then
  echo "tensorboard_test: a corrupt file passed the check" >&2
  exit 1
fi
grep -q "CRC of the record at byte" "$storage/err"

"$cli" tune --workers 1 --param lr=loguniform:0.001:0.1 --param optimizer=choice:sgd,adam \
  --samples 2 --metric test_accuracy --name experiment "${small[@]}" >/dev/null
/usr/bin/python3 "$here/check_events.py" tune "$storage/experiment"
