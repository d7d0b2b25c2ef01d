#!/bin/bash
# Chapter 09 on the H100, in one call: precompile, GPU tests, records, notebook. Everything under $OUT.
cd "$(dirname "$0")"
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
LOG=$OUT/run.log
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a $LOG; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $LOG
stamp precompile
timeout 150 python - <<'PY' 2>&1 | grep -v "^\s*$" | tail -20 | tee -a $LOG
import sys, time
t = time.time()
sys.path.insert(0, "tests")
import course_utils  # noqa: F401
from course_utils.measure.benchmarks.ch09_varlen_decode import precompile_ch09
import test_varlen_decode_gpu as gpu_tests
precompile_ch09()
gpu_tests.precompile()
print(f"precompiled in {time.time() - t:.0f} s")
PY
stamp tests
timeout 130 python -m pytest -q tests/test_varlen_decode_gpu.py -p no:cacheprovider 2>&1 | tail -30 | tee -a $LOG
for rec in ch09_decode_splits_h100 ch09_varlen_h100 ch09_decode_h100; do
  stamp $rec
  timeout 200 python -m course_utils.measure.benchmarks $rec 2>&1 | grep -v "^\s*$" | tail -40 | tee -a $LOG
  cp figures/$rec.json $OUT/ 2>/dev/null
done
stamp notebook
timeout 150 python -m course_utils.tooling.run_notebooks 09 --no-sync 2>&1 | tail -5 | tee -a $LOG
stamp pack
tar czf $OUT/results.tgz figures/ch09_* notebooks/09_varlen_decoding.ipynb 2>&1 | tee -a $LOG
stamp done
