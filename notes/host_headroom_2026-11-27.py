"""Thirteenth session (issue 26): is a 150-µs forward close to being bound by the host? (python ... OUT.json)

Twice a record's D=128 causal S=1k row came out slow for ours and cuDNN alike while FlashAttention-2 (the slowest)
kept its time (2026-11-27: bf16 0.200 against 0.152 ms in call U1; fp16 0.274 and cuDNN 0.240 against 0.153/0.157
in call V4). If the host's time to issue one call is near the kernel's, a slower host turns back-to-back calls into
host-bound ones. Per implementation: the host time to issue 200 calls (no sync; the GPU queue is drained first),
and the CUDA-event time per call of the same 200, five times each.
"""
import json
import sys
import time

import torch

from course_utils import flash_attention
from course_utils.measure.benchmarks.common import CUDNN, FA2, SDPA_PEERS, sdpa

out_path = sys.argv[1]
rows = []
for dtype, dim, causal, seq in [("float16", 128, True, 1024), ("float16", 64, True, 1024),
                                ("float16", 128, False, 4096)]:
    heads = 2048 // dim
    q, k, v = (torch.randn(16384 // seq, heads, seq, dim, device="cuda", dtype=getattr(torch, dtype))
               for _ in range(3))
    fns = {"ours": lambda: flash_attention(q, k, v, causal=causal)}
    for peer in (CUDNN, FA2):
        fns[peer] = lambda peer=peer: sdpa(q, k, v, causal, SDPA_PEERS[peer])
    for name, fn in fns.items():
        for _ in range(20):
            fn()
        for rep in range(5):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(200):
                fn()
            end.record()
            host_us = (time.perf_counter() - t0) / 200 * 1e6
            end.synchronize()
            gpu_us = start.elapsed_time(end) / 200 * 1e3
            rows.append(dict(case=f"{dtype} D{dim} causal={causal} S={seq}", impl=name, rep=rep,
                             host_us_per_call=host_us, gpu_us_per_call=gpu_us))
            print(f"{rows[-1]['case']:32} {name:32} host {host_us:7.1f} µs/call, events {gpu_us:7.1f} µs/call",
                  flush=True)
json.dump(rows, open(out_path, "w"), indent=1)
