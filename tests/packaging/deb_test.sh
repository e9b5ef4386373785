#!/usr/bin/env bash
# The Debian package (cmake/package.cmake): cpack builds it from BUILD_DIR; it holds the library,
# headers, CMake package, CLI, bash completion, man page and copyright, depends on Debian's libtorch
# and friends, and an outside project builds and runs against the unpacked package.
# (scripts/deb_install_check.sh installs it with apt in a new Debian root: too slow for CI.)
# Usage: deb_test.sh BUILD_DIR
set -euo pipefail
build_dir="$(cd "$1" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() { echo "deb_test: $*" >&2; exit 1; }

(cd "$build_dir" && cpack -G DEB -B "$work/package" >"$work/cpack.log" 2>&1) ||
  { tail -20 "$work/cpack.log" >&2; fail "cpack -G DEB failed"; }
deb="$(ls "$work"/package/cohort_*.deb)"
version="$(grep -o 'COHORT_VERSION "[^"]*"' "$build_dir/include/cohort/version.h" | cut -d'"' -f2)"
[ "$(basename "$deb")" = "cohort_${version}_$(dpkg --print-architecture).deb" ] ||
  fail "the package is $(basename "$deb"), not cohort_${version}_$(dpkg --print-architecture).deb"

contents="$(dpkg-deb -c "$deb" | awk '{ print $6 }')"
for path in ./usr/bin/cohort ./usr/include/cohort/cohort.h ./usr/include/cohort/version.h \
    ./usr/include/cohort/train/trainer.h ./usr/lib/libcohort.a ./usr/lib/libcohort_models.a \
    ./usr/lib/cmake/cohort/cohortConfig.cmake ./usr/lib/cmake/cohort/cohortConfigVersion.cmake \
    ./usr/share/bash-completion/completions/cohort ./usr/share/man/man1/cohort.1.gz \
    ./usr/share/doc/cohort/copyright ./usr/share/doc/cohort/guides/getting-started.md; do
  grep -qx "$path" <<<"$contents" || fail "the package lacks $path"
done
# Every public header is in it.
for header in $(cd "$here/../../include" && find cohort -name '*.h'); do
  grep -qx "./usr/include/$header" <<<"$contents" || fail "the package lacks the header $header"
done

depends="$(dpkg-deb -f "$deb" Depends)"
for package in libtorch-dev nlohmann-json3-dev libcli11-dev libgloo-dev "libtorch[0-9.]* (>="; do
  grep -q "$package" <<<"$depends" || fail "Depends has no $package: $depends"
done

dpkg-deb -x "$deb" "$work/root"
"$work/root/usr/bin/cohort" --version | grep -q "^cohort $version " ||
  fail "the packaged cohort --version says: $("$work/root/usr/bin/cohort" --version)"
# The man page: help2man's, with a section per subcommand; the completion script parses.
man_page="$(zcat "$work/root/usr/share/man/man1/cohort.1.gz")"
for section in NAME SYNOPSIS '"COMMAND: TRAIN"' '"COMMAND: LAUNCH"' '"EXIT STATUS"'; do
  grep -q "^\.SH $section" <<<"$man_page" || fail "the man page has no $section section"
done
bash -c "source '$work/root/usr/share/bash-completion/completions/cohort' && complete -p cohort" \
  >/dev/null || fail "the bash completion script does not register a completion for cohort"

cmake -S "$here/../install/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/root/usr" >"$work/configure.log" 2>&1 ||
  { tail -30 "$work/configure.log" >&2; fail "the consumer does not configure against the package"; }
cmake --build "$work/consumer" >"$work/build.log" 2>&1 ||
  { tail -30 "$work/build.log" >&2; fail "the consumer does not build against the package"; }
"$work/consumer/consumer" "$work/runs" >"$work/run.log" 2>&1 || { cat "$work/run.log" >&2; fail "the consumer failed"; }
grep -q "consumer world_size 2" "$work/run.log" || fail "the consumer did not train on 2 workers: $(cat "$work/run.log")"
echo "deb_test: $(basename "$deb"): $(($(stat -c %s "$deb") / 1024)) KiB, $(grep -vc '/$' <<<"$contents") files; an outside project built and ran against the unpacked package"
