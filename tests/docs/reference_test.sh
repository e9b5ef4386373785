#!/usr/bin/env bash
# The API reference and guides build with Debian's doxygen (the `docs` target) without a warning,
# except the public symbols docs/undocumented.txt lists as not documented yet. A symbol not
# documented and not listed fails naming it; a listed one that is documented now fails too, so
# that the list only shrinks. Prints the pages and the undocumented symbols left.
# Usage: reference_test.sh BUILD_DIR
set -euo pipefail
build_dir="$(cd "$1" && pwd)"
root="$(cd "$(dirname "$0")/../.." && pwd)"
command -v doxygen >/dev/null || { echo "reference_test: SKIPPED: no doxygen (scripts/setup.sh installs it)"; exit 77; }
cmake --build "$build_dir" --target docs >"$build_dir/docs/build.log" 2>&1 ||
  { tail -20 "$build_dir/docs/build.log" >&2; echo "reference_test: the docs target failed" >&2; exit 1; }
log="$build_dir/docs/warnings.log"
[ -f "$build_dir/docs/html/index.html" ] || { echo "reference_test: no build/docs/html/index.html" >&2; exit 1; }
# "FILE:LINE: warning: TEXT" with FILE relative to the clone, without its line: stable keys.
sed -e "s|^$root/||" -e "s|^$build_dir/||" -e 's|^\([^:]*\):[0-9]*: warning: |\1: |' "$log" | sort -u >"$build_dir/docs/warnings.txt"
grep -v ' is not documented\.$' "$build_dir/docs/warnings.txt" >"$build_dir/docs/other.txt" || true
grep ' is not documented\.$' "$build_dir/docs/warnings.txt" >"$build_dir/docs/undocumented.txt" || true
status=0
if [ -s "$build_dir/docs/other.txt" ]; then
  echo "reference_test: doxygen warnings (fix the comment, e.g. \`<run>\` in backquotes):" >&2
  cat "$build_dir/docs/other.txt" >&2
  status=1
fi
new="$(comm -23 "$build_dir/docs/undocumented.txt" <(sort -u "$root/docs/undocumented.txt"))"
if [ -n "$new" ]; then
  echo "reference_test: public symbols without documentation (a /// comment before each):" >&2
  echo "$new" >&2
  status=1
fi
gone="$(comm -13 "$build_dir/docs/undocumented.txt" <(sort -u "$root/docs/undocumented.txt"))"
if [ -n "$gone" ]; then
  echo "reference_test: documented now: remove these lines from docs/undocumented.txt:" >&2
  echo "$gone" >&2
  status=1
fi
pages="$(find "$build_dir/docs/html" -name '*.html' | wc -l)"
echo "reference_test: $pages HTML pages in $build_dir/docs/html; $(wc -l <"$build_dir/docs/undocumented.txt") public symbols not documented yet (docs/undocumented.txt)"
exit "$status"
