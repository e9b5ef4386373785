#!/usr/bin/env bash
# Installs cohort from BUILD_DIR into a temporary prefix, builds the outside project in
# tests/install/consumer against it with find_package(cohort), and runs it.
set -euo pipefail
build_dir="$1"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/cohort/cohort.h"
test -f "$work/prefix/lib/cmake/cohort/cohortConfig.cmake"
cmake -S "$here/consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/build" > "$work/build.log"
"$work/build/consumer" "$work/runs" | tee "$work/run.log"
grep -q "consumer world_size 2" "$work/run.log"
