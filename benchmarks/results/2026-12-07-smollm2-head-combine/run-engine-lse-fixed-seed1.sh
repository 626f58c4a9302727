set -x
S=/root/.pyenv/versions/3.11.7/lib/python3.11
python -m sketchkv.eval.sweep $S/asyncio $S/email $S/json $S/concurrent $S/importlib $S/pydoc_data \
  --model /root/.cache/sketchkv/SmolLM2-135M-Instruct.Q4_1.gguf --basis 32=/tmp/q43/basis32.safetensors \
  --lengths 8192 --samples 6 --seed 1 --continuation 256 --k-fracs 0.015625 --tier-formats --production '' \
  --variant lse16:softmax_lse_stride=16 --variant lse64:softmax_lse_stride=64 --threads 2 \
  --only '^sketch32-shared-k128(\+lse16|\+lse64)?$' --out-dir /tmp/q43/out --name engine-lse-8192-seed1
