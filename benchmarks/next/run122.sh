# run 122 (short: the session's last device minutes): the top-k in 7 launches (each radix round's pick folded into
# the next kernel; run 121's one-launch barrier version was slower and is gone): correctness at real sizes and
# benchmarks/studies/topk_launches.py, then the GPU test of read groups (fp32 exact tokens through the whole model),
# which run 121 cut short.
# run(command="bash benchmarks/next/run122.sh", carry=[".whl"], timeout_s=150)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
timeout $(left 35) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py -k topk > $OUT/pytest-topk.txt 2>&1; mark topk-test $?
timeout $(left 70) python3 benchmarks/studies/topk_launches.py --out $OUT/r/topk.json > $OUT/topk.txt 2>&1; mark topk-study $?
timeout $(left 145) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k read_groups > $OUT/pytest.txt 2>&1; mark pytest $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/pytest-topk.txt; tail -8 $OUT/topk.txt; tail -3 $OUT/pytest.txt; cat $OUT/all.log
