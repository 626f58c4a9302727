#!/usr/bin/env bash
# One device call on a machine of several H200s (kinds nvidia-h200-x2 / -x4), from the repo root with .whl
# carried: independent single-GPU jobs side by side, one "lane" per GPU, all under one time guard.
#   LANE0="..." LANE1="..." [LANE2=... LANE3=...] bash benchmarks/lanes_session.sh SECONDS
# Each LANEi is a bash command run with CUDA_VISIBLE_DEVICES=i, OUT=$R/lanei and LANE_SECONDS (what is left
# of the budget when it starts) in its environment; it usually calls benchmarks/h200_session.sh. A lane may
# set CUDA_VISIBLE_DEVICES itself (e.g. "0,1" for a tensor-parallel check) when the lane of the other GPU
# does untimed work meanwhile. Everything lands in $OUT/results.tgz (the device tool brings back at most 8
# files) plus each lane's log. PYTHONFAULTHANDLER=1: a job killed by `timeout -s ABRT` prints where it hung.
set -u
BUDGET=${1:-570}
START=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}; R=/tmp/results; mkdir -p "$OUT" $R
nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm --format=csv | tee $R/gpus.txt
for i in 0 1 2 3 4 5 6 7; do
  var=LANE$i; [ -n "${!var:-}" ] || continue
  # own Triton cache per lane: run 13 lost a TP rank to a compile failure inside fla's autotuner while
  # another lane compiled the same kernels into the shared cache (cause not proven; isolation is cheap)
  (export CUDA_VISIBLE_DEVICES=$i OUT=$R/lane$i LANE_SECONDS=$(( BUDGET - 20 - ($(date +%s) - START) )) \
          TRITON_CACHE_DIR=/tmp/triton-cache-lane$i
   mkdir -p $OUT; timeout -s ABRT -k 10 $LANE_SECONDS bash -c "${!var}" > $R/lane$i.log 2>&1
   echo "lane $i exit $? after $(( $(date +%s) - START )) s" >> $R/lane$i.log) &
done
wait
tar czf "$OUT/results.tgz" -C $R .
cp $R/*.log "$OUT/" 2>/dev/null
for f in $R/lane*.log; do echo "== $f"; tail -${TAIL:-14} $f; done
echo "session done after $(( $(date +%s) - START )) s"
