# bwd3 GPU call 2 (2026-11-26): the two timing methods alternated with clocks sampled; D=64 dQ-by-rows over S.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt 2>&1
timeout 100 python bwd3/gpu_bwd3.py methods > $OUT/methods.log 2>&1; echo "methods exit $?" >> $OUT/methods.log
export BWD3_SWEEP=1
timeout 110 python bwd3/gpu_bwd3.py compile 1024 2048 4096 8192 16384 > $OUT/compile.log 2>&1; echo "compile exit $?" >> $OUT/compile.log
timeout 230 python bwd3/gpu_bwd3.py main 1024 2048 4096 8192 16384 > $OUT/main.log 2>&1; echo "main exit $?" >> $OUT/main.log
tail -2 $OUT/compile.log; grep -c FAILED $OUT/compile.log; grep -v "^\[" $OUT/main.log | tail -70; grep -E "median" $OUT/methods.log | head -80
