#!/usr/bin/env bash
# The Python engine on GPU caches (gpu_e2e_test's case) on the final package, both executors.
export LD_LIBRARY_PATH=$PWD/.devlib PYTHONPATH=$PWD/.devlib/py
export KVFERRY_BUILD=$PWD/.devlib/b
source tests/lib.sh
export KVFERRY_BACKEND=cuda
L="--model llama-3.1-8b --tp 8 --cache-mib 1024"
mkdir -p $OUT/pyfinal
for ex in engine sender; do
  up $TAG-yd$ex --role decode $L --executor $ex
  up $TAG-yp$ex --role prefill $L --executor $ex
  PYTHONPATH="$ROOT/python:$PYTHONPATH" python3 tests/gpu_python_engine.py $TAG-yp$ex $TAG-yd$ex 2>&1 | tee $OUT/pyfinal/$ex.txt
  down $TAG-yp$ex; down $TAG-yd$ex
done
export LD_LIBRARY_PATH=$PWD/.devlib
build/gpu/gpu_l2_bench --working-set 8,32 --rounds 2 2>&1 | tee $OUT/pyfinal/l2.txt | tail -6
build/gpu/gpu_copy_bench --sizes 64 --blocks 16 --tp 8 2>&1 | tee $OUT/pyfinal/copy.txt | grep "^target"
