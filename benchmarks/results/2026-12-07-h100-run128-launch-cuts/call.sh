# run 128 (session 39), call 1: what decides session 38's defaults, for a short budget (device starts kept failing).
# 1. GPU tests of what session 38 built (select_top_k's composed rows, the mixed int4 + bf16 GDN in_proj in one
#    launch, prefill's dequantize in overlapped column slices, the restructured W4A16 kernel on the 27B shapes);
# 2. the 8 x 250K W4A16 step with both launch cuts on
#    (fuse.MIXED_ONE_LAUNCH, selection.COMPOSE_IN_TOPK), bf16 (issue 39's ratio), the cuts off. Then, on the same
#    warm machine, run127.sh (GEMM studies) and run127b.sh (their winners in the engine).
# run(command="END=585 bash benchmarks/next/run128.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-450}
timeout $(left 100) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py tests/test_ops_w4a16.py \
  -k "select_top_k or mixed or prefill_dequant or 27b_shapes_match" > $OUT/pytest.txt 2>&1; mark pytest $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
SET='import sys; import sketchkv.models.fuse as f, sketchkv.ops.selection as s; f.MIXED_ONE_LAUNCH = s.COMPOSE_IN_TOPK = sys.argv[1] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
step cuts-on python3 -c "$SET" 1 $B
step bf16 python3 -m sketchkv ${B/-w4a16/}
step cuts-off python3 -c "$SET" 0 $B
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -2 $OUT/pytest.txt; grep -E "FAILED|Error" $OUT/pytest.txt | head -5 | cut -c1-200
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
cat $OUT/all.log
