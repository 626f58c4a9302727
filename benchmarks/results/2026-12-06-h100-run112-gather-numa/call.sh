# H100 run 112: is the host gather's speed (13.4-14.0 ms per 8 x 250K step at ~20 GB/s in run 110, 6.7 ms at
# 41 GB/s in run 102, same measured copy bandwidth) a matter of which NUMA node holds the pinned rows?
# The topology, then the zero-copy gather benchmark (--quick) with the process (and so the first touch of its
# pinned buffer) bound to each NUMA node's CPUs in turn.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
(lscpu | grep -iE "model name|socket|numa"; nvidia-smi topo -m; for n in /sys/devices/system/node/node*; do echo "$n cpus $(cat $n/cpulist)"; done;
 G=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-F' 'a-f' | sed 's/^0000//'); echo "gpu $G numa_node $(cat /sys/bus/pci/devices/0000$G/numa_node 2>/dev/null || cat /sys/bus/pci/devices/$G/numa_node 2>/dev/null)";
 grep -E "MemTotal|Hugepagesize" /proc/meminfo) > $OUT/topology.txt 2>&1
START=$(date +%s)
for n in /sys/devices/system/node/node*; do
  N=${n##*node}; CPUS=$(cat $n/cpulist)
  timeout 80 taskset -c $CPUS python3 benchmarks/bench_host_gather.py --quick --gib 2 --picks 131072 --footprints-mib \
    --out $OUT/gather-node$N.json > $OUT/gather-node$N.txt 2>&1
  echo "node $N (cpus $CPUS) rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
done
timeout 80 python3 benchmarks/bench_host_gather.py --quick --gib 2 --picks 131072 --footprints-mib --out $OUT/gather-unbound.json > $OUT/gather-unbound.txt 2>&1
echo "unbound rc $? at $(( $(date +%s) - START )) s" >> $OUT/all.log
cat $OUT/topology.txt; cat $OUT/all.log
for f in $OUT/gather-*.txt; do echo "== $f"; grep -E "copy H2D|GB/s|Error" $f | grep -v "sorted " | head -14 | cut -c1-140; done
