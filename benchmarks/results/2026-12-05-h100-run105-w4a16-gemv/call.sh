# H200 run 102: the small-M CUDA-core GEMV kernel (tests at 27B shapes + graph replay, then the --gemv bench that
# picks GEMV_MAX_M / GEMV_TUNED), and the int4-vs-dequantized-twin test that failed in run 101 (its log was lost).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p ~/.triton && [ -f .tc/tcb.txz ] && tar -C ~/.triton -xJf .tc/tcb.txz
L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $OUT/gpu.txt
timeout 150 python3 -m pytest tests/test_ops_w4a16.py -m gpu -q -rfEs -p no:cacheprovider -k gemv > $OUT/gemv-tests.log 2>&1
echo "gemv gpu tests rc $?" >> $L; grep -E "^FAILED|passed|failed|Error" $OUT/gemv-tests.log | tail -6 | cut -c1-500 >> $L
timeout 170 python3 benchmarks/bench_w4a16_gemm.py --gemv --out $OUT > $OUT/gemv-bench.log 2>&1
echo "gemv bench rc $?" >> $L
tail -40 $OUT/gemv-bench.log; cat $L
