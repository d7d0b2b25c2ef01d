# bwd3 GPU call 1 (2026-11-26): profiler first (fewest kernels), then compile everything, then check + time.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt 2>&1
python -c "import torch;print(torch.cuda.get_device_name())" >> $OUT/gpu.txt 2>&1
timeout 150 python bwd3/gpu_bwd3.py profile > $OUT/profile.log 2>&1; echo "profile exit $?" >> $OUT/profile.log
timeout 200 python bwd3/gpu_bwd3.py compile > $OUT/compile.log 2>&1; echo "compile exit $?" >> $OUT/compile.log
timeout 220 python bwd3/gpu_bwd3.py main > $OUT/main.log 2>&1; echo "main exit $?" >> $OUT/main.log
tail -3 $OUT/compile.log; grep -c FAILED $OUT/compile.log; tail -40 $OUT/main.log; tail -c 3000 $OUT/profile.log
