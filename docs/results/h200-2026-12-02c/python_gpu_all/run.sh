#!/usr/bin/env bash
# The Python engine on GPU caches, then the whole GPU run (final build).
R=$PWD; export LD_LIBRARY_PATH=$PWD/.devlib PATH=$PATH:/usr/local/nvidia/bin PYTHONPATH=$PWD/.devlib/py
O=$OUT/py; mkdir -p $O
python3 -c 'import torch, msgpack; print("torch", torch.__version__, "msgpack", msgpack.version)' > $O/python.txt 2>&1
cat $O/python.txt
bench/gpu_all.sh /tmp/all > $O/gpu_all.out 2>&1; echo "gpu_all rc=$?"
grep -E "^ok:|FAIL|skipped|python" /tmp/all/gpu_e2e_test.txt | head -30
tail -25 /tmp/all/summary.txt
cp -r /tmp/all $O/gpu_all
cd $OUT && find py -type f -name "*.txt" -exec sed -i "s#$R#REPO#g; s#/tmp/all#OUTDIR#g" {} + 2>/dev/null; tar czf py.tgz py && rm -rf py
