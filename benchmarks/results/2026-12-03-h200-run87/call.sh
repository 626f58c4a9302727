python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
L=$OUT/all.log
timeout 150 python3 scratch/variant_bench.py scratch/variants/v4_rows.py --kernels dp4a --out $OUT/score-v4_rows.json > /tmp/score-v4.log 2>&1; echo "v4 rc $?" >> $L
timeout 150 python3 scratch/variant_bench.py scratch/variants/v3_scs.py --quick --kernels dp4a fma --out $OUT/score-v3_scs.json > /tmp/score-v3.log 2>&1; echo "v3 rc $?" >> $L
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis"
sed -i 's/sm_scale: float = 1.0, bpp: int = 4,/sm_scale: float = 1.0, bpp: int = 2,/' scratch/variants/v4_rows.py
grep -n "def sketch_score_dp4a" -A2 scratch/variants/v4_rows.py >> $L
timeout 60 ncu --clock-control none -k regex:_dp4a --launch-skip 2 --launch-count 1 $S python3 scratch/variant_bench.py scratch/variants/v4_rows.py --profile > $OUT/ncu-v4.txt 2>&1; echo "ncu rc $?" >> $L
cat /tmp/score-v4.log /tmp/score-v3.log >> $L
grep -E "rc |^\| (sum|max)|^(sum|max) " $L
grep -E "Duration|DRAM Throughput|Issue Slots|Registers Per|Achieved Occ|Eligible Warps|rc " $OUT/ncu-v4.txt | head -30
