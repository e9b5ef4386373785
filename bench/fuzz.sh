#!/usr/bin/env bash
# Fuzzes cohort's decoders of what other processes send (tests/fuzz/<target>.cpp) with libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer (Debian's clang), each target for SECONDS, and
# prints per target its executions, executions per second, the coverage it reached (edges and
# features, libFuzzer's cov: and ft:) and the crashes it found. A crash stops that target and is
# saved as tests/fuzz/corpus/<target>/crash-<sha1>, where the replay test fuzz.<target> runs it in
# every CI run: fix the decoder, keep the input.
#
# The targets are the decoders that compile without libtorch's tensor headers: Debian 12's clang
# 14 cannot compile libtorch 1.13's ATen headers as C++20 against libstdc++ 12 (c10::IValue is
# incomplete where std::vector's constexpr members need it). c10's scalar types compile, so the
# safetensors and IDX headers are targets, and so are DeepSpeed JSON and the worker spec (the
# options they hold have torch-free headers: zero_options.h, lr_schedule_options.h,
# activation_checkpointing_policy.h, mesh_shape.h), and the checkpoint manifests, the data
# plane's messages and the parameter server's, each decoded in a source of its own
# (train/manifest.cpp, data/wire_messages.cpp, parallel/parameter_server_messages.cpp).
#
# Usage: bench/fuzz.sh [SECONDS (default 600)] [TARGET...] (default: every target)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-600}"
[ $# -gt 0 ] && shift
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(sed -n 's/^\([a-z_]*\):.*/\1/p' "$root/tests/fuzz/targets.txt")
clang="$(command -v clang++ || command -v clang++-14 || true)"
[ -n "$clang" ] || { echo "fuzz.sh: no clang++ (apt install clang)" >&2; exit 2; }

# The sources each target's decoder is built from, instrumented with it (tests/fuzz/targets.txt).
sources_of() {
  local line
  line="$(grep -E "^$1:" "$root/tests/fuzz/targets.txt" || true)"
  [ -n "$line" ] || {
    echo "fuzz.sh: no target '$1' (targets: $(sed -n 's/^\([a-z_]*\):.*/\1/p' "$root/tests/fuzz/targets.txt" | tr '\n' ' '))" >&2
    return 2
  }
  echo "${line#*:}"
}

work="$(mktemp -d /tmp/cohort-fuzz.XXXXXX)"
trap 'rm -rf "$work"' EXIT
printf '%-22s %8s %12s %8s %6s %7s %s\n' target seconds executions exec/s cov ft crashes
status=0
for target in "${targets[@]}"; do
  listed="$(sources_of "$target")" || exit 2
  read -r -a sources <<<"$listed"
  (cd "$root" && "$clang" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=undefined -I include -I src "tests/fuzz/$target.cpp" "${sources[@]}" \
    -lcrypto -lc10 -o "$work/$target") || { echo "fuzz.sh: $target does not build" >&2; exit 1; }
  mkdir -p "$work/corpus-$target"
  cp "$root/tests/fuzz/corpus/$target/"* "$work/corpus-$target/"
  log="$work/$target.log"
  rc=0
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$work/$target" \
    -max_total_time="$seconds" -print_final_stats=1 -timeout=10 \
    -artifact_prefix="$root/tests/fuzz/corpus/$target/" "$work/corpus-$target" >"$log" 2>&1 || rc=$?
  executions="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  per_second="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)"
  last="$(grep -E '^#[0-9]+' "$log" | tail -n 1)"
  cov="$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")"
  ft="$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")"
  crashes="$(grep -c 'Test unit written' "$log" || true)"
  printf '%-22s %8s %12s %8s %6s %7s %s\n' "$target" "$seconds" "${executions:-?}" "${per_second:-?}" \
    "${cov:-?}" "${ft:-?}" "$crashes"
  if [ "$rc" != 0 ]; then
    status=1
    grep -E 'ERROR|what\(\)|Test unit written' "$log" | head -n 5 | sed "s/^/  $target: /"
  fi
done
exit "$status"
