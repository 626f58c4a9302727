# run 122 (ready, not run: session 36's device time went to failed machine starts): the top-k in 7 launches (each
# radix round's pick folded into the next kernel; run 121's one-launch barrier version was slower and is gone):
# correctness at real sizes (never run on a GPU yet) and benchmarks/studies/topk_launches.py; the GPU test of read
# groups (fp32 exact tokens through the whole model; run 121 cut it short, and the grouped step now writes into
# whole-batch buffers); then 8 x 250K W4A16 and bf16 steps in one run (issue 39's ratio; on an H200 the first one
# in one run; compare the top-k kind with run 121's 2.23 ms and run 119's 1.46 ms).
# run(command="bash benchmarks/next/run122.sh", carry=[".whl"], timeout_s=595)
# (.whl: ../shared/tools/device-wheels.sh fla-core==0.6.0 pytest-timeout, in the repo root; a fresh checkout lacks it)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
timeout $(left 45) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py -k topk > $OUT/pytest-topk.txt 2>&1; mark topk-test $?
timeout $(left 85) python3 benchmarks/studies/topk_launches.py --out $OUT/r/topk.json > $OUT/topk.txt 2>&1; mark topk-study $?
timeout $(left 230) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_tier_engine.py -k read_groups > $OUT/pytest.txt 2>&1; mark pytest $?
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K"
timeout $(left 420) python3 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16 > $OUT/w4a16.txt 2>&1; mark w4a16 $?
timeout $(left 588) python3 $B --model random:qwen3.5-27b --out-dir $OUT/r/bf16 > $OUT/bf16.txt 2>&1; mark bf16 $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -3 $OUT/pytest-topk.txt; tail -8 $OUT/topk.txt; tail -3 $OUT/pytest.txt
for m in w4a16 bf16; do echo "== $m"; tail -15 $OUT/$m.txt | cut -c1-150; done
cat $OUT/all.log
