#!/usr/bin/env bash
# One device call on a 2 x H200 machine (nvidia-h200-x2), from the repo root with .whl carried:
#   bash benchmarks/x2_session.sh SECONDS
# Phase A runs single-GPU work side by side, one GPU each (GPU 0: the GPU tests in $TESTS; GPU 1: the
# sparse-op kernels and the engine's sparse decode modes); phase B runs $PHASE_B (a command that uses
# both GPUs, e.g. the tensor-parallel benchmark). Everything lands in $OUT/results.tgz (the device
# tool brings back at most 8 files) plus the short logs.
set -u
BUDGET=${1:-570}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/results; mkdir -p "$OUT" $R
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee $R/gpus.txt
A=${PHASE_A_SECONDS:-300}
TESTS=${TESTS:-tests/test_gpu_sparse_ops.py tests/test_host_tier.py tests/test_tier_engine.py tests/test_gpu_speculative.py tests/test_ops_norm_and_gates.py tests/test_gpu_parity.py tests/test_ops_attention.py tests/test_ops_gdn.py}
ENGINE_ARGS=${ENGINE_ARGS:---preset qwen3.5-27b --contexts 8192 131072 --batches 1 8 --prefill-contexts --steps 16 --modes sparse-sum sparse}
# then, on each GPU, $GPU0_EXTRA / $GPU1_EXTRA (e.g. a quality eval) until phase A's deadline
until_a() { echo $(( A - ($(date +%s) - START) )); }
(export CUDA_VISIBLE_DEVICES=0; OUT=$R/gpu0 STAGES=tests TESTS_SHARE=10 bash benchmarks/h200_session.sh ${TESTS_SECONDS:-$A} \
  $TESTS > $R/gpu0.log 2>&1; [ -n "${GPU0_EXTRA:-}" ] && timeout $(until_a) bash -c "$GPU0_EXTRA" > $R/gpu0-extra.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1; OUT=$R/gpu1 STAGES="sparse engine" ENGINE_ARGS="$ENGINE_ARGS" bash benchmarks/h200_session.sh \
  ${ENGINE_SECONDS:-$A} > $R/gpu1.log 2>&1; [ -n "${GPU1_EXTRA:-}" ] && timeout $(until_a) bash -c "$GPU1_EXTRA" \
  > $R/gpu1-extra.log 2>&1) &
wait
echo "phase A done after $(( $(date +%s) - START )) s"
if [ -n "${PHASE_B:-}" ]; then
  timeout $(( $(left) - 15 )) bash -c "$PHASE_B" > $R/phase-b.log 2>&1
  echo "phase B done after $(( $(date +%s) - START )) s"
fi
tar czf "$OUT/results.tgz" -C $R .
cp $R/*.log "$OUT/" 2>/dev/null
echo "== GPU 0 tests"; grep -E "passed|failed|FAILED|ERROR|error" $R/gpu0/gpu-tests.log | tail -25
echo "== GPU 1"; tail -12 $R/gpu1.log
for f in $R/gpu0-extra.log $R/gpu1-extra.log; do [ -f $f ] && { echo "== $f"; tail -15 $f; }; done
[ -f $R/phase-b.log ] && { echo "== phase B"; tail -25 $R/phase-b.log; }
echo "session done after $(( $(date +%s) - START )) s"
