#!/usr/bin/env bash
# Every C++ block of README.md and docs/ compiles against the installed package: whole programs
# are compiled and linked, fragments compiled inside their harness (tests/docs/harnesses/). A
# block that no longer compiles fails naming its Markdown file and line.
# Usage: snippets_test.sh BUILD_DIR
set -euo pipefail
build_dir="$(cd "$1" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >"$work/install.log"
/usr/bin/python3 "$here/extract_snippets.py" "$root" "$work/project"
# Unoptimised: the blocks are compiled to be checked, never run (-O0 compiles them in about 60% of
# a Release build's time, -O3).
cmake -S "$work/project" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS=-O0 \
  -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log" 2>&1 ||
  { tail -30 "$work/configure.log" >&2; exit 1; }
if ! cmake --build "$work/build" -j "${COHORT_JOBS:-2}" -- -k 0 >"$work/build.log" 2>&1; then
  echo "snippets_test: C++ blocks of the docs that do not compile (file:line of the Markdown):" >&2
  grep -E '\.md:[0-9]+:[0-9]+: error' "$work/build.log" >&2 || tail -40 "$work/build.log" >&2
  exit 1
fi
echo "snippets_test: $(wc -l <"$work/project/snippets.txt") C++ blocks of README.md and docs/ compile against the installed package"
