#!/usr/bin/env bash
# Everything the benchmark issue needs from one H200 session, in one command (see benchmarks/README.md).
# Usage (device tool, repo root): bash benchmarks/run_h200.sh   -> results under $OUT (or benchmarks/results)
set -euo pipefail
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
if [ -d .whl ]; then  # Liger-Kernel and Cut Cross-Entropy carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps -e . 2>/dev/null || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
export PYTHONUNBUFFERED=1
# 1. correctness at real shapes first: the Triton kernels against the float64-accumulated torch twin
python3 benchmarks/check_gpu.py --output "$out/check_gpu.json" 2>&1 | tee "$out/check_gpu.log"
# 2. the op against its peers, then the update step, then the exchange
python3 benchmarks/kernels.py --output "$out/kernels" 2>&1 | tee "$out/kernels.log"
python3 benchmarks/update.py --output "$out/update" 2>&1 | tee "$out/update.log"
python3 benchmarks/exchange.py --processes 2 --output "$out/exchange-gpu.json" 2>&1 | tee "$out/exchange.log"
