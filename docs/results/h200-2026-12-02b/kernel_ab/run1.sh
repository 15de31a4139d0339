#!/usr/bin/env bash
# A/B/C of the copy kernel on the H200: A = HEAD (a6a5f8a), B = device descriptors read by every
# thread + 2-way unroll, C = B with 256-thread blocks. Alternating, then the copy tests.
export LD_LIBRARY_PATH=$PWD/.devlib
O=$OUT/ab; mkdir -p $O
nvidia-smi > $O/nvidia-smi.txt 2>&1
lscpu | grep -i "model name" > $O/lscpu.txt
timeout 200 build/gpu/gpu_copy_test > $O/test_B.txt 2>&1; echo "test_B rc=$?" | tee -a $O/summary.txt
timeout 200 .devlib/ab/test_C > $O/test_C.txt 2>&1; echo "test_C rc=$?" | tee -a $O/summary.txt
for i in 1 2 3; do for v in A B C; do
  t=$(date +%s); timeout 120 .devlib/ab/bench_$v > $O/bench_${v}_$i.txt 2>&1; rc=$?
  echo "bench_$v run $i rc=$rc $(( $(date +%s) - t ))s" | tee -a $O/summary.txt
  grep -E "^\s+\[3\]\s+16 .* 64\.00|^target" $O/bench_${v}_$i.txt | tee -a $O/summary.txt
done; done
cd $OUT && tar czf ab.tgz ab
