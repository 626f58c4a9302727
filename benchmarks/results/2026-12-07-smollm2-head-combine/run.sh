set -x
for L in 2048 8192; do
  F=$([ $L = 2048 ] && echo 0.03125 || echo 0.015625)
  python -m sketchkv.eval.sweep /root/.pyenv/versions/3.11.7/lib/python3.11/asyncio /root/.pyenv/versions/3.11.7/lib/python3.11/email /root/.pyenv/versions/3.11.7/lib/python3.11/json /root/.pyenv/versions/3.11.7/lib/python3.11/concurrent /root/.pyenv/versions/3.11.7/lib/python3.11/importlib /root/.pyenv/versions/3.11.7/lib/python3.11/pydoc_data --model /root/.cache/sketchkv/SmolLM2-135M-Instruct.Q4_1.gguf     --basis 32=/tmp/q42/basis32.safetensors --lengths $L --samples 2 --continuation 256 --k-fracs $F --tier-formats     --production '' --variant sum:head_combine=sum --variant max:head_combine=max --threads 2     --only '^(floor:bf16|(oracle|sketch32)-shared-k(64|128)(\+(sum|max))?)$' --out-dir /tmp/q42/out --name combine-$L
done
