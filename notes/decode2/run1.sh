#!/bin/bash
# Device call 1 (issue 27, helper decode2): bash run1.sh from .h2 (the carried copy).
cd "$(dirname "$0")"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "== [t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/run.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $OUT/run.log
python -c "import torch, triton, tilelang; print(torch.__version__, triton.__version__, tilelang.__version__, torch.backends.cudnn.version())" 2>&1 | tee -a $OUT/run.log
part() { local lim=$1; shift; stamp "$*"; timeout $lim python dec.py "$@" 2>&1 | grep -v "^\s*$\|INFO\]" | tail -60 >> $OUT/run.log; stamp "rc=${PIPESTATUS[0]}"; }
part 75 precompile
part 25 host
part 100 bench 64 1,8,64 1024,8192,32768,131072
part 105 bench 128 1,8,64 1024,8192,32768,131072
part 80 sweep 1x131072x64,1x32768x64,8x131072x64,8x32768x64,1x131072x128,8x131072x128,1x32768x128,8x32768x128
stamp done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1 | tee -a $OUT/run.log
