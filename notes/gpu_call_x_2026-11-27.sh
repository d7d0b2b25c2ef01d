#!/bin/bash
# 2026-11-27 (seventeenth session), device calls X... (issue 26): the D = 64 forward with one warpgroup per block
# issuing its own loads (flash_fwd_hopper_one_warpgroup_kernel), the default since this session. PART picks:
#   X1: chapter 07's persistent-vs-rotated record and ablation (version 21 added); the Hopper forward GPU tests.
#   X2: chapter 07's 40-case record; chapter 06's gpt-oss record (its full-causal layer now runs the new kernel).
#   X3: chapters 07 and 06 executed in place with those records (stored records, no refresh).
source "$(dirname "$0")/device_call_lib.sh"
case ${PART:?} in
  X1) TAIL=30 record ch07_persistent_vs_rotated_h100 200
      TAIL=4 record ch07_forward_ablation_h100 280
      stamp "Hopper forward GPU tests"; timeout 100 python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py \
        -k "persistent_forward or hopper_default" 2>&1 | tail -n 6 | tee /tmp/n/pytest_x1.log; pack ;;
  X2) TAIL=12 record ch07_forward_vs_peers_h100 300
      TAIL=12 record ch06_gpt_oss_h100 240 ;;
  X3) (unset COURSE_REFRESH_RECORDS; notebook 07 220; notebook 06 200) ;;
esac
stamp done
