# run 127 (session 38), by priority (device time was scarce: this call may be the session's only one).
# 1. GPU tests of what this session made the default: select_top_k (top-k's compaction writes the composed rows),
#    the mixed int4 + bf16 GDN in_proj in one GEMM launch, prefill's dequantize in overlapped column slices.
# 2. Issue 39 GEMM studies: x on the MMA's M side (Config.x_major) at M = 64 (the MTP-7 step's rows, 27% of the
#    floor now), persistent programs (Config.persistent) at M = 8; prefill GEMMs (dequant slices vs bf16 cuBLAS).
# 3. The 8 x 250K W4A16 step with this session's two launch cuts off / on (fuse.MIXED_ONE_LAUNCH,
#    selection.COMPOSE_IN_TOPK), then bf16 (issue 39's ratio on this machine; on an H200 never measured in one run).
# The studies' JSON go to /tmp/r127 for call 2 (run127b.sh: the winners in TUNED in the engine, MTP-7, row reads).
# run(command="END=585 bash benchmarks/next/run127.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
timeout $(left 75) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py tests/test_ops_w4a16.py \
  -k "select_top_k or mixed or prefill_dequant" > $OUT/pytest.txt 2>&1; mark pytest $?
timeout $(left 175) python3 benchmarks/studies/w4a16_flag.py --flag x_major --rows 64 --out $OUT/r/xm > $OUT/xm.txt 2>&1; mark x_major $?
timeout $(left 250) python3 benchmarks/studies/w4a16_flag.py --flag persistent --rows 8 --out $OUT/r/pers > $OUT/pers.txt 2>&1; mark persistent $?
timeout $(left 300) python3 benchmarks/studies/w4a16_prefill.py --out $OUT/r/prefill > $OUT/prefill.txt 2>&1; mark prefill $?
mkdir -p /tmp/r127 && cp $OUT/r/xm/*.json $OUT/r/pers/*.json /tmp/r127/ 2>/dev/null
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
OLD='import sys; import sketchkv.models.fuse as f, sketchkv.ops.selection as s; f.MIXED_ONE_LAUNCH = s.COMPOSE_IN_TOPK = sys.argv[1] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
step() {   # name, then the command; skipped when under 50 s are left
  local L=$(left $END) n=$1; shift; [ $L -lt 50 ] && return
  timeout $(( L < 110 ? L : 110 )) "$@" --out-dir $OUT/r/$n > $OUT/s-$n.txt 2>&1; mark $n $?; }
step cuts-off python3 -c "$OLD" 0 $B
step cuts-on python3 -c "$OLD" 1 $B
step bf16 python3 -m sketchkv ${B/-w4a16/}
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -2 $OUT/pytest.txt; grep -v Warning $OUT/xm.txt | grep -E "^\||FAILED" | tail -9 | cut -c1-230
grep -v Warning $OUT/pers.txt | grep -E "^\||FAILED" | tail -9 | cut -c1-230; grep -E '^\|' $OUT/prefill.txt | cut -c1-200
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
cat $OUT/all.log
