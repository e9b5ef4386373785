#!/usr/bin/env bash
# The API reference and guides build with Debian's doxygen (the `docs` target) without a single
# warning: every public class, function and member of include/cohort/ is documented, and the
# guides' Markdown is well-formed. A warning (an undocumented symbol, named with its header and
# line) fails the docs target, and this test with it. Prints the pages it made.
# Usage: reference_test.sh BUILD_DIR
set -euo pipefail
build_dir="$(cd "$1" && pwd)"
command -v doxygen >/dev/null || { echo "reference_test: SKIPPED: no doxygen (scripts/setup.sh installs it)"; exit 77; }
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! cmake --build "$build_dir" --target docs >"$log" 2>&1; then
  echo "reference_test: the docs target failed (doxygen warnings fail it):" >&2
  grep -E 'warning:|error:' "$log" | sort -u >&2 || tail -20 "$log" >&2
  exit 1
fi
[ -f "$build_dir/docs/html/index.html" ] || { echo "reference_test: no $build_dir/docs/html/index.html" >&2; exit 1; }
echo "reference_test: $(find "$build_dir/docs/html" -name '*.html' | wc -l) HTML pages in $build_dir/docs/html, no doxygen warning (every public symbol documented)"
