#!/usr/bin/env bash
# Issue 11: the copier's cache hints. gpu_copy_test; gpu_l2_bench twice; gpu_copy_bench plain vs evict-first alternately.
export LD_LIBRARY_PATH=$PWD/.devlib
O=$OUT/hints; mkdir -p $O
lscpu | grep -i "model name" > $O/lscpu.txt
B=build/gpu
timeout 200 $B/gpu_copy_test > $O/gpu_copy_test.txt 2>&1; echo "gpu_copy_test rc=$?" >> $O/summary.txt
for i in 1 2; do timeout 120 $B/gpu_l2_bench > $O/l2_$i.txt 2>&1; echo "l2 $i rc=$?" >> $O/summary.txt; done
timeout 120 $B/gpu_l2_bench --block 128 --working-set 16,40 > $O/l2_128k.txt 2>&1; echo "l2 128k rc=$?" >> $O/summary.txt
for i in 1 2 3; do for h in plain evict-first; do
  timeout 120 $B/gpu_copy_bench --hints $h > $O/bench_${h}_$i.txt 2>&1; echo "bench $h $i rc=$?" >> $O/summary.txt
done; done
cat $O/summary.txt; tail -3 $O/gpu_copy_test.txt; cat $O/l2_1.txt $O/l2_2.txt $O/l2_128k.txt
cd $OUT && tar czf hints.tgz hints
