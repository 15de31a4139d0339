#!/usr/bin/env bash
# Issue 11: cache policies. A = .cs (the default), H = plain (--hints plain), X = L1::no_allocate +
# an L2 evict_first cache policy, Z = L1::no_allocate only. gpu_copy_bench alternately, 4 rounds;
# gpu_l2_bench for each (its evict-first column is the variant's default kernel); tests of X and Z.
export LD_LIBRARY_PATH=$PWD/.devlib
O=$OUT/pol; mkdir -p $O
lscpu | grep -i "model name" > $O/lscpu.txt
for v in X Z; do timeout 200 .devlib/ab4/test_$v > $O/test_$v.txt 2>&1; echo "test_$v rc=$?" >> $O/summary.txt; done
for i in 1 2 3 4; do
  for v in A H X Z; do
    case $v in A) cmd="build/gpu/gpu_copy_bench";; H) cmd="build/gpu/gpu_copy_bench --hints plain";; *) cmd=".devlib/ab4/bench_$v";; esac
    timeout 120 $cmd --sizes 64,256 > $O/bench_${v}_$i.txt 2>&1; echo "bench $v $i rc=$?" >> $O/summary.txt
    grep "^target kernel >= 0.85" $O/bench_${v}_$i.txt >> $O/summary.txt
  done
done
for i in 1 2; do
  timeout 120 build/gpu/gpu_l2_bench > $O/l2_A_$i.txt 2>&1; echo "l2 A $i rc=$?" >> $O/summary.txt
  for v in X Z; do timeout 120 .devlib/ab4/l2_$v > $O/l2_${v}_$i.txt 2>&1; echo "l2 $v $i rc=$?" >> $O/summary.txt; done
done
cat $O/summary.txt; for f in $O/l2_*_1.txt; do echo "== $f"; sed -n '4,12p' $f; done
cd $OUT && tar czf pol.tgz pol
