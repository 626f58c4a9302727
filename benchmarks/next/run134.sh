# run 134 (session 42; what run 133 became when device starts failed left ~6 min): whole-row miss reads against the
# shipped per-field reads inside the 8 x 250K bf16 step (`--sparse-miss-read rows` vs fields, in one run: fields,
# rows, fields). The H200 host of run 131 read 1,088-byte rows at 89% of its copy bandwidth whole and at 80% by
# fields in isolation, yet its step's gather ran at 33 GB/s (60%); a fast H100 gave the same step either way (run 121).
# run(command="END=300 bash benchmarks/next/run134.sh", carry=[".whl"], timeout_s=330, kind="nvidia-h200")
. benchmarks/next/preamble.sh
END=${END:-300}
B="bench step --fill random --sparse-host-format int4 --agents 8 --context 250K --model random:qwen3.5-27b --steps 12"
STEP_S=150 step fields python3 -m sketchkv $B
STEP_S=90 step rows python3 -m sketchkv $B --sparse-miss-read rows
STEP_S=90 step fields2 python3 -m sketchkv $B
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
for f in $OUT/s-*.txt; do echo "$(basename $f): $(grep -E '\] step |bandwidth' $f | tr -s ' ' | tr '\n' ';' | cut -c1-300)"; done
cat $OUT/all.log
