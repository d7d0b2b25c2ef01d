"""Seventeenth session: why gpt-oss's window backward at D = 64 takes longer than at D = 128 (ch06 record: 0.72 ms
against 0.60 ms for 16x fewer FLOPs than the full-causal layer). torch.profiler over 5 calls of the backward
(forward excluded), bf16, B = 1, 64/8 heads, S = 4096, sinks, window 128: each kernel's total GPU time.
    python notes/window_bwd_profile_2026-11-27.py OUT.json
"""
import json
import sys

import torch

from course_utils import flash_attention
from course_utils.api.attention import backward_kernels
from course_utils.measure.benchmarks.ch06_gpt_oss import GPT_OSS_SHAPE, gpt_oss_inputs

result = {}
for dim in (64, 128):
    for window in (128, None):
        q, k, v, sinks = gpt_oss_inputs(dict(GPT_OSS_SHAPE, dim=dim))
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        out = flash_attention(*leaves[:3], causal=True, window_size=window, sinks=leaves[3])
        d_out = torch.randn_like(out)
        kern = backward_kernels(q, k, causal=True, window_size=window)
        for _ in range(3):
            torch.autograd.grad(out, leaves, d_out, retain_graph=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.autograd.grad(out, leaves, d_out, retain_graph=True)
            torch.cuda.synchronize()
        rows = sorted(((e.key, e.device_time_total / 5, e.count // 5) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[1])
        label = f"D={dim} window={window}"
        result[label] = dict(kernels=rows[:12], deterministic_dq=kern.dq is not None)
        print(label, "total µs per call", round(sum(r[1] for r in rows), 1))
        for name, us, n in rows[:8]:
            print(f"   {us:9.1f} µs x{n}  {name[:110]}")
json.dump(result, open(sys.argv[1], "w"), indent=1, default=str)
