#!/usr/bin/env bash
# The example decoder on a GPU host: same tokens for every strategy, transport,
# EP size and a 2 x 2 data x expert mesh, after a checkpoint round trip, in
# 4 processes x 1 GPU; the
# benchmark with C and S calibrated from a recorded trace.
#
#   tools/gpu_examples.sh OUT_DIR
#
# Needs 4 GPUs and moe_jax installed with its CUDA handlers (tools/gpu_checks.sh
# builds them). Every step's output goes to OUT_DIR/logs/<step>.log and its
# tokens to OUT_DIR/tokens/<step>.json; OUT_DIR/summary.txt lists the steps
# with their exit status and time, then the token comparison, and ends with
# PASS or FAIL (exit status 0 or 1). OUT_DIR/bench_ep4.{json,md} and
# OUT_DIR/bench_4proc.{json,md} hold the benchmark tables.
#
# Dry run on CPU (no nvlink, no custom_call across processes):
#   MOE_EXAMPLES_PLATFORM=cpu tools/gpu_examples.sh OUT_DIR
# PYTHON (default python3) picks the interpreter; MODEL_FLAGS replaces the
# model and batch flags below.
set -uo pipefail
out=${1:?usage: tools/gpu_examples.sh OUT_DIR}
mkdir -p "$out/logs" "$out/tokens"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
platform=${MOE_EXAMPLES_PLATFORM:-cuda}
export JAX_PLATFORMS=$platform
if [ "$platform" = cpu ]; then
  export XLA_FLAGS="--xla_force_host_platform_device_count=4"
fi
read -r -a model <<<"${MODEL_FLAGS:---vocab=512 --d_model=256 --heads=8 --layers=2 --experts=8 --top_k=2 --ffn=512 --batch=16 --prompt_len=16 --tokens=32 --seed=0}"
model+=(--progress=off)
summary=$out/summary.txt
: >"$summary"
failed=0

# step NAME COMMAND...: runs COMMAND with its output in logs/NAME.log.
step() {
  local name=$1
  shift
  local start rc
  start=$(date +%s)
  "$@" >"$out/logs/$name.log" 2>&1
  rc=$?
  printf '%-34s %-4s %5ss  logs/%s.log\n' "$name" "$([ $rc -eq 0 ] && echo ok || echo "rc=$rc")" \
    "$(( $(date +%s) - start ))" "$name" | tee -a "$summary"
  [ $rc -eq 0 ] || failed=$((failed + 1))
  return $rc
}

# example NAME FLAGS...: examples/generate.py (one process), tokens to tokens/NAME.json.
example() {
  local name=$1
  shift
  step "$name" timeout 1800 "$PY" examples/generate.py "${model[@]}" \
    --tokens_out="$out/tokens/$name.json" "$@"
}

# launch NAME FLAGS...: examples/launch.py, 4 processes x 1 device.
launch() {
  local name=$1
  shift
  step "$name" "$PY" examples/launch.py --platform="$platform" --num_processes=4 \
    --devices_per_process=1 --out_dir="$out/launch/$name" --timeout=1800 --quiet -- \
    "${model[@]}" "$@"
  [ -f "$out/launch/$name/tokens.json" ] && cp "$out/launch/$name/tokens.json" "$out/tokens/$name.json"
}

{ echo "platform $platform, $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null)"
  echo "model: ${model[*]}"; } | tee -a "$summary"
step devices "$PY" -c "import jax, moe_jax; print(jax.__version__, jax.devices()); \
print(moe_jax.custom_calls.available_platforms())"
if [ "$platform" = cuda ]; then nvidia-smi topo -m >"$out/logs/topo.log" 2>&1; fi

# 1. The reference: ragged at EP=4, recording the routing trace.
example ep4_ragged_lax_record --ep=4 --strategy=ragged --transport=lax \
  --record_traces="$out/traces_ep4.jsonl"
traces=(--calibrate_from="$out/traces_ep4.jsonl")

# 2. Every strategy and transport at EP 1, 2, 4 (C and S from the trace): one
# process per EP size compiles and runs every method once and fails unless
# they all generate the tokens of the first (dense); its tokens then meet
# the reference's in step 6.
once=(--benchmark_steps=1 --benchmark_warmup=1)
methods=max_counts:lax,max_counts:custom_call,cap_and_spill:lax,cap_and_spill:custom_call
methods+=,ragged:lax,ragged:custom_call
nvlink_methods=
if [ "$platform" = cuda ]; then nvlink_methods=,cap_and_spill:nvlink,ragged:nvlink; fi
for ep in 1 2 4; do
  example "ep${ep}_all_methods" --ep="$ep" "${once[@]}" "${traces[@]}" \
    --benchmark_methods="dense,$methods$([ "$ep" -gt 1 ] && echo "$nvlink_methods")"
done
# Data x expert parallelism: 2 data groups of 2 EP ranks (C and S per group).
example dp2_ep2_all_methods --ep=2 --data_parallel=2 "${once[@]}" "${traces[@]}" \
  --benchmark_methods="dense,$methods$nvlink_methods"
# C = S = 1: the spill pass and the fallback run on every step.
example ep4_all_transports_C1S1 --ep=4 "${once[@]}" --capacity=1 --spill_capacity=1 \
  --benchmark_methods="cap_and_spill:lax,cap_and_spill:custom_call${nvlink_methods:+,cap_and_spill:nvlink}"
example ep4_nnx_cap_and_spill_lax --ep=4 --variant=nnx --strategy=cap_and_spill "${traces[@]}"

# 3. Checkpoint saved at EP=4, restored onto EP 2 and 1.
rm -rf "$out/ckpt"
example ckpt_save_ep4 --ep=4 --strategy=ragged --checkpoint_dir="$out/ckpt"
example ckpt_restore_ep2 --ep=2 --strategy=cap_and_spill --checkpoint_dir="$out/ckpt" "${traces[@]}"
example ckpt_restore_ep1 --ep=1 --strategy=max_counts --checkpoint_dir="$out/ckpt"

# 4. Four processes, one device each (jax.distributed), every method that
# crosses processes on this platform.
# (The ragged strategy's lax.ragged_all_to_all cannot cross GPU processes.)
if [ "$platform" = cuda ]; then
  mp_methods=max_counts:lax,cap_and_spill:lax,max_counts:custom_call,cap_and_spill:custom_call
  mp_methods+=,cap_and_spill:nvlink,ragged:nvlink
else
  mp_methods=max_counts:lax,cap_and_spill:lax,ragged:lax
fi
launch 4proc_all_methods "${once[@]}" --benchmark_methods="$mp_methods" "${traces[@]}"

# 5. Benchmarks with C and S calibrated from the trace.
bench_methods=dense,max_counts:lax,cap_and_spill:lax,cap_and_spill:custom_call,ragged:lax
if [ "$platform" = cuda ]; then bench_methods+=,cap_and_spill:nvlink,ragged:nvlink; fi
example bench_ep4 --ep=4 --benchmark_steps="${BENCH_STEPS:-50}" \
  --benchmark_methods="$bench_methods" --benchmark_out="$out/bench_ep4.json" "${traces[@]}"
grep '^|' "$out/logs/bench_ep4.log" >"$out/bench_ep4.md"
mp_bench=max_counts:lax,cap_and_spill:lax
if [ "$platform" = cuda ]; then mp_bench+=,cap_and_spill:custom_call,cap_and_spill:nvlink; fi
launch bench_4proc --benchmark_steps="${BENCH_STEPS:-50}" --benchmark_methods="$mp_bench" \
  --benchmark_out="$out/bench_4proc.json" "${traces[@]}"
grep '^|' "$out/launch/bench_4proc/process_0.log" >"$out/bench_4proc.md"

# 6. Every run's tokens against the reference.
step compare_tokens "$PY" - "$out/tokens" ep4_ragged_lax_record <<'EOF'
import json, pathlib, sys
folder, ref_name = pathlib.Path(sys.argv[1]), sys.argv[2]
ref = json.loads((folder / f"{ref_name}.json").read_text())["tokens"]
bad = 0
for path in sorted(folder.glob("*.json")):
    same = json.loads(path.read_text())["tokens"] == ref
    bad += not same
    print(f"{'same' if same else 'DIFFERENT'}  {path.stem}")
print(f"{bad} of {len(list(folder.glob('*.json')))} runs differ from {ref_name}")
sys.exit(1 if bad else 0)
EOF
cat "$out/logs/compare_tokens.log" >>"$summary"
runs=$(ls "$out/tokens" | wc -l)

if [ "$failed" -eq 0 ]; then
  echo "PASS: all steps succeeded; $runs runs generated identical tokens" | tee -a "$summary"
  exit 0
fi
echo "FAIL: $failed step(s) failed (see $summary)" | tee -a "$summary"
exit 1
