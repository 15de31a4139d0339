#!/usr/bin/env bash
# --order given vs src, alternately, 4 rounds, the committed kernel (build of the session's final code + --order)
O=$OUT/order; mkdir -p $O
for i in 1 2 3 4; do for v in given src; do
  timeout 120 .devlib/ab/bench_O --order $v > $O/bench_${v}_$i.txt 2>&1; echo "$v run $i rc=$?" | tee -a $O/summary.txt
  grep -E "^\s+\[[1-4]\].*(64|256)\.00|^target" $O/bench_${v}_$i.txt | tee -a $O/summary.txt
done; done
cd $OUT && tar czf order.tgz order
