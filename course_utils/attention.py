"""``flash_attention``: the course's kernels behind one PyTorch-style function.

Kernels are compiled once per (shapes, dtype, variant, tiling, target) and cached, so calling
this in a loop costs one compilation.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from .flash_fwd import flash_fwd_kernel
from .flash_fwd_hopper import flash_fwd_hopper_kernel
from .reference import validate_attention_inputs
from .tiles import compile_kernel

__all__ = ["flash_attention", "ForwardConfig", "BackwardConfig", "default_forward_config",
           "default_backward_config", "is_hopper", "SUPPORTED", "TUNED_FORWARD_CONFIG",
           "HOPPER_FORWARD_CONFIGS"]

# What the kernels accept, per device type. The CPU path is for learning and testing at small sizes.
SUPPORTED = {
    "cuda": {"dtypes": (torch.float16, torch.bfloat16), "head_dims": (64, 128)},
    "cpu": {"dtypes": (torch.float32, torch.float16), "head_dims": (16, 32, 64, 128)},
}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class ForwardConfig(NamedTuple):
    """Tiling of the forward kernel, and which kernel: chapter 03/04's or (``overlap``) chapter 07's."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    overlap: bool = False  # softmax overlapped with async wgmma (Hopper only, chapter 07)
    pingpong: bool = False  # chapter 07's kernel only: the two consumer warpgroups take turns


def is_hopper():
    """Whether the current CUDA GPU is sm_90 (H100/H200), where wgmma and TMA exist."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# Best of the chapter 04 sweep on the H100 (figures/ch04_forward_sweep_h100.json), causal and not.
TUNED_FORWARD_CONFIG = ForwardConfig(128, 128, 1, 256)
# Chapter 07's kernel, tiled per (head dim, causal or window mask) from its sweep on the H100
# (figures/ch07_overlap_sweep_h100.json): wider key blocks pay with a mask (fewer iterations for
# the short rows), and ping-pong pays where the exponentials weigh most (D = 64 with a mask).
HOPPER_FORWARD_CONFIGS = {
    (128, False): ForwardConfig(128, 128, 2, 256, overlap=True),
    (128, True): ForwardConfig(128, 192, 2, 256, overlap=True),
    (64, False): ForwardConfig(128, 128, 2, 256, overlap=True),
    (64, True): ForwardConfig(128, 192, 2, 256, overlap=True, pingpong=True),
}


def default_forward_config(device_type, dim, masked=False):
    """The kernel and tiling used when none is given: small tiles on the CPU, the fastest on the GPU.

    ``masked``: causal or sliding-window attention.
    """
    if device_type == "cpu":
        return ForwardConfig(16, 16, 1, 1)
    if is_hopper() and (dim, bool(masked)) in HOPPER_FORWARD_CONFIGS:
        return HOPPER_FORWARD_CONFIGS[dim, bool(masked)]
    return TUNED_FORWARD_CONFIG


class BackwardConfig(NamedTuple):
    """Tiling of the main backward kernel: block_M queries per step, block_N resident keys."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int


def default_backward_config(device_type, dim):
    if device_type == "cpu":
        return BackwardConfig(16, 16, 1, 1)
    # Best of the chapter 05 sweep on the H100 (figures/ch05_backward_sweep_h100.json), causal and not.
    return BackwardConfig(64, 128, 1, 256)


@functools.lru_cache(maxsize=None)
def _compiled_forward(batch, heads, heads_kv, seq_q, seq_k, dim, dtype_name, causal, window_size,
                      has_sinks, sm_scale, config, target):
    variant = dict(heads_kv=heads_kv, causal=causal, window_size=window_size, has_sinks=has_sinks,
                   sm_scale=sm_scale, dtype=dtype_name)
    tiling = config._asdict()
    overlap, pingpong = tiling.pop("overlap"), tiling.pop("pingpong")
    if overlap:
        if target != "cuda" or not is_hopper():
            raise ValueError("ForwardConfig(overlap=True) is chapter 07's Hopper kernel: it needs an sm_90 GPU")
        func = flash_fwd_hopper_kernel(batch, heads, seq_q, seq_k, dim, **variant, **tiling, pingpong=pingpong)
    elif pingpong:
        raise ValueError("ForwardConfig(pingpong=True) needs overlap=True (chapter 07's Hopper kernel)")
    else:
        func = flash_fwd_kernel(batch, heads, seq_q, seq_k, dim, target=target, **variant, **tiling)
    return compile_kernel(func, out_idx=[4, 5], target=target, dtype=dtype_name)


@functools.lru_cache(maxsize=None)
def _compiled_backward(batch, heads, heads_kv, seq_q, seq_k, dim, dtype_name, causal, window_size,
                       sm_scale, config, target):
    """The three backward kernels (plus a cast for GQA's float32 dK/dV accumulators)."""
    small = 16 if target == "c" else 64
    threads = 1 if target == "c" else 128

    def build(func, out_idx):
        return compile_kernel(func, out_idx=out_idx, target=target, dtype=dtype_name)

    common = dict(dtype=dtype_name, target=target)
    pre = build(flash_bwd_preprocess_kernel(batch, heads, seq_q, dim, block=small, threads=threads, **common), [2])
    main = build(flash_bwd_kernel(batch, heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal,
                                  window_size=window_size, sm_scale=sm_scale, **common, **config._asdict()), [])
    post_q = build(flash_bwd_postprocess_kernel(batch, heads, seq_q, dim, scale=sm_scale, block=small,
                                                threads=threads, **common), [1])
    post_kv = None
    if heads_kv != heads:
        post_kv = build(flash_bwd_postprocess_kernel(batch, heads_kv, seq_k, dim, block=small, threads=threads,
                                                     **common), [1])
    return pre, main, post_q, post_kv


@functools.lru_cache(maxsize=None)
def _no_sinks(heads, device):
    """Sink logits of -inf for every head (cached: one fewer allocation and kernel launch per call)."""
    return torch.full((heads,), float("-inf"), device=device)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, window_size, sm_scale, fwd_config, bwd_config, target):
        fwd = _compiled_forward(
            q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], _DTYPE_NAMES[q.dtype],
            causal, window_size, sinks is not None, sm_scale, fwd_config, target)
        # "No sink" is a sink of logit -inf: its exp() is 0, so one kernel signature serves both.
        sink_logits = (sinks.detach().float().contiguous() if sinks is not None
                       else _no_sinks(q.shape[1], q.device))
        out, lse = fwd(q, k, v, sink_logits)
        ctx.save_for_backward(q, k, v, out, lse, sink_logits)
        ctx.options = (causal, window_size, sm_scale, bwd_config, target, sinks is not None)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse, sink_logits = ctx.saved_tensors
        causal, window_size, sm_scale, bwd_config, target, has_sinks = ctx.options
        pre, main, post_q, post_kv = _compiled_backward(
            q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], _DTYPE_NAMES[q.dtype],
            causal, window_size, sm_scale, bwd_config, target)
        d_out = d_out.contiguous()
        delta = pre(out, d_out)
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if post_kv is None:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        else:
            dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
        main(q, k, v, d_out, lse, delta, dq_acc, dk, dv)
        dq = post_q(dq_acc)
        if post_kv is not None:
            dk, dv = post_kv(dk), post_kv(dv)
        d_sinks = None
        if has_sinks and ctx.needs_input_grad[3]:
            # d(loss)/d(sink_h) = -Σ_{b,i} P_sink[b,h,i] · Δ[b,h,i], with P_sink = exp(sink_h - LSE).
            p_sink = torch.exp(sink_logits[None, :, None] - lse)
            d_sinks = -(p_sink * delta).sum(dim=(0, 2))
        return dq, dk, dv, d_sinks, None, None, None, None, None, None


def _check_supported(q):
    device_type = q.device.type
    if device_type not in SUPPORTED:
        raise ValueError(f"flash_attention runs on CUDA or the CPU; got device {q.device}")
    support = SUPPORTED[device_type]
    if q.dtype not in support["dtypes"]:
        names = ", ".join(str(d) for d in support["dtypes"])
        raise ValueError(f"on {device_type}, flash_attention supports dtypes {names}; got {q.dtype}")
    if q.shape[-1] not in support["head_dims"]:
        raise ValueError(f"on {device_type}, head_dim must be one of {support['head_dims']}; got {q.shape[-1]}")


def flash_attention(q, k, v, causal=False, sm_scale=None, *, window_size=None, sinks=None,
                    return_lse=False, config=None, backward_config=None):
    """Attention with the course's TileLang FlashAttention kernel.

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (GQA). ``window_size``
    W lets a query see its last W keys (implies causal); ``sinks`` is a float tensor [H] of
    per-head sink logits (gpt-oss). Returns O (and the natural-log LSE [B, H, S_q] in float32 with
    ``return_lse``). Masking conventions are those of ``course_utils.reference``. Differentiable
    with respect to q, k, v and sinks: ``out.backward(d_out)`` runs the backward kernels.
    """
    validate_attention_inputs(q, k, v, window_size=window_size, sinks=sinks)
    _check_supported(q)
    device_type = q.device.type
    dim = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    masked = bool(causal or window_size is not None)
    config = ForwardConfig(*config) if config is not None else default_forward_config(device_type, dim, masked)
    target = "cuda" if device_type == "cuda" else "c"
    bwd_config = (BackwardConfig(*backward_config) if backward_config is not None
                  else default_backward_config(device_type, dim))
    out, lse = _FlashAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), sinks, masked,
        window_size, sm_scale, config, bwd_config, target)
    return (out, lse) if return_lse else out
