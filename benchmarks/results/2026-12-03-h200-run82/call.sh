python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
timeout 470 python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_tier_engine.py -k "chunk_prefill_selection or admit_stream" --durations=0 > $OUT/tests.log 2>&1
echo "pytest rc $?" >> $OUT/tests.log
grep -E "PASSED|FAILED|ERROR|passed|failed|rc " $OUT/tests.log
cd /tmp/tc && find . -name "*.cubin" -o -name "*.json" -o -name "*.so" | tar cJf $OUT/tcb.txz -T -
