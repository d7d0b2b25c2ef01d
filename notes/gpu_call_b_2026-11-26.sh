#!/bin/bash
# 2026-11-26, device call B (issue 26): chapter 07's and 08's 40-case comparisons with the peers and chapter 07's
# ablation (versions 19/20 new), each benchmark alone on the GPU. Logs and JSON tarred under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/b; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/b/gpu.txt
for spec in ${RECS:-ch07_forward_vs_peers_h100:170 ch08_backward_vs_peers_h100:170 ch07_forward_ablation_h100:170}; do
  rec=${spec%%:*}; limit=${spec##*:}
  stamp "$rec (limit $limit s)"
  timeout $limit python -m course_utils.measure.benchmarks $rec > /tmp/b/$rec.log 2>&1; echo "exit $?" >> /tmp/b/$rec.log
  grep -v Warning /tmp/b/$rec.log | grep -v "^\s*return\|^\s*$" | tail -6
  cp figures/$rec.json /tmp/b/ 2>/dev/null
  tar czf $OUT/call_b.tgz -C /tmp/b .
done
stamp done
