python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
timeout 200 python3 benchmarks/bench_sparse_ops.py --out $OUT/sparse-ops.json > $OUT/sparse-ops.log 2>&1; echo "rc $?" >> $OUT/sparse-ops.log
tail -25 $OUT/sparse-ops.log
