# H200 run 99: W4A16 in the engine (issue 39): GPU tests, then bench agents 8 x 250K W4A16 vs bf16 in one run,
# then 4 x 250K W4A16 under a 24 GB cap (set_per_process_memory_fraction), each stage under a time guard.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
START=$(date +%s); left() { echo $(( ${BUDGET:-550} - ($(date +%s) - START) )); }
L=$OUT/all.log
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > $OUT/gpu.txt
timeout 150 python3 -m pytest tests/test_ops_w4a16.py tests/test_w4a16_checkpoints.py -m gpu -q -rfEs -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc $?" >> $L; tail -4 $OUT/tests.log >> $L
B="-m sketchkv bench agents --out-dir $OUT --breakdown --configs sparse --fill random"
timeout $(( $(left) / 2 )) python3 $B --model random:qwen3.5-27b-w4a16 --agents 8 --contexts 250K --name a8-w4a16 > /tmp/w4.txt 2>&1; echo "a8 w4a16 rc $?" >> $L
timeout $(( $(left) * 2 / 3 )) python3 $B --model random:qwen3.5-27b --agents 8 --contexts 250K --name a8-bf16 > /tmp/bf.txt 2>&1; echo "a8 bf16 rc $?" >> $L
# the seed's card: 24 GB (of 139.8 GiB reported) for everything this process allocates; engine sized to it too
timeout $(( $(left) - 5 )) python3 -c "import sys, torch; torch.cuda.set_per_process_memory_fraction(24e9 / torch.cuda.mem_get_info()[1]); from sketchkv.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench agents --out-dir $OUT --configs sparse --fill random --model random:qwen3.5-27b-w4a16 --agents 4 --contexts 250K \
  --gpu-memory-utilization 0.16 --name a4-w4a16-24gb > /tmp/cap.txt 2>&1; echo "a4 24GB rc $?" >> $L
rm -f $OUT/*.png; cat /tmp/w4.txt /tmp/bf.txt /tmp/cap.txt > $OUT/log.txt
grep -hE "decode .* tok/s|agents x|Error|error" $OUT/log.txt | head -30 >> $L
for f in $OUT/*.md; do grep -h "^| sketchkv" $f | cut -d'|' -f2-14; grep -h -A6 "^| config | agents x context | graph step ms" $f; done >> $L 2>/dev/null
cat $L
