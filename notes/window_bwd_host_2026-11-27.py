"""Seventeenth session: the gpt-oss window backward's host time (D = 64 and 128, bf16, B = 1, 64/8 heads, S = 4096,
sinks, window 128 and full causal). Per call: CUDA-event time of 50 calls back to back, host time of issuing 50
calls without a sync, and cProfile's top functions of 20 calls at D = 64 with the window.
    python notes/window_bwd_host_2026-11-27.py
"""
import cProfile
import pstats

import torch
from device_ab import gpu_and_host_ms  # notes/, the script's own folder

from course_utils import flash_attention
from course_utils.measure.benchmarks.ch06_gpt_oss import GPT_OSS_SHAPE, gpt_oss_inputs

for dim in (64, 128):
    for window in (128, None):
        q, k, v, sinks = gpt_oss_inputs(dict(GPT_OSS_SHAPE, dim=dim))
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, causal=True, window_size=window, sinks=sinks)
        d_out = torch.randn_like(out)
        call = lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True)  # noqa: E731
        ms, host = gpu_and_host_ms(call)
        print(f"D={dim} window={window}: {ms:.3f} ms a call back to back, host {host:.3f} ms", flush=True)
        if dim == 64 and window:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(20):
                call()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
