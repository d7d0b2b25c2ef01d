#!/bin/bash
# 2026-11-27 (ninth session), device calls N1-N3 (issues 26, 27). PART picks what runs:
#   N1: chapter 08's 40-case record and feature checks with version 21 (longest_first) the D=128 causal default;
#   N2: the packed-backward A/B (notes/packed_bwd_ab_2026-11-27.py), chapter 08's ablation, chapter 08 executed in place;
#   N3: chapter 09's packed record with the new packed defaults, chapter 09 executed in place.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/n; pack() { tar czf $OUT/call_n.tgz -C /tmp/n .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/n/gpu.txt
record() {  # name limit
  stamp "$1 (limit $2 s)"
  timeout $2 python -m course_utils.measure.benchmarks $1 > /tmp/n/$1.log 2>&1; echo "exit $?" >> /tmp/n/$1.log
  grep -v Warning /tmp/n/$1.log | grep -v "^\s*return\|^\s*$" | tail -n ${TAIL:-6}
  cp figures/$1.json /tmp/n/ 2>/dev/null; pack
}
notebook() {  # chapter limit
  stamp "chapter $1 in place (limit $2 s)"
  timeout $2 python -m course_utils.tooling.run_notebooks $1 --in-place --jobs 1 > /tmp/n/nb_$1.log 2>&1; echo "exit $?" >> /tmp/n/nb_$1.log
  tail -n 5 /tmp/n/nb_$1.log; cp notebooks/$1_*.ipynb /tmp/n/ 2>/dev/null; cp figures/ch$1_*.png figures/ch$1_*.svg /tmp/n/ 2>/dev/null; pack
}
case ${PART:?} in
  N1) record ch08_backward_vs_peers_h100 360; record ch08_feature_checks_h100 200 ;;
  N2) stamp "packed A/B"; timeout 240 python notes/packed_bwd_ab_2026-11-27.py /tmp/n/packed_ab.json 2>&1 | grep -v Warning | tee /tmp/n/packed_ab.log | tail -n 14; pack
      record ch08_backward_ablation_h100 200; notebook 08 150 ;;
  N3) record ch09_varlen_h100 200; notebook 09 200 ;;
esac
stamp done
