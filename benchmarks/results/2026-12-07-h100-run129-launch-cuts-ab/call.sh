# run 129 (session 40): run 128's cuts-on step died at 110 s while building the engine (the first W4A16 engine on a
# fresh machine: its Triton compiles, or a stall? run 126 gave its first W4A16 step 155 s). Here the cuts-off step runs
# first (compiles the shared kernels),
# then both cuts, each on its own, 200 s each, with a Python traceback dumped at 150 s if one is still running;
# bf16 again for the ratio on this machine; then the 27B-shape GEMV tests run 128's 100 s did not reach.
# run(command="END=585 bash benchmarks/next/run129.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 12"
SET='import sys, faulthandler; faulthandler.dump_traceback_later(150)
import sketchkv.models.fuse as f, sketchkv.ops.selection as s
f.MIXED_ONE_LAUNCH, s.COMPOSE_IN_TOPK = sys.argv[1] == "1", sys.argv[2] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[3:]))'
T=200 step cuts-off python3 -c "$SET" 0 0 $B
T=200 step cuts-on python3 -c "$SET" 1 1 $B
T=200 step compose python3 -c "$SET" 0 1 $B
T=200 step mixed python3 -c "$SET" 1 0 $B
step bf16 python3 -m sketchkv ${B/-w4a16/}
timeout $(left $END) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_w4a16.py \
  -k "gemv_27b_shapes_match" > $OUT/pytest.txt 2>&1; mark pytest $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -2 $OUT/pytest.txt; grep -E "FAILED|Error" $OUT/pytest.txt | head -5 | cut -c1-200
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
cat $OUT/all.log

# call 2, the same warm machine (repeat/): COMPOSE_IN_TOPK on, then off, 24 steps each
# . benchmarks/next/preamble.sh; END=200; B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 24"
# SET='import sys; import sketchkv.ops.selection as s; s.COMPOSE_IN_TOPK = sys.argv[1] == "1"
# from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'; step compose2 python3 -c "$SET" 1 $B; step off2 python3 -c "$SET" 0 $B
