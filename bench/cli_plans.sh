#!/usr/bin/env bash
# cohort train's samples/s and test accuracy for DDP, ZeRO-2, pp 2 and DiLoCo, for one or more
# cohort binaries in the same run (e.g. a build before a change and one after), the same seed:
#   bench/cli_plans.sh /tmp/cohort-before build/cohort
# Settings: CNN on Fashion-MNIST, 2 workers, 1 epoch of --train-examples (default 8192).
set -euo pipefail
examples="${TRAIN_EXAMPLES:-8192}"
storage="$(mktemp -d)"
trap 'rm -rf "$storage"' EXIT
printf '%-10s %-24s %12s %14s\n' plan binary samples/s test_accuracy
for plan in "ddp:" "zero2:--zero-stage 2" "pp2:--pp 2" "diloco:--sync diloco:4"; do
  label="${plan%%:*}"
  read -r -a flags <<<"${plan#*:}"
  index=0
  for binary in "$@"; do
    # A run of its own for each binary (two builds' binaries may both be build/cohort).
    index=$((index + 1))
    name="$label-$index-$(basename "$binary")"
    "$binary" train --model cnn --workers 2 --epochs 1 --train-examples "$examples" \
      --test-examples 2000 --seed 1 --quiet --no-tensorboard --storage-path "$storage" \
      --name "$name" "${flags[@]}" >/dev/null 2>&1
    /usr/bin/python3 - "$storage/$name/result.json" "$label" "$binary" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:<10} {sys.argv[3][-24:]:<24} {m['samples_per_second']:12.1f} {m['test_accuracy']:14.6f}")
PY
  done
done
