# H100/H200 run 116: 8 x 250K W4A16 decode step with the batch's reads in groups on a second stream
# (sparse_read_groups 1 / 2 / 4, and 4 with the read stream at high priority), then the GPU tests of the groups.
# run(command="bash benchmarks/next/run116.sh", carry=[".whl"], timeout_s=595)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16"
timeout $(left 200) python3 $B --sparse-read-groups 1 --out-dir $OUT/r/g1 > $OUT/g1.txt 2>&1; mark g1 $?
timeout $(left 275) python3 $B --sparse-read-groups 4 --out-dir $OUT/r/g4 > $OUT/g4.txt 2>&1; mark g4 $?
timeout $(left 350) python3 $B --sparse-read-groups 2 --out-dir $OUT/r/g2 > $OUT/g2.txt 2>&1; mark g2 $?
sed -i 's/self.read_stream = torch.cuda.Stream(device) if/self.read_stream = torch.cuda.Stream(device, priority=-1) if/' sketchkv/kv/host_tier.py
grep -c "priority=-1" sketchkv/kv/host_tier.py >> $OUT/all.log
timeout $(left 425) python3 $B --sparse-read-groups 4 --out-dir $OUT/r/g4hi > $OUT/g4hi.txt 2>&1; mark g4hi $?
sed -i 's/, priority=-1) if/) if/' sketchkv/kv/host_tier.py
timeout $(left 585) python3 -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_tier_engine.py -k "read_groups or admit_stream" > $OUT/tests.txt 2>&1; mark tests $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for m in g1 g2 g4 g4hi; do echo "== $m"; grep -E "step ms|floor ms|kernels / step|gaps ms|host gather|gemm|sketch score" $OUT/$m.txt | cut -c1-200; tail -2 $OUT/$m.txt | cut -c1-300; done
grep -E "passed|failed|FAILED|Error" $OUT/tests.txt | tail -5; cat $OUT/all.log
