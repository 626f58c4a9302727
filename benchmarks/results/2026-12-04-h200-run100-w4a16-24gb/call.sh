# H200 run 100: the W4A16 GPU tests (graph replay per M; the int4 model vs its dequantized bf16 twin), then the
# seed's per-card workload: 4 x 250K agents of the 27B W4A16 shape in 24 GiB (set_per_process_memory_fraction).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
L=$OUT/all.log
timeout 170 python3 -m pytest tests/test_ops_w4a16.py tests/test_w4a16_checkpoints.py -m gpu -q -rfEs -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc $?" >> $L; grep -E "Error|assert|^FAILED|passed|failed" $OUT/tests.log | tail -12 >> $L
timeout 200 python3 -c "import sys, torch; torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.mem_get_info()[1]); from sketchkv.cli import main; rc = main(sys.argv[1:]); print('peak allocated GiB', torch.cuda.max_memory_allocated() / 2**30, 'reserved', torch.cuda.max_memory_reserved() / 2**30); sys.exit(rc)" \
  bench agents --out-dir $OUT --configs sparse --fill random --model random:qwen3.5-27b-w4a16 --agents 4 --contexts 250K \
  --gpu-memory-utilization 0.1717 --max-num-batched-tokens 2048 --name a4-w4a16-24gib > $OUT/cap.txt 2>&1; echo "a4 24GiB rc $?" >> $L
grep -hE "decode .* tok/s|agents x|skipped|peak allocated|Error|error" $OUT/cap.txt | head -12 >> $L
rm -f $OUT/*.png; cat $L
