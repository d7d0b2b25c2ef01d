#!/bin/bash
# 2026-11-27 (thirteenth session), device calls V1... (issues 26, 27). PART picks what runs:
#   V1: the D=64 short forward with 64-row persistent tiles, one or two blocks per SM (notes/fwd64_rows_ab_2026-11-27.py);
#       chapter 08's deterministic record in changing orders; the two GPU tests of test_varlen_decode_gpu.py not reached.
#   V2: the same with a third stage and 64-key tiles at two or three blocks per SM (set V2 of the script).
#   V3: (D64_SHORT_FORWARD_CONFIGS shipped) set V3 (S = 1k causal confirmed); the GPU forward tests; chapter 07's
#       comparison with the peers re-measured. V4: its persistent-vs-rotated record.
#   V5: how close the host's time per call is to a short kernel's (notes/host_headroom_2026-11-27.py); the
#       persistent-vs-rotated record again (V4's D=128 causal 1k row: ours and cuDNN both slowed, FA2 not); chapter
#       07 executed in place.
#   V6: (flash_attention keeps a plan per signature and launches the forward through TVM-FFI's main, skipping
#       autograd when nothing needs a gradient) the host headroom again; GPU forward tests; chapter 07's two
#       comparison records re-measured.
#   V7: chapter 07 executed (stored records, no refresh); chapter 08's comparison re-measured; chapter 08 executed.
source "$(dirname "$0")/device_call_lib.sh"
case ${PART:?} in
  V1) TAIL=40 ab notes/fwd64_rows_ab_2026-11-27.py fwd64 - 300
      TAIL=4 record ch08_deterministic_h100 150
      stamp "varlen window sinks tests"; timeout 150 python -m pytest -q -x tests/test_varlen_decode_gpu.py -k test_varlen_window_sinks 2>&1 | tail -n 5 | tee /tmp/n/pytest_v1.log; pack ;;
  V2) TAIL=60 ab notes/fwd64_rows_ab_2026-11-27.py fwd64_v2 V2 300 ;;
  V3) TAIL=30 ab notes/fwd64_rows_ab_2026-11-27.py fwd64_v3 V3 120
      stamp "GPU forward tests"; timeout 200 python -m pytest -q tests/test_gpu.py -k "forward or query_blocks or hidden_key or sinks_that or persistent" 2>&1 | tail -n 8 | tee /tmp/n/pytest_v3.log; pack
      TAIL=3 record ch07_forward_vs_peers_h100 150 ;;
  V4) TAIL=20 record ch07_persistent_vs_rotated_h100 240 ;;
  V5) stamp "host headroom"; timeout 90 python notes/host_headroom_2026-11-27.py /tmp/n/host_headroom.json 2>&1 | grep -v Warning | tee /tmp/n/host_headroom.log | tail -n 45; pack
      TAIL=20 record ch07_persistent_vs_rotated_h100 150; notebook 07 200 ;;
  V6) stamp "host headroom"; timeout 90 python notes/host_headroom_2026-11-27.py /tmp/n/host_headroom_v6.json 2>&1 | grep -v Warning | tee /tmp/n/host_headroom_v6.log | awk 'NR%5==1' | tail -n 12; pack
      stamp "GPU forward tests"; timeout 170 python -m pytest -q -x tests/test_gpu.py -k "forward_full_size or gpt_oss_shape or persistent or query_blocks or hidden_key" 2>&1 | tail -n 6 | tee /tmp/n/pytest_v6.log; pack
      TAIL=3 record ch07_forward_vs_peers_h100 150; TAIL=20 record ch07_persistent_vs_rotated_h100 150 ;;
  V7) (unset COURSE_REFRESH_RECORDS; notebook 07 200); TAIL=3 record ch08_backward_vs_peers_h100 260; (unset COURSE_REFRESH_RECORDS; notebook 08 150) ;;
esac
stamp done
