"""Issue 26 diagnostic (2026-11-26): the ch08 comparison record puts our backward at 0.85x cuDNN (fp16 D128 S4k),
do_bench side by side at 0.94x (2026-11-24). Same case, fresh process: both timing methods, ours and cuDNN."""
import json, os, sys
import torch, triton
import course_utils  # noqa: F401
from course_utils import flash_attention
from course_utils.measure.bench import time_side_by_side
from course_utils.measure.benchmarks.common import CUDNN, backward_timer, random_inputs, sdpa, SDPA_PEERS

rows = []
for dim, causal in ((128, False), (128, True), (64, False)):
    shape = dict(batch=4, heads=2048 // dim, seq=4096, dim=dim)
    q, k, v = random_inputs(shape, torch.float16)
    fns = {"ours": backward_timer(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v)[0],
           "cudnn": backward_timer(lambda a, b, c: sdpa(a, b, c, causal, SDPA_PEERS[CUDNN]), q, k, v)[0]}
    record = time_side_by_side(fns)
    bench = {n: triton.testing.do_bench(f, warmup=50, rep=300) for n, f in fns.items()}
    bench2 = {n: triton.testing.do_bench(f, warmup=50, rep=300) for n, f in reversed(list(fns.items()))}
    row = dict(dim=dim, causal=causal, record_ms=record, do_bench_ms=bench, do_bench_again_ms=bench2,
               record_ratio=record["cudnn"] / record["ours"], do_bench_ratio=bench["cudnn"] / bench["ours"])
    rows.append(row); print(json.dumps(row))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "bwd_timing_diag.json"), "w"), indent=1)
