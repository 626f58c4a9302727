# run 135 (planned in sessions 43-45), on an H200 (kind="nvidia-h200"; an H100 serves: comparisons within the run).
# Session 45 narrowed it to issue 41's bf16 step (one call is what a session gets lately; W4A16's first build costs
# ~175 s on a fresh machine): (1) GPU tests: read groups give the same tokens and hits as one group with session
# 44's attend stream; session 45's residual-key base inside the decode kernel's scores (the kernel at 27B sizes
# against the base rewritten by apply_sketch_base; the engine's log-probabilities with and without it); (2) the
# bf16 8 x 250K step: default, attend stream (host_tier.ATTEND_STREAM), attend + key base in attention
# (tiered_attention.KEY_BASE_IN_ATTENTION), both with 2 / 4 / 8 read groups (H100 run 134's profile: PCIe idles
# ~210 us per attention layer while the first group is scored and picked; smaller groups start the reads sooner; 4
# groups lost to 2 in H200 run 117, before the read stream's priority removed an ~80 us wait per group), the 4-group
# step profiled.
# run(command="END=540 bash benchmarks/next/run135.sh", carry=[".whl", ".triton-cache"], timeout_s=580, kind="nvidia-h200")
# (.triton-cache/cache.tgz: the last run's triton-cache.tgz, if one came back; none yet)
. benchmarks/next/preamble.sh
END=${END:-540}
timeout ${PYT_S:-90} python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_ops_attention.py tests/test_tier_engine.py \
  -k "key_base or read_groups_same_tokens" > $OUT/pytest.txt 2>&1
mark pytest $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12 --model random:qwen3.5-27b"
SET='import sys; import sketchkv.kv.host_tier as t; import sketchkv.layers.tiered_attention as a
t.ATTEND_STREAM = sys.argv[1] == "1"; a.KEY_BASE_IN_ATTENTION = sys.argv[2] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[3:]))'
STEP_S=150 step bf16 python3 -m sketchkv $B
STEP_S=75 step bf16-attend-fold-g4 python3 -c "$SET" 1 1 $B --sparse-read-groups 4
STEP_S=75 step bf16-attend-fold python3 -c "$SET" 1 1 $B
STEP_S=90 step bf16-attend-fold-g4-profile python3 -c "$SET" 1 1 $B --sparse-read-groups 4 --profile
STEP_S=75 step bf16-attend python3 -c "$SET" 1 0 $B
STEP_S=75 step bf16-2 python3 -m sketchkv $B
STEP_S=75 step bf16-attend-fold-g8 python3 -c "$SET" 1 1 $B --sparse-read-groups 8
grep -h -E "PASSED|FAILED|ERROR" $OUT/pytest*.txt 2>/dev/null | sed 's/ *\[.*%\]//' | cut -c1-150; grep -h -E "^E " $OUT/pytest*.txt | head -5
finish
# next, on the same warm machine: W4A16 default vs attend / fold (x2), the W4A16 profile, --sparse-miss-read rows,
# tests/test_ops_w4a16.py -k "gemv_27b or spanning or graph_replay", the sampled-parity and pinned-gather tests, and
# the MTP-7 verification step:
# STEP_S=150 step w4a16-mtp python3 -m sketchkv $B --model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 \
#   --sparse-verify-selection shared --reference-accepted-length 4.06
