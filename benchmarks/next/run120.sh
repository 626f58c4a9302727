# run 120 (ready, not run: session 35's device time went to failed machine starts): how the miss gather reads a host
# row (benchmarks/studies/host_row_reads.py: field loads vs whole-row copies vs copy + dequantise on the GPU, 1,088 vs
# 1,152-byte strides), then the 8 x 250K W4A16 step with --sparse-miss-read fields (default) and rows on the same
# machine (if rows wins on this host and loses nowhere: make it the default), then the never-run GPU tests of the
# pinned gather / row copy and of read groups.
# run(command="bash benchmarks/next/run120.sh", carry=[".whl"], timeout_s=595)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
timeout $(left 130) python3 benchmarks/studies/host_row_reads.py --gib 2 --out $OUT/r/rows.json > $OUT/rows.txt 2>&1; mark rows $?
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16"
timeout $(left 330) python3 $B --out-dir $OUT/r/fields > $OUT/fields.txt 2>&1; mark fields $?
timeout $(left 400) python3 $B --sparse-miss-read rows --out-dir $OUT/r/rows > $OUT/rowsstep.txt 2>&1; mark rowsstep $?
timeout $(left 585) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_host_tier.py tests/test_tier_engine.py \
  -k "gpu_gather_from_pinned or read_groups" > $OUT/pytest.txt 2>&1; mark pytest $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -14 $OUT/rows.txt; for m in fields rowsstep; do echo "== $m"; grep -E "step ms|host gather|other  " $OUT/$m.txt | cut -c1-120; done
tail -3 $OUT/pytest.txt; cat $OUT/all.log
