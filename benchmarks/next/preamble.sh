# Sourced by every device script here (`. benchmarks/next/preamble.sh` from the repo root): the carried wheels
# (.whl: ../shared/tools/device-wheels.sh fla-core==0.6.0 pytest-timeout, in the repo root; a fresh checkout lacks
# them) into /tmp/site, the import path, Triton's kernel cache from the last run (.triton-cache/cache.tgz when
# carried: a fresh machine otherwise compiles every kernel again, ~175 s for the first W4A16 engine), `left N`
# (seconds left until N s after the start: a step's timeout) and `mark NAME RC` (a line in $OUT/all.log),
# `step NAME CMD...` (a `sketchkv bench` command with --out-dir $R/NAME, output in $R/s-NAME.txt, at most
# STEP_S s (default 110) and until END s after the start; skipped when under 50 s are left; $R (outside $OUT) packed
# into $OUT/r.tgz after each step), and `finish` (last: each step's summary line, r.tgz, the Triton cache as triton-cache.tgz when under 16 MiB, the
# log; the device tool returns at most 8 files). The GPU's name first in the log.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $TRITON_CACHE_DIR; [ -f .triton-cache/cache.tgz ] && tar xzf .triton-cache/cache.tgz -C $TRITON_CACHE_DIR
START=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - START) )); }
mark() { echo "$1 rc $2 at $(( $(date +%s) - START )) s" >> $OUT/all.log; }
step() {
  local L=$(left $END) n=$1; shift; [ $L -lt 50 ] && return
  local T=${STEP_S:-110}; timeout $(( L < T ? L : T )) "$@" --out-dir $R/$n > $R/s-$n.txt 2>&1; mark $n $?
  tar czf $OUT/r.tgz -C $(dirname $R) r; }   # after every step: a call cut short by the tool still returns them
finish() {
  for f in $R/s-*.txt; do [ -f $f ] && echo "$(basename $f .txt): $(grep -E '\] step |kernels|tok/s at|floor|attention layers|graph replay' $f \
    | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; done
  tar czf $OUT/r.tgz -C $(dirname $R) r
  tar czf /tmp/triton-cache.tgz -C $TRITON_CACHE_DIR . && [ $(stat -c %s /tmp/triton-cache.tgz) -lt 16000000 ] \
    && cp /tmp/triton-cache.tgz $OUT/
  cat $OUT/all.log; }
R=/tmp/out/r; mkdir -p $R; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/all.log
