# GPU call: the W4A16 GEMM with K-major words (16-byte cp.async instead of 4-byte): its gpu tests, the 27B-shape
# GEMM bench (no sweep; TUNED is still run 98's), then 8 x 250K W4A16 vs bf16 in one run (as run 102).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p ~/.triton && [ -f .tc/tcb.txz ] && tar -C ~/.triton -xJf .tc/tcb.txz
START=$(date +%s); left() { echo $(( ${BUDGET:-540} - ($(date +%s) - START) )); }
L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $OUT/gpu.txt
timeout 120 python3 -m pytest tests/test_ops_w4a16.py -m gpu -q -rfEs -p no:cacheprovider > $OUT/gemm-tests.log 2>&1
echo "gemm gpu tests rc $? at $(( $(date +%s) - START )) s" >> $L; grep -E "^E |^FAILED|passed|failed" $OUT/gemm-tests.log | head -12 | cut -c1-300 >> $L
timeout 100 python3 benchmarks/bench_w4a16_gemm.py --rows 1 8 64 2048 --l2-bytes 1e9 --out $OUT/gemm > $OUT/gemm-bench.log 2>&1
echo "gemm bench rc $? at $(( $(date +%s) - START )) s" >> $L
B="-m sketchkv bench agents --out-dir $OUT --breakdown --configs sparse --fill random --sparse-host-format int4 --agents 8 --contexts 250K"
timeout 220 python3 $B --model random:qwen3.5-27b-w4a16 --name a8-w4a16 > $OUT/w4.txt 2>&1; echo "a8 w4a16 rc $? at $(( $(date +%s) - START )) s" >> $L
timeout $(( $(left) - 15 )) python3 $B --model random:qwen3.5-27b --name a8-bf16 > $OUT/bf.txt 2>&1; echo "a8 bf16 rc $? at $(( $(date +%s) - START )) s" >> $L
rm -f $OUT/*.png
grep -hE "decode .* tok/s|Error|error" $OUT/w4.txt $OUT/bf.txt | head -8 | cut -c1-300 >> $L
python3 - >> $L <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/a8-*.json")):
    r = json.load(open(f))["rows"][0]
    bd = r.get("breakdown", {})
    print(os.path.basename(f), "tok/s %.1f" % r["decode"]["tok_s"], "step %.2f ms" % r["decode"]["step_ms_mean"],
          "floor %.2f ms (%.0f%%)" % (r["floor"]["ms"], 100 * r["floor"]["fraction"]), "hit rate %.3f" % r["tier"]["hit_rate"],
          "kernels/step", bd.get("kernels_per_step"), "gemm ms", round(bd.get("ms", {}).get("gemm (weights)", 0), 2))
PY
tar -C ~/.triton -cJf $OUT/tcb.txz cache 2>/dev/null
tail -28 $OUT/gemm-bench.log | cut -c1-220; cat $L
