#!/usr/bin/env bash
# The Debian package as a user meets it: builds it (cpack in the build folder), makes a new Debian 12
# root with debootstrap, installs the package there with apt (its dependencies come from the
# archive) and builds and runs an example against it; prints the package's size and the times.
# The root is removed afterwards. Needs root (debootstrap, chroot); about 10 minutes.
#   scripts/deb_install_check.sh [BUILD_DIR (default build)]
set -euo pipefail
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:-$src/build}" && pwd)"
[ -f "$build/CPackConfig.cmake" ] || { echo "deb_install_check.sh: $build is not a configured build folder (scripts/setup.sh makes one)" >&2; exit 2; }
started=$SECONDS
(cd "$build" && cpack -G DEB -B "$build/package" >/dev/null)
deb="$(ls -t "$build"/package/cohort_*.deb | head -1)"
echo "deb_install_check: $(basename "$deb"): $(($(stat -c %s "$deb") / 1024)) KiB, $(dpkg-deb -c "$deb" | grep -vc '/$') files"
roots="$(mktemp -d /var/tmp/cohort-deb-check.XXXXXX)"
# Removed only once nothing is mounted under it any more.
trap 'if findmnt -rno TARGET | grep -q "^$roots"; then echo "deb_install_check: $roots still has mounts: left in place" >&2; else rm -rf "$roots"; fi' EXIT
start=$SECONDS
COHORT_ROOTS="$roots" "$src/scripts/debian_root.sh" --suite bookworm --install-deb "$deb"
echo "deb_install_check: a new Debian 12 root, the package installed with apt and an example built and run against it in $((SECONDS - start)) s (all: $((SECONDS - started)) s)"
