# run 122 (issue 41): the top-k in 7 launches (each radix round's pick folded into the next kernel; never run on a GPU
# before) and its first round counted by the softmax combine kernel as it writes the scores (5 launches; the memset by
# _lse_finish_kernel): GPU tests and benchmarks/studies/topk_launches.py; then 8 x 250K W4A16 steps with and without
# the scoring's count (SCORING_COUNTS_FIRST_ROUND), a bf16 step (issue 39's ratio on an H200: never in one run), and
# the read-groups fp32 token test (whole-batch buffers; cut short in run 121) with what time is left.
# run(command="bash benchmarks/next/run122.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
timeout $(left 50) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py -k topk > $OUT/pytest-topk.txt 2>&1; mark topk-test $?
timeout $(left 95) python3 benchmarks/studies/topk_launches.py --out $OUT/r/topk.json > $OUT/topk.txt 2>&1; mark topk-study $?
B="bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K"
PY='import sys; import sketchkv.ops.topk as t; t.SCORING_COUNTS_FIRST_ROUND = sys.argv[1] == "1"; from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
timeout $(left 245) python3 -c "$PY" 1 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16 > $OUT/w4a16.txt 2>&1; mark w4a16 $?
timeout $(left 390) python3 -c "$PY" 0 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16-topk7 > $OUT/w4a16-topk7.txt 2>&1; mark w4a16-topk7 $?
timeout $(left 525) python3 -m sketchkv $B --model random:qwen3.5-27b --out-dir $OUT/r/bf16 > $OUT/bf16.txt 2>&1; mark bf16 $?
L=$(left 590); [ $L -gt 40 ] && { timeout $L python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k read_groups > $OUT/pytest.txt 2>&1; mark pytest $?; }
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/pytest-topk.txt; tail -8 $OUT/topk.txt; tail -3 $OUT/pytest.txt 2>/dev/null
for m in w4a16 w4a16-topk7 bf16; do echo "== $m"; tail -16 $OUT/$m.txt | cut -c1-150; done
cat $OUT/all.log
