python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SourceCounters --section SchedulerStats --section ComputeWorkloadAnalysis"
timeout 75 ncu --clock-control none -k regex:_sketch_score_dot_kernel --launch-skip 2 --launch-count 1 $S python3 benchmarks/bench_sketch_score.py --profile > $OUT/ncu-dot.txt 2>&1; echo "ncu dot rc $?" >> $OUT/ncu-dot.txt
timeout 75 ncu --clock-control none -k regex:^_sketch_score_kernel --launch-skip 2 --launch-count 1 $S python3 benchmarks/bench_sketch_score.py --profile > $OUT/ncu-fma.txt 2>&1; echo "ncu fma rc $?" >> $OUT/ncu-fma.txt
timeout 150 python3 benchmarks/bench_sketch_score.py --quick --maxnreg 56 64 72 80 --out $OUT/sketch-score.json > $OUT/bench.log 2>&1; echo "bench rc $?" >> $OUT/bench.log
T=$OUT/tests.log
( for k in "chunk_prefill_selection and False" "chunk_prefill_selection and True" "admit_stream"; do
    echo "== $k" >> $T; timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k "$k" --durations=3 >> $T 2>&1; echo "rc $?" >> $T; done ) &
TP=$!
( timeout 150 python3 -m sketchkv eval recall --lengths 4096 16384 65536 131072 262144 --samples 10 --kinds lookup --seed 0 \
  --candidate 'int4-tier:sparse=true,sparse_host_tier=true,sparse_host_residual_keys=false' \
  --candidate 'k8v4-tier:sparse=true,sparse_host_tier=true,sparse_host_format=k8v4' \
  --candidate 'bf16-tier:sparse=true,sparse_host_tier=true,sparse_host_format=bf16' \
  --out-dir $OUT --name recall-formats --quiet > $OUT/recall.log 2>&1; echo "recall rc $?" >> $OUT/recall.log
  timeout 110 python3 -m sketchkv eval kld --lengths 65536 --samples 8 --continuation 256 --seed 0 --max-num-seqs 8 \
  --candidate 'int4r-tier:sparse=true,sparse_host_tier=true' --candidate 'bf16-tier:sparse=true,sparse_host_tier=true,sparse_host_format=bf16' \
  --out-dir $OUT --name kld-64k-8docs > $OUT/kld.log 2>&1; echo "kld rc $?" >> $OUT/kld.log ) &
TQ=$!
wait $TP $TQ
rm -f $OUT/*.png
grep -E "^== |passed|failed|^rc " $T; tail -2 $OUT/recall.log $OUT/kld.log; tail -12 $OUT/bench.log
cd /tmp/tc && find . -name "*.cubin" -o -name "*.json" -o -name "*.so" | tar cJf $OUT/tcb.txz -T -
