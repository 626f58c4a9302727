# H100 run 110: `sketchkv bench step --profile` at 8 x 250K, 27B bf16 then W4A16 (issue 41's per-step timeline).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K --out-dir $OUT"
timeout 200 python3 $B --model random:qwen3.5-27b > $OUT/bf.txt 2>&1; echo "bf16 rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
timeout $(( 400 - ($(date +%s) - START) )) python3 $B --model random:qwen3.5-27b-w4a16 > $OUT/w4.txt 2>&1; echo "w4a16 rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
tail -22 $OUT/bf.txt; tail -22 $OUT/w4.txt; cat $OUT/all.log; ls $OUT
