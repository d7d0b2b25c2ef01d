#!/bin/bash
# 2026-11-26 (seventh session), device call E (issues 26, 27): GPU tests of the merged backward (D=64 warp splits),
# packed and decode changes, then chapter 08's records (feature checks, comparison with the peers, deterministic).
# Each benchmark alone on the GPU. Logs and JSON tarred under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/e; pack() { tar czf $OUT/call_e.tgz -C /tmp/e .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/e/gpu.txt
python -c "import torch, tilelang; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'tilelang', tilelang.__version__)" | tee -a /tmp/e/gpu.txt
stamp tests
(timeout ${TEST_LIMIT:-200} python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k "backward or hopper" > /tmp/e/tests_gpu.log 2>&1; echo "exit $?" >> /tmp/e/tests_gpu.log) &
(timeout ${TEST_LIMIT:-200} python -m pytest -q -rs -p no:cacheprovider tests/test_varlen_decode_gpu.py > /tmp/e/tests_decode.log 2>&1; echo "exit $?" >> /tmp/e/tests_decode.log) &
wait
tail -n 4 /tmp/e/tests_*.log; pack
for spec in ${RECS:-ch08_feature_checks_h100:100 ch08_backward_vs_peers_h100:190 ch08_deterministic_h100:80}; do
  rec=${spec%%:*}; limit=${spec##*:}
  stamp "$rec (limit $limit s)"
  timeout $limit python -m course_utils.measure.benchmarks $rec > /tmp/e/$rec.log 2>&1; echo "exit $?" >> /tmp/e/$rec.log
  grep -v Warning /tmp/e/$rec.log | grep -v "^\s*return\|^\s*$" | tail -n 6
  cp figures/$rec.json /tmp/e/ 2>/dev/null; pack
done
stamp done
