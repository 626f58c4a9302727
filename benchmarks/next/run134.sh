# run 134 (session 43), on an H200 (kind="nvidia-h200"): the one-pass softmax combine (issue 41) against the stored one
# in one run: (1) its GPU tests at 8 x 250K (sampled normalizers, counted first radix round, same picks) and in a
# tiny engine (CUDA graphs = eager); (2) one
# 27B layer's scoring at 8 x 250K, `dot` (stored head scores: 4 kernels) vs `dot1p` (every 16th position for the
# normalizers, then one scoring pass: 3 kernels), per kernel; (3) the bf16 8 x 250K step default vs
# `--sparse-softmax-lse-stride 16` (bf16: no 175 s W4A16 build), then the latter profiled (kernel count); (4) time
# left: the W4A16 GPU tests whose reference session 42 fixed (run 132's tolerance tail), never run on a GPU yet.
# run(command="END=560 bash benchmarks/next/run134.sh", carry=[".whl"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-560}
timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_gpu_sparse_ops.py \
  tests/test_gpu_parity.py -k "sampled or first_round or dot_250k" > $OUT/pytest-sparse.txt 2>&1; mark pytest-sparse $?
timeout 150 python3 benchmarks/bench_sketch_score.py --quick --kernels dot dot1p --out $OUT/r/sketch-score.json \
  > $OUT/sketch-score.txt 2>&1; mark sketch-score $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12 --model random:qwen3.5-27b"
STEP_S=150 step bf16 python3 -m sketchkv $B
STEP_S=110 step bf16-lse16 python3 -m sketchkv $B --sparse-softmax-lse-stride 16
STEP_S=110 step bf16-lse16-profile python3 -m sketchkv $B --sparse-softmax-lse-stride 16 --profile
L=$(left $END); [ $L -gt 40 ] && { timeout $((L - 10)) python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
  tests/test_ops_w4a16.py -k "27b_shapes_match_reference or spanning or graph or mixed" > $OUT/pytest-w4a16.txt 2>&1
  mark pytest-w4a16 $?; }
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -1 $OUT/pytest-*.txt; grep -h -E "^E |FAILED" $OUT/pytest-*.txt | head -8 | cut -c1-220
grep -E "softmax|per kernel" $OUT/sketch-score.txt | cut -c1-200
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E '\] step |kernels|tok/s at|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; done
cat $OUT/all.log
