#!/usr/bin/env bash
# One device call: GPU tests, then the sparse-kernel and engine benchmarks, each under a time guard.
# Usage (on the H200, from the repo root, with .whl carried):
#   bash benchmarks/h200_session.sh SECONDS [TEST_FILES...]
#   ENGINE_ARGS="..." overrides the engine benchmark's arguments; STAGES="tests sparse kernels host mtp engine"
#   picks stages (kernels: benchmarks/bench_sketch_score.py + bench_prefill_attention.py; mtp: MTP accepted
#   length, benchmarks/bench_mtp.py with MTP_ARGS; agents: `sketchkv bench agents`, issue 8, the runs named in
#   AGENTS_RUNS, see the stage below; qsa: issue 10, benchmarks/bench_qsa_tier.py).
# Everything lands in $OUT (logs + JSON), to be copied into benchmarks/results/ afterwards.
set -u
BUDGET=${1:-540}; shift || true
TESTS=${*:-tests/}  # every test marked gpu
STAGES=${STAGES:-tests sparse engine}
ENGINE_ARGS=${ENGINE_ARGS:---preset qwen3.5-27b --contexts 8192 131072 --batches 1 8 --prefill-contexts 8192 131072 --steps 24 --sparse --hf}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
[ -d /tmp/site/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
export SKETCHKV_PARITY_OUT=$OUT/gpu-parity.json
case " $STAGES " in *" tests "*)
  # full log (-rA: every test's outcome, --durations: where the time went) in $OUT; the tail on screen
  # a test that hangs is stopped after TEST_TIMEOUT s with its stack (pytest-timeout, on the device machine)
  TO=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=${TEST_TIMEOUT:-180}")
  timeout $(( $(left) * ${TESTS_SHARE:-6} / 10 )) python3 -m pytest -m gpu -v -rfE --durations=15 -p no:cacheprovider $TO $TESTS \
    > "$OUT/gpu-tests.log" 2>&1; tail -40 "$OUT/gpu-tests.log";;
esac
case " $STAGES " in *" sparse "*)
  timeout $(( $(left) / 3 )) python3 benchmarks/bench_sparse_ops.py --out "$OUT/sparse-ops.json" 2>&1 | tail -14 | tee "$OUT/sparse-ops.log";;
esac
case " $STAGES " in *" kernels "*)
  # sketch-scoring tiles (issue 4's 70% goal) and prefill attention backends (flash vs cuDNN, issue 2's prefill)
  timeout $(( $(left) / 3 )) python3 benchmarks/bench_sketch_score.py --out "$OUT/sketch-score.json" 2>&1 | tail -7 | tee "$OUT/sketch-score.log"
  timeout $(( $(left) / 3 )) python3 benchmarks/bench_prefill_attention.py --out "$OUT/prefill-attention.json" 2>&1 | tail -14 | tee "$OUT/prefill-attention.log";;
esac
case " $STAGES " in *" host "*)
  timeout $(( $(left) / 2 )) python3 benchmarks/bench_host_gather.py --quick --out "$OUT/host-gather.json" 2>&1 | tail -20 | tee "$OUT/host-gather.log";;
esac
case " $STAGES " in *" mtp "*)
  MTP_ARGS=${MTP_ARGS:---n 1 3 7 --prompts 8 --context 4096 --max-tokens 256}
  timeout $(( $(left) / 2 )) python3 benchmarks/bench_mtp.py $MTP_ARGS --out "$OUT/mtp-accept.json" 2>&1 | tail -12 | tee "$OUT/mtp-accept.log";;
esac
case " $STAGES " in *" engine "*)
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_engine.py $ENGINE_ARGS --out "$OUT/engine-27b.json" 2>&1 | tee "$OUT/engine-27b.log" | tail -20;;
esac
case " $STAGES " in *" agents "*)
  # Issue 8 on one H200, one device call (<= 10 min) per run; expected wall time (incl. ~1-2 min of engine
  # build + CUDA-graph capture + fla autotuning on a fresh machine) after each. Contexts: 250K = 256000 tokens.
  # --fill random writes random caches for all but the last 1024 tokens of each agent (decode speed depends on
  # the bytes a step reads, not their values; 8 x 250K real prefills would take ~10 min): cold prefill is
  # measured for real in `prefill` (1 x 250K) and in `reference`.
  #   STAGES=agents AGENTS_RUNS=sparse bash benchmarks/h200_session.sh 590
  # Afterwards, on the workstation: sketchkv bench agents --from-json agents-*.json --name agents-<date>
  AGENTS_RUNS=${AGENTS_RUNS:-sparse}
  M27="--model random:qwen3.5-27b"
  for run in $AGENTS_RUNS; do
    case $run in
      # 8 x 250K goal, tok/s vs agents and vs context, step breakdown: 9 points, ~5-6 min
      sparse) A="$M27 --configs sparse --agents 1 4 8 --contexts 32K 128K 250K --fill random --breakdown";;
      # the fused scratch composition (ops/tier_gather.py; interpreter-tested, first GPU run) against run 11's 52.0 ms at
      # 8 x 250K: flip SparseConfig.tier_kernel's default if it wins: ~4 min
      sparse-triton) A="$M27 --configs sparse --agents 1 8 --contexts 32K 250K --fill random --breakdown --sparse-tier-kernel triton";;
      # dense on the same grid where it fits (the arithmetic skips 4+ x 250K and 8 x 128K): ~3-4 min
      dense) A="$M27 --configs dense --agents 1 4 8 --contexts 32K 128K 250K --fill random --breakdown";;
      # cold prefill of one 250K-token document (goal >= 8K tok/s; ~4K tok/s = 64 s today) + follow-up TTFT: ~3-4 min
      prefill) A="$M27 --configs sparse --agents 1 --contexts 250K --fill real --max-num-batched-tokens 16384";;
      # 1 x 128K: sparse vs sketchkv dense vs transformers (its prefill is real: ~35 s; decode 258 x ~145 ms): ~6 min
      vs128k) A="$M27 --configs sparse dense hf --agents 1 --contexts 128K --fill random";;
      # the largest N x 250K the host budget holds (80 GiB of the 128 GiB machine pinned: ~18-19 agents): ~4-5 min
      max) A="$M27 --configs sparse --agents max --contexts 250K --fill random --sparse-host-budget-gb 80";;
      # issue 9 on the 2 x H200 machine (kind nvidia-h200-x2, 256 GB host RAM): 8 x 250K on one GPU alone, then
      # 16 x 250K as two replicas of 8 x 250K (one engine per GPU, timed windows started together); goal: combined
      # >= 1.9x the one-GPU tok/s. 48 GB of pinned host tier per replica (8 agents need ~36 GB): ~5-7 min
      #   STAGES=agents AGENTS_RUNS=dp bash benchmarks/h200_session.sh 590
      dp) A="$M27 --configs sparse --agents 8 --contexts 250K --fill random --data-parallel 1 2 --sparse-host-budget-gb 48";;
      # issue 11: MTP-7 verification steps (CUDA graphs since session 5) at 8 x 128K and 8 x 250K on the 27B shape
      # with a random MTP layer (drafts rejected: every step verifies 7 drafts); projected tok/s with the
      # reference model's accepted length at n = 7 (explain-style, run 11: 4.01); compare with `sparse`: ~5 min
      # (run 18: the 8 x 250K point alone needs > 195 s after a 120 s engine build; give it >= 300 s)
      spec) A="--model random:qwen3.5-27b+mtp --configs sparse --agents 8 --contexts 128K 250K --fill random --num-speculative-tokens 7 --reference-accepted-length 4.01";;
      # only the 8 x 250K point of `spec` (the 128K point first made run 18's stage run out): ~6 min with the build
      spec250) A="--model random:qwen3.5-27b+mtp --configs sparse --agents 8 --contexts 250K --fill random --num-speculative-tokens 7 --reference-accepted-length 4.20";;
      # the same with one selection per sequence in verification steps (its first row's; approximate): ~5 min
      spec-shared) A="--model random:qwen3.5-27b+mtp --configs sparse --agents 8 --contexts 128K 250K --fill random --num-speculative-tokens 7 --reference-accepted-length 4.01 --sparse-verify-selection shared";;
      # the bundled reference model on real text (realistic picks and hit rates), real prefill: ~3-4 min
      reference) A="--configs sparse dense --agents 1 8 --contexts 32K 128K 250K --fill real --breakdown";;
      *) echo "unknown agents run $run (see the runs listed in benchmarks/h200_session.sh)"; exit 2;;
    esac
    timeout $(( $(left) - 10 )) python3 -m sketchkv bench agents $A --out-dir "$OUT" --name "agents-$run" 2>&1 \
      | tee "$OUT/agents-$run.log" | tail -25
  done;;
esac
case " $STAGES " in *" qsa "*)
  # Issue 10 on one H200: random:qwen4-exp-h200 (12 QSA layers of 2 x 256, 14.7B params, 27.3 GiB bf16) over the
  # host tier (bf16 rows), decode tok/s at 8K..1M (random fill of all but 64 tokens), PCIe bytes per step, a real
  # 128K prefill. QSA_ARGS overrides (e.g. --prefill-context 0 to skip the prefill).
  #   STAGES=qsa bash benchmarks/h200_session.sh 590
  timeout $(( $(left) - 10 )) python3 benchmarks/bench_qsa_tier.py ${QSA_ARGS:-} --out "$OUT/qsa-tier-h200.json" 2>&1 \
    | tee "$OUT/qsa-tier-h200.log" | tail -15;;
esac
echo "session done after $(( $(date +%s) - START )) s"
