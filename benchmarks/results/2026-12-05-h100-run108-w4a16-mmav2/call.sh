# (run as benchmarks/next/mma_call.sh)
# H100 run 108: the W4A16 kernel's wgmmas are serialized by ptxas (run 107's ncu: a WARPGROUP.DEPBAR after every
# HGMMA, barrier stalls 48%); the same kernel on mma.sync (DISABLE_MMA_V3=1, its own Triton cache key): GPU tests,
# GEMM bench v3 vs v2 in one run, then a v2 config sweep (M = 8, 1, 64) with the time left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p ~/.triton && [ -f .tc/tcb.txz ] && tar -C ~/.triton -xJf .tc/tcb.txz
START=$(date +%s); left() { echo $(( ${BUDGET:-560} - ($(date +%s) - START) )); }
L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $OUT/gpu.txt
DISABLE_MMA_V3=1 timeout 150 python3 -m pytest tests/test_ops_w4a16.py -m gpu -q -rfEs -p no:cacheprovider > $OUT/v2-tests.log 2>&1
echo "v2 gpu tests rc $? at $(( $(date +%s) - START )) s" >> $L; grep -E "^E |^FAILED|passed|failed" $OUT/v2-tests.log | head -8 | cut -c1-300 >> $L
timeout 100 python3 benchmarks/bench_w4a16_gemm.py --rows 1 8 64 --l2-bytes 1e9 --out $OUT/gemm-v3 > $OUT/v3-bench.log 2>&1
echo "v3 bench rc $? at $(( $(date +%s) - START )) s" >> $L
DISABLE_MMA_V3=1 timeout 120 python3 benchmarks/bench_w4a16_gemm.py --rows 1 8 64 --l2-bytes 1e9 --out $OUT/gemm-v2 > $OUT/v2-bench.log 2>&1
echo "v2 bench rc $? at $(( $(date +%s) - START )) s" >> $L
DISABLE_MMA_V3=1 timeout $(( $(left) - 20 )) python3 benchmarks/bench_w4a16_gemm.py --rows 8 1 64 --sweep --sweep-rows 8 1 64 --l2-bytes 1e9 --out $OUT/sweep-v2 > $OUT/v2-sweep.log 2>&1
echo "v2 sweep rc $? at $(( $(date +%s) - START )) s" >> $L
tar -C ~/.triton -cJf $OUT/tcb.txz cache 2>/dev/null
grep -E "^\|" $OUT/v3-bench.log; grep -E "^\|" $OUT/v2-bench.log; grep -E "^sweep .* best|^TUNED|^    \(" $OUT/v2-sweep.log | cut -c1-200; grep -E "^\|" $OUT/v2-sweep.log; cat $L
