#!/bin/bash
# GPU tests of this session's changes on the H100, in one device call: the decoding tests (CUDA-graph
# replay, no host sync), the Hopper backward's single-step stress test and the other Hopper backward tests,
# three processes side by side (correctness only, nothing timed). Logs under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch, tilelang; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version(), 'tilelang', tilelang.__version__)" | tee -a $OUT/gpu.txt
LIMIT=${LIMIT:-330}
(timeout $LIMIT bash notes/run_ch09_decode_h100.sh tests > $OUT/decode.log 2>&1; echo "exit $?" >> $OUT/decode.log) &
(timeout $LIMIT python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py -k stress > $OUT/stress.log 2>&1; echo "exit $?" >> $OUT/stress.log) &
(timeout $LIMIT python -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py tests/test_hopper_backward.py -k "hopper_backward and not stress" > $OUT/hopper.log 2>&1; echo "exit $?" >> $OUT/hopper.log) &
wait
tail -5 $OUT/*.log
