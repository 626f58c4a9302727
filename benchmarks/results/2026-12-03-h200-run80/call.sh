python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc && tar xJf .tc/tcb.txz -C /tmp/tc
T=$OUT/tests.log
( timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k "chunk_prefill_selection or admit_stream" --durations=0 > $T 2>&1;
  timeout 250 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k "no_host_sync" --durations=0 >> $T 2>&1 ) &
TP=$!
timeout 330 python3 -m sketchkv eval kld --lengths 65536 131072 262144 --samples 3 --continuation 256 --seed 0 --max-num-seqs 8 \
  --candidate 'sparse:sparse=true' --candidate 'exact:sparse=true,sparse_selector=exact' \
  --candidate 'exact-k8192:sparse=true,sparse_selector=exact,sparse_top_k=8192' \
  --candidate 'int4r-tier:sparse=true,sparse_host_tier=true' --out-dir $OUT --name kld-oracle > $OUT/kld.log 2>&1
echo "kld rc $?" >> $OUT/kld.log
timeout 200 python3 -m sketchkv eval recall --lengths 4096 16384 65536 131072 262144 --samples 10 --kinds lookup --seed 0 \
  --candidate 'sparse:sparse=true' --candidate 'sparse-tier:sparse=true,sparse_host_tier=true' \
  --out-dir $OUT --name recall --quiet > $OUT/recall.log 2>&1
echo "recall rc $?" >> $OUT/recall.log
wait $TP
rm -f $OUT/*.png
tail -5 $T; grep -E "passed|failed|error" $T | tail; tail -3 $OUT/kld.log $OUT/recall.log
cd /tmp/tc && find . -name "*.cubin" -o -name "*.json" -o -name "*.so" | tar cJf $OUT/tcb.txz -T -
