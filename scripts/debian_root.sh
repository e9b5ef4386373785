#!/usr/bin/env bash
# Builds and tests cohort against another Debian suite's libtorch, inside a Debian root made with
# debootstrap: the second libtorch line of CI (suite sid: libtorch 2.x, the newest c10d API).
#
#   scripts/debian_root.sh [--suite sid|trixie] [--cuda] [--no-core-pch] [--no-bench] [--sanitize]
#                          [--sanitize-layers] [--no-fuzz-replays] [--opt-level N] [--no-tests]
#                          [--prepare-only]
#   scripts/debian_root.sh --suite bookworm --install-deb cohort_VERSION_ARCH.deb
#
# The root lives outside the clone (COHORT_ROOTS, default /var/cache/cohort/roots/<suite>), so a
# later run on the same machine reuses it; it is refreshed (apt upgrade) once a day. The clone is
# bind-mounted at /src inside it and built into build-<suite>/. --no-core-pch compiles the library
# and CLI without the precompiled header (every file includes what it uses); --no-bench leaves the
# benchmarks out, --no-fuzz-replays the fuzz targets' replays (CI: both are built and run in the
# 1.13 lane, from the same sources). --opt-level N compiles everything at -ON, not -O3 (CI: 1,
# for a third less compile time in a lane that measures nothing). --sanitize builds everything with AddressSanitizer and
# UndefinedBehaviorSanitizer (-DCOHORT_SANITIZE=ON), so that the whole suite runs instrumented and any finding fails its test
# with the sanitizer's report (about three times slower than plain). --sanitize-layers (CI) builds
# and runs the comm, runtime, data and train tests that way instead (scripts/sanitizer_check.sh,
# in build-<suite>-sanitize/) and leaves them out of the plain build and its run: those layers'
# tests run once against libtorch 2.x, instrumented, and the rest plain. --prepare-only makes the root and
# installs the packages, no more (CI runs it while the first lane builds: downloading and
# unpacking overlap compiling). --cuda instead compiles comm/'s NCCL path and the sources with a
# CUDA path (COHORT_WITH_CUDA: CUDA graphs' capture) (syntax only: there is no GPU, and the cuDNN
# package would download from NVIDIA) against contrib's libtorch-cuda-dev (trixie: 2.6), in a
# root of its own.
# --install-deb instead installs cohort's Debian package with apt (which brings its dependencies)
# and builds and runs tests/install/consumer against it, as a user of the package would
# (scripts/deb_install_check.sh runs it in a new root). Needs root.
set -euo pipefail
src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
suite=sid
cuda=0
core_pch=ON
tests=1
bench=ON
fuzz=ON
opt_level=""
sanitize=OFF
sanitize_layers=0
prepare_only=0
deb=""
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) suite="$2"; shift 2 ;;
    --cuda) cuda=1; shift ;;
    --no-core-pch) core_pch=OFF; shift ;;
    --no-tests) tests=0; shift ;;
    --no-bench) bench=OFF; shift ;;
    --no-fuzz-replays) fuzz=OFF; shift ;;
    --opt-level)
      [[ "${2:-}" =~ ^[0123sg]$ ]] ||
        { echo "debian_root.sh: --opt-level '${2:-}': use 0, 1, 2, 3, s or g (-O<level>)" >&2; exit 2; }
      opt_level="$2"; shift 2 ;;
    --sanitize) sanitize=ON; shift ;;
    --sanitize-layers) sanitize_layers=1; shift ;;
    --prepare-only) prepare_only=1; shift ;;
    --install-deb) deb="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
    *) echo "debian_root.sh: unknown option '$1' (see the comment at the top of $0)" >&2; exit 2 ;;
  esac
done
case "$suite" in
  sid|trixie) ;;
  bookworm) [ -n "$deb" ] || { echo "debian_root.sh: --suite bookworm is for --install-deb" >&2; exit 2; } ;;
  *) echo "debian_root.sh: --suite $suite: use sid (libtorch 2.x, newest) or trixie (libtorch 2.6)" >&2; exit 2 ;;
esac
if [ "$sanitize_layers" -eq 1 ] && [ "$sanitize" = ON ]; then
  echo "debian_root.sh: --sanitize-layers with --sanitize: --sanitize instruments every test already" >&2
  exit 2
fi
if [ -n "$opt_level" ] && [ "$sanitize" = ON ]; then
  echo "debian_root.sh: --opt-level with --sanitize: the sanitized build compiles at -O1 of its own" >&2
  exit 2
fi
if [ -n "$deb" ] && [ ! -f "$deb" ]; then
  echo "debian_root.sh: --install-deb $deb: no such file (make it with: cpack -G DEB in the build folder)" >&2
  exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "debian_root.sh: needs root (debootstrap, chroot, mounts): run it with sudo" >&2
  exit 2
fi

roots="${COHORT_ROOTS:-/var/cache/cohort/roots}"
root="$roots/$suite"
[ "$cuda" -eq 1 ] && root="$roots/$suite-cuda"
mirror="$("$src/scripts/apt_mirror.sh")"
components=main
[ "$cuda" -eq 1 ] && components="main,contrib,non-free"

log() { echo "debian_root ($suite): $*" >&2; }

if ! command -v debootstrap >/dev/null; then
  log "installing debootstrap"
  apt-get -o DPkg::Lock::Timeout=900 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -qq debootstrap >&2
fi

# A root is complete once the marker exists; a half-made one (killed run) is made again.
if [ ! -f "$root/.cohort-ready" ]; then
  rm -rf "$root"
  mkdir -p "$roots"
  log "creating the root at $root from $mirror (a few minutes, once per machine)"
  debootstrap --variant=minbase --components="$components" "$suite" "$root" "$mirror" >&2 \
    || { tail -20 "$root/debootstrap/debootstrap.log" >&2 2>/dev/null; exit 1; }
  # The registry's copy of a moving suite can be past its Release file's Valid-Until date.
  echo 'Acquire::Check-Valid-Until "false";' > "$root/etc/apt/apt.conf.d/99cohort-valid-until"
  echo "deb $mirror $suite ${components//,/ }" > "$root/etc/apt/sources.list"
  touch "$root/.cohort-ready"
fi

mounts=()
cleanup() {
  local m
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    m="${mounts[$i]}"
    umount -l "$m" 2>/dev/null || true
  done
}
trap cleanup EXIT
bind() {  # bind <from> <to-inside-root>
  mkdir -p "$root$2"
  mount --bind "$1" "$root$2"
  mounts+=("$root$2")
}
# The root a mount point of its own: `ip netns exec` remounts / (tests make hosts with it).
mount --bind "$root" "$root" && mounts+=("$root")
mount -t proc proc "$root/proc" && mounts+=("$root/proc")
# All of /sys, with /sys/fs/cgroup (slurmd needs it); slave, so unmounting here leaves the host's.
mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys" && mounts+=("$root/sys")
bind /dev /dev
bind /dev/pts /dev/pts
mkdir -p "$root/dev/shm" "$root/run"
mount -t tmpfs -o mode=1777 shm "$root/dev/shm" && mounts+=("$root/dev/shm")
mount -t tmpfs run "$root/run" && mounts+=("$root/run")
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
bind "$src" /src
# CI's environment may have no HOME.
ccache_dir="${CCACHE_DIR:-${HOME:-/root}/.cache/ccache}-$suite"
mkdir -p "$ccache_dir"
bind "$ccache_dir" /ccache

in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  CCACHE_DIR=/ccache CI="${CI:-}" LANG=C.UTF-8 "$@"; }

stamp="$root/.cohort-upgraded"
if [ ! -f "$stamp" ] || [ -n "$(find "$stamp" -mmin +1440)" ]; then
  log "apt update and upgrade"
  in_root apt-get update -qq >&2
  in_root env DEBIAN_FRONTEND=noninteractive apt-get -y -qq -o Dpkg::Use-Pty=0 dist-upgrade >&2
  touch "$stamp"
fi
if [ "$cuda" -eq 1 ]; then
  # nvidia-cudnn's set-up downloads from NVIDIA and fails here; the headers are unpacked anyway.
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    libtorch-cuda-dev libgloo-cuda-dev nlohmann-json3-dev libssl-dev libcpp-httplib-dev g++ >&2 || true
  in_root sh -c 'cd /tmp && apt-get download -qq libnccl-dev && dpkg -x libnccl-dev_*.deb / && rm libnccl-dev_*.deb'
  torch_version="$(in_root dpkg-query -W -f='libtorch-cuda-dev ${Version}' libtorch-cuda-dev)"
  status=0
  check() {  # check <what> <file> <defines...>
    local what="$1" f="$2"
    shift 2
    if in_root sh -c "cd /src && g++ -std=c++20 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter \
        -Wno-missing-field-initializers -DUSE_DISTRIBUTED -DUSE_C10D_GLOO $* \
        -Iinclude -Isrc -isystem /usr/include/torch/csrc/api/include $f"; then
      log "$f compiles with $what against $torch_version"
    else
      status=1
    fi
  }
  for f in src/comm/*.cpp; do check NCCL "$f" -DUSE_C10D_NCCL -DCOHORT_WITH_NCCL; done
  for f in $(cd "$src" && grep -rl --include='*.cpp' COHORT_WITH_CUDA src); do
    check CUDA "$f" -DCOHORT_WITH_CUDA
  done
  exit "$status"
fi

if [ -n "$deb" ]; then
  # As a user does: apt installs the package and what it depends on; a compiler and CMake.
  cp "$deb" "$root/tmp/"
  in_root apt-get update -qq >&2
  start=$SECONDS
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o Dpkg::Use-Pty=0 \
    --no-install-recommends "/tmp/$(basename "$deb")" g++ cmake ninja-build >&2
  log "installed $(basename "$deb") and its dependencies with apt in $((SECONDS - start)) s"
  start=$SECONDS
  in_root sh -c 'rm -rf /tmp/consumer && cmake -S /src/tests/install/consumer -B /tmp/consumer -G Ninja \
    -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /tmp/consumer >/dev/null && /tmp/consumer/consumer /tmp/runs' >&2
  log "built and ran tests/install/consumer against the installed package in $((SECONDS - start)) s"
  in_root cohort --version >&2
  exit 0
fi
log "$(in_root dpkg-query -W -f='libtorch-dev ${Version}' libtorch-dev 2>/dev/null || echo 'libtorch-dev not installed yet')"
if [ "$prepare_only" -eq 1 ]; then
  in_root /src/scripts/setup.sh --install-only
  log "prepared: $(in_root dpkg-query -W -f='libtorch-dev ${Version}' libtorch-dev)"
  exit 0
fi
build="build-$suite"
# --sanitize-layers: the layers' test binaries are built and run instrumented, after the others.
skipped=""
[ "$sanitize_layers" -eq 1 ] && skipped="$("$src/scripts/sanitizer_check.sh" --binaries)"
# The configuration is made once per build folder; a changed option starts it afresh.
if ! grep -qs "^COHORT_CORE_PCH:BOOL=$core_pch\$" "$src/$build/CMakeCache.txt" ||
  ! grep -qs "^COHORT_SANITIZE:BOOL=$sanitize\$" "$src/$build/CMakeCache.txt"; then
  rm -rf "${src:?}/$build"
fi
# --no-bench, --no-fuzz-replays (CI: built and run in the 1.13 lane) and --opt-level reconfigure
# in place.
if [ -f "$src/$build/build.ninja" ] &&
  { ! grep -qs "^COHORT_BUILD_BENCH:BOOL=$bench\$" "$src/$build/CMakeCache.txt" ||
    ! grep -qs "^COHORT_FUZZ_REPLAYS:BOOL=$fuzz\$" "$src/$build/CMakeCache.txt" ||
    ! grep -qs "^COHORT_OPT_LEVEL:STRING=$opt_level\$" "$src/$build/CMakeCache.txt" ||
    ! grep -qsxF "COHORT_SKIP_TEST_BINARIES:STRING=$skipped" "$src/$build/CMakeCache.txt"; }; then
  in_root cmake -S /src -B "/src/$build" -DCOHORT_BUILD_BENCH="$bench" -DCOHORT_FUZZ_REPLAYS="$fuzz" \
    -DCOHORT_OPT_LEVEL="$opt_level" "-DCOHORT_SKIP_TEST_BINARIES=$skipped" >&2
fi
in_root env COHORT_BUILD_DIR="/src/$build" \
  COHORT_CMAKE_ARGS="-DCOHORT_CORE_PCH=$core_pch -DCOHORT_BUILD_BENCH=$bench -DCOHORT_FUZZ_REPLAYS=$fuzz -DCOHORT_SANITIZE=$sanitize -DCOHORT_OPT_LEVEL=$opt_level -DCOHORT_SKIP_TEST_BINARIES=$skipped" \
  /src/scripts/setup.sh
what="built"
[ "$sanitize" = ON ] && what="built with AddressSanitizer and UndefinedBehaviorSanitizer"
[ -n "$opt_level" ] && what="$what at -O$opt_level"
log "$what $(in_root dpkg-query -W -f='against libtorch-dev ${Version}' libtorch-dev) into $src/$build"
if [ "$tests" -eq 1 ]; then
  # The format check, the docs (another doxygen warns otherwise) and the Debian 12 package read
  # the same sources as the first lane: run there only. So do the tests of cohort's own protocols
  # and process handling, which libtorch does not touch and the unit tests here cover in parts
  # (live recovery, etcd's store, the Tuner): the two-host scenarios of the attack table, etcd's
  # failover, the launcher's faults and live recovery, a CPU-only node, the failures across two
  # hosts, torchrun's and Slurm's environments, and the CLI's tests of bad input, config files,
  # `cohort launch`'s options, Ctrl-C, a killed driver and `cohort tune` (in the first lane, on
  # 2 vCPUs at -j2, about 640 s and 167 s of test time). multi_host.two_hosts stays, for Gloo
  # between two hosts under libtorch 2.x, and so do the CLI's runs of every plan, checkpoint and
  # resume.
  own='multi_host\.(attacks|etcd_failover|launched_faults|launched_live|cpu_node|two_hosts_failures'
  own+='|torchrun_env|slurm)'
  own+='|Cli\.(BadInput|ConfigFiles|LaunchRejects|CtrlC|WorkersDieWithAKilledDriver|AKilledDriver'
  own+='|TuneSearches|TuneRejects|AKilledTune)'
  in_root ctest --test-dir "/src/$build" --output-on-failure -j2 -E "^(format\.|docs\.|packaging\.|$own)"
  if [ "$sanitize_layers" -eq 1 ]; then
    in_root /src/scripts/sanitizer_check.sh "/src/$build-sanitize"
    log "the comm, runtime, data and train tests passed under the sanitizers against $(in_root dpkg-query -W -f='libtorch-dev ${Version}' libtorch-dev)"
  fi
fi
