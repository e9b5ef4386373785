#!/usr/bin/env bash
# Installs cohort from BUILD_DIR into a temporary prefix, builds the outside project in
# tests/install/consumer against it with find_package(cohort), and runs it. The project also
# compiles the README's first C++ program, as a new user copies it.
set -euo pipefail
build_dir="$1"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
test -f "$work/prefix/include/cohort/cohort.h"
test -f "$work/prefix/lib/cmake/cohort/cohortConfig.cmake"
test -f "$work/prefix/include/cohort/version.h"
# The first ```cpp block after "## Using the library".
awk '/^## Using the library/ { section = 1 }
     section && /^```cpp/ { inside = 1; next }
     inside && /^```/ { exit }
     inside { print }' "$here/../../README.md" > "$work/readme_first.cpp"
grep -q "int main" "$work/readme_first.cpp" || { echo "the README's first program was not found" >&2; exit 1; }
cmake -S "$here/consumer" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DREADME_PROGRAM="$work/readme_first.cpp" \
  > "$work/configure.log"
cmake --build "$work/build" > "$work/build.log" || { tail -30 "$work/build.log" >&2; exit 1; }
"$work/build/consumer" "$work/runs" | tee "$work/run.log"
grep -q "consumer world_size 2" "$work/run.log"
grep -q "consumer of cohort [0-9]*\.[0-9]*\.[0-9]* (git " "$work/run.log"
# A project that asks for a version this is not is told so at configure time.
if cmake -S "$here/consumer" -B "$work/build-99" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCOHORT_REQUIRED_VERSION=99.0 > "$work/configure-99.log" 2>&1; then
  echo "find_package(cohort 99.0) found cohort $(grep -o 'COHORT_VERSION "[^"]*"' \
    "$work/prefix/include/cohort/version.h")" >&2
  exit 1
fi
grep -q "version" "$work/configure-99.log" || { cat "$work/configure-99.log" >&2; exit 1; }
