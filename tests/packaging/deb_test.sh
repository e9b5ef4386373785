#!/usr/bin/env bash
# The Debian package (cmake/package.cmake): cpack builds it from BUILD_DIR; it holds the library,
# headers, CMake package, CLI, bash completion, man page and copyright, depends on Debian's libtorch
# and friends, and holds what `cmake --install` writes (install.find_package builds an outside
# project against that).
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

# An optimised BLAS for libtorch's CPU matrix products (the reference one otherwise: runtime/blas.h).
recommends="$(dpkg-deb -f "$deb" Recommends)"
grep -q "libopenblas0-openmp" <<<"$recommends" || fail "Recommends has no optimised BLAS: $recommends"

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

# The package holds exactly what `cmake --install` writes, byte for byte: install.find_package
# builds and runs an outside project (tests/install/consumer) and the README's program against
# that, so they build against the package as well (a third build of them here took 44 s).
cmake --install "$build_dir" --prefix "$work/install/usr" >"$work/install.log" 2>&1 ||
  { tail -20 "$work/install.log" >&2; fail "cmake --install failed"; }
difference="$(diff -r "$work/root/usr" "$work/install/usr" 2>&1)" ||
  fail "the package differs from what cmake --install writes (an outside project is built against that): $difference"
echo "deb_test: $(basename "$deb"): $(($(stat -c %s "$deb") / 1024)) KiB, $(grep -vc '/$' <<<"$contents") files, the same as cmake --install writes"
