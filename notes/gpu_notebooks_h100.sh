#!/bin/bash
# The session's last H100 call: chapter 11's record again (PyTorch's compiled flex_attention under dynamo's raised
# recompile limit), then every chapter re-executed in place with the stored records. Everything under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
echo "[$(date -u +%T)] ch11_flex_h100"
timeout ${FLEX_LIMIT:-150} python -m course_utils.measure.benchmarks ch11_flex_h100 > $OUT/flex.log 2>&1; echo "exit $?" >> $OUT/flex.log
grep -v Warning $OUT/flex.log | tail -25
echo "[$(date -u +%T)] notebooks"
timeout ${NB_LIMIT:-380} python -m course_utils.tooling.run_notebooks ${CHAPTERS:-} --in-place --jobs ${JOBS:-6} > $OUT/nb.log 2>&1; echo "exit $?" >> $OUT/nb.log
grep -E "^(ok|FAIL)|exit|failed" $OUT/nb.log
echo "[$(date -u +%T)] pack"
tar czf $OUT/results.tgz notebooks/*.ipynb figures/*.png figures/*.json
