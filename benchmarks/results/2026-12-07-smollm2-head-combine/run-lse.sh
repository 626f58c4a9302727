set -x
for run in "2048 1" "8192 1" "8192 64"; do
  set -- $run; L=$1; BL=$2
  F=$([ $L = 2048 ] && echo 0.03125 || echo 0.015625)
  K=$([ $L = 2048 ] && echo 64 || echo 128)
  python benchmarks/studies/softmax_lse_estimate.py --stride 16 --block $BL -- /root/.pyenv/versions/3.11.7/lib/python3.11/asyncio /root/.pyenv/versions/3.11.7/lib/python3.11/email /root/.pyenv/versions/3.11.7/lib/python3.11/json /root/.pyenv/versions/3.11.7/lib/python3.11/concurrent /root/.pyenv/versions/3.11.7/lib/python3.11/importlib /root/.pyenv/versions/3.11.7/lib/python3.11/pydoc_data --model /root/.cache/sketchkv/SmolLM2-135M-Instruct.Q4_1.gguf     --basis 32=/tmp/q42/basis32.safetensors --lengths $L --samples 2 --continuation 256 --k-fracs $F --tier-formats     --production '' --threads 2 --only "^(oracle|sketch32)-shared-k$K\$" --out-dir /tmp/q42/lse --name lse-stride16-block$BL-$L
done
