# run 127 (session 38). First the host: benchmarks/studies/host_row_reads.py (how fast this host's zero-copy field
# loads read a miss row against whole-row reads). On a slow-gather host (fields < 60% of the copy bandwidth; run
# 119's / 126's H100s: ~43%) `--sparse-miss-read rows` could take several ms off the 8 x 250K step and has never
# been measured there: W4A16 steps fields / rows alternating. On a fast one, gate_up with Config.xsum at M = 8
# (run 126: 51.7 -> 47.9 us per call, one sample) as an engine A/B instead. Then a bf16 step: issue 39's W4A16 /
# bf16 ratio on this machine (on an H200: never measured in one run). MTP-7 verification is call 2. Issue 39 first:
# the W4A16 GEMM with x on the MMA's M side (Config.x_major) at M = 64, the MTP-7 step's rows (27% of the floor now),
# and persistent programs (Config.persistent) at M = 8.
# run(command="END=585 bash benchmarks/next/run127.sh", carry=[".whl"], timeout_s=595); call 2: run127b.sh
. benchmarks/next/preamble.sh
END=${END:-585}
at() { echo $(( $1 < END ? $1 : END )); }
timeout $(left 60) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_sparse_ops.py tests/test_ops_w4a16.py -k "select_top_k or mixed" > $OUT/pytest-sel.txt 2>&1; mark select-test $?
timeout $(left 120) python3 benchmarks/studies/host_row_reads.py --gib 2 --out $OUT/r/rows.json > $OUT/rows.txt 2>&1; mark rows-study $?
SLOW=$(python3 -c "import json; r = json.load(open('$OUT/r/rows.json'))['rows']
print(int(next(x['frac_h2d'] for x in r if x['variant'] == 'fields' and x['picks'] == 16384) < 0.6))" 2>/dev/null || echo 1)
echo "slow gather: $SLOW" >> $OUT/all.log
timeout $(left 220) python3 benchmarks/studies/w4a16_flag.py --flag x_major --rows 64 --out $OUT/r/xm > $OUT/xm.txt 2>&1; mark x_major $?
timeout $(left 295) python3 benchmarks/studies/w4a16_flag.py --flag persistent --rows 8 --out $OUT/r/pers > $OUT/pers.txt 2>&1; mark persistent $?
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b-w4a16 --steps 16"
PY='import sys, dataclasses; import sketchkv.ops.w4a16_gemm as w
k = (8, 34816, 5120)
w.TUNED[k] = dataclasses.replace(w.TUNED[k], xsum=sys.argv[1] == "1")
from sketchkv.cli import main; sys.exit(main(sys.argv[2:]))'
i=0
for f in 0 1; do i=$((i + 1))
  if [ "$SLOW" = 1 ]; then n=$([ $f = 1 ] && echo rows || echo fields)
    timeout $(left $(at $((295 + 60 * i)))) python3 -m sketchkv $B --sparse-miss-read $n --out-dir $OUT/r/$n-$i > $OUT/s$i-$n.txt 2>&1; mark $n-$i $?
  else timeout $(left $(at $((295 + 60 * i)))) python3 -c "$PY" $f $B --out-dir $OUT/r/x$f-$i > $OUT/s$i-xsum$f.txt 2>&1; mark xsum$f-$i $?; fi
done
L=$(left $END); [ $L -gt 60 ] && { timeout $L python3 -m sketchkv ${B/-w4a16/} --out-dir $OUT/r/bf16 > $OUT/bf16.txt 2>&1; mark bf16 $?; }
mkdir -p /tmp/r127 && cp $OUT/r/xm/*.json $OUT/r/pers/*.json /tmp/r127/ 2>/dev/null   # for call 2
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
tail -2 $OUT/pytest-sel.txt; grep -E "H2D|N=" $OUT/rows.txt | cut -c1-140; grep -v Warning $OUT/xm.txt | grep -E "^\||FAILED|M=64" | tail -14 | cut -c1-230; grep -v Warning $OUT/pers.txt | grep -E "^\||FAILED|M=8" | tail -14 | cut -c1-230
for f in $OUT/s*.txt $OUT/bf16.txt; do echo "$(basename $f): $(grep -E 'step ms|tok/s|floor' $f | tr -s ' ' | tr '\n' ';' | cut -c1-150)"; done
cat $OUT/all.log
