#!/usr/bin/env bash
# One device call: GPU tests, then the engine and sparse-kernel benchmarks, each under a time guard.
# Usage (on the H200, from the repo root, with .whl carried): bash benchmarks/h200_session.sh SECONDS
# Everything lands in $OUT (logs + JSON), copied into benchmarks/results/ afterwards.
set -u
BUDGET=${1:-540}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
export SKETCHKV_PARITY_OUT=$OUT/gpu-parity.json
timeout $(( $(left) - 360 )) python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu_parity.py \
    tests/test_ops_attention.py tests/test_ops_gdn.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"
timeout $(( $(left) - 300 )) python3 benchmarks/bench_sparse_ops.py --out "$OUT/sparse-ops.json" 2>&1 | tail -12 | tee "$OUT/sparse-ops.log"
timeout $(( $(left) - 20 )) python3 benchmarks/bench_engine.py --preset qwen3.5-27b --contexts 8192 131072 \
    --batches 1 8 --prefill-contexts 8192 131072 --steps 24 --sparse --hf --hf-contexts 8192 131072 \
    --hf-batches 1 --out "$OUT/engine-27b.json" 2>&1 | tee "$OUT/engine-27b.log" | tail -30
echo "session done after $(( $(date +%s) - START )) s"
