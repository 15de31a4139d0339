#!/usr/bin/env bash
# Issue 11: the 16 KiB / 64 MiB row. A = HEAD (chunk per batch), A8/A4 = HEAD --chunk 8/4,
# T = 1024-thread blocks, H = plain loads and stores (no .cs hints), L = plain loads, .cs stores.
# Alternately, 5 rounds, then the variants' copy tests.
export LD_LIBRARY_PATH=$PWD/.devlib
O=$OUT/ab2; mkdir -p $O
nvidia-smi > $O/nvidia-smi.txt 2>&1
lscpu | grep -i "model name" > $O/lscpu.txt
git log -1 --format=%H > $O/commit.txt 2>/dev/null
A=build/gpu/gpu_copy_bench
for i in 1 2 3 4 5; do
  for v in A A8 A4 T H L; do
    case $v in
      A) cmd="$A";; A8) cmd="$A --chunk 8";; A4) cmd="$A --chunk 4";;
      *) cmd=".devlib/ab2/bench_$v";;
    esac
    timeout 120 $cmd > $O/bench_${v}_$i.txt 2>&1; rc=$?
    echo "$v run $i rc=$rc" >> $O/summary.txt
    grep -E "^\s+\[[1-4]\].*(64|256)\.00 |^target" $O/bench_${v}_$i.txt >> $O/summary.txt
  done
done
for v in T H L; do timeout 200 .devlib/ab2/test_$v > $O/test_$v.txt 2>&1; echo "test_$v rc=$?" >> $O/summary.txt; done
grep -E "rc=|\[3\].* 64\.00 " $O/summary.txt | tail -60
