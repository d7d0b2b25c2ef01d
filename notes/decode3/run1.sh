#!/bin/bash
# Device call 1 (issue 27, helper decode3): bash run1.sh from the carried copy (.h1).
cd "$(dirname "$0")"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "== [t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/run.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $OUT/run.log
python -c "import torch, triton, tilelang, datetime; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, tilelang.__version__, torch.backends.cudnn.version(), datetime.datetime.utcnow().isoformat())" 2>&1 | tee -a $OUT/run.log
part() { local lim=$1; shift; stamp "$*"; timeout $lim python dec3.py "$@" 2>&1 | grep -v "^\s*$\|INFO\]\|Warning\|return F\.\|warnings.warn" | tail -60 >> $OUT/run.log; stamp "rc=${PIPESTATUS[0]}"; }
part 100 precompile
part 60 check
part 130 bench 64 64,8,1 131072,32768,8192,1024
part 150 bench 128 64,8,1 131072,32768,8192,1024
stamp done
