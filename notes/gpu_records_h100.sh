#!/bin/bash
# Records of this session on the H100, in one device call, each benchmark alone on the GPU:
# chapter 09's decoding record (flash_decode with its defaults next to cuDNN, FA2, torch.sum) and
# chapter 11's flex record (ours vs PyTorch's compiled flex_attention and SDPA). JSON and logs under $OUT.
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
for spec in ch11_flex_h100:${FLEX_LIMIT:-330} ch09_decode_h100:${DECODE_LIMIT:-250}; do
  rec=${spec%%:*}; limit=${spec##*:}
  echo "[$(date -u +%T)] $rec (limit $limit s)"
  timeout $limit python -m course_utils.measure.benchmarks $rec > $OUT/$rec.log 2>&1; echo "exit $?" >> $OUT/$rec.log
  tail -30 $OUT/$rec.log
  cp figures/$rec.json $OUT/ 2>/dev/null
done
