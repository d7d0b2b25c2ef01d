"""Chapter 01: the textbook attention in PyTorch against SDPA's FlashAttention-2 backend."""

import math

import torch
from torch.nn.attention import SDPBackend

from ...checking.validation import check_forward, references
from ...core.labels import FA2, NAIVE
from ..bench import attention_flops, tflops, time_cuda
from .common import random_inputs, sdpa

__all__ = ["naive_attention", "naive_vs_sdpa"]


def naive_attention(q, k, v, causal=False):
    """Textbook attention in PyTorch: materialises the S×S score matrix in HBM."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def naive_vs_sdpa(seq_lens=(256, 512, 1024, 2048, 4096, 8192), batch=4, heads=16, dim=64):
    """Time and peak memory of naive attention vs SDPA (FlashAttention-2 backend), fp16."""
    rows = []
    for seq in seq_lens:
        q, k, v = random_inputs(dict(batch=batch, heads=heads, seq=seq, dim=dim), torch.float16)
        flops = attention_flops(batch, heads, seq, seq, dim)
        impls = {NAIVE: lambda: naive_attention(q, k, v), FA2: lambda: sdpa(q, k, v, False, SDPBackend.FLASH_ATTENTION)}
        refs = references(q, k, v)  # both must be right, on every head, before either is timed
        err = {impl: check_forward(q, k, v, fn(), name=f"{impl} S={seq}", refs=refs, quiet=True)
               for impl, fn in impls.items()}
        for impl, fn in impls.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = time_cuda(fn)
            rows.append(dict(impl=impl, seq=seq, batch=batch, heads=heads, dim=dim, dtype="float16", ms=ms,
                             errors=err[impl],
                             tflops=tflops(flops, ms), peak_extra_bytes=peak))
        print(f"S={seq}: " + ", ".join(f"{r['impl']} {r['ms']:.3f} ms" for r in rows[-2:]))
    return rows
