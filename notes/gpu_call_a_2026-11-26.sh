#!/bin/bash
# 2026-11-26, device call A (issues 26, 27): GPU tests of the merged decode/packed/keyless changes, then chapter 09's
# records (each benchmark alone on the GPU). Everything under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, tilelang; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'tilelang', tilelang.__version__)" | tee -a $OUT/gpu.txt
stamp precompile
timeout 120 python - <<'PY' 2>&1 | grep -v "^\s*$" | tail -5
import sys, time
t = time.time(); sys.path.insert(0, "tests")
import course_utils  # noqa: F401
from course_utils.measure.benchmarks.ch09_varlen_decode import precompile_ch09
import test_varlen_decode_gpu as gpu_tests
precompile_ch09(); gpu_tests.precompile()
print(f"precompiled in {time.time() - t:.0f} s")
PY
stamp tests
(timeout 170 python -m pytest -q -rs -p no:cacheprovider tests/test_varlen_decode_gpu.py > $OUT/tests_decode.log 2>&1; echo "exit $?" >> $OUT/tests_decode.log) &
(timeout 170 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "without_keys or full_size or hidden_key or sinks or one_key or stress" > $OUT/tests_gpu.log 2>&1; echo "exit $?" >> $OUT/tests_gpu.log) &
wait
tail -4 $OUT/tests_*.log
for spec in ch09_decode_splits_h100:60 ch09_decode_h100:130 ch09_varlen_h100:90; do
  rec=${spec%%:*}; limit=${spec##*:}
  stamp "$rec (limit $limit s)"
  timeout $limit python -m course_utils.measure.benchmarks $rec > $OUT/$rec.log 2>&1; echo "exit $?" >> $OUT/$rec.log
  grep -v Warning $OUT/$rec.log | tail -8
  cp figures/$rec.json $OUT/ 2>/dev/null
done
stamp done
