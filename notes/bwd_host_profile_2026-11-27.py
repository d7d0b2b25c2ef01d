"""Eighteenth session: where the backward's host time goes (gpt-oss layers, bf16, B = 1, 64/8 heads, S = 4096, sinks,
D = 64 and 128, window 128 and full causal). The seventeenth session measured, per call, 0.32-0.34 ms of host time
issuing full-causal backwards without a sync, but 0.43 ms with the window at D = 64 (about its GPU time), which
hints at a wait for the GPU. Per case: CUDA-event time of 50 calls back to back and host time of 50 calls issued
without a sync; for the D = 64 cases, torch.profiler's CPU-side events of 20 calls (a cudaStreamSynchronize or
cudaMemcpy there would be a wait), sorted by self CPU time.
    python notes/bwd_host_profile_2026-11-27.py
"""

import torch
from device_ab import gpu_and_host_ms  # notes/, the script's own folder
from torch.profiler import ProfilerActivity, profile

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
        forward = lambda: flash_attention(*leaves, causal=True, window_size=window, sinks=sinks)  # noqa: E731
        fwd_ms, fwd_host = gpu_and_host_ms(forward)
        print(f"D={dim} window={window}: backward {ms:.3f} ms a call back to back, host {host:.3f} ms; "
              f"forward {fwd_ms:.3f}, host {fwd_host:.3f}", flush=True)
        if dim == 64:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48),
                  flush=True)
