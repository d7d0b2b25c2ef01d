#!/bin/bash
# 2026-11-27 (fourteenth session), device calls W1... (issues 26, 27). PART picks what runs:
#   W1: the D=64 short forward with no warp specialisation (notes/fwd64_nows_ab_2026-11-27.py); chapter 07's ablation
#       re-measured in changing orders.
#   W2: every GPU-only test, four pytest processes side by side (notes/gpu_tests_sharded.sh).
#   W3: the four tests W2 ran out of GPU memory in (five processes shared the GPU), one process; chapter 08's
#       ablation re-measured in changing orders.
#   W4: chapters 07 and 08 executed in place on the GPU with the re-measured ablations (stored records, no refresh).
#   W5: chapter 08 again (its claims cell split in two after W4); chapter 09's decode record in changing orders;
#       chapter 09 executed in place with it.
#   W6: is the D=64 S=1k forward's remaining gap the persistent schedule's last round? (notes/fwd64_tail_ab_2026-11-27.py)
source "$(dirname "$0")/device_call_lib.sh"
case ${PART:?} in
  W1) TAIL=40 ab notes/fwd64_nows_ab_2026-11-27.py fwd64_nows - 240
      TAIL=4 record ch07_forward_ablation_h100 260 ;;
  W2) stamp "GPU tests, sharded"; mkdir -p /tmp/n/tests; SHARDS=${SHARDS:-4} LIMIT=${LIMIT:-520} bash notes/gpu_tests_sharded.sh /tmp/n/tests; pack ;;
  W3) stamp "W2's out-of-memory tests alone"; timeout 240 python -m pytest -q -rs -p no:cacheprovider \
        "tests/test_varlen_decode_gpu.py::test_varlen_forward_backward[grid-True]" "tests/test_varlen_decode_gpu.py::test_varlen_window_sinks[gpt-oss]" \
        "tests/test_gpu.py::test_backward_full_size[True-64]" "tests/test_gpu.py::test_backward_gpt_oss_shape[128]" 2>&1 | tail -n 4 | tee /tmp/n/pytest_w3.log; pack
      TAIL=4 record ch08_backward_ablation_h100 260 ;;
  W4) (unset COURSE_REFRESH_RECORDS; notebook 07 220; notebook 08 200) ;;
  W5) (unset COURSE_REFRESH_RECORDS; notebook 08 200); TAIL=30 record ch09_decode_h100 200
      (unset COURSE_REFRESH_RECORDS; notebook 09 150) ;;
  W6) TAIL=20 ab notes/fwd64_tail_ab_2026-11-27.py fwd64_tail - 200 ;;
esac
stamp done
