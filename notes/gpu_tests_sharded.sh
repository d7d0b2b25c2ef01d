#!/bin/bash
# Every GPU-only test (the 107 that CI skips) in SHARDS pytest processes side by side on one GPU (the machine has no
# pytest-xdist); each shard takes every SHARDS-th test id. Usage: SHARDS=4 LIMIT=500 bash notes/gpu_tests_sharded.sh LOGDIR
LOGDIR=${1:?}; SHARDS=${SHARDS:-4}; LIMIT=${LIMIT:-500}
FILES="tests/test_gpu.py tests/test_varlen_decode_gpu.py tests/test_checks_and_bench.py tests/test_exercises_late.py"
python -m pytest -q -p no:cacheprovider --co $FILES 2>/dev/null | grep "::" > $LOGDIR/ids.txt
for s in $(seq 0 $((SHARDS - 1))); do
  awk -v s=$s -v n=$SHARDS 'NR % n == s' $LOGDIR/ids.txt > $LOGDIR/shard$s.txt
  mapfile -t ids < $LOGDIR/shard$s.txt  # ids may hold spaces (parametrised names)
  (timeout $LIMIT python -m pytest -q -rfEs -p no:cacheprovider "${ids[@]}" > $LOGDIR/shard$s.log 2>&1
   echo "exit $?" >> $LOGDIR/shard$s.log) &
done
wait
for s in $(seq 0 $((SHARDS - 1))); do echo "shard $s: $(grep -E 'passed|failed|error' $LOGDIR/shard$s.log | tail -1) $(tail -1 $LOGDIR/shard$s.log)"; done
grep -h -E "^(FAILED|ERROR)" $LOGDIR/shard*.log | head -20
