# run 136 (planned in session 45): issue 39's W4A16 step with what run 135 decides, then the MTP-7 verification step
# and W4A16 prefill in larger chunks. On the machine run 135 left warm if there is one (kind="nvidia-h200").
# Before it: set ALL below to the flags run 135 found best (ATTEND FOLD COMPOSE_ON_READ and --sparse-read-groups);
# if run 135 made them the defaults, ALL is the default and the "all" steps can go.
# (1) W4A16 8 x 250K: default vs "all" (the first W4A16 build on a fresh machine takes ~175 s: the default goes first),
# "all" profiled (its attention-layer split and graph replay against bf16's in run 135); (2) the W4A16 MTP-7
# verification step at the seed's accepted length (issue 39's "with MTP"); (3) time left: cold 244K prefill, W4A16 in
# 16K-token chunks against bf16 in the default 8K (prompt chunks of >= 512 rows dequantise every int4 weight once per
# chunk: ~19 ms of a ~820 ms chunk on an H100, H100 run 118's 1.8% gap; twice the chunk halves it).
# run(command="END=560 bash benchmarks/next/run136.sh", carry=[".whl", ".triton-cache"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-560}
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12"
W=random:qwen3.5-27b-w4a16
SET='import sys; import sketchkv.kv.host_tier as t; import sketchkv.layers.tiered_attention as a
t.ATTEND_STREAM = sys.argv[1] == "1"; a.KEY_BASE_IN_ATTENTION = sys.argv[2] == "1"
t.COMPOSE_ON_READ_STREAM = sys.argv[3] == "1"
from sketchkv.cli import main; sys.exit(main(sys.argv[4:]))'
ALL="1 1 0"; G="--sparse-read-groups 4"
STEP_S=260 step w4a16 python3 -m sketchkv $B --model $W
STEP_S=80 step w4a16-all python3 -c "$SET" $ALL $B --model $W $G
STEP_S=90 step w4a16-all-profile python3 -c "$SET" $ALL $B --model $W $G --profile
STEP_S=150 step w4a16-mtp python3 -c "$SET" $ALL $B --model $W+mtp --num-speculative-tokens 7 \
  --sparse-verify-selection shared --reference-accepted-length 4.06
P="bench agents --configs sparse --agents 1 --contexts 244K --fill real --decode-tokens 8"
STEP_S=120 step prefill-w4a16-16k python3 -m sketchkv $P --model $W --max-num-batched-tokens 16384
STEP_S=120 step prefill-bf16 python3 -m sketchkv $P --model random:qwen3.5-27b
finish
