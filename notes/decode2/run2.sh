#!/bin/bash
# Device call 2 (issue 27, helper decode2), ≤ 240 s: bash run2.sh from .h2 (the carried copy).
cd "$(dirname "$0")"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "== [t+$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/run.log; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a $OUT/run.log
python -c "import torch, triton, tilelang; print(torch.__version__, triton.__version__, tilelang.__version__, torch.backends.cudnn.version())" 2>&1 | tee -a $OUT/run.log
part() { local lim=$1; shift; stamp "$*"; timeout $lim python dec.py "$@" 2>&1 | grep -v "^\s*$\|INFO\]" | tail -40 >> $OUT/run.log; stamp "rc=${PIPESTATUS[0]}"; }
part 28 precompile
part 14 host
stamp tests
timeout 32 python -m pytest -q -x -p no:cacheprovider tests/test_varlen_decode_gpu.py -k "gpt_oss_shape or replays" 2>&1 | tail -8 >> $OUT/run.log
stamp "tests rc=${PIPESTATUS[0]}"
part 58 bench 64 1,8,64 1024,8192,32768,131072
part 58 bench 128 1,8,64 1024,8192,32768,131072
part 34 sweep 1x131072x64,8x131072x64,1x32768x64,1x131072x128,8x32768x64,8x131072x128,1x32768x128,8x32768x128
stamp done
