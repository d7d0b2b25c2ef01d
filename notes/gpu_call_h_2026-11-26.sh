#!/bin/bash
# 2026-11-26 (eighth session), device call H (issues 26, 27): version 19 (dK/dV by TMA store) against the shipped
# backward, checked and timed beside the peers; chapter 09's split sweep with 2k and 4k keys.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/h; pack() { tar czf $OUT/call_h.tgz -C /tmp/h .; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee /tmp/h/gpu.txt
python -c "import torch, tilelang; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), tilelang.__version__)" | tee -a /tmp/h/gpu.txt
for part in ${PARTS:-splits fp16 bf16 long}; do
  [ "$part" = lpt ] && { stamp lpt; OUT=/tmp/h timeout ${LIMIT:-200} python notes/bwd_lpt_ab_2026-11-26.py > /tmp/h/lpt.log 2>&1; echo "exit $?" >> /tmp/h/lpt.log; grep "TFLOP\|exit\|rror" /tmp/h/lpt.log; pack; continue; }
  [ "$part" = ab ] && { stamp ab; OUT=/tmp/h timeout ${LIMIT:-200} python notes/bwd_epilogue_ab_2026-11-26.py > /tmp/h/ab.log 2>&1; echo "exit $?" >> /tmp/h/ab.log; grep "TFLOP\|exit\|rror" /tmp/h/ab.log; pack; continue; }
  stamp "$part"
  OUT=/tmp/h timeout ${LIMIT:-200} python notes/bwd_epilogue_probe_2026-11-26.py $part > /tmp/h/$part.log 2>&1; echo "exit $?" >> /tmp/h/$part.log
  grep -v Warning /tmp/h/$part.log | grep "TFLOP\|splits B\|exit\|rror" | tail -n 40
  pack
done
stamp done
