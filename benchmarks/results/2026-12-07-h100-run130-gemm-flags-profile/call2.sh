# run 127, call 2 (same warm machine; run127.sh left its GEMM studies in /tmp/r127): engine A/B pairs with the studies'
# winners in TUNED (benchmarks/next/tuned_from_study.py: a row's best flipped config where it beats the shipped one
# by >= 3%): a plain 8 x 250K W4A16 decode step (M = 8: persistent) and an MTP-7 verification step (M = 64:
# x_major), a profiled plain step (kernels per step); then the GEMM GPU tests of the new configs; then how this host
# reads miss rows (host_row_reads.py).
# The first plain and MTP steps get more time: a fresh machine compiles the engine's kernels (163 s in run 129).
# run(command="END=585 bash benchmarks/next/run127b.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
ls /tmp/r127/*.json >> $OUT/all.log 2>&1
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
M="--model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 --sparse-verify-selection shared"
T="python3 benchmarks/next/tuned_from_study.py $(ls /tmp/r127/*.json 2>/dev/null | tr '\n' ' ') --"
STEP_S=200 step plain-shipped python3 -m sketchkv $B
step plain-tuned $T $B
STEP_S=180 step mtp-shipped python3 -m sketchkv $B $M
step mtp-tuned $T $B $M
step profile python3 -m sketchkv $B --profile   # issue 41's kernel count with session 38's cuts on (~1,333 expected)
L=$(left $END); [ $L -gt 60 ] && { timeout $(( L < 120 ? L - 5 : 115 )) python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_ops_w4a16.py tests/test_gpu_sparse_ops.py -k "group_sizes or spanning or topk" > $OUT/pytest.txt 2>&1; mark pytest $?; }
L=$(left $END); [ $L -gt 40 ] && { timeout $(( L - 5 )) python3 benchmarks/studies/host_row_reads.py --gib 2 --out $OUT/r/rows.json > $OUT/rows.txt 2>&1; mark rows $?; }
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
grep -h TUNED $OUT/s-*tuned*.txt | sort -u | cut -c1-200
grep -E "^\| [0-9]+ \|" $OUT/s-profile.txt 2>/dev/null | head -1
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
tail -3 $OUT/pytest.txt 2>/dev/null; grep -E "H2D|N=" $OUT/rows.txt 2>/dev/null | cut -c1-140
cat $OUT/all.log
