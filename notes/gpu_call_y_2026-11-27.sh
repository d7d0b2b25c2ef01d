#!/bin/bash
# 2026-11-27 (eighteenth session), device calls Y... PART picks what runs:
#   Y1: decode5 (notes/decode5/dec5.py): an L2 eviction hint on flash_decode's K/V loads, and more splits, at the
#       nine memory-bound shapes where cuDNN led in the kept record (issue 27).
#   Y2: where the backward's host time goes (notes/bwd_host_profile_2026-11-27.py); then every GPU-only test in six
#       shards (the forward's two-output launcher and the backward's FFI launchers had not run on a GPU together).
#   Y3: chapter 06's gpt-oss record and chapter 08's record against the peers, with the backward's new launchers.
#   Y4: chapters 06 and 08 executed in place with those records.
source "$(dirname "$0")/device_call_lib.sh"
dec5() { stamp "decode5 $*"; timeout $1 python notes/decode5/dec5.py "${@:2}" 2>&1 | grep -v "Warning\|warnings.warn\|^\s*$" | grep "SUMMARY\|precompiled\|FAILED\|Error\|rc=" | tail -40; cp $OUT/*.jsonl /tmp/n/ 2>/dev/null; pack; }
case ${PART:?} in
  Y1) dec5 120 precompile; dec5 90 check
      dec5 100 bench 64 64 8192,32768,131072; dec5 150 bench 128 64 1024,8192,32768,131072
      dec5 80 bench 128 1,8 131072,32768 ;;
  Y2) stamp "backward host profile"; timeout 120 python notes/bwd_host_profile_2026-11-27.py 2>&1 | grep -v Warning \
        > /tmp/n/bwd_host_profile.log; grep "^D=" /tmp/n/bwd_host_profile.log; pack
      stamp "GPU tests, six shards"; mkdir -p /tmp/n/tests; SHARDS=6 LIMIT=420 bash notes/gpu_tests_sharded.sh /tmp/n/tests
      pack ;;
  Y3) TAIL=12 record ch06_gpt_oss_h100 240; TAIL=6 record ch08_backward_vs_peers_h100 300 ;;
  Y4) (unset COURSE_REFRESH_RECORDS; notebook 06 220; notebook 08 220) ;;
esac
stamp done
