# run 127 (ready, not run): what session 37 left. Issue 39: (1) gate_up with Config.xsum at decode sizes (run 126:
# 51.7 -> 47.9 us per call at M = 8, one sample; +64 small reduction kernels per step) as an engine A/B, alternating;
# (2) W4A16 + MTP-7 verification steps at 8 x 250K on today's tree (the scoring's top-k count also runs in the
# leaders' selection). On an H200 the W4A16 steps also give issue 39's H200 ratio against run 117's figure.
# run(command="END=585 bash benchmarks/next/run127.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
at() { echo $(( $1 < END ? $1 : END )); }
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 16"
PY='import sys, dataclasses; import sketchkv.ops.w4a16_gemm as w
k = (8, 34816, 5120)
w.TUNED[k] = dataclasses.replace(w.TUNED[k], xsum=sys.argv[1] == "1")
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
i=0; for f in 0 1 0 1; do i=$((i + 1)); timeout $(left $(at $((60 + 55 * i + 100)))) python3 -c "$PY" $f $B --out-dir $OUT/r/x$f-$i > $OUT/x$f-$i.txt 2>&1; mark x$f-$i $?; done
timeout $(left $END) python3 -m sketchkv bench agents --model random:qwen3.5-27b-w4a16+mtp --configs sparse --agents 8 \
  --contexts 250K --fill random --num-speculative-tokens 7 --reference-accepted-length 4.06 --sparse-verify-selection shared \
  --sparse-host-format int4 --out-dir $OUT/r --name mtp7-w4a16 > $OUT/mtp.txt 2>&1; mark mtp $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for f in $OUT/x*.txt; do echo "$(basename $f) $(grep -E 'step ms' $f | tail -1)"; done
grep -E "decode|projected|verif" $OUT/mtp.txt | tail -4 | cut -c1-300; cat $OUT/all.log
