# (run as benchmarks/next/ncu_call.sh, its target then at benchmarks/next/ncu_w4a16.py)
# ncu stall profile of the W4A16 kernel at the 27B shapes, M = 8 (warm launches skipped by count: every
# shape's first two launches of each kernel are compiles+warm-ups; we profile all and read the second of each)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p ~/.triton && [ -f .tc/tcb.txz ] && tar -C ~/.triton -xJf .tc/tcb.txz
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1); echo "ncu: $NCU" > $OUT/ncu.log
timeout 420 $NCU --clock-control none --set full --import-source no --kernel-name regex:'_w4a16|nvjet|gemm' \
  -o $OUT/w4a16 -f python3 benchmarks/studies/ncu_w4a16.py 8 >> $OUT/ncu.log 2>&1
echo "ncu rc $?" >> $OUT/ncu.log
$NCU -i $OUT/w4a16.ncu-rep --page details --csv > $OUT/details.csv 2>> $OUT/ncu.log
$NCU -i $OUT/w4a16.ncu-rep --page raw --csv --metrics regex:smsp__pcsamp_warps_issue_stalled_.*,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,launch__shared_mem_per_block_dynamic,launch__grid_size > $OUT/raw.csv 2>> $OUT/ncu.log
$NCU -i $OUT/w4a16.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>> $OUT/ncu.log
ls -la $OUT; tail -5 $OUT/ncu.log
python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/raw.csv")))
if len(rows) > 2:
    h = rows[0]
    for r in rows[2:]:
        d = dict(zip(h, r))
        name = d.get("Kernel Name", "")[:40]
        st = {k.split("stalled_")[1]: float(v.replace(",", "") or 0) for k, v in d.items() if "pcsamp_warps_issue_stalled" in k and v and v.replace(",", "").replace(".", "").isdigit()}
        tot = sum(v for k, v in st.items() if not k.endswith("not_issued")) or 1
        top = sorted(st.items(), key=lambda kv: -kv[1])[:6]
        print(name, d.get("gpu__time_duration.sum"), "dram%", d.get("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
              "warps%", d.get("sm__warps_active.avg.pct_of_peak_sustained_active"), "regs", d.get("launch__registers_per_thread"),
              "grid", d.get("launch__grid_size"))
        print("   ", ", ".join(f"{k} {100*v/tot:.0f}%" for k, v in top))
PY
