# Sourced by every device script here (`. benchmarks/next/preamble.sh` from the repo root): the carried wheels
# (.whl: ../shared/tools/device-wheels.sh fla-core==0.6.0 pytest-timeout, in the repo root; a fresh checkout lacks
# them) into /tmp/site, the import path, `left N` (seconds left until N s after the start: a step's timeout) and
# `mark NAME RC` (a line in $OUT/all.log), `step NAME CMD...` (a `sketchkv bench` command with --out-dir $OUT/r/NAME,
# output in $OUT/s-NAME.txt, at most STEP_S s (default 110) and until END s after the start; skipped when under 50 s
# are left); the GPU's name first in that log.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
step() {
  local L=$(left $END) n=$1; shift; [ $L -lt 50 ] && return
  local T=${STEP_S:-110}; timeout $(( L < T ? L : T )) "$@" --out-dir $OUT/r/$n > $OUT/s-$n.txt 2>&1; mark $n $?; }
mkdir -p $OUT/r; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
