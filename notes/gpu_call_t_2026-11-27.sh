#!/bin/bash
# 2026-11-27 (twelfth session), device calls T1... (issues 26, 27). PART picks what runs:
#   T1: which kernels the peers launch where ours trails (notes/peer_kernels_2026-11-27.py); decode4's larger
#       K/V tiles for flash_decode (notes/decode4/dec4.py: precompile, check, bench at D=64's memory-bound shapes);
#   T2: the record's timing order against the backward's kernel time (notes/timing_order_2026-11-27.py, nvidia-smi
#       sampling clocks and power); decode4 at D=128's memory-bound shapes.
#   U1: chapters 08's and 07's comparisons with the peers re-measured in changing orders (bench.round_orders);
#   U2: chapters 07 and 08 executed in place.
source "$(dirname "$0")/device_call_lib.sh"
dec4() { stamp "decode4 $*"; timeout $1 python notes/decode4/dec4.py "${@:2}" 2>&1 | grep -v "Warning\|warnings.warn\|^\s*$" | grep "SUMMARY\|precompiled\|FAILED\|Error\|rc=" | tail -40; cp $OUT/*.jsonl /tmp/n/ 2>/dev/null; pack; }
case ${PART:?} in
  T1) stamp peers; timeout 150 python notes/peer_kernels_2026-11-27.py /tmp/n/peer_kernels.json 2>&1 | grep -v Warning | cut -c1-400 | tee /tmp/n/peer_kernels.log | tail -40; pack
      dec4 90 precompile; dec4 60 check
      dec4 110 bench 64 1,8 131072; dec4 100 bench 64 64 8192,32768 ;;
  T2) nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > /tmp/n/smi.csv &
      stamp "timing order"; timeout 200 python notes/timing_order_2026-11-27.py /tmp/n/timing_order.json 2>&1 | grep -v Warning | tee /tmp/n/timing_order.log | grep -v MARK | tail -24; kill %1; pack
      dec4 60 precompile; dec4 120 bench 128 8,64 8192,32768; dec4 100 bench 128 1,8 131072 ;;
  U1) TAIL=3 record ch08_backward_vs_peers_h100 260; TAIL=3 record ch07_forward_vs_peers_h100 200 ;;
  U2) notebook 07 200; notebook 08 180 ;;
esac
stamp done
