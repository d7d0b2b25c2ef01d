#!/bin/bash
# Device call 2 (issue 27, helper decode3): bash run1.sh from the carried copy (.h1).
cd "$(dirname "$0")"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DEC3_CALL=2
T0=$(date +%s)
stamp() { echo "== [t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/run.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $OUT/run.log
python -c "import torch, triton, tilelang, datetime; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, tilelang.__version__, torch.backends.cudnn.version(), datetime.datetime.utcnow().isoformat())" 2>&1 | tee -a $OUT/run.log
part() { local lim=$1; shift; stamp "$*"; timeout $lim python dec3.py "$@" 2>&1 | grep -v "^\s*$\|INFO\]\|Warning\|return F\.\|warnings.warn" | tail -30 >> $OUT/run.log; stamp "rc=${PIPESTATUS[0]}"; }
part 120 precompile
part 60 check
stamp tests
timeout 60 python -m pytest -q -x -p no:cacheprovider tests/test_varlen_decode_gpu.py -k "gpt_oss_shape or replays" 2>&1 | tail -8 >> $OUT/run.log
stamp "tests rc=${PIPESTATUS[0]}"
part 130 bench 64 64,8,1 131072,32768,8192,1024
part 150 bench 128 64,8,1 131072,32768,8192,1024
stamp done
