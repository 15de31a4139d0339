#!/usr/bin/env bash
# Issue 11: the final build: gpu_copy_bench twice, gpu_l2_bench once, then the whole GPU run.
R=$PWD; export LD_LIBRARY_PATH=$PWD/.devlib PATH=$PATH:/usr/local/nvidia/bin
O=$OUT/final; mkdir -p $O
B=build/gpu
lscpu | grep -i "model name" > $O/lscpu.txt
for i in 1 2; do timeout 120 $B/gpu_copy_bench > $O/bench_$i.txt 2>&1; echo "bench $i rc=$?" >> $O/summary.txt; grep "^target" $O/bench_$i.txt >> $O/summary.txt; done
timeout 120 $B/gpu_l2_bench > $O/l2.txt 2>&1; echo "l2 rc=$?" >> $O/summary.txt
cat $O/summary.txt $O/l2.txt
bench/gpu_all.sh /tmp/all > $O/gpu_all.out 2>&1; echo "gpu_all rc=$?"
tail -42 /tmp/all/summary.txt
cp -r /tmp/all $O/gpu_all
cd $OUT && find final -type f -name "*.txt" -exec sed -i "s#$R#REPO#g; s#/tmp/all#OUTDIR#g" {} + 2>/dev/null; tar czf final.tgz final && rm -rf final
