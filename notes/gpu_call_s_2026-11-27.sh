#!/bin/bash
# 2026-11-27 (eleventh session), device calls S3-S5 (issues 26, 27); calls S1 and S2 ran notes/ab_2026-11-27c.py's
# parts PFB and C directly. PART picks what runs:
#   S3: the packed causal backward's rows (A/B part D); chapter 08's 40-case and deterministic records (version 23);
#   S4: chapter 08's feature checks and ablation, chapter 09's packed record;
#   S4b (run directly, warm after S4; 285 s limit): the backward's and packed batches' GPU tests
#       (python -m pytest -q -x tests/test_gpu.py -k "backward or bwd or packed or varlen" tests/test_varlen_decode_gpu.py);
#   S5: chapters 08 and 09 executed in place.
source "$(dirname "$0")/device_call_lib.sh"
case ${PART:?} in
  S3) ab notes/ab_2026-11-27c.py packed_bwd_ab D 150; record ch08_backward_vs_peers_h100 250; record ch08_deterministic_h100 90 ;;
  S4) record ch08_feature_checks_h100 130; record ch08_backward_ablation_h100 160; record ch09_varlen_h100 170 ;;
  S5) notebook 08 170; notebook 09 150 ;;
esac
stamp done
