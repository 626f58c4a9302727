# run 135 (planned in sessions 43-44), on an H200 (kind="nvidia-h200"; an H100 serves: comparisons within the run).
# (1) GPU tests first: read groups give the same tokens and hits as one group with session 44's attend stream (each
# group's hits, key base and attention on a third stream, so the next group's PCIe reads no longer queue behind
# them: ~56 us per attention layer, H100 run 134's profile); the one-pass combine in CUDA graphs; the pinned gather.
# (2) the W4A16 8 x 250K step (the first W4A16 build on a fresh machine takes ~175 s) without the attend stream (the
# default until this run: the read stream does that work), then with it (host_tier.ATTEND_STREAM = True), then bf16
# (issue 39's ratio in one run), then the attend stream with the one-pass combine (with the attend stream the next
# group's selection, not the first group's attention, is what the read stream waits for: a shorter scoring may now
# pay); (3) the W4A16 step profiled (kernels per step, gaps); (4) time left: whole-row miss reads, the W4A16 GEMV /
# graph tests. If the test passes and the step gains, make ATTEND_STREAM True and profile it.
# run(command="END=560 bash benchmarks/next/run135.sh", carry=[".whl", ".triton-cache"], timeout_s=595, kind="nvidia-h200")
# (.triton-cache/cache.tgz: the last run's triton-cache.tgz, if one came back; none yet)
. benchmarks/next/preamble.sh
END=${END:-560}
timeout 100 python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_tier_engine.py tests/test_gpu_parity.py \
  tests/test_host_tier.py -k "read_groups_same_tokens or sampled or gather_from_pinned" > $OUT/pytest.txt 2>&1
mark pytest $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12"
W=random:qwen3.5-27b-w4a16
SET='import sys; import sketchkv.kv.host_tier as t; t.ATTEND_STREAM = sys.argv[1] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
STEP_S=260 step w4a16 python3 -m sketchkv $B --model $W
STEP_S=100 step w4a16-attend python3 -c "$SET" 1 $B --model $W
STEP_S=150 step bf16 python3 -m sketchkv $B --model random:qwen3.5-27b
STEP_S=100 step w4a16-2 python3 -m sketchkv $B --model $W
STEP_S=100 step w4a16-attend-2 python3 -c "$SET" 1 $B --model $W
STEP_S=100 step w4a16-attend-lse16 python3 -c "$SET" 1 $B --model $W --sparse-softmax-lse-stride 16
STEP_S=100 step w4a16-profile python3 -m sketchkv $B --model $W --profile
STEP_S=100 step w4a16-rows python3 -m sketchkv $B --model $W --sparse-miss-read rows
L=$(left $END); [ $L -gt 60 ] && { timeout $((L - 10)) python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short \
  tests/test_ops_w4a16.py -k "gemv_27b or spanning or graph_replay" > $OUT/pytest-w4a16.txt 2>&1; mark pytest-w4a16 $?; }
grep -h -E "PASSED|FAILED|ERROR" $OUT/pytest*.txt 2>/dev/null | sed 's/ *\[.*%\]//' | cut -c1-150; grep -h -E "^E " $OUT/pytest*.txt | head -5
finish
# next, on the same warm machine (run 136): the MTP-7 verification step, and the attend-stream A/B repeated:
# STEP_S=150 step w4a16-mtp python3 -m sketchkv $B --model $W+mtp --num-speculative-tokens 7 \
#   --sparse-verify-selection shared --reference-accepted-length 4.06
