#!/usr/bin/env bash
# One device call: GPU tests, then the sparse-kernel and engine benchmarks, each under a time guard.
# Usage (on the H200, from the repo root, with .whl carried):
#   bash benchmarks/h200_session.sh SECONDS [TEST_FILES...]
#   ENGINE_ARGS="..." overrides the engine benchmark's arguments; STAGES="tests sparse host mtp engine" picks
#   stages (mtp: MTP accepted length, benchmarks/bench_mtp.py with MTP_ARGS).
# Everything lands in $OUT (logs + JSON), to be copied into benchmarks/results/ afterwards.
set -u
BUDGET=${1:-540}; shift || true
TESTS=${*:-tests/}  # every test marked gpu
STAGES=${STAGES:-tests sparse engine}
ENGINE_ARGS=${ENGINE_ARGS:---preset qwen3.5-27b --contexts 8192 131072 --batches 1 8 --prefill-contexts 8192 131072 --steps 24 --sparse --hf}
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
export SKETCHKV_PARITY_OUT=$OUT/gpu-parity.json
case " $STAGES " in *" tests "*)
  timeout $(( $(left) * 6 / 10 )) python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS 2>&1 | tail -30 | tee "$OUT/gpu-tests.log";;
esac
case " $STAGES " in *" sparse "*)
  timeout $(( $(left) / 3 )) python3 benchmarks/bench_sparse_ops.py --out "$OUT/sparse-ops.json" 2>&1 | tail -14 | tee "$OUT/sparse-ops.log";;
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
echo "session done after $(( $(date +%s) - START )) s"
