# H200 call: the seed workload (8 x 250K, 27B W4A16) as two data-parallel replicas on one GPU, each capped at 23.5 GiB
# (a 24 GiB card less its CUDA context). Carry .tc/tcb.txz from a previous call if there is one.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p ~/.triton && [ -f .tc/tcb.txz ] && tar -C ~/.triton -xJf .tc/tcb.txz
L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $OUT/gpu.txt
timeout 120 python3 -m pytest tests/test_tier_engine.py -m gpu -q -rfEs -p no:cacheprovider -k gpu_memory_gb > $OUT/cap-test.log 2>&1
echo "cap test rc $?" >> $L; grep -E "^E |^FAILED|passed|failed" $OUT/cap-test.log | head -20 | cut -c1-400 >> $L
(while sleep 5; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done) > $OUT/smi-apps.txt 2>&1 &
timeout 400 python3 -m sketchkv bench agents --model random:qwen3.5-27b-w4a16 --configs sparse --fill random \
  --sparse-host-format int4 --agents 4 --contexts 250K --data-parallel 2 --gpu-memory-gb 23.5 --gpu-memory-utilization 0.98 --max-num-batched-tokens 2048 --decode-tokens 32 \
  --out-dir $OUT --name dp2-24gib > $OUT/dp2.txt 2>&1; echo "dp2 x 24 GiB rc $?" >> $L
kill %1; sort -t, -k2 -n $OUT/smi-apps.txt | tail -4 >> $L
rm -f $OUT/*.png
grep -hE "tok/s|GB|Error|error|refused" $OUT/dp2.txt | tail -20 | cut -c1-300 >> $L
python3 - >> $L <<'PY2'
import json, os
d = json.load(open(os.environ["OUT"] + "/dp2-24gib.json"))
for r in d.get("dp_rows", []):
    print("combined tok/s %.1f" % r["decode"]["tok_s"] if isinstance(r.get("decode"), dict) and "tok_s" in r["decode"] else r.get("status"))
    for x in r.get("replica_rows", []):
        m = x.get("memory", {})
        print("  replica: tok/s %.1f" % x["decode"]["tok_s"], "GPU GB/agent %.3f" % (m.get("gpu_bytes_per_agent", 0) / 1e9),
              "host GB/agent %.2f" % (m.get("host_bytes_per_agent", 0) / 1e9), "hit", x.get("tier", {}).get("hit_rate"))
PY2
cat $L
