# run 135 (planned in sessions 43-45), on an H200 (kind="nvidia-h200"; an H100 serves: comparisons within the run).
# Session 45 (no machine was lent) narrowed it to issue 41's bf16 step, one call's worth (W4A16's first build costs
# ~175 s on a fresh machine). `bench step --profile` now splits each attention layer's critical section
# (breakdown.attention_layers); on H100 run 134's bf16 profile, per step: lead 3.44 ms (the first read group's
# selection, PCIe idle), PCIe busy 6.93, PCIe idle between the groups' reads 1.18, tail 0.77 (12.3 of 35.0 ms).
# (1) GPU tests: the residual-key base inside the decode kernel's scores (kernel at 27B sizes; the engine's
# log-probabilities with / without it); read groups 1 / 3 / 3 + attend stream / 3 + attend + compose on the main
# stream: same tokens and hits. (2) bf16 8 x 250K: default; then "all" = 4 read groups (a shorter lead: group 1's
# selection is a quarter of the batch), attend stream (host_tier.ATTEND_STREAM), key base in attention
# (tiered_attention.KEY_BASE_IN_ATTENTION), compose on the main stream (host_tier.COMPOSE_ON_READ_STREAM False);
# "all" with the compose on the read stream; "all" profiled; 2 groups with the rest; "all" + the one-pass combine.
# run(command="END=540 bash benchmarks/next/run135.sh", carry=[".whl", ".triton-cache"], timeout_s=580, kind="nvidia-h200")
# (.triton-cache/cache.tgz: the last run's triton-cache.tgz, if one came back; none yet). Each step's summary line
# carries "attention layers ms: lead / PCIe / idle / tail = sum" where profiled.
. benchmarks/next/preamble.sh
END=${END:-540}
timeout ${PYT_S:-100} python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short tests/test_ops_attention.py \
  tests/test_tier_engine.py -k "key_base or read_groups_same_tokens" > $OUT/pytest.txt 2>&1
mark pytest $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12 --model random:qwen3.5-27b"
# SET ATTEND FOLD COMPOSE_ON_READ ARGS...: the module flags, then the CLI
SET='import sys; import sketchkv.kv.host_tier as t; import sketchkv.layers.tiered_attention as a
t.ATTEND_STREAM = sys.argv[1] == "1"; a.KEY_BASE_IN_ATTENTION = sys.argv[2] == "1"
t.COMPOSE_ON_READ_STREAM = sys.argv[3] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[4:]))'
STEP_S=150 step bf16 python3 -m sketchkv $B
STEP_S=75 step bf16-all python3 -c "$SET" 1 1 0 $B --sparse-read-groups 4
STEP_S=75 step bf16-all-compose-read python3 -c "$SET" 1 1 1 $B --sparse-read-groups 4
STEP_S=90 step bf16-all-profile python3 -c "$SET" 1 1 0 $B --sparse-read-groups 4 --profile
STEP_S=75 step bf16-all-g2 python3 -c "$SET" 1 1 0 $B
STEP_S=75 step bf16-all-lse16 python3 -c "$SET" 1 1 0 $B --sparse-read-groups 4 --sparse-softmax-lse-stride 16
STEP_S=75 step bf16-2 python3 -m sketchkv $B
grep -h -E "PASSED|FAILED|ERROR" $OUT/pytest*.txt 2>/dev/null | sed 's/ *\[.*%\]//' | cut -c1-150; grep -h -E "^E " $OUT/pytest*.txt | head -5
finish
# next, on the same warm machine: the default profiled (its attention layers' split, against "all"), W4A16 default vs
# "all" (x2), --sparse-miss-read rows, tests/test_ops_w4a16.py -k "gemv_27b or spanning or graph_replay", the
# sampled-parity and pinned-gather tests, and the MTP-7 verification step:
# STEP_S=150 step w4a16-mtp python3 -m sketchkv $B --model random:qwen3.5-27b-w4a16+mtp --num-speculative-tokens 7 \
#   --sparse-verify-selection shared --reference-accepted-length 4.06
