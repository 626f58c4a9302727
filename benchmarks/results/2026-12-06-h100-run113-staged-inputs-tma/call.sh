# Ready for the next device session (not run yet: session 32 got no machine time for it; an attempt on a cold H100 timed
# out compiling). Issue 41: the staged CUDA-graph inputs (ModelRunner._stage_decode / _stage_verify, MTP drafter) on a
# GPU, then bench step before / after; issue 39: the W4A16 GEMM's words by TMA (Config.tma).
# Before the call, put the runner of HEAD before the change beside it (the base of the before / after):
#   mkdir -p benchmarks/next/base && for f in model_runner speculative; do
#     git show f82ed26:sketchkv/engine/$f.py > benchmarks/next/base/$f.py; done
# run(command="bash benchmarks/next/run113.sh", carry=[".whl"], timeout_s=600); ~8 minutes on a warm machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
left() { echo $(( $1 - ($(date +%s) - START) )); }
timeout $(left 150) python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/test_gpu_speculative.py tests/test_tier_engine.py \
    tests/test_ops_w4a16.py > $OUT/gputests.txt 2>&1; echo "gpu tests rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
B="-m sketchkv bench step --profile --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16"
timeout $(left 270) python3 $B --out-dir $OUT/staged > $OUT/staged.txt 2>&1; echo "staged rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
cp benchmarks/next/base/model_runner.py sketchkv/engine/model_runner.py; cp benchmarks/next/base/speculative.py sketchkv/engine/speculative.py
timeout $(left 380) python3 $B --out-dir $OUT/base > $OUT/base.txt 2>&1; echo "base rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
timeout $(left 580) python3 benchmarks/studies/w4a16_tma.py --out $OUT/tma > $OUT/tma.txt 2>&1; echo "tma rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
tail -3 $OUT/gputests.txt; grep -E "^\| [0-9]" $OUT/staged/*.md | head -2; grep -E "^\| [0-9]" $OUT/base/*.md | head -2
grep -v Warning $OUT/tma.txt | tail -24; cat $OUT/all.log
