# run 126: runs 122 and 123 in one call (session 37 lost most of its device time to failed machine starts), by
# priority. Issue 41: the top-k GPU tests (7 launches, and its first round counted by the scoring kernels: radix_hist)
# and 8 x 250K W4A16 steps with and without the scoring's count; issue 39: the GEMM GPU tests with Config.xsum and a
# quick xsum study at M = 8, 64; then the host cost of a graph launch (benchmarks/studies/graph_launch.py) and a bf16
# step (the W4A16 / bf16 ratio on this machine) if time is left. END (default 585): seconds until the results are
# packed; the call's timeout_s must exceed it.
# run(command="END=585 bash benchmarks/next/run126.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
at() { echo $(( $1 < END ? $1 : END )); }    # a step's deadline, never past END
timeout $(left $(at 45)) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py -k topk > $OUT/pytest-topk.txt 2>&1; mark topk-test $?
B="bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K"
PY='import sys; import sketchkv.ops.topk as t; t.SCORING_COUNTS_FIRST_ROUND = sys.argv[1] == "1"; from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
timeout $(left $(at 200)) python3 -c "$PY" 1 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16 > $OUT/w4a16.txt 2>&1; mark w4a16 $?
timeout $(left $(at 330)) python3 -c "$PY" 0 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16-topk7 > $OUT/w4a16-topk7.txt 2>&1; mark w4a16-topk7 $?
timeout $(left $(at 400)) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_w4a16.py -k "group_sizes or spanning" > $OUT/pytest-w4a16.txt 2>&1; mark w4a16-test $?
timeout $(left $(at 460)) python3 benchmarks/studies/w4a16_flag.py --flag xsum --quick --rows 8 64 --out $OUT/r/xsum > $OUT/xsum.txt 2>&1; mark xsum $?
timeout $(left $(at 480)) python3 benchmarks/studies/graph_launch.py --out $OUT/r/launch > $OUT/launch.txt 2>&1; mark launch $?
L=$(left $END); [ $L -gt 100 ] && { timeout $L python3 -m sketchkv $B --model random:qwen3.5-27b --out-dir $OUT/r/bf16 > $OUT/bf16.txt 2>&1; mark bf16 $?; }
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -2 $OUT/pytest-topk.txt; tail -2 $OUT/pytest-w4a16.txt; grep -A20 "^# CUDA graph" $OUT/launch.txt | tail -14
grep -v Warning $OUT/xsum.txt | grep -E "^\||FAILED" | tail -16 | cut -c1-160
for m in w4a16 w4a16-topk7 bf16; do echo "== $m"; tail -16 $OUT/$m.txt 2>/dev/null | cut -c1-150; done
cat $OUT/all.log

# call 2 (same warm machine):
# . benchmarks/next/preamble.sh; timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k read_groups > $OUT/pytest.txt 2>&1
# timeout 90 python3 benchmarks/studies/topk_launches.py --out $OUT/topk.json > $OUT/topk.txt 2>&1
# call 3:
# . benchmarks/next/preamble.sh; B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16"
# PY='import sys; import sketchkv.ops.topk as t; t.SCORING_COUNTS_FIRST_ROUND = sys.argv[1] == "1"; from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
# for f in 0 1 0 1; do timeout 120 python3 -c "$PY" $f $B --steps 16 --out-dir $OUT/r/c$f > $OUT/c$f.txt 2>&1; done
