#!/usr/bin/env bash
# Installs cohort's Debian dependencies (when missing), configures and builds.
# Idempotent: a second run only rebuilds what changed. --install-only stops after the packages.
set -euo pipefail
install_only=0
case "${1:-}" in
  "") ;;
  --install-only) install_only=1 ;;
  *) echo "setup.sh: unknown option '$1' (the only one is --install-only)" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${COHORT_BUILD_DIR:-$root/build}"

# procps (pgrep, pkill) and hostname: the multi-host tests call them, and a minimal root lacks them.
# libopenblas0-openmp: libtorch's CPU matrix products call libblas.so.3, which is otherwise netlib's
# reference BLAS (libblas3, one thread, plain loops: a ViT step 16 times slower; runtime/blas.h).
packages=(build-essential cmake ninja-build ccache pkg-config clang-format git libtorch-dev libopenblas0-openmp
  dataset-fashion-mnist
  nlohmann-json3-dev libcli11-dev libgloo-dev zlib1g-dev libssl-dev libgtest-dev libbenchmark-dev python3-torch
  libopencv-core-dev libopencv-imgproc-dev libopencv-imgcodecs-dev
  openmpi-bin iproute2 procps hostname slurmctld slurmd slurm-client munge
  python3-protobuf protobuf-compiler libcpp-httplib-dev chromium help2man doxygen)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo_cmd=()
[ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  # Another apt (CI prepares a Debian root beside this) waits for the lock instead of failing.
  "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=900 update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=900 install -y -qq \
    --no-install-recommends "${missing[@]}" >&2
fi
# Tools taken out of Debian packages into .tools/ rather than installed, because installing the
# package would start its server on this machine: Prometheus' promtool lints the dashboard's
# /metrics (tests/train/dashboard); etcd is the rendezvous of `--rdzv etcd://` that the tests start
# on loopback (tests/comm/etcd_store_test, tests/multi_host/etcd_failover_test).
tools="$root/.tools"
unpack_tool() {  # unpack_tool PACKAGE PATH-IN-PACKAGE: .tools/<its file name>
  local package="$1" path="$2" unpack
  [ -x "$tools/$(basename "$path")" ] && return 0
  echo "setup: unpacking $(basename "$path") from Debian's $package package into $tools" >&2
  unpack="$(mktemp -d)"
  chmod 777 "$unpack"  # apt's download user (_apt) writes there
  if ! (cd "$unpack" && apt-get download -qq "$package" >&2); then
    # No package lists yet (a fresh root whose packages were all there): fetch them once.
    "${sudo_cmd[@]}" apt-get -o DPkg::Lock::Timeout=900 update -qq
    (cd "$unpack" && apt-get download -qq "$package" >&2)
  fi
  (cd "$unpack" && dpkg-deb --fsys-tarfile "${package}"_*.deb | tar -x ".$path")
  mkdir -p "$tools"
  mv "$unpack$path" "$tools/$(basename "$path").new" && mv "$tools/$(basename "$path").new" "$tools/$(basename "$path")"
  rm -rf "$unpack"
}
unpack_tool prometheus /usr/bin/promtool
unpack_tool etcd-server /usr/bin/etcd
[ "$install_only" -eq 1 ] && exit 0

if [ ! -f "$build/build.ninja" ]; then
  # COHORT_CMAKE_ARGS: extra configure flags, e.g. -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON.
  # shellcheck disable=SC2086
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${COHORT_CMAKE_ARGS:-} >&2
fi
cmake --build "$build" -j "${COHORT_JOBS:-2}" >&2
