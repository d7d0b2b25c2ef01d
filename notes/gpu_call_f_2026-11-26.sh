#!/bin/bash
# 2026-11-26 (seventh session), device call F (issues 26, 27): chapter 08's ablation (versions 17, 18 new) and
# chapter 09's records (decode with two K/V heads per block at D=64, its split rule, packed batches).
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/f; pack() { tar czf $OUT/call_f.tgz -C /tmp/f .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/f/gpu.txt
for spec in ${RECS:-ch09_decode_h100:130 ch09_decode_splits_h100:60 ch09_varlen_h100:90 ch08_backward_ablation_h100:220}; do
  rec=${spec%%:*}; limit=${spec##*:}
  stamp "$rec (limit $limit s)"
  timeout $limit python -m course_utils.measure.benchmarks $rec > /tmp/f/$rec.log 2>&1; echo "exit $?" >> /tmp/f/$rec.log
  grep -v Warning /tmp/f/$rec.log | grep -v "^\s*return\|^\s*$" | tail -n 4
  cp figures/$rec.json /tmp/f/ 2>/dev/null; pack
done
stamp done
