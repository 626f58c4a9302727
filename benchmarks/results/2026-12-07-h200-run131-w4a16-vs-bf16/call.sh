# run 131 (session 41), issue 39's missing H200 figure and issue 41's bf16 profile with the launch cuts on: on an
# H200, the 8 x 250K decode step (27B shape, random fill, int4 host rows) with W4A16 and bf16 weights in one run
# (issue 39 asks W4A16 >= 2x bf16 on the H200), the W4A16 GEMM's GPU tests after session 41 removed its x-major,
# persistent and xsum variants, a profiled bf16 step (kernels per step, floor fraction), how this host reads miss
# rows, then (time left) the W4A16 MTP-7 verification step.
# run(command="END=585 bash benchmarks/next/run131.sh", carry=[".whl"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-585}
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
STEP_S=240 step w4a16 python3 -m sketchkv $B
STEP_S=150 step bf16 python3 -m sketchkv ${B/-w4a16/}
L=$(left $END); [ $L -gt 100 ] && { timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_w4a16.py \
  -k "27b_shapes_match_reference or mixed" > $OUT/pytest.txt 2>&1; mark pytest $?; }
step bf16-profile python3 -m sketchkv ${B/-w4a16/} --profile
L=$(left $END); [ $L -gt 60 ] && { timeout 50 python3 benchmarks/studies/host_row_reads.py --gib 2 --out $OUT/r/rows.json > $OUT/rows.txt 2>&1; mark rows $?; }
STEP_S=150 step w4a16-mtp python3 -m sketchkv $B --model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 --sparse-verify-selection shared
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
grep -E "^\| [0-9]+ \|" $OUT/s-bf16-profile.txt 2>/dev/null | head -1
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
tail -2 $OUT/pytest.txt; grep -E "FAILED|Error" $OUT/pytest.txt | head -5 | cut -c1-200
grep -E "H2D|N=" $OUT/rows.txt 2>/dev/null | cut -c1-140
cat $OUT/all.log
