"""``flash_attention``: the course's kernels behind one PyTorch-style function.

Kernels are compiled once per (shapes, dtype, variant, tiling, target) and cached, so calling
this in a loop costs one compilation. The compiled kernels are public too, for the chapters that
take the pieces apart: ``forward_kernel`` and ``backward_kernels`` return what ``flash_attention``
would run on given inputs, and ``attention_backward`` is its backward pass as a plain function.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from .flash_fwd import flash_fwd_kernel
from .flash_fwd_hopper import flash_fwd_hopper_kernel
from .reference import validate_attention_inputs
from .tiles import compile_kernel

__all__ = ["flash_attention", "attention_backward", "forward_kernel", "backward_kernels", "BackwardKernels",
           "ForwardConfig", "BackwardConfig", "sink_logits", "check_sm_scale", "default_forward_config", "default_backward_config", "is_hopper",
           "SUPPORTED", "TUNED_FORWARD_CONFIG", "HOPPER_FORWARD_CONFIGS", "FORWARD_KERNELS", "BACKWARD_KERNELS"]

# What the kernels accept, per device type. The CPU path is for learning and testing at small sizes.
SUPPORTED = {
    "cuda": {"dtypes": (torch.float16, torch.bfloat16), "head_dims": (64, 128)},
    "cpu": {"dtypes": (torch.float32, torch.float16), "head_dims": (16, 32, 64, 128)},
}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# The kernels a ForwardConfig or BackwardConfig can select: chapter 03/04's and chapter 07's Hopper
# forward; chapter 05's backward.
FORWARD_KERNELS = {"flash_fwd": flash_fwd_kernel, "flash_fwd_hopper": flash_fwd_hopper_kernel}
BACKWARD_KERNELS = {"flash_bwd": flash_bwd_kernel}


class ForwardConfig(NamedTuple):
    """Which forward kernel (``FORWARD_KERNELS``) and its tiling."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    kernel: str = "flash_fwd"
    pingpong: bool = False  # flash_fwd_hopper only: the two consumer warpgroups take turns

    def tiling(self):
        """The tiling as keyword arguments of a kernel factory."""
        return dict(block_M=self.block_M, block_N=self.block_N, num_stages=self.num_stages, threads=self.threads)


def is_hopper():
    """Whether the current CUDA GPU is sm_90 (H100/H200), where wgmma and TMA exist."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# Best of the chapter 04 sweep on the H100 (figures/ch04_forward_sweep_h100.json), causal and not.
TUNED_FORWARD_CONFIG = ForwardConfig(128, 128, 1, 256)
# Chapter 07's kernel, tiled per (head dim, causal or window mask) from its sweep on the H100
# (figures/ch07_overlap_sweep_h100.json): wider key blocks pay with a mask (fewer iterations for
# the short rows), and ping-pong pays where the exponentials weigh most (D = 64 with a mask).
HOPPER_FORWARD_CONFIGS = {
    (128, False): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"),
    (128, True): ForwardConfig(128, 192, 2, 256, kernel="flash_fwd_hopper"),
    (64, False): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"),
    (64, True): ForwardConfig(128, 192, 2, 256, kernel="flash_fwd_hopper", pingpong=True),
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
    """Which backward kernel (``BACKWARD_KERNELS``) and its tiling: block_M queries per step, block_N resident keys."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    kernel: str = "flash_bwd"

    tiling = ForwardConfig.tiling


def default_backward_config(device_type):
    """The backward tiling used when none is given: small tiles on the CPU, the chapter 05 sweep's best on the GPU."""
    if device_type == "cpu":
        return BackwardConfig(16, 16, 1, 1)
    # Best of the chapter 05 sweep on the H100 (figures/ch05_backward_sweep_h100.json), causal and not.
    return BackwardConfig(64, 128, 1, 256)


class _Problem(NamedTuple):
    """Everything a compiled kernel is specialised for (the key of the kernel caches)."""

    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    dim: int
    dtype: str
    masked: bool
    window_size: int | None
    sm_scale: float
    target: str


def _problem(q, k, *, causal, window_size, sm_scale):
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    return _Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], _DTYPE_NAMES[q.dtype],
                    bool(causal or window_size is not None), window_size, sm_scale,
                    "cuda" if q.device.type == "cuda" else "c")


# Bounded: a loop over many sequence lengths must not keep every compiled kernel alive.
_CACHE_SIZE = 64


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compiled_forward(problem, has_sinks, config):
    pr = problem
    if config.kernel not in FORWARD_KERNELS:
        raise ValueError(f"ForwardConfig.kernel must be one of {sorted(FORWARD_KERNELS)}; got {config.kernel!r}")
    tiling = config.tiling()
    variant = dict(heads_kv=pr.heads_kv, causal=pr.masked, window_size=pr.window_size, has_sinks=has_sinks,
                   sm_scale=pr.sm_scale, dtype=pr.dtype)
    if config.kernel == "flash_fwd_hopper":
        if pr.target != "cuda" or not is_hopper():
            raise ValueError("ForwardConfig(kernel='flash_fwd_hopper') is chapter 07's Hopper kernel: it needs an sm_90 GPU")
        func = flash_fwd_hopper_kernel(pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, **variant, **tiling,
                                       pingpong=config.pingpong)
    elif config.pingpong:
        raise ValueError("ForwardConfig(pingpong=True) needs kernel='flash_fwd_hopper' (chapter 07's Hopper kernel)")
    else:
        func = flash_fwd_kernel(pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, target=pr.target, **variant, **tiling)
    return compile_kernel(func, out_idx=[4, 5], target=pr.target, dtype=pr.dtype)


class BackwardKernels(NamedTuple):
    """The compiled backward: Δ, then dK/dV and the float32 dQ accumulator, then the dQ (and GQA dK/dV) casts."""

    preprocess: object  # (O, dO) -> Δ
    main: object  # (Q, K, V, dO, LSE, Δ, dQ_acc, dK, dV) -> None, accumulating in place
    postprocess_dq: object  # dQ_acc -> sm_scale · dQ_acc in the input dtype
    postprocess_dkv: object  # GQA only (else None): the float32 dK/dV accumulators -> the input dtype


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compiled_backward(problem, config):
    pr = problem
    small = 16 if pr.target == "c" else 64
    threads = 1 if pr.target == "c" else 128

    def build(func, out_idx):
        return compile_kernel(func, out_idx=out_idx, target=pr.target, dtype=pr.dtype)

    common = dict(dtype=pr.dtype, target=pr.target)
    pre = build(flash_bwd_preprocess_kernel(pr.batch, pr.heads, pr.seq_q, pr.dim, block=small, threads=threads,
                                            **common), [2])
    if config.kernel not in BACKWARD_KERNELS:
        raise ValueError(f"BackwardConfig.kernel must be one of {sorted(BACKWARD_KERNELS)}; got {config.kernel!r}")
    tiling = config.tiling()
    main = build(BACKWARD_KERNELS[config.kernel](pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, heads_kv=pr.heads_kv,
                                                 causal=pr.masked, window_size=pr.window_size, sm_scale=pr.sm_scale,
                                                 **common, **tiling), [])
    post_q = build(flash_bwd_postprocess_kernel(pr.batch, pr.heads, pr.seq_q, pr.dim, scale=pr.sm_scale, block=small,
                                                threads=threads, **common), [1])
    post_kv = None
    if pr.heads_kv != pr.heads:
        post_kv = build(flash_bwd_postprocess_kernel(pr.batch, pr.heads_kv, pr.seq_k, pr.dim, block=small,
                                                     threads=threads, **common), [1])
    return BackwardKernels(pre, main, post_q, post_kv)


def forward_kernel(q, k, *, causal=False, window_size=None, has_sinks=False, sm_scale=None, config=None):
    """The compiled forward ``flash_attention`` runs for queries like ``q`` and keys like ``k``.

    Call it as ``kernel(q, k, v, sink_logits) -> (out, lse)``, with float32 sink logits of shape [H]
    (all -inf for no sinks). ``config`` defaults to ``default_forward_config``.
    """
    problem = _problem(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale)
    if config is None:
        config = default_forward_config(q.device.type, q.shape[-1], problem.masked)
    return _compiled_forward(problem, bool(has_sinks), ForwardConfig(*config))


def backward_kernels(q, k, *, causal=False, window_size=None, sm_scale=None, config=None):
    """The compiled ``BackwardKernels`` ``flash_attention``'s backward runs for these shapes."""
    problem = _problem(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale)
    config = BackwardConfig(*config) if config is not None else default_backward_config(q.device.type)
    return _compiled_backward(problem, config)


@functools.lru_cache(maxsize=16)
def _no_sinks(heads, device):
    """Sink logits of -inf for every head (cached: one fewer allocation and kernel launch per call)."""
    return torch.full((heads,), float("-inf"), device=device)


def sink_logits(sinks, heads, device):
    """The kernels' ``Sinks`` argument: float32 logits [H], or -inf for every head when there are none.

    "No sink" is a sink of logit -inf: its exp() is 0, so one kernel signature serves both.
    """
    return sinks.detach().float().contiguous() if sinks is not None else _no_sinks(heads, device)


def attention_backward(q, k, v, out, lse, d_out, *, d_lse=None, causal=False, window_size=None, sinks=None,
                       sm_scale=None, config=None):
    """Gradients of attention from the forward's O and LSE: returns (dQ, dK, dV, dsinks or None).

    The backward half of ``flash_attention``, as a plain function: P is rebuilt from Q, K and the
    LSE, so it also serves ``out`` and ``lse`` that were merged from several partial forwards.
    ``d_lse`` is the gradient reaching the LSE (a loss that uses it, such as a z-loss): since
    ∂LSE_i/∂S_ij = P_ij, it joins dS = P ∘ (dP − Δ) as Δ − dLSE.
    """
    kernels = backward_kernels(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale, config=config)
    # region: three kernels
    d_out = d_out.contiguous()
    delta = kernels.preprocess(out, d_out)
    if d_lse is not None:
        delta = (delta - d_lse.float()).contiguous()
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # atomics add into it: zeroed
    # region: gqa
    if kernels.postprocess_dkv is None:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
    # endregion
    kernels.main(q, k, v, d_out, lse, delta, dq_acc, dk, dv)
    dq = kernels.postprocess_dq(dq_acc)
    if kernels.postprocess_dkv is not None:
        dk, dv = kernels.postprocess_dkv(dk), kernels.postprocess_dkv(dv)  # GQA: cast the float32 sums
    # endregion
    # region: dsinks
    d_sinks = None
    if sinks is not None:
        # d(loss)/d(sink_h) = -Σ_{b,i} P_sink[b,h,i] · (Δ − dLSE)[b,h,i], with P_sink = exp(sink_h - LSE).
        p_sink = torch.exp(sinks.detach().float()[None, :, None] - lse)
        d_sinks = -(p_sink * delta).sum(dim=(0, 2))
    # endregion
    return dq, dk, dv, d_sinks


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, window_size, sm_scale, fwd_config, bwd_config):
        fwd = forward_kernel(q, k, causal=causal, window_size=window_size, has_sinks=sinks is not None,
                             sm_scale=sm_scale, config=fwd_config)
        logits = sink_logits(sinks, q.shape[1], q.device)
        out, lse = fwd(q, k, v, logits)
        ctx.save_for_backward(q, k, v, out, lse, logits)
        ctx.options = dict(causal=causal, window_size=window_size, sm_scale=sm_scale, config=bwd_config)
        ctx.has_sinks = sinks is not None
        return out, lse

    @staticmethod
    @once_differentiable  # the backward is kernels, not PyTorch ops: a second derivative must raise, not drop terms
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, logits = ctx.saved_tensors
        sinks = logits if ctx.has_sinks and ctx.needs_input_grad[3] else None
        if d_out is None:  # only the LSE was used
            d_out = torch.zeros_like(out)
        dq, dk, dv, d_sinks = attention_backward(q, k, v, out, lse, d_out, d_lse=d_lse, sinks=sinks, **ctx.options)
        return dq, dk, dv, d_sinks, None, None, None, None, None


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


def check_sm_scale(sm_scale):
    """Raise ``ValueError`` unless ``sm_scale`` is None (1/√D) or a positive finite number."""
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                             or not math.isfinite(sm_scale) or sm_scale <= 0):
        raise ValueError(f"sm_scale must be a positive finite number (the kernels fold it into exp2); got {sm_scale!r}")


def flash_attention(q, k, v, causal=False, sm_scale=None, *, window_size=None, sinks=None,
                    return_lse=False, config=None, backward_config=None):
    """Attention with the course's TileLang FlashAttention kernel.

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (GQA). ``window_size``
    W lets a query see its last W keys (implies causal); ``sinks`` is a float tensor [H] of
    per-head sink logits (gpt-oss). Returns O (and the natural-log LSE [B, H, S_q] in float32 with
    ``return_lse``). Masking conventions are those of ``course_utils.reference``. Differentiable
    (once) with respect to q, k, v and sinks, through O and the LSE: ``out.backward(d_out)`` runs the
    backward kernels. ``sm_scale`` must be positive.
    """
    validate_attention_inputs(q, k, v, window_size=window_size, sinks=sinks)
    _check_supported(q)
    check_sm_scale(sm_scale)
    if window_size is not None and window_size >= k.shape[2]:
        window_size = None  # a window as long as the keys hides nothing that causal masking does not
        causal = True
    out, lse = _FlashAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks,
                                     bool(causal or window_size is not None), window_size, sm_scale, config,
                                     backward_config)
    return (out, lse) if return_lse else out
