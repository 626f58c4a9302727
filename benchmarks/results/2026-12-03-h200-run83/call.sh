python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py -k "dp4a or test_gpu_sketch_score_250k" > $OUT/tests.log 2>&1; echo "pytest rc $?" >> $OUT/tests.log
timeout 120 python3 benchmarks/bench_sketch_score.py --quick --out $OUT/sketch-score.json > $OUT/bench.log 2>&1; echo "bench rc $?" >> $OUT/bench.log
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis"
timeout 50 ncu --clock-control none -k regex:_dp4a --launch-skip 2 --launch-count 1 $S python3 benchmarks/bench_sketch_score.py --profile > $OUT/ncu-dp4a.txt 2>&1; echo "ncu rc $?" >> $OUT/ncu-dp4a.txt
tail -3 $OUT/tests.log; grep -E "^sum|^softmax  dot bpp 2|of copy|\| sum|\| softmax" $OUT/bench.log; grep -E "Duration|DRAM Throughput|Issue Slots|Registers Per|Achieved Occ|rc " $OUT/ncu-dp4a.txt
