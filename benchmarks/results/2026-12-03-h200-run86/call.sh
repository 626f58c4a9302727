python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
L=$OUT/all.log
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py -k "dp4a or sketch_score" > $OUT/tests.log 2>&1; echo "pytest rc $?" >> $L; tail -3 $OUT/tests.log >> $L
for v in v3_scs v4_rows; do
  timeout 120 python3 scratch/variant_bench.py scratch/variants/$v.py --kernels dp4a --out $OUT/score-$v.json > /tmp/score-$v.log 2>&1; echo "$v rc $?" >> $L
  grep -E "^\| (sum|max)|^(sum|max) " /tmp/score-$v.log >> $L
done
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis --section SourceCounters"
timeout 60 ncu --clock-control none -k regex:_dp4a --launch-skip 2 --launch-count 1 $S python3 scratch/variant_bench.py scratch/variants/v3_scs.py --profile > $OUT/ncu-v3.txt 2>&1; echo "ncu rc $?" >> $L
cat /tmp/score-*.log >> $L
grep -E "rc |passed|failed|^\| (sum|max)" $L
grep -E "Duration|DRAM Throughput|Issue Slots|Registers Per|Achieved Occ|Stall|rc " $OUT/ncu-v3.txt | head -30
