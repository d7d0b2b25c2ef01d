#!/bin/bash
# 2026-11-27 (tenth session), device calls R1-R3 (issues 26, 27). PART picks what runs:
#   R1: the rotated query loop A/B (notes/bwd_rotate_ab_2026-11-27.py); the packed window+sinks GPU tests;
#   R2: the deferred dQ-wait A/B (notes/bwd_dq_wait_ab_2026-11-27.py);
#   R3: chapter 08's records (40 cases, deterministic, feature checks) with the winners as defaults;
#   R4: chapter 09's packed record, chapter 08's ablation, chapter 08 executed in place;
#   R5: chapters 08 and 09 executed in place, the backward's and packed batches' GPU tests.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/n; pack() { tar czf $OUT/call_r.tgz -C /tmp/n .; }
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
  R1) stamp "rotate A/B"; timeout 330 python notes/bwd_rotate_ab_2026-11-27.py /tmp/n/rotate_ab.json 2>&1 | grep -v Warning | tee /tmp/n/rotate_ab.log | tail -n 16; pack
      stamp "packed window tests"; timeout 200 python -m pytest -q -x "tests/test_varlen_decode_gpu.py::test_varlen_window_sinks" 2>&1 | tail -n 4 | tee /tmp/n/varlen_tests.log; pack ;;
  R2) stamp "dQ wait A/B"; timeout 400 python notes/bwd_dq_wait_ab_2026-11-27.py /tmp/n/dq_wait_ab.json 2>&1 | grep -v Warning | tee /tmp/n/dq_wait_ab.log | tail -n 16; pack ;;
  R3) record ch08_backward_vs_peers_h100 300; record ch08_deterministic_h100 110; record ch08_feature_checks_h100 150 ;;
  R4) record ch09_varlen_h100 200; record ch08_backward_ablation_h100 180; notebook 08 150 ;;
  R5) notebook 08 150; notebook 09 120; stamp "GPU tests"; timeout 280 python -m pytest -q -x tests/test_gpu.py -k "backward or bwd or packed or varlen" tests/test_varlen_decode_gpu.py 2>&1 | tail -n 6 | tee /tmp/n/gpu_tests.log; pack ;;
esac
stamp done
