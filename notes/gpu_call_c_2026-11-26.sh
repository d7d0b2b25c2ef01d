#!/bin/bash
# 2026-11-26, device call C (issue 26): chapter 08's ablation, a backward timing diagnostic in a fresh process,
# the dense GPU tests. Logs and JSON tarred under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/c; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/c/gpu.txt
pack() { tar czf $OUT/call_c.tgz -C /tmp/c .; }
stamp ch08_backward_ablation_h100
timeout 180 python -m course_utils.measure.benchmarks ch08_backward_ablation_h100 > /tmp/c/ablation.log 2>&1; echo "exit $?" >> /tmp/c/ablation.log
grep -v Warning /tmp/c/ablation.log | grep -v "^\s*return\|^\s*$" | tail -8; cp figures/ch08_backward_ablation_h100.json /tmp/c/; pack
stamp diag
OUT=/tmp/c timeout 90 python notes/bwd_timing_diag_2026-11-26.py > /tmp/c/diag.log 2>&1; echo "exit $?" >> /tmp/c/diag.log; tail -5 /tmp/c/diag.log; pack
stamp tests
timeout 200 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py > /tmp/c/tests_gpu.log 2>&1; echo "exit $?" >> /tmp/c/tests_gpu.log
tail -6 /tmp/c/tests_gpu.log; pack
stamp done
