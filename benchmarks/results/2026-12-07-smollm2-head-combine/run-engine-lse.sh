set -x
S=/root/.pyenv/versions/3.11.7/lib/python3.11
for L in 8192 2048; do
  F=$([ $L = 2048 ] && echo 0.03125 || echo 0.015625)
  K=$([ $L = 2048 ] && echo 64 || echo 128)
  python -m sketchkv.eval.sweep $S/asyncio $S/email $S/json $S/concurrent $S/importlib $S/pydoc_data \
    --model /root/.cache/sketchkv/SmolLM2-135M-Instruct.Q4_1.gguf --basis 32=/tmp/q43/basis32.safetensors \
    --lengths $L --samples 2 --continuation 256 --k-fracs $F --tier-formats --production '' \
    --variant lse16:softmax_lse_stride=16 --threads 2 --only "^sketch32-shared-k$K(\+lse16)?\$" \
    --out-dir /tmp/q43/out --name engine-lse16-$L
done
