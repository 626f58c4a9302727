# run 135 (planned in sessions 43-44), on an H200 (kind="nvidia-h200"; an H100 serves: comparisons within the run):
# issue 39's ratio and issue 41's W4A16 profile with session 44's read-stream priority (-1.3% on the bf16 step, H100
# run 134): (1) the W4A16 8 x 250K step (the first W4A16 build on a fresh machine takes ~175 s), then bf16 in the
# same run; (2) the W4A16 step profiled (kernels per step); (3) the same step with whole-row miss reads
# (`--sparse-miss-read rows`: never compared inside the step on an H200); (4) time left: the GPU tests run 134 did
# not reach (the one-pass combine in CUDA graphs, the pinned gather at 1 GiB, the W4A16 GEMV / graph tests), then
# the MTP-7 verification step. LSE=16 adds `--sparse-softmax-lse-stride 16` to every step (run 134: -0.5% on bf16,
# inside the noise; off by default).
# run(command="END=560 bash benchmarks/next/run135.sh", carry=[".whl"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-560}
X=""; [ "${LSE:-0}" != 0 ] && X="--sparse-softmax-lse-stride $LSE"
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12"
W=random:qwen3.5-27b-w4a16
STEP_S=260 step w4a16 python3 -m sketchkv $B --model $W $X
STEP_S=150 step bf16 python3 -m sketchkv $B --model random:qwen3.5-27b $X
STEP_S=110 step w4a16-profile python3 -m sketchkv $B --model $W $X --profile
STEP_S=110 step w4a16-rows python3 -m sketchkv $B --model $W $X --sparse-miss-read rows
L=$(left $END); [ $L -gt 60 ] && { timeout $((L - 40)) python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short \
  tests/test_gpu_parity.py tests/test_host_tier.py tests/test_ops_w4a16.py \
  -k "sampled or gather_from_pinned or gemv_27b or spanning or graph_replay" > $OUT/pytest.txt 2>&1; mark pytest $?; }
STEP_S=150 step w4a16-mtp python3 -m sketchkv $B --model $W+mtp --num-speculative-tokens 7 \
  --sparse-verify-selection shared --reference-accepted-length 4.06 $X
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
grep -E "PASSED|FAILED|ERROR" $OUT/pytest.txt 2>/dev/null | sed 's/ *\[.*%\]//' | cut -c1-150; grep -E "^E " $OUT/pytest.txt | head -5
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E '\] step |kernels|tok/s at|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; done
cat $OUT/all.log
