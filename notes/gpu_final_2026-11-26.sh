#!/bin/bash
# 2026-11-26, the session's last H100 calls (issues 26, 27). Two parts, each one device call under 10 minutes:
#   bash notes/gpu_final_2026-11-26.sh records    # chapter 07/08/09 records, each benchmark alone on the GPU
#   bash notes/gpu_final_2026-11-26.sh notebooks  # GPU tests, then the changed chapters executed in place
# Everything it writes goes under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
PART=${1:-records}
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, tilelang; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'tilelang', tilelang.__version__)" | tee -a $OUT/gpu.txt
if [ "$PART" = records ]; then
  for spec in ${RECS:-ch07_forward_vs_peers_h100:150 ch08_backward_vs_peers_h100:150 ch07_forward_ablation_h100:110 ch08_backward_ablation_h100:110 ch09_decode_h100:110 ch09_varlen_h100:60}; do
    rec=${spec%%:*}; limit=${spec##*:}
    stamp "$rec (limit $limit s)"
    timeout $limit python -m course_utils.measure.benchmarks $rec > $OUT/$rec.log 2>&1; echo "exit $?" >> $OUT/$rec.log
    grep -v Warning $OUT/$rec.log | tail -12
    cp figures/$rec.json $OUT/ 2>/dev/null
  done
else
  stamp tests
  (timeout ${TEST_LIMIT:-200} python -m pytest -q -rs -p no:cacheprovider tests/test_varlen_decode_gpu.py > $OUT/tests_decode.log 2>&1; echo "exit $?" >> $OUT/tests_decode.log) &
  (timeout ${TEST_LIMIT:-200} python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "hopper or forward" > $OUT/tests_gpu.log 2>&1; echo "exit $?" >> $OUT/tests_gpu.log) &
  wait
  tail -3 $OUT/tests_*.log
  stamp notebooks
  timeout ${NB_LIMIT:-330} python -m course_utils.tooling.run_notebooks ${CHAPTERS:-05 06 07 08 09} --in-place --jobs ${JOBS:-5} > $OUT/nb.log 2>&1; echo "exit $?" >> $OUT/nb.log
  grep -E "^(ok|FAIL)|exit|failed" $OUT/nb.log
  tar czf $OUT/results.tgz notebooks/*.ipynb figures/*.png figures/*.json
fi
stamp done
