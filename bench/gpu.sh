#!/usr/bin/env bash
# Benchmarks and the CPU/CUDA equality check on a machine with an NVIDIA GPU.
# Usage (from the repo root, torch with CUDA installed in .venv or the active Python):
#   bash bench/gpu.sh
# Writes bench/results/*.json; paste the printed tables (with the device name) into docs/performance.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
"$PY" bench/quant_speed.py --device cuda --out bench/results/quant_speed_cuda.json
"$PY" bench/calibrate_overhead.py --device cuda --out bench/results/calibrate_overhead_cuda.json
"$PY" bench/cuda_check.py
