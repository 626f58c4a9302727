# H100 run 121 (2026-12-07, session 36): the one-kernel top-k (ops/topk.py _topk_fused_kernel: correctness at real sizes, then its study against
# the 11-launch path); the 8 x 250K W4A16 step (now with the fused top-k, without the grouped step's three
# concatenations per layer and without the q / k copies before their norms); the GPU tests of read groups (fp32 exact
# tokens through the whole model) and of the pinned gather / row copy; the same step with --sparse-miss-read rows
# (make it the default only if it wins here and loses nowhere); bf16 for issue 39's ratio; last, if time is left,
# benchmarks/studies/host_row_reads.py (how the miss gather reads a host row).
# run(command="bash benchmarks/next/run121.sh", carry=[".whl"], timeout_s=595)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
timeout $(left 60) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py tests/test_ops_gdn.py -k "topk or raw_gates" > $OUT/pytest-topk.txt 2>&1; mark topk-test $?
timeout $(left 95) python3 benchmarks/studies/topk_fused.py --out $OUT/r/topk.json > $OUT/topk.txt 2>&1; mark topk-study $?
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K"
timeout $(left 250) python3 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/fields > $OUT/fields.txt 2>&1; mark fields $?
timeout $(left 330) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_host_tier.py tests/test_tier_engine.py \
  -k "gpu_gather_from_pinned or read_groups" > $OUT/pytest.txt 2>&1; mark pytest $?
timeout $(left 460) python3 $B --model random:qwen3.5-27b-w4a16 --sparse-miss-read rows --out-dir $OUT/r/rows > $OUT/rowsstep.txt 2>&1; mark rowsstep $?
timeout $(left 580) python3 $B --model random:qwen3.5-27b --out-dir $OUT/r/bf16 > $OUT/bf16.txt 2>&1; mark bf16 $?
L=$(left 585); [ $L -gt 60 ] && { timeout $L python3 benchmarks/studies/host_row_reads.py --gib 2 --out $OUT/r/rows.json > $OUT/rows.txt 2>&1; mark rows-study $?; }
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/pytest-topk.txt; tail -8 $OUT/topk.txt
for m in fields rowsstep bf16; do echo "== $m"; tail -15 $OUT/$m.txt | cut -c1-150; done
tail -3 $OUT/pytest.txt; tail -12 $OUT/rows.txt 2>/dev/null; cat $OUT/all.log
