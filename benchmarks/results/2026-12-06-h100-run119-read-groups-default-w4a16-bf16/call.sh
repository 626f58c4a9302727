# H100 run 119 (2026-12-06, session 35): sparse_read_groups = 2 is the default now (run 118: same tokens and hits as one group on the GPU); the
# 8 x 250K step for W4A16 and bf16 on one machine (the ratio issue 39 asks, both with 2 groups), W4A16 with one group,
# then W4A16 + MTP-7 at 8 x 250K (verification steps; projected at the reference model's accepted length).
# run(command="bash benchmarks/next/run119.sh", carry=[".whl"], timeout_s=595)  (then at benchmarks/next/)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K"
timeout $(left 200) python3 $B --model random:qwen3.5-27b-w4a16 --out-dir $OUT/r/w4a16-g2 > $OUT/w4a16-g2.txt 2>&1; mark w4a16-g2 $?
timeout $(left 300) python3 $B --model random:qwen3.5-27b --out-dir $OUT/r/bf16-g2 > $OUT/bf16-g2.txt 2>&1; mark bf16-g2 $?
timeout $(left 365) python3 $B --model random:qwen3.5-27b-w4a16 --sparse-read-groups 1 --out-dir $OUT/r/w4a16-g1 > $OUT/w4a16-g1.txt 2>&1; mark w4a16-g1 $?
timeout $(left 585) python3 -m sketchkv bench agents --model random:qwen3.5-27b-w4a16+mtp --configs sparse --agents 8 --contexts 250K \
  --fill random --num-speculative-tokens 7 --reference-accepted-length 4.06 --sparse-verify-selection shared --sparse-host-format int4 \
  --out-dir $OUT/r --name mtp7-w4a16 > $OUT/mtp.txt 2>&1; mark mtp $?
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for m in w4a16-g2 bf16-g2 w4a16-g1; do echo "== $m"; grep -E "step ms|floor ms|gemm|host gather|sketch score|top-k" $OUT/$m.txt | cut -c1-120; done
grep -E "decode|projected|verif" $OUT/mtp.txt | tail -4 | cut -c1-300; cat $OUT/all.log
