#!/usr/bin/env bash
# Issue 11: gpu_l2_bench paced and back to back, then the whole GPU run on the plain-hint build.
R=$PWD; export LD_LIBRARY_PATH=$PWD/.devlib PATH=$PATH:/usr/local/nvidia/bin
O=$OUT/l2; mkdir -p $O
B=build/gpu
for i in 1 2; do timeout 120 $B/gpu_l2_bench > $O/l2_paced_$i.txt 2>&1; echo "l2 paced $i rc=$?" >> $O/summary.txt; done
timeout 120 $B/gpu_l2_bench --block 128 > $O/l2_paced_128k.txt 2>&1; echo "l2 paced 128k rc=$?" >> $O/summary.txt
timeout 120 $B/gpu_l2_bench --every-us 100 --batch 64 > $O/l2_paced_64m_100us.txt 2>&1; echo "l2 paced 64m rc=$?" >> $O/summary.txt
cat $O/summary.txt $O/l2_paced_*.txt
bench/gpu_all.sh /tmp/all > $O/gpu_all.out 2>&1; echo "gpu_all rc=$?"
tail -40 /tmp/all/summary.txt
cp -r /tmp/all $OUT/all
cd $OUT && find all -type f -name "*.txt" -exec sed -i "s#$R#REPO#g; s#/tmp/all#OUTDIR#g" {} + 2>/dev/null; tar czf l2.tgz l2 all && rm -rf all
