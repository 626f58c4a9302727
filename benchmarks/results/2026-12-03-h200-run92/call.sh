python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
L=$OUT/all.log
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py tests/test_sparse.py > $OUT/tests.log 2>&1; echo "pytest rc $?" >> $L; tail -3 $OUT/tests.log >> $L
timeout 150 python3 benchmarks/bench_sketch_score.py --quick --kernels dot dp4a --out $OUT/sketch-score.json > /tmp/bench.log 2>&1; echo "bench rc $?" >> $L
timeout 60 python3 scratch/gemm_probe.py $OUT/gemm.json > /tmp/gemm.log 2>&1; echo "gemm rc $?" >> $L
B="python3 -m sketchkv bench agents --model random:qwen3.5-27b --configs sparse --breakdown --out-dir $OUT --agents 8 --contexts 250K --fill random"
timeout 130 $B --sparse-score-kernel dp4a --name a8-softmax-dp4a > /tmp/a8d.txt 2>&1; echo "a8 softmax dp4a rc $?" >> $L
rm -f $OUT/*.png $OUT/*.md; cp /tmp/a8d.txt $OUT/a8.txt
cat /tmp/bench.log /tmp/gemm.log >> $L
grep -h "decode .* tok/s combined" /tmp/a8d.txt >> $L
grep -E "rc |passed|failed|tok/s combined|^\| |^(sum|max|softmax) |M=|copy bw" $L | head -60
