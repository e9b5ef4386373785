#!/usr/bin/env bash
# GPU checks, on a host with a CUDA GPU and a CUDA build of torch (a Python wheel) but no package
# registry. Two steps:
#
#   scripts/gpu_check.sh --stage        # here, with Debian's packages: copies what the GPU host
#                                       # lacks into .gpu_deps/ (header-only libraries, Gloo's
#                                       # headers, GoogleTest's sources, Fashion-MNIST)
#   scripts/gpu_check.sh [--bench|--build-only]  # there, in a copy of the tree with .gpu_deps/: builds
#                                       # cohort against the wheel's libtorch, runs the CUDA tests,
#                                       # then seed 002's job (ResNet-18, 10 epochs) on the GPU;
#                                       # --bench adds bench/ddp_throughput on CPU at 2, 4, 8 workers
#                                       # and bench/fast_steps on the GPU (step times, and seed
#                                       # 002's 10 epochs eager and as CUDA graphs), and bench/gpt
#                                       # (with and without the optimizer on the host) beside
#                                       # bench/gpt_torch.py (PyTorch eager) on a 304 M GPT
#
# Environment: PYTHON (default python3, the one with torch), JOBS (default: all cores),
# EPOCHS (default 10).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$root/.gpu_deps"

if [ "${1:-}" = "--stage" ]; then
  rm -rf "$deps"
  # The layout of /usr (include/, share/cmake/): the package configs find their headers three
  # folders up from themselves, so .gpu_deps works as a prefix.
  mkdir -p "$deps/include" "$deps/share/cmake" "$deps/src" "$deps/data"
  cp -r /usr/include/nlohmann /usr/include/CLI /usr/include/gloo "$deps/include/"
  cp -r /usr/share/cmake/nlohmann_json /usr/share/cmake/CLI11 "$deps/share/cmake/"
  cp -r /usr/src/googletest "$deps/src/"
  cp -r /usr/share/datasets/fashion-mnist "$deps/data/"
  # The dashboard's HTTP library (Debian's is a shared library) and what it links that such a
  # host may lack; its pkg-config file relocated to the staging folder.
  mkdir -p "$deps/lib/pkgconfig"
  cp -r /usr/include/httplib.h /usr/include/brotli "$deps/include/"
  cp -a /usr/lib/x86_64-linux-gnu/libcpp-httplib.so* /usr/lib/x86_64-linux-gnu/libbrotli{common,dec,enc}.so.1* \
    /usr/lib/x86_64-linux-gnu/libssl.so.3 /usr/lib/x86_64-linux-gnu/libcrypto.so.3 "$deps/lib/"
  # The job secret's HMAC: libcrypto's headers (with the architecture's configuration headers
  # merged in) and its link name.
  cp -r /usr/include/openssl "$deps/include/"
  cp /usr/include/x86_64-linux-gnu/openssl/* "$deps/include/openssl/"
  ln -s libcrypto.so.3 "$deps/lib/libcrypto.so"
  sed -e 's|^prefix=.*|prefix=${pcfiledir}/../..|' -e 's|^libdir=.*|libdir=${prefix}/lib|' \
    -e '/^Requires.private/d' /usr/lib/x86_64-linux-gnu/pkgconfig/cpp-httplib.pc >"$deps/lib/pkgconfig/cpp-httplib.pc"
  echo "staged $(du -sh "$deps" | cut -f1) in $deps: carry .gpu_deps to the GPU host"
  exit 0
fi

bench=0
build_only=0
[ "${1:-}" = "--bench" ] && bench=1
[ "${1:-}" = "--build-only" ] && build_only=1
if [ ! -d "$deps" ]; then
  echo "gpu_check: $deps is missing: run scripts/gpu_check.sh --stage on a Debian host first and carry it" >&2
  exit 2
fi
python="${PYTHON:-python3}"
jobs="${JOBS:-$(nproc)}"
torch_prefix="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
torch_lib="$("$python" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
echo "gpu_check: torch $("$python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)') at $torch_prefix"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export LD_LIBRARY_PATH="$torch_lib:$deps/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# CUDA's toolkit: an installed one (nvcc on the PATH or in /usr/local/cuda), else the headers and
# libraries of the nvidia-* wheels beside torch.
cuda_root=""
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  cuda_root="$("$python" -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)"
fi

# GoogleTest from Debian's sources, installed into the staging folder once.
if [ ! -f "$deps/gtest/lib/cmake/GTest/GTestConfig.cmake" ] && [ ! -f "$deps/gtest/lib64/cmake/GTest/GTestConfig.cmake" ]; then
  cmake -S "$deps/src/googletest" -B "$deps/gtest-build" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$deps/gtest" -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DBUILD_GMOCK=OFF >/dev/null
  cmake --build "$deps/gtest-build" -j "$jobs" --target install >/dev/null
fi

build="$root/build-gpu"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)  # builds the targets in parallel, not in turn
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS=-g1 -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DCMAKE_PREFIX_PATH="$torch_prefix;$deps;$deps/gtest" \
  ${cuda_root:+-DCUDAToolkit_ROOT="$cuda_root"} \
  -DCOHORT_GLOO_INCLUDE_DIR="$deps/include" -DCOHORT_WITH_OPENCV=OFF \
  -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON
# TARGETS: what to build (default: what the checks below run).
cmake --build "$build" -j "$jobs" --target ${TARGETS:-cohort_cli comm_test runtime_test parallel_test train_test optim_test apps_test ddp_throughput fast_steps}
[ "$build_only" -eq 1 ] && exit 0

status=0
run() { echo "+ $*"; "$@" || status=1; }
run "$build/tests/comm_test" --gtest_filter='CudaCollectives.*:ProcessGroup.*'
run "$build/tests/runtime_test" --gtest_filter='Gpus.*:GpuUsage.*'
run "$build/tests/train_test" --gtest_filter='GpuTraining.*:Trainer.*:RunStatus.*:CapturedStep.*'
run "$build/tests/parallel_test"
run "$build/tests/optim_test"
run "$build/tests/apps_test" --gtest_filter='Cli.ACudaGraph*'

# Seed 002: ResNet-18 with the 1-channel 7x7 stem on Fashion-MNIST, batch 128, Adam 1e-3.
run "$build/cohort" train --model resnet18 --dataset fashion-mnist --data-dir "$deps/data/fashion-mnist" \
  --workers 1 --use-gpu --batch-size 128 --optimizer adam --lr 0.001 --epochs "${EPOCHS:-10}" \
  --storage-path "$build/runs" --name resnet18_gpu --no-resume --quiet
run "$python" - "$build/runs/resnet18_gpu/result.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
m = r["metrics"]
print(f"resnet18 on the GPU: test_accuracy {m['test_accuracy']:.4f}, {m['epochs']} epochs in "
      f"{m['elapsed_s']:.1f} s ({m['elapsed_s'] / m['epochs']:.2f} s/epoch), "
      f"{m['samples_per_second']:.0f} samples/s")
EOF

if [ "$bench" -eq 1 ]; then
  # The fast-steps table on the GPU: torch::optim against the flat optimizers, fp32 and bf16.
  run "$build/bench/fast_steps" --device cuda --data-dir "$deps/data/fashion-mnist" --rounds 5 --steps 20
  # Seed 002's 10 epochs with the data on the GPU, eager and as one CUDA graph per step.
  run "$build/bench/fast_steps" --device cuda --data-dir "$deps/data/fashion-mnist" --models resnet18 \
    --rounds 1 --steps 5 --epochs 10
  # The zoo's GPT at 304 M parameters, context 1024, bf16: cohort (each step one CUDA graph; and
  # ddp-host, the optimizer on the host) beside PyTorch eager on the same model (tokens/s, MFU).
  gpt_shape=(--layers 24 --width 1024 --heads 16 --context 1024 --batch-size 8 --steps 10)
  run "$build/bench/gpt" --device cuda "${gpt_shape[@]}" --modes ddp,ddp-host
  run "$python" "$root/bench/gpt_torch.py" --device cuda "${gpt_shape[@]}"
  for workers in 1 2 4 8; do
    for mode in independent ddp; do
      echo "ddp_throughput --mode $mode --workers $workers: $("$build/bench/ddp_throughput" --mode "$mode" \
        --workers "$workers" --data-dir "$deps/data/fashion-mnist" --steps 200)"
    done
  done
fi
exit "$status"
