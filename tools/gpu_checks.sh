#!/usr/bin/env bash
# Build, GPU tests and the dispatch benchmark on a GPU host, in one go.
#
#   tools/gpu_checks.sh OUT_DIR [tests|bench|all] [benchmark flags...]
#
# Writes build.log, topo.txt, ctest.log, gpu_tests.log (+ junit xml) and the benchmark's
# JSON / markdown / CDF plot under OUT_DIR.
#   tools/gpu_checks.sh OUT_DIR fast [fast_gpu_bench flags...]
# runs the staged (FAST) all-to-all benchmark instead (JSON + markdown);
#   tools/gpu_checks.sh OUT_DIR expert [expert_ffn_bench flags...]
# the expert FFN / MoE layer benchmark;
#   tools/gpu_checks.sh OUT_DIR tune
# the grouped GEMM's tile configurations (cuda/tune/grouped_gemm_tune).
set -uo pipefail
out=${1:?usage: tools/gpu_checks.sh OUT_DIR [tests|bench|all] [flags...]}
what=${2:-all}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PY=${PYTHON:-python3}

# Always rebuild: a binary built from other sources must never be tested or
# measured under these sources' digest. CUTLASS's headers come from the
# nvidia-cutlass wheel (pip install nvidia-cutlass==4.2.0.0, or a copy on
# PYTHONPATH).
echo "== build"
start=$(date +%s)
"$PY" -m pip install --no-build-isolation --no-deps -e . \
    -Ccmake.define.MOE_JAX_CUDA=ON -Ccmake.define.MOE_JAX_BUILD_TESTS=ON \
    -Ccmake.define.MOE_JAX_GROUPED_GEMM_TUNE=ON \
    -Cbuild-dir=build/gpu >"$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
"$PY" -c "import jax, moe_jax; print(jax.__version__, jax.devices(), moe_jax.custom_calls.available_platforms())"
nvidia-smi topo -m >"$out/topo.txt" 2>&1 || true

status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "== C++ and CUDA unit tests (ctest)"
  (cd build/gpu && ctest --output-on-failure) >"$out/ctest.log" 2>&1 || status=1
  tail -15 "$out/ctest.log"
  echo "== GPU tests"
  start=$(date +%s)
  "$PY" -m pytest -m "gpu or multi_gpu" -q -rs tests/ --junitxml="$out/gpu_tests.xml" \
      >"$out/gpu_tests.log" 2>&1 || status=1
  tail -25 "$out/gpu_tests.log"
  echo "tests took $(( $(date +%s) - start )) s"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  echo "== benchmark"
  "$PY" -m benchmarks.dispatch_bench --out="$out" "$@" 2>&1 | grep -v "^I1\|^W1" \
      | tee "$out/bench.log" | grep -E "^T=|bandwidth|FAILED|budget|x NVIDIA" | tail -80
fi
if [ "$what" = expert ]; then
  echo "== expert FFN / layer benchmark"
  "$PY" -m benchmarks.expert_ffn_bench --out="$out" "$@" 2>&1 | grep -v "^I1\|^W1" \
      | tee "$out/expert_bench.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = tune ]; then
  echo "== grouped GEMM tile configurations"
  build/gpu/cuda/grouped_gemm_tune "$out/grouped_gemm_tune.csv" 2>&1 | tee "$out/tune.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = fast ]; then
  echo "== FAST staged all-to-all benchmark"
  "$PY" -m benchmarks.fast_gpu_bench --out="$out" "$@" 2>&1 | grep -v "^I1\|^W1" \
      | tee "$out/fast_bench.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
