# H200 run: the seed's workload (8 agents x 250K, 27B W4A16) on two 24 GiB "cards": two data-parallel replicas on
# the one H200, each engine capped at 24 GiB (--gpu-memory-gb: torch.cuda.set_per_process_memory_fraction, and the
# engine sizes its caches against the cap). Memory is the point (GPU and host GB per agent, nothing refused); the
# combined tok/s is two engines sharing one GPU's compute, not two cards'. Int4 host rows, as the seed (4.4 GB/agent).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
mkdir -p ~/.triton && [ -f .tc/tcb.txz ] && tar -C ~/.triton -xJf .tc/tcb.txz
L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $OUT/gpu.txt
(while sleep 5; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done) > $OUT/smi-apps.txt 2>&1 &
timeout 540 python3 -m sketchkv bench agents --model random:qwen3.5-27b-w4a16 --configs sparse --fill random \
  --sparse-host-format int4 --agents 4 --contexts 250K --data-parallel 2 --gpu-memory-gb 24 --decode-tokens 32 \
  --out-dir $OUT --name dp2-24gib > $OUT/dp2.txt 2>&1; echo "dp2 x 24 GiB rc $?" >> $L
kill %1; sort -t, -k2 -n $OUT/smi-apps.txt | tail -4 >> $L
rm -f $OUT/*.png
grep -hE "tok/s|GB|Error|error|refused" $OUT/dp2.txt | tail -20 | cut -c1-300 >> $L
cat $L
