# run 120: how the miss gather reads a host row (benchmarks/studies/host_row_reads.py: field loads vs whole-row copies
# vs copy + dequantise on the GPU, 1,088 vs 1,152-byte strides). Device time was short (failed starts): the study only.
# Next: the 8 x 250K W4A16 step with --sparse-miss-read fields vs rows in one call.
# run(command="bash benchmarks/next/run120.sh", carry=[".whl"], timeout_s=200)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 170 python3 benchmarks/studies/host_row_reads.py --gib 2 --out $OUT/rows.json > $OUT/rows.txt 2>&1; echo "rc $?" >> $OUT/rows.txt
tail -16 $OUT/rows.txt
