#!/bin/bash
# 2026-11-26 (eighth session), device call J (issues 26, 27): chapter 08's and chapter 09's records after version 20
# became the D=128 default and short caches stopped splitting. RECS picks the records ("name:limit_seconds").
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/j; pack() { tar czf $OUT/call_j.tgz -C /tmp/j .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/j/gpu.txt
for spec in ${RECS:?}; do
  rec=${spec%%:*}; limit=${spec##*:}
  stamp "$rec (limit $limit s)"
  timeout $limit python -m course_utils.measure.benchmarks $rec > /tmp/j/$rec.log 2>&1; echo "exit $?" >> /tmp/j/$rec.log
  grep -v Warning /tmp/j/$rec.log | grep -v "^\s*return\|^\s*$" | tail -n ${TAIL:-6}
  cp figures/$rec.json /tmp/j/ 2>/dev/null; pack
done
stamp done
