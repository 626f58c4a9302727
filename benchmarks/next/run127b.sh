# run 127, call 2 (same warm machine; call 1 left its GEMM studies in /tmp/r127): the GPU tests of the new GEMM
# configs (x_major, persistent) and of select_top_k, then engine A/B pairs with the studies' winners in TUNED
# (benchmarks/next/tuned_from_study.py: a row's best flipped config where it beats the shipped one by >= 3%):
# a plain 8 x 250K W4A16 decode step (M = 8: persistent) and an MTP-7 verification step (M = 64: x_major). Before
# them the prefill GEMM study (dequantize slices overlapping the GEMMs vs bf16 cuBLAS).
# run(command="END=585 bash benchmarks/next/run127b.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
at() { echo $(( $1 < END ? $1 : END )); }
ls /tmp/r127/*.json >> $OUT/all.log 2>&1
timeout $(left 150) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_w4a16.py tests/test_gpu_sparse_ops.py \
  -k "group_sizes or spanning or topk or select or mixed or prefill_dequant" > $OUT/pytest.txt 2>&1; mark pytest $?
timeout $(left 200) python3 benchmarks/studies/w4a16_prefill.py --out $OUT/r/prefill > $OUT/prefill.txt 2>&1; mark prefill $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
M="--model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 --sparse-verify-selection shared"
T="python3 benchmarks/next/tuned_from_study.py $(ls /tmp/r127/*.json 2>/dev/null | tr '\n' ' ') --"
OLD='import sys; import sketchkv.models.fuse as f, sketchkv.ops.selection as s; f.MIXED_ONE_LAUNCH = s.COMPOSE_IN_TOPK = sys.argv[1] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
step() {   # name, then the command; skipped when under 50 s are left
  local L=$(left $END) n=$1; shift; [ $L -lt 50 ] && return
  timeout $(( L < 110 ? L : 110 )) "$@" --out-dir $OUT/r/$n > $OUT/s-$n.txt 2>&1; mark $n $?; }
step plain-shipped python3 -m sketchkv $B
step plain-tuned $T $B
step mtp-shipped python3 -m sketchkv $B $M
step mtp-tuned $T $B $M
# this session's two launch cuts (mixed GEMM, compose in top-k) off / on
step cuts-off python3 -c "$OLD" 0 $B
step cuts-on python3 -c "$OLD" 1 $B
step plain-shipped-2 python3 -m sketchkv $B
step plain-tuned-2 $T $B
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/pytest.txt; grep -E '^\|' $OUT/prefill.txt | cut -c1-200; grep -h TUNED $OUT/s-*tuned*.txt | sort -u | cut -c1-200
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
cat $OUT/all.log
