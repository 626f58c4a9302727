# run 134 (planned in session 43, extended in session 44), on an H200 (kind="nvidia-h200"; an H100 serves: every
# comparison here is within the run). (1) GPU tests: the one-pass softmax combine (issue 41) at 8 x 250K (sampled
# normalizers, the counted first radix round, same picks) and in a tiny engine (CUDA graphs = eager), and the
# pinned-memory gather with the capped grid, whose programs now prefetch their next tile (session 44);
# (2) the miss gather capped at 66 programs as the host tier runs it (read groups), tile and prefetch swept, against
# the uncapped kernel, at the per-group pick counts of the 8 x 250K step (~8K rows) and 16K;
# (3) the bf16 8 x 250K step: session 44's defaults (capped gather prefetching; the read stream at priority -1, so
# a group's gather no longer waits ~80 us per layer behind the next group's queued scoring blocks, run 131's
# profile), both off (the old step), `--sparse-softmax-lse-stride 16`, the prefetch alone off;
# (4) one 27B layer's scoring, `dot` (stored head scores: 4 kernels) vs `dot1p` (one-pass: 3 kernels);
# (5) the lse16 step profiled; (6) time left: the W4A16 GPU tests whose reference session 42 fixed.
# run(command="END=560 bash benchmarks/next/run134.sh", carry=[".whl"], timeout_s=595, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-560}
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests/test_gpu_sparse_ops.py \
  tests/test_gpu_parity.py tests/test_host_tier.py -k "sampled or first_round or dot_250k or gather_from_pinned" \
  > $OUT/pytest-sparse.txt 2>&1; mark pytest-sparse $?
timeout 60 python3 benchmarks/studies/host_row_reads.py --gib 2 --picks 8192 16384 --cap 66 --out $OUT/r/rows.json \
  > $OUT/rows.txt 2>&1; mark rows $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12 --model random:qwen3.5-27b"
SET='import sys; import sketchkv.ops.host_gather as h, sketchkv.kv.host_tier as t
h.PREFETCH_CAPPED, t.READ_STREAM_PRIORITY = sys.argv[1] == "1", int(sys.argv[2])
from sketchkv.cli import main; sys.exit(main(sys.argv[3:]))'
STEP_S=150 step bf16 python3 -m sketchkv $B
STEP_S=110 step bf16-old python3 -c "$SET" 0 0 $B
STEP_S=110 step bf16-lse16 python3 -m sketchkv $B --sparse-softmax-lse-stride 16
STEP_S=110 step bf16-noprefetch python3 -c "$SET" 0 -1 $B
L=$(left $END); [ $L -gt 90 ] && { timeout 80 python3 benchmarks/bench_sketch_score.py --quick --kernels dot dot1p \
  --out $OUT/r/sketch-score.json > $OUT/sketch-score.txt 2>&1; mark sketch-score $?; }
STEP_S=110 step bf16-lse16-profile python3 -m sketchkv $B --sparse-softmax-lse-stride 16 --profile
L=$(left $END); [ $L -gt 40 ] && { timeout $((L - 10)) python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short \
  tests/test_ops_w4a16.py -k "27b_shapes_match_reference or spanning or graph or mixed" > $OUT/pytest-w4a16.txt 2>&1
  mark pytest-w4a16 $?; }
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -qn1 $OUT/pytest-*.txt; grep -h -E "^E |FAILED" $OUT/pytest-*.txt | head -8 | cut -c1-220
grep -E "H2D|N=" $OUT/rows.txt | grep -v 1152 | cut -c1-100
grep -E "softmax|per kernel" $OUT/sketch-score.txt 2>/dev/null | cut -c1-200
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E '\] step |kernels|tok/s at|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; done
cat $OUT/all.log

# The first call ran the above (551 s; its first step, "bf16", ran out of its 150 s compiling on the fresh machine).
# Calls 2 and 3, the same warm machine (r/ renamed in this folder: np = prefetch off, priority -1 = the new default;
# old = both off; prefetch = both on):
# . benchmarks/next/preamble.sh; END=380; B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --steps 12 --model random:qwen3.5-27b"
# SET='import sys; import sketchkv.ops.host_gather as h, sketchkv.kv.host_tier as t
# h.PREFETCH_CAPPED, t.READ_STREAM_PRIORITY = sys.argv[1] == "1", int(sys.argv[2])
# from sketchkv.cli import main; sys.exit(main(sys.argv[3:]))'
# STEP_S=100 step bf16 python3 -c "$SET" 1 -1 $B; STEP_S=80 step np python3 -c "$SET" 0 -1 $B
# STEP_S=80 step np-lse16 python3 -c "$SET" 0 -1 $B --sparse-softmax-lse-stride 16; STEP_S=80 step old python3 -c "$SET" 0 0 $B
# STEP_S=80 step bf16-2 python3 -c "$SET" 1 -1 $B; STEP_S=80 step np-2 python3 -c "$SET" 0 -1 $B          (271 s)
# (call 3, END=230) np-lse16-2, np-3, np-lse16-3 as above, then np with --profile                          (200 s)
