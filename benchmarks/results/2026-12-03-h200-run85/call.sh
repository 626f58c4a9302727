python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
L=$OUT/all.log
for v in v0_head v2_cols v3_scs; do
  echo "== variant $v" >> $L
  timeout 100 python3 scratch/variant_bench.py scratch/variants/$v.py --quick --kernels dp4a fma --out $OUT/score-$v.json > /tmp/score-$v.log 2>&1; echo "$v rc $?" >> $L
  grep -E "^\||dp4a|fma" /tmp/score-$v.log | grep -v "^softmax" | tail -12 >> $L
done
echo "== gpu tests" >> $L
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_sparse_ops.py -k "dp4a or sketch_score" >> $L 2>&1; echo "tests rc $?" >> $L
B="python3 -m sketchkv bench agents --model random:qwen3.5-27b --configs sparse --breakdown --out-dir $OUT --agents 8 --contexts 250K --fill random"
timeout 120 $B --name a8-softmax > /tmp/a8s.txt 2>&1; echo "a8 softmax rc $?" >> $L
timeout 120 $B --sparse-head-combine sum --name a8-sum > /tmp/a8u.txt 2>&1; echo "a8 sum rc $?" >> $L
rm -f $OUT/*.png $OUT/*.md; cat /tmp/a8s.txt /tmp/a8u.txt > $OUT/a8.txt
cd /tmp/tc && find . -name "*.cubin" -o -name "*.json" -o -name "*.so" | tar cJf $OUT/tcb.txz -T -
cd - >/dev/null
grep -h "decode .* tok/s combined" /tmp/a8s.txt /tmp/a8u.txt >> $L
grep -h -A3 "sketch score" /tmp/a8s.txt /tmp/a8u.txt | head -20 >> $L
echo "== full score logs" >> $L; cat /tmp/score-*.log >> $L
grep -E "rc |passed|failed|tok/s combined|^\\| (sum|max) " $L | head -60
