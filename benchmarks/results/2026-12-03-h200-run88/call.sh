python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
L=$OUT/all.log
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py tests/test_sparse.py > $OUT/tests.log 2>&1; echo "pytest rc $?" >> $L; tail -3 $OUT/tests.log >> $L
timeout 200 python3 benchmarks/bench_sketch_score.py --quick --out $OUT/sketch-score.json > /tmp/bench.log 2>&1; echo "bench rc $?" >> $L
B="python3 -m sketchkv bench agents --model random:qwen3.5-27b --configs sparse --breakdown --out-dir $OUT --agents 8 --contexts 250K --fill random"
timeout 120 $B --name a8-softmax > /tmp/a8s.txt 2>&1; echo "a8 softmax rc $?" >> $L
timeout 120 $B --sparse-head-combine sum --name a8-sum > /tmp/a8u.txt 2>&1; echo "a8 sum rc $?" >> $L
rm -f $OUT/*.png $OUT/*.md; cat /tmp/a8s.txt /tmp/a8u.txt > $OUT/a8.txt
cd /tmp/tc && find . -name "*.cubin" -o -name "*.json" -o -name "*.so" | tar cJf $OUT/tcb.txz -T -
cd - >/dev/null
cat /tmp/bench.log >> $L
grep -h "decode .* tok/s combined" /tmp/a8s.txt /tmp/a8u.txt >> $L
grep -E "rc |passed|failed|tok/s combined|^\| |top-k" $L | head -40
