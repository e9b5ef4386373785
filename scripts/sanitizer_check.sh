#!/usr/bin/env bash
# The unit tests of the layers that read what other processes and files send (comm, runtime, data
# and train: their binaries comm_test, runtime_test, data_test, train_test) built with
# AddressSanitizer and UndefinedBehaviorSanitizer (GCC's, -DCOHORT_SANITIZE=ON) in a build folder
# of their own, and run: a finding ends its test with the sanitizer's report in ctest's output.
# The workers those tests start are the same instrumented binaries.
#
# The sanitizers' settings are compiled into the programs (src/sanitizer_options.cpp says which
# checks are off and why); ASAN_OPTIONS and UBSAN_OPTIONS add to them. CI runs this script after
# its libtorch 2.x lane, inside that lane's Debian root (scripts/debian_root.sh --sanitize-layers),
# or after its first lane where it cannot make the root; scripts/debian_root.sh --sanitize runs the
# whole suite so against libtorch 2.x (about three times slower than plain).
#
# Usage: scripts/sanitizer_check.sh [BUILD_DIR (default: build-sanitize)] [CTEST_ARGS...]
#        scripts/sanitizer_check.sh --binaries   (prints the binaries, ;-separated, as CMake lists)
set -euo pipefail
binaries=(comm_test runtime_test data_test train_test)
if [ "${1:-}" = --binaries ]; then
  (IFS=';'; echo "${binaries[*]}")
  exit 0
fi
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build-sanitize}"
[ $# -gt 0 ] && shift
started=$SECONDS
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOHORT_SANITIZE=ON \
  -DCOHORT_BUILD_BENCH=OFF ${COHORT_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "${COHORT_JOBS:-2}" --target "${binaries[@]}"
echo "sanitizer_check: built in $((SECONDS - started)) s"
labels="^($(IFS='|'; echo "${binaries[*]}"))\$"
ctest --test-dir "$build" -L "$labels" --output-on-failure -j "${COHORT_JOBS:-2}" "$@"
echo "sanitizer_check: passed in $((SECONDS - started)) s"
