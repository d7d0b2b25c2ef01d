#!/bin/bash
# 2026-11-27 (eighteenth session), device calls Y... PART picks what runs:
#   Y1: decode5 (notes/decode5/dec5.py): an L2 eviction hint on flash_decode's K/V loads, and more splits, at the
#       nine memory-bound shapes where cuDNN led in the kept record (issue 27).
#   Y2: where the backward's host time goes (notes/bwd_host_profile_2026-11-27.py); then every GPU-only test in six
#       shards (the forward's two-output launcher and the backward's FFI launchers had not run on a GPU together).
#   Y3: Y2's failed tests again, in two processes (six were out of memory beside five other shards; two, windows of
#       2 and 3 keys, failed to lower the one-warpgroup forward: fixed in 2582b2e), with the other tests of the
#       kernels that changed; chapter 06's gpt-oss record.
#   Y4: the one-warpgroup forward before and after 2582b2e (notes/owg_guard_ab_2026-11-27.py); the one test Y3 left
#       unrun after a Y2 failure; the host profile again (the backward no longer gets the LSE's zeros); chapter 06
#       executed in place with Y3's record.
#   Y5: every GPU-only test on the final code in four shards, then any that failed again in one process (Y2's six
#       shards ran out of GPU memory).
source "$(dirname "$0")/device_call_lib.sh"
Y3_TESTS="varlen_forward_backward or varlen_window_sinks or planted_bugs_at_full_size or stress_single_step or backward_full_size or gpt_oss_shape or persistent_forward_every_head or hopper_default"
dec5() { stamp "decode5 $*"; timeout $1 python notes/decode5/dec5.py "${@:2}" 2>&1 | grep -v "Warning\|warnings.warn\|^\s*$" | grep "SUMMARY\|precompiled\|FAILED\|Error\|rc=" | tail -40; cp $OUT/*.jsonl /tmp/n/ 2>/dev/null; pack; }
case ${PART:?} in
  Y1) dec5 120 precompile; dec5 90 check
      dec5 100 bench 64 64 8192,32768,131072; dec5 150 bench 128 64 1024,8192,32768,131072
      dec5 80 bench 128 1,8 131072,32768 ;;
  Y2) stamp "backward host profile"; timeout 120 python notes/bwd_host_profile_2026-11-27.py 2>&1 | grep -v Warning \
        > /tmp/n/bwd_host_profile.log; grep "^D=" /tmp/n/bwd_host_profile.log; pack
      stamp "GPU tests, six shards"; mkdir -p /tmp/n/tests; SHARDS=6 LIMIT=420 bash notes/gpu_tests_sharded.sh /tmp/n/tests
      pack ;;
  Y3) stamp "Y2's failures and the tests of the changed kernels, two processes"
      python -m pytest -q -p no:cacheprovider --co tests/test_gpu.py tests/test_varlen_decode_gpu.py -k "$Y3_TESTS" \
        2>/dev/null | grep "::" > /tmp/n/y3_ids.txt
      for s in 0 1; do awk -v s=$s 'NR % 2 == s' /tmp/n/y3_ids.txt > /tmp/n/y3_shard$s.txt
        (mapfile -t ids < /tmp/n/y3_shard$s.txt; timeout 270 python -m pytest -q -rs -p no:cacheprovider "${ids[@]}" \
          > /tmp/n/y3_shard$s.log 2>&1; echo "exit $?" >> /tmp/n/y3_shard$s.log) & done; wait
      for s in 0 1; do echo "shard $s: $(grep -E 'passed|failed' /tmp/n/y3_shard$s.log | tail -1)"; done
      grep -h -E "^(FAILED|ERROR)" /tmp/n/y3_shard*.log | head; pack
      TAIL=12 record ch06_gpt_oss_h100 220 ;;
  Y4) stamp "one-warpgroup guard A/B"; timeout 100 python notes/owg_guard_ab_2026-11-27.py 2>&1 | grep -v Warning \
        | tee /tmp/n/owg_guard_ab.log | tail -n 4; pack
      stamp "varlen gpt-oss test"; timeout 80 python -m pytest -q -p no:cacheprovider \
        "tests/test_varlen_decode_gpu.py::test_varlen_window_sinks[gpt-oss]" 2>&1 | tail -n 2 | tee /tmp/n/pytest_y4.log
      stamp "backward host profile"; timeout 100 python notes/bwd_host_profile_2026-11-27.py 2>&1 | grep -v Warning \
        > /tmp/n/bwd_host_profile_y4.log; grep "^D=" /tmp/n/bwd_host_profile_y4.log; pack
      (unset COURSE_REFRESH_RECORDS; notebook 06 220) ;;
  Y5) stamp "GPU tests, four shards"; mkdir -p /tmp/n/tests; SHARDS=4 LIMIT=420 bash notes/gpu_tests_sharded.sh /tmp/n/tests
      pack; grep -h -E "^(FAILED|ERROR) " /tmp/n/tests/shard*.log | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' > /tmp/n/rerun.txt
      if [ -s /tmp/n/rerun.txt ]; then stamp "again, one process: $(wc -l < /tmp/n/rerun.txt) tests"
        mapfile -t ids < /tmp/n/rerun.txt; timeout 130 python -m pytest -q -rs -p no:cacheprovider "${ids[@]}" 2>&1 \
          | tail -n 12 | tee /tmp/n/rerun.log; pack; fi ;;
esac
stamp done
