# H100 run 117: read groups with the miss gather's grid capped (programs looping over their tiles) against one group,
# 8 x 250K W4A16 step; then the cold prefill of a 244K-token prompt with W4A16 and with bf16 weights (issue 39).
# run(command="bash benchmarks/next/run117.sh", carry=[".whl"], timeout_s=595)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16"
timeout $(left 190) python3 $B --sparse-read-groups 1 --out-dir $OUT/r/g1 > $OUT/g1.txt 2>&1; mark g1 $?
timeout $(left 250) python3 $B --sparse-read-groups 4 --out-dir $OUT/r/g4-sm2 > $OUT/g4-sm2.txt 2>&1; mark g4-sm2 $?
timeout $(left 305) python3 $B --sparse-read-groups 2 --out-dir $OUT/r/g2-sm2 > $OUT/g2-sm2.txt 2>&1; mark g2-sm2 $?
sed -i 's#multi_processor_count // 2#multi_processor_count // 4#' sketchkv/kv/host_tier.py; grep -c "count // 4" sketchkv/kv/host_tier.py >> $OUT/all.log
timeout $(left 360) python3 $B --sparse-read-groups 4 --out-dir $OUT/r/g4-sm4 > $OUT/g4-sm4.txt 2>&1; mark g4-sm4 $?
sed -i 's#multi_processor_count // 4#multi_processor_count // 2#' sketchkv/kv/host_tier.py
P="-m sketchkv bench agents --configs sparse --agents 1 --contexts 244K --fill real --decode-tokens 8"
timeout $(left 475) python3 $P --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r --name prefill-w4a16 > $OUT/prefill-w4a16.txt 2>&1; mark prefill-w4a16 $?
timeout $(left 588) python3 $P --model random:qwen3.5-27b --out-dir $OUT/r --name prefill-bf16 > $OUT/prefill-bf16.txt 2>&1; mark prefill-bf16 $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for m in g1 g4-sm2 g2-sm2 g4-sm4; do echo "== $m"; grep -E "step ms|host gather|sketch score" $OUT/$m.txt | cut -c1-120; done
for m in prefill-w4a16 prefill-bf16; do echo "== $m"; grep -iE "prefill" $OUT/$m.txt | tail -3 | cut -c1-300; done
cat $OUT/all.log
