# H100 run 118 (2026-12-06, session 35): read groups on the GPU for correctness (reference model,
# fp32 + bf16, greedy tokens and tier hits; if identical, make sparse_read_groups=2 the default and rerun the
# 8 x 250K step for W4A16 and bf16 on one machine), then a fair cold prefill of 244K tokens: bf16 first, W4A16, bf16
# again (bench agents now sends an untimed two-chunk prompt before each timed prefill, so the order should not matter).
# run(command="bash benchmarks/next/run118.sh", carry=[".whl"], timeout_s=595)  (then at benchmarks/next/)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
nvidia-smi --query-gpu=name --format=csv,noheader >> $OUT/all.log
timeout $(left 240) python3 benchmarks/studies/check_read_groups.py float32 bfloat16 > $OUT/check.txt 2>&1; mark check $?
P="-m sketchkv bench agents --configs sparse --agents 1 --contexts 244K --fill real --decode-tokens 8 --out-dir $OUT/r"
timeout $(left 360) python3 $P --model random:qwen3.5-27b --name prefill-bf16-first > $OUT/p1.txt 2>&1; mark bf16-first $?
timeout $(left 470) python3 $P --model random:qwen3.5-27b-w4a16 --name prefill-w4a16 > $OUT/p2.txt 2>&1; mark w4a16 $?
timeout $(left 570) python3 $P --model random:qwen3.5-27b --name prefill-bf16 > $OUT/p3.txt 2>&1; mark bf16 $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/check.txt; grep -h "prefill .* tok/s" $OUT/p*.txt | cut -c1-200; cat $OUT/all.log
