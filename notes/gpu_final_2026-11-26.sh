#!/bin/bash
# 2026-11-26, device call D: the dense GPU test of query blocks without keys (chapter 03/04 loops, the default),
# then chapters 05-10 executed in place with the stored records (re-measured by calls A-C). Everything under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
stamp tests
timeout ${TEST_LIMIT:-120} python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "without_keys or chapter04" > $OUT/tests_gpu.log 2>&1; echo "exit $?" >> $OUT/tests_gpu.log
tail -4 $OUT/tests_gpu.log
stamp notebooks
timeout ${NB_LIMIT:-380} python -m course_utils.tooling.run_notebooks ${CHAPTERS:-05 06 07 08 09 10} --in-place --jobs ${JOBS:-6} > $OUT/nb.log 2>&1; echo "exit $?" >> $OUT/nb.log
grep -E "^(ok|FAIL)|exit|failed|Error:" $OUT/nb.log | head -20
tar czf $OUT/results.tgz notebooks/*.ipynb figures/*.png figures/*.json
stamp done
