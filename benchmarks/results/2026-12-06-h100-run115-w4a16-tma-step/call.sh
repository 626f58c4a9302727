# H100 run 115: 8 x 250K W4A16 with the words by TMA (config_for's default now) vs the same without TMA vs bf16,
# one machine; then the W4A16 GPU tests. run(command="bash benchmarks/next/run115.sh", carry=[".whl"], timeout_s=560)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K"
timeout $(left 210) python3 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16-tma > $OUT/w4a16-tma.txt 2>&1; mark w4a16-tma $?
sed -i 's/if M <= 16 and _tma_ok(N, device):/if False:/' sketchkv/ops/w4a16_gemm.py
timeout $(left 340) python3 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16-notma > $OUT/w4a16-notma.txt 2>&1; mark w4a16-notma $?
sed -i 's/if False:/if M <= 16 and _tma_ok(N, device):/' sketchkv/ops/w4a16_gemm.py
timeout $(left 465) python3 $B --model random:qwen3.5-27b --out-dir $OUT/r/bf16 > $OUT/bf16.txt 2>&1; mark bf16 $?
timeout $(left 545) python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_ops_w4a16.py > $OUT/w4a16-tests.txt 2>&1; mark w4a16-tests $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for m in w4a16-tma w4a16-notma bf16; do echo "== $m"; grep -E "step ms|floor ms|kernels / step|gaps ms|host gather|gemm" $OUT/$m.txt; done
grep -E "passed|failed|FAILED" $OUT/w4a16-tests.txt | tail -5; cat $OUT/all.log
