#!/usr/bin/env bash
# Benchmarks and the CPU/CUDA equality check on a machine with an NVIDIA GPU.
# Usage (from the repo root, torch with CUDA installed in .venv or the active Python):
#   bash bench/gpu.sh                 # every step below (~8 minutes on an H200; ~13 with llm-compressor)
# The steps run in the order of what is still open (#53: the CUDA tests, W8A8 calibration against a float pass,
# 8B-shaped GPTQ blocks against llm-compressor in float32 and TF32), then the rest.
# On a lent machine with no network, pydantic (and llm-compressor, for its comparison) travel as wheels installed
# with --target: the list and the commands are in bench/gptq_gpu_blocks.py's docstring.
#   GPU_SH_BUDGET=300 bash bench/gpu.sh   # stop starting steps once 300 s have passed
# Each step runs on its own: a failure is reported and the next step still runs; the exit code is 1 if any failed.
# Writes bench/results/*cuda*.json; paste the printed tables (with the device name) into docs/performance.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
BUDGET=${GPU_SH_BUDGET:-1800}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # qtool from this tree, beside any carried wheels' --target
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__,
      '| GPUs', torch.cuda.device_count(), '| CPU cores', __import__('os').cpu_count())"
failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit that never passes the budget
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then echo "== $name: skipped (budget spent)"; failed+=("$name (skipped)"); return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s)"
    local t0=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    if [ $rc -eq 0 ]; then echo "-- $name: ok, $((SECONDS - t0)) s"
    else echo "-- $name: FAILED (exit $rc), $((SECONDS - t0)) s"; failed+=("$name"); fi
}
R=bench/results
# the CUDA-only tests: the activation pass replayed as a CUDA graph (MLP, a forward with a host sync, a tiny
# Llama: the eager ranges bit for bit, at float32 and TF32 products), GPTQ's replayed column loop, and the input
# statistics staying float32 inside a TF32 pass
step "CUDA tests" 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_rounding.py \
    tests/test_matmul_precision.py -k "cuda or gpu"
# W8A8 calibration of the reference MLP, eager against replayed as a CUDA graph: times and equal ranges
step "calibration graph replay" 60 "$PY" bench/calibration_graph_probe.py
# the same pass eager: tensor operations (kernels) per activation quantizer call, and time against a float pass
step "calibration call kernels" 60 "$PY" bench/calibration_calls.py --device cuda
# W8A8 on SmolLM2's shape (#53: at most 2x a float pass): as shipped (shared calls, the pass replayed as a CUDA
# graph), without the replay, and without the shared calls; 64 samples, 16 batches
step "W8A8 calibration of SmolLM2's shape on CUDA" 150 "$PY" bench/shared_calls.py --device cuda --layers 30 \
    --samples 64 --out $R/shared_calls_cuda.json
# the same with the all-ones attention mask qtool's packed text gives (the replay leaves it out once shown equal)
step "... with an attention mask" 150 "$PY" bench/shared_calls.py --device cuda --layers 30 --samples 64 \
    --attention-mask --out $R/shared_calls_mask_cuda.json
# 8B-shaped blocks, qtool against llm-compressor (only where its wheels are installed: see the script's docstring)
if "$PY" -c "import llmcompressor" 2>/dev/null; then
    step "8B blocks against llm-compressor" 300 "$PY" bench/gptq_gpu_blocks.py --side-timeout 140 \
        --out $R/gptq_gpu_blocks.json
    # the same with TF32 products on both sides (qtool --matmul-precision high; llm-compressor's whole run)
    step "8B blocks against llm-compressor, TF32" 240 "$PY" bench/gptq_gpu_blocks.py --side-timeout 110 \
        --matmul-precision high --out $R/gptq_gpu_blocks_tf32.json
fi
# one decoder block's forward at float32 and TF32 products (SmolLM2, 1.1B and 8B shapes)
step "block forward, float32 against TF32" 60 "$PY" bench/matmul_precision.py --device cuda --skip-calibration \
    --out $R/matmul_precision_cuda.json
# GPTQ's column loop replayed as CUDA graphs against launched step by step (codes must be equal), 8B layer shapes
step "GPTQ column loop on CUDA" 120 "$PY" bench/gptq_columns.py --out $R/gptq_columns_cuda.json
# CPU and CUDA give the same weight encodings (MLP, MiniLM where installed, every analyzer)
step "cuda_check" 150 "$PY" bench/cuda_check.py
# GPTQ W4A16 block 32, --sequential, on the GPU: SmolLM2-135M's shape, then the 1.1B (TinyLlama) shape with W8A8
step "GPTQ SmolLM2 shape on CUDA" 150 "$PY" bench/sequential_memory.py --shape smollm2 --device cuda \
    --recipes w4a16-block32-gptq --out $R/gptq_smollm2_cuda.json
step "1.1B sequential GPTQ + W8A8 on CUDA" 300 "$PY" bench/sequential_memory.py --device cuda \
    --out $R/sequential_memory_cuda.json
# torchrun with --device cuda: NCCL default group, 2 ranks (round-robin over the GPUs there are)
step "torchrun --device cuda (NCCL)" 180 "$PY" bench/distributed.py --device cuda --nproc 2 \
    --out $R/distributed_cuda.json
step "quant_speed" 90 "$PY" bench/quant_speed.py --device cuda --out $R/quant_speed_cuda.json
step "calibrate_overhead" 150 "$PY" bench/calibrate_overhead.py --device cuda --out $R/calibrate_overhead_cuda.json
# the CPU figure beside the GPU one, on this machine's cores
step "GPTQ SmolLM2 shape on this machine's CPU" 200 "$PY" bench/sequential_memory.py --shape smollm2 --device cpu \
    --recipes w4a16-block32-gptq --out $R/gptq_smollm2_cpu_gpuhost.json
if [ ${#failed[@]} -gt 0 ]; then printf 'failed: %s\n' "${failed[@]}"; exit 1; fi
echo "all steps passed ($SECONDS s)"
