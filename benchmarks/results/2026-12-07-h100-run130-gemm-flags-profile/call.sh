# run 127 (sessions 38-40), issue 39's GEMM studies (run127b.sh follows on the same warm machine).
# x on the MMA's M side (Config.x_major) at M = 64 (the MTP-7 step's rows, 27% of the floor now), persistent programs
# (Config.persistent) at M = 8, prefill GEMMs (dequant slices, DEQUANT_PARTS 1/2/4/8, vs bf16 cuBLAS).
# The studies' JSON go to /tmp/r127 for call 2 (run127b.sh: the winners in TUNED in the engine, MTP-7, row reads).
# run(command="END=585 bash benchmarks/next/run127.sh", carry=[".whl"], timeout_s=595)
. benchmarks/next/preamble.sh
END=${END:-585}
timeout $(left 200) python3 benchmarks/studies/w4a16_flag.py --flag x_major --rows 64 --out $OUT/r/xm > $OUT/xm.txt 2>&1; mark x_major $?
timeout $(left 380) python3 benchmarks/studies/w4a16_flag.py --flag persistent --rows 8 --out $OUT/r/pers > $OUT/pers.txt 2>&1; mark persistent $?
timeout $(left $END) python3 benchmarks/studies/w4a16_prefill.py --out $OUT/r/prefill > $OUT/prefill.txt 2>&1; mark prefill $?
mkdir -p /tmp/r127 && cp $OUT/r/xm/*.json $OUT/r/pers/*.json /tmp/r127/ 2>/dev/null
tar czf $OUT/r.tgz -C $OUT r && rm -rf $OUT/r
grep -v Warning $OUT/xm.txt | grep -E "^\||FAILED" | tail -9 | cut -c1-230
grep -v Warning $OUT/pers.txt | grep -E "^\||FAILED" | tail -9 | cut -c1-230; grep -E '^\|' $OUT/prefill.txt | cut -c1-200
cat $OUT/all.log
