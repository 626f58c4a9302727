python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
L=$OUT/all.log
B="python3 -m sketchkv bench agents --out-dir $OUT --breakdown"
timeout 130 $B --model random:qwen3.5-27b --configs sparse --agents 8 --contexts 250K --fill random --name a8 > /tmp/a8.txt 2>&1; echo "a8 rc $?" >> $L
timeout 70 python3 benchmarks/bench_weight_gemms.py --out $OUT/weight-gemms.json > /tmp/gemm.log 2>&1; echo "gemm rc $?" >> $L; tail -5 /tmp/gemm.log >> $L
timeout 280 $B --fill real --configs sparse dense --agents 1 8 --contexts 128K 250K --name ref-agents > /tmp/ref.txt 2>&1; echo "ref agents rc $?" >> $L
timeout 90 $B --fill real --configs sparse --agents 8 --contexts 250K --sparse-hot-fraction 0.1 --name ref-hot10 > /tmp/hot.txt 2>&1; echo "ref hot 0.1 rc $?" >> $L
rm -f $OUT/*.png; cat /tmp/a8.txt /tmp/ref.txt /tmp/hot.txt /tmp/gemm.log > $OUT/log.txt
grep -hE "decode .* tok/s|agents x" $OUT/log.txt >> $L
for f in $OUT/*.md; do grep -h "^| sketchkv" $f | cut -d'|' -f2-14; grep -h -A6 "^| config | agents x context | graph step ms" $f; done >> $L 2>/dev/null
rm -f $OUT/*.md
cat $L
