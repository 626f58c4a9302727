# run 123 (issue 39): rowsum(x) summed before the W4A16 GEMM (Config.xsum) instead of a second dot against ones:
# the GPU tests of the GEMM (xsum configs included), then benchmarks/studies/w4a16_flag.py --flag xsum at M = 8 .. 64.
# run(command="bash benchmarks/next/run123.sh", carry=[".whl"], timeout_s=420)
. benchmarks/next/preamble.sh
timeout $(left 110) python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ops_w4a16.py -k "group_sizes or spanning" > $OUT/pytest.txt 2>&1; mark pytest $?
timeout $(left 60) python3 benchmarks/studies/graph_launch.py --out $OUT/launch > $OUT/launch.txt 2>&1; mark launch $?
timeout $(left 410) python3 benchmarks/studies/w4a16_flag.py --flag xsum --rows 8 16 32 64 --out $OUT/xsum > $OUT/xsum.txt 2>&1; mark xsum $?
tail -14 $OUT/launch.txt; tail -3 $OUT/pytest.txt; grep -v Warning $OUT/xsum.txt | tail -32 | cut -c1-200; cat $OUT/all.log
