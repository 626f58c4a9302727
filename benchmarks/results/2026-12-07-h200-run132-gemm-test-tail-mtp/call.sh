# run 132 (next session), on an H200 (kind="nvidia-h200"; an H100 serves for 1-2): (1) run 131's one failure of
# test_gpu_27b_shapes_match_reference[o/out] (4 reruns passed): the 27B-shape GEMM tests in a loop, stopping at the
# first failure with its traceback (the message now names M and the config); (2) the W4A16 8 x 250K step profiled on
# the H200 (kernels, the int4 GEMMs' ms: issue 39's ratio there was 1.26x, run 131); (3) the MTP-7 verification
# step with the projection at the seed's accepted length 4.06 (`bench step --reference-accepted-length`, session 41).
# run(command="END=585 bash benchmarks/next/run132.sh", carry=[".whl"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-585}
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
for i in $(seq 1 20); do
  L=$(left 240); [ $L -lt 20 ] && break
  timeout $L python3 -m pytest -m gpu -q -x -p no:cacheprovider --tb=short tests/test_ops_w4a16.py \
    -k "test_gpu_27b_shapes_match_reference or mixed" > $OUT/pytest-$i.txt 2>&1; rc=$?; mark "pytest-$i" $rc
  [ $rc -eq 0 ] && rm $OUT/pytest-$i.txt || { [ $rc -eq 1 ] && break; }
done
STEP_S=200 step w4a16-profile python3 -m sketchkv $B --profile
STEP_S=150 step w4a16-mtp python3 -m sketchkv $B --model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 \
  --sparse-verify-selection shared --reference-accepted-length 4.06
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
grep -h -E "^E |Error|off, max excess" $OUT/pytest-*.txt 2>/dev/null | head -20 | cut -c1-220
grep -E "^\| [0-9]+ \|" $OUT/s-w4a16-profile.txt 2>/dev/null | head -1
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s|floor|speculative' $f | tr -s ' ' | tr '\n' ';' | cut -c1-260)"; done
cat $OUT/all.log
