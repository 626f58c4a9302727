# run 124 (issue 39), after run 123 shows Config.xsum faster at M = 64: 8 x 250K W4A16 + MTP-7 verification steps
# (8 sequences x 8 rows = the GEMMs at M = 64) with rowsum(x) by the second dot (shipped) and summed before the launch
# (XSUM_MIN_M = 17), one run, same machine.
# run(command="bash benchmarks/next/run124.sh", carry=[".whl"], timeout_s=560)
. benchmarks/next/preamble.sh
A="bench agents --model random:qwen3.5-27b-w4a16+mtp --configs sparse --agents 8 --contexts 250K --fill random
   --num-speculative-tokens 7 --reference-accepted-length 4.06 --sparse-verify-selection shared --sparse-host-format int4
   --out-dir $OUT/r"
PY='import sys; import sketchkv.ops.w4a16_gemm as w; w.XSUM_MIN_M = int(sys.argv[1]); from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
timeout $(left 275) python3 -c "$PY" 17 $A --name mtp7-xsum > $OUT/xsum.txt 2>&1; mark xsum $?
timeout $(left 550) python3 -c "$PY" 1073741824 $A --name mtp7-base > $OUT/base.txt 2>&1; mark base $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for m in xsum base; do echo "== $m"; grep -E "decode|projected|verif" $OUT/$m.txt | tail -4 | cut -c1-300; done
cat $OUT/all.log
