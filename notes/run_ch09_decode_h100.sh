#!/bin/bash
# Issue 27 on the H100: decoding without a host sync. Two parts, each one device call under 10 minutes:
#   bash notes/run_ch09_decode_h100.sh tests     # precompile, then tests/test_varlen_decode_gpu.py (CUDA graphs included)
#   bash notes/run_ch09_decode_h100.sh records   # precompile, then ch09_decode_splits_h100 and ch09_decode_h100
#   bash notes/run_ch09_decode_h100.sh varlen    # precompile, then ch09_varlen_h100 (the grid path no longer syncs)
# Everything it writes goes under $OUT (run.log, and the records' JSON for the records part).
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
PART=${1:-tests}
LOG=$OUT/run-$PART.log
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
stamp "precompile ($PART)"
timeout 150 python - "$PART" <<'PY' 2>&1 | grep -v "^\s*$" | tail -20 | tee -a "$LOG"
import sys, time
t = time.time()
sys.path.insert(0, "tests")
import course_utils  # noqa: F401
from course_utils.measure.benchmarks.ch09_varlen_decode import precompile_ch09
precompile_ch09()
if sys.argv[1] == "tests":
    import test_varlen_decode_gpu as gpu_tests
    gpu_tests.precompile()
print(f"precompiled in {time.time() - t:.0f} s")
PY
if [ "$PART" = tests ]; then
  stamp tests
  timeout 400 python -m pytest -q -rs tests/test_varlen_decode_gpu.py -p no:cacheprovider 2>&1 | tail -40 | tee -a "$LOG"
else
  RECS="ch09_decode_splits_h100 ch09_decode_h100"
  [ "$PART" = varlen ] && RECS=ch09_varlen_h100
  for rec in $RECS; do
    stamp $rec
    LIMIT=300; [ $rec = ch09_decode_splits_h100 ] && LIMIT=120
    timeout $LIMIT python -m course_utils.measure.benchmarks $rec 2>&1 | grep -v "^\s*$" | tail -45 | tee -a "$LOG"
    cp figures/$rec.json "$OUT/" 2>/dev/null
  done
fi
stamp done
