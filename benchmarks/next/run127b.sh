# run 127, call 2 (same warm machine; call 1 left its GEMM studies in /tmp/r127): the GPU tests of the new GEMM
# configs (x_major, persistent) and of select_top_k, then engine A/B pairs with the studies' winners in TUNED
# (benchmarks/next/tuned_from_study.py: a row's best flipped config where it beats the shipped one by >= 3%):
# a plain 8 x 250K W4A16 decode step (M = 8: persistent) and an MTP-7 verification step (M = 64: x_major).
# run(command="END=585 bash benchmarks/next/run127b.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
at() { echo $(( $1 < END ? $1 : END )); }
ls /tmp/r127/*.json >> $OUT/all.log 2>&1
timeout $(left 150) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_w4a16.py tests/test_gpu_sparse_ops.py \
  -k "group_sizes or spanning or topk or select or mixed" > $OUT/pytest.txt 2>&1; mark pytest $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
M="--model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 --sparse-verify-selection shared"
T="python3 benchmarks/next/tuned_from_study.py $(ls /tmp/r127/*.json 2>/dev/null | tr '\n' ' ') --"
i=0
for r in 1 2; do
  for v in plain mtp; do
    for t in shipped tuned; do i=$((i + 1))
      L=$(left $END); [ $L -lt 50 ] && break 3
      cmd="python3 -m sketchkv"; [ $t = tuned ] && cmd=$T
      extra=""; [ $v = mtp ] && extra=$M
      timeout $(( L < 110 ? L : 110 )) $cmd $B $extra --out-dir $OUT/r/$v-$t-$r > $OUT/s$i-$v-$t.txt 2>&1; mark $v-$t-$r $?
    done
  done
done
# this session's two launch cuts (mixed GEMM, compose in top-k) off / on, if time is left
OLD='import sys; import sketchkv.models.fuse as f, sketchkv.ops.selection as s; f.MIXED_ONE_LAUNCH = s.COMPOSE_IN_TOPK = sys.argv[1] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
for f in 0 1; do L=$(left $END); [ $L -lt 50 ] && break
  timeout $(( L < 110 ? L : 110 )) python3 -c "$OLD" $f $B --out-dir $OUT/r/cuts$f > $OUT/t$f-cuts.txt 2>&1; mark cuts$f $?; done
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/pytest.txt; grep -h TUNED $OUT/s*-tuned.txt | sort -u | cut -c1-200
for f in $OUT/s*.txt $OUT/t*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
cat $OUT/all.log
