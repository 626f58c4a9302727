# run 135 (planned in session 43; after run 134), on an H200 (kind="nvidia-h200"): session 42's unrun plan (run 133) with
# the one-pass softmax combine: (1) the W4A16 8 x 250K step with exact normalizers and with LSE (default 16;
# LSE=0 if run 134 found the one-pass combine slower) in one run, the first after the 175 s first W4A16 build;
# (2) the LSE step profiled (kernels per step, the W4A16 figure issue 41 asks for); (3) the same step with whole-row
# miss reads (`--sparse-miss-read rows`: this H200 host read rows at 89% of its copy bandwidth and fields at 80% in
# isolation, run 131; never compared inside the step on an H200); (4) time left: the MTP-7 verification step with LSE.
# run(command="LSE=16 END=560 bash benchmarks/next/run135.sh", carry=[".whl"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-560}
LSE=${LSE:-16}
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12"
W=random:qwen3.5-27b-w4a16
X="--sparse-softmax-lse-stride $LSE"
STEP_S=260 step w4a16 python3 -m sketchkv $B --model $W
STEP_S=110 step w4a16-lse python3 -m sketchkv $B --model $W $X
STEP_S=110 step w4a16-lse-profile python3 -m sketchkv $B --model $W $X --profile
STEP_S=110 step w4a16-lse-rows python3 -m sketchkv $B --model $W $X --sparse-miss-read rows
STEP_S=150 step w4a16-lse-mtp python3 -m sketchkv $B --model $W+mtp --num-speculative-tokens 7 \
  --sparse-verify-selection shared --reference-accepted-length 4.06 $X
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E '\] step |kernels|tok/s at|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; done
cat $OUT/all.log
