# run 120: how the miss gather reads a row (benchmarks/studies/host_row_reads.py: field loads vs whole-row copies vs
# copy + dequantise on the GPU, 1,088 vs 1,152-byte strides), then the never-run GPU test of the capped gather grid.
# run(command="bash benchmarks/next/run120.sh", carry=[".whl"], timeout_s=400)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
timeout $(left 200) python3 benchmarks/studies/host_row_reads.py --out $OUT/rows.json > $OUT/rows.txt 2>&1; mark rows $?
timeout $(left 390) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_host_tier.py -k gpu_gather_from_pinned > $OUT/pytest.txt 2>&1; mark pytest $?
cat $OUT/rows.txt | tail -16; tail -3 $OUT/pytest.txt; cat $OUT/all.log
