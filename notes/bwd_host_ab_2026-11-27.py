"""Seventeenth session: the backward's host time after its kernels are called through their TVM-FFI ``main``
(``tiles.allocating_launcher``/``launcher``), on gpt-oss's layers (bf16, B = 1, 64/8 heads, S = 4096, sinks;
D = 64 and 128, window 128 and full causal) and on chapter 08's D = 64 causal S = 1k shape: per call, the
CUDA-event time of 50 calls back to back and the host time of issuing 50 calls without a sync; every gradient
checked against float64 first (gpt-oss D = 64 window, and the 1k case).
    python notes/bwd_host_ab_2026-11-27.py
"""

import torch
from device_ab import gpu_and_host_ms  # notes/, the script's own folder

from course_utils import flash_attention
from course_utils.checking.validation import check_backward
from course_utils.measure.benchmarks.ch06_gpt_oss import GPT_OSS_SHAPE, gpt_oss_inputs

cases = [(f"gpt-oss D={d} window={w}", dict(GPT_OSS_SHAPE, dim=d), w) for d in (64, 128) for w in (128, None)]
cases.append(("D=64 causal S=1k B=16 H=32 fp16", dict(batch=16, heads=32, heads_kv=32, seq=1024, dim=64), None))
for label, shape, window in cases:
    q, k, v, sinks = gpt_oss_inputs(shape, dtype=torch.float16 if "fp16" in label else torch.bfloat16)
    sinks = None if "fp16" in label else sinks
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=True, window_size=window, sinks=sinks)
    d_out = torch.randn_like(out)
    if (window and "D=64" in label) or "fp16" in label:
        grads = torch.autograd.grad(out, leaves, d_out, retain_graph=True)
        check_backward(q, k, v, d_out, grads, causal=True, window_size=window, sinks=sinks, name=label)
    ms, host = gpu_and_host_ms(lambda: torch.autograd.grad(out, leaves, d_out, retain_graph=True))
    print(f"{label}: {ms:.3f} ms a call back to back, host {host:.3f} ms", flush=True)
