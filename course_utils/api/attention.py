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

from ..core.reference import validate_attention_inputs
from ..kernels.flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from ..kernels.flash_bwd_hopper import PASS_CONFIGS as HOPPER_BACKWARD_PASS_CONFIGS
from ..kernels.flash_bwd_hopper import flash_bwd_hopper_dq_kernel, flash_bwd_hopper_kernel
from ..kernels.flash_fwd import flash_fwd_kernel
from ..kernels.flash_fwd_hopper import flash_fwd_hopper_kernel
from ..kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel
from ..kernels.tiles import compile_kernel

__all__ = ["flash_attention", "attention_backward", "forward_kernel", "backward_kernels", "BackwardKernels",
           "ForwardConfig", "BackwardConfig", "sink_logits", "check_sm_scale", "default_forward_config",
           "default_backward_config", "is_hopper", "SUPPORTED", "TUNED_FORWARD_CONFIG", "HOPPER_FORWARD_CONFIGS",
           "THREE_WARPGROUPS_MIN_SEQ", "hopper_forward_config", "FORWARD_KERNELS", "BACKWARD_KERNELS",
           "TUNED_BACKWARD_CONFIG", "HOPPER_BACKWARD_CONFIGS", "HOPPER_DQ_TILES"]

# What the kernels accept, per device type. The CPU path is for learning and testing at small sizes.
SUPPORTED = {
    "cuda": {"dtypes": (torch.float16, torch.bfloat16), "head_dims": (64, 128)},
    "cpu": {"dtypes": (torch.float32, torch.float16), "head_dims": (16, 32, 64, 128)},
}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# The kernels a ForwardConfig or BackwardConfig can select: chapter 03/04's forward, chapter 07's two
# Hopper forwards (the rotated loop, and its persistent version); chapter 05's and chapter 08's
# Hopper backward.
FORWARD_KERNELS = {"flash_fwd": flash_fwd_kernel, "flash_fwd_hopper": flash_fwd_hopper_kernel,
                   "flash_fwd_hopper_persistent": flash_fwd_hopper_persistent_kernel}
_HOPPER_KERNELS = ("flash_fwd_hopper", "flash_fwd_hopper_persistent")
BACKWARD_KERNELS = {"flash_bwd": flash_bwd_kernel, "flash_bwd_hopper": flash_bwd_hopper_kernel}


class ForwardConfig(NamedTuple):
    """Which forward kernel (``FORWARD_KERNELS``) and its tiling."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    kernel: str = "flash_fwd"
    pingpong: bool = False  # Hopper kernels only: the consumer warpgroups take turns issuing their matmuls

    def tiling(self):
        """The tiling as keyword arguments of a kernel factory."""
        return dict(block_M=self.block_M, block_N=self.block_N, num_stages=self.num_stages, threads=self.threads)


def is_hopper():
    """Whether the current CUDA GPU is sm_90 (H100/H200), where wgmma and TMA exist."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# Best of the chapter 04 sweep on the H100 (figures/ch04_forward_sweep_h100.json), causal and not.
TUNED_FORWARD_CONFIG = ForwardConfig(128, 128, 1, 256)
# Chapter 07's persistent kernel, tiled per (head dim, causal or window mask) from its ablation and
# sweep on the H100 (figures/ch07_forward_ablation_h100.json, ch07_overlap_sweep_h100.json): the
# consumer warpgroups take turns issuing their matmuls (ping-pong), and at D = 64 three of them share
# each K/V tile (192 query rows per block, as FlashAttention-3).
HOPPER_FORWARD_CONFIGS = {
    (128, False): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True),
    (128, True): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True),
    (64, False): ForwardConfig(192, 128, 2, 384, kernel="flash_fwd_hopper_persistent", pingpong=True),
    (64, True): ForwardConfig(192, 128, 2, 384, kernel="flash_fwd_hopper_persistent", pingpong=True),
}
# Below this many queries 192-row tiles waste more than a third warpgroup gains: at S = 1k the last
# tile is two-thirds padding and a causal tile of 192 rows straddles 1.5 key blocks of its diagonal.
THREE_WARPGROUPS_MIN_SEQ = 2048


def hopper_forward_config(dim, masked=False, *, seq_len=None, window=False):
    """The forward ``flash_attention`` runs on a Hopper GPU (whichever device this runs on).

    ``HOPPER_FORWARD_CONFIGS[dim, masked]``, except that three consumer warpgroups (block_M = 192)
    fall back to two for fewer than ``THREE_WARPGROUPS_MIN_SEQ`` queries, and for a sliding window,
    whose two-sided mask does not fit in the 160 registers a thread of three warpgroups gets.
    """
    config = HOPPER_FORWARD_CONFIGS[dim, bool(masked)]
    if config.block_M == 192 and (window or (seq_len is not None and seq_len < THREE_WARPGROUPS_MIN_SEQ)):
        config = config._replace(block_M=128, threads=256)
    return config


def default_forward_config(device_type, dim, masked=False, *, seq_len=None, window=False):
    """The kernel and tiling used when none is given: small tiles on the CPU, the fastest on the GPU.

    ``masked``: causal or sliding-window attention; ``seq_len``: the number of queries; ``window``:
    whether a sliding window is used. On Hopper this is ``hopper_forward_config``.
    """
    if device_type == "cpu":
        return ForwardConfig(16, 16, 1, 1)
    if is_hopper() and (dim, bool(masked)) in HOPPER_FORWARD_CONFIGS:
        return hopper_forward_config(dim, masked, seq_len=seq_len, window=window)
    return TUNED_FORWARD_CONFIG


class BackwardConfig(NamedTuple):
    """Which backward kernel (``BACKWARD_KERNELS``) and its tiling: block_M queries per step, block_N resident keys."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    kernel: str = "flash_bwd"

    tiling = ForwardConfig.tiling


# Best of the chapter 05 sweep on the H100 (figures/ch05_backward_sweep_h100.json), causal and not.
TUNED_BACKWARD_CONFIG = BackwardConfig(64, 128, 1, 256)
# Chapter 08's Hopper backward, tiled per (head dim, causal or window mask) as FlashAttention-3 tiles
# it (block_M queries per step, block_N resident keys), checked by chapter 08's ablation on the H100.
HOPPER_BACKWARD_CONFIGS = {
    (128, False): BackwardConfig(80, 128, 2, 256, kernel="flash_bwd_hopper"),
    (128, True): BackwardConfig(64, 128, 2, 256, kernel="flash_bwd_hopper"),
    (64, False): BackwardConfig(128, 128, 2, 256, kernel="flash_bwd_hopper"),
    (64, True): BackwardConfig(128, 128, 2, 256, kernel="flash_bwd_hopper"),
}
# The deterministic backward's dQ kernel: (block_M queries, block_N keys per step) by head dim.
HOPPER_DQ_TILES = {128: (128, 64), 64: (128, 128)}


def default_backward_config(device_type, dim=None, masked=False):
    """The backward used when none is given: small tiles on the CPU, chapter 08's kernel on Hopper
    GPUs, chapter 05's tuned tiling on other GPUs. ``masked``: causal or sliding-window attention."""
    if device_type == "cpu":
        return BackwardConfig(16, 16, 1, 1)
    if is_hopper() and (dim, bool(masked)) in HOPPER_BACKWARD_CONFIGS:
        return HOPPER_BACKWARD_CONFIGS[dim, bool(masked)]
    return TUNED_BACKWARD_CONFIG


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
    if config.kernel in _HOPPER_KERNELS:
        if pr.target != "cuda" or not is_hopper():
            raise ValueError(f"ForwardConfig(kernel={config.kernel!r}) is one of chapter 07's Hopper kernels: "
                             "it needs an sm_90 GPU")
        if config.kernel == "flash_fwd_hopper_persistent":  # one persistent block per SM
            variant["num_ctas"] = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        func = FORWARD_KERNELS[config.kernel](pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, **variant, **tiling,
                                              pingpong=config.pingpong)
    elif config.pingpong:
        raise ValueError("ForwardConfig(pingpong=True) needs one of chapter 07's Hopper kernels "
                         f"{_HOPPER_KERNELS}")
    else:
        func = flash_fwd_kernel(pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, target=pr.target, **variant, **tiling)
    return compile_kernel(func, out_idx=[4, 5], target=pr.target, dtype=pr.dtype)


def _check_backward_options(config, target, deterministic):
    """A clear error for a backward that cannot run here (raised when the forward is called)."""
    if config.kernel not in BACKWARD_KERNELS:
        raise ValueError(f"BackwardConfig.kernel must be one of {sorted(BACKWARD_KERNELS)}; got {config.kernel!r}")
    hopper = config.kernel == "flash_bwd_hopper"
    if hopper and (target != "cuda" or not is_hopper()):
        raise ValueError("BackwardConfig(kernel='flash_bwd_hopper') is chapter 08's Hopper kernel: "
                         "it needs an sm_90 GPU")
    if deterministic and not hopper:
        raise ValueError("deterministic=True needs chapter 08's Hopper backward (kernel='flash_bwd_hopper', sm_90 "
                         "GPU); chapter 05's kernel adds dQ with atomics in whatever order blocks finish")


class BackwardKernels(NamedTuple):
    """The compiled backward: Δ, then dK/dV and the float32 dQ accumulator, then the dQ (and GQA dK/dV) casts.

    The deterministic backward (chapter 08) has no accumulators: ``main`` is then
    (Q, K, V, dO, LSE, Δ, dK, dV) -> None, writing dK and dV once in the input dtype, ``dq`` is
    (Q, K, V, dO, LSE, Δ) -> dQ, and the two postprocess kernels are None.
    """

    preprocess: object  # (O, dO) -> Δ
    main: object  # (Q, K, V, dO, LSE, Δ, dQ_acc, dK, dV) -> None, accumulating in place
    postprocess_dq: object  # dQ_acc -> sm_scale · dQ_acc in the input dtype
    postprocess_dkv: object  # GQA only (else None): the float32 dK/dV accumulators -> the input dtype
    dq: object = None  # deterministic only: dQ in a fixed order, one block per query block


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compiled_backward(problem, config, deterministic=False):
    pr = problem
    small = 16 if pr.target == "c" else 64
    threads = 1 if pr.target == "c" else 128

    def build(func, out_idx, pass_configs=None):
        return compile_kernel(func, out_idx=out_idx, target=pr.target, dtype=pr.dtype, pass_configs=pass_configs)

    common = dict(dtype=pr.dtype, target=pr.target)
    pre = build(flash_bwd_preprocess_kernel(pr.batch, pr.heads, pr.seq_q, pr.dim, block=small, threads=threads,
                                            **common), [2])
    _check_backward_options(config, pr.target, deterministic)
    hopper = config.kernel == "flash_bwd_hopper"
    tiling = config.tiling()
    variant = dict(heads_kv=pr.heads_kv, causal=pr.masked, window_size=pr.window_size, sm_scale=pr.sm_scale)
    shape = (pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim)
    if hopper:
        main = build(flash_bwd_hopper_kernel(*shape, **variant, dtype=pr.dtype, **tiling, deterministic=deterministic),
                     [], HOPPER_BACKWARD_PASS_CONFIGS)
    else:
        main = build(flash_bwd_kernel(*shape, **variant, **common, **tiling), [])
    if deterministic:
        block_M, block_N = HOPPER_DQ_TILES[pr.dim]
        dq = build(flash_bwd_hopper_dq_kernel(*shape, **variant, dtype=pr.dtype, block_M=block_M, block_N=block_N),
                   [6])
        return BackwardKernels(pre, main, None, None, dq)
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
        config = default_forward_config(q.device.type, q.shape[-1], problem.masked, seq_len=q.shape[2],
                                        window=window_size is not None)
    return _compiled_forward(problem, bool(has_sinks), ForwardConfig(*config))


def backward_kernels(q, k, *, causal=False, window_size=None, sm_scale=None, config=None, deterministic=False):
    """The compiled ``BackwardKernels`` ``flash_attention``'s backward runs for these shapes."""
    problem = _problem(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale)
    config = (BackwardConfig(*config) if config is not None
              else default_backward_config(q.device.type, q.shape[-1], problem.masked))
    if config.kernel == "flash_bwd_hopper" and problem.window_size == 1:
        # With a one-key window and GQA, the atomic (default) Hopper kernel gave wrong dQ and dK in
        # some runs on the H100 (notes/hopper_backward.md, 2026-11-23); its deterministic kernels did
        # not, in any run. They are used for this case until that race is found.
        deterministic = True
    return _compiled_backward(problem, config, bool(deterministic))


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
                       sm_scale=None, config=None, deterministic=False):
    """Gradients of attention from the forward's O and LSE: returns (dQ, dK, dV, dsinks or None).

    The backward half of ``flash_attention``, as a plain function: P is rebuilt from Q, K and the
    LSE, so it also serves ``out`` and ``lse`` that were merged from several partial forwards.
    ``d_lse`` is the gradient reaching the LSE (a loss that uses it, such as a z-loss): since
    ∂LSE_i/∂S_ij = P_ij, it joins dS = P ∘ (dP − Δ) as Δ − dLSE.
    ``deterministic``: bitwise-reproducible gradients (chapter 08; Hopper only): no float atomics,
    every gradient summed in a fixed order, at the price of recomputing S and dP for dQ.
    """
    kernels = backward_kernels(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale, config=config,
                               deterministic=deterministic)
    # region: three kernels
    d_out = d_out.contiguous()
    delta = kernels.preprocess(out, d_out)
    if d_lse is not None:
        delta = (delta - d_lse.float()).contiguous()
    if kernels.dq is not None:  # deterministic: each gradient is written once, by one block
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        kernels.main(q, k, v, d_out, lse, delta, dk, dv)
        dq = kernels.dq(q, k, v, d_out, lse, delta)
    else:
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
    def forward(ctx, q, k, v, sinks, causal, window_size, sm_scale, fwd_config, bwd_config, deterministic):
        fwd = forward_kernel(q, k, causal=causal, window_size=window_size, has_sinks=sinks is not None,
                             sm_scale=sm_scale, config=fwd_config)
        logits = sink_logits(sinks, q.shape[1], q.device)
        out, lse = fwd(q, k, v, logits)
        ctx.save_for_backward(q, k, v, out, lse, logits)
        ctx.options = dict(causal=causal, window_size=window_size, sm_scale=sm_scale, config=bwd_config,
                           deterministic=deterministic)
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
        return dq, dk, dv, d_sinks, None, None, None, None, None, None


def _check_supported(q, fn="flash_attention"):
    """Raise ``ValueError`` unless ``fn``'s kernels run on q's device type, dtype and head dim."""
    device_type = q.device.type
    if device_type not in SUPPORTED:
        raise ValueError(f"{fn} runs on CUDA or the CPU; got device {q.device}")
    support = SUPPORTED[device_type]
    if q.dtype not in support["dtypes"]:
        names = ", ".join(str(d) for d in support["dtypes"])
        raise ValueError(f"on {device_type}, {fn} supports dtypes {names}; got {q.dtype}")
    if q.shape[-1] not in support["head_dims"]:
        raise ValueError(f"on {device_type}, head_dim must be one of {support['head_dims']}; got {q.shape[-1]}")


def check_sm_scale(sm_scale):
    """Raise ``ValueError`` unless ``sm_scale`` is None (1/√D) or a positive finite number."""
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                             or not math.isfinite(sm_scale) or sm_scale <= 0):
        raise ValueError(f"sm_scale must be a positive finite number (the kernels fold it into exp2); got {sm_scale!r}")


def flash_attention(q, k, v, causal=False, sm_scale=None, *, window_size=None, sinks=None,
                    return_lse=False, config=None, backward_config=None, deterministic=False):
    """Attention with the course's TileLang FlashAttention kernel.

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (GQA). ``window_size``
    W lets a query see its last W keys (implies causal); ``sinks`` is a float tensor [H] of
    per-head sink logits (gpt-oss). Returns O (and the natural-log LSE [B, H, S_q] in float32 with
    ``return_lse``). Masking conventions are those of ``course_utils.core.reference``. Differentiable
    (once) with respect to q, k, v and sinks, through O and the LSE: ``out.backward(d_out)`` runs the
    backward kernels. ``sm_scale`` must be positive. ``deterministic=True`` makes the gradients
    bitwise reproducible from run to run (Hopper backward only; see ``attention_backward``).
    """
    validate_attention_inputs(q, k, v, window_size=window_size, sinks=sinks)
    _check_supported(q)
    check_sm_scale(sm_scale)
    if window_size is not None and window_size >= k.shape[2]:
        window_size = None  # a window as long as the keys hides nothing that causal masking does not
        causal = True
    masked = bool(causal or window_size is not None)
    bwd = (BackwardConfig(*backward_config) if backward_config is not None
           else default_backward_config(q.device.type, q.shape[-1], masked))
    _check_backward_options(bwd, "cuda" if q.device.type == "cuda" else "c", deterministic)
    out, lse = _FlashAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks,
                                     bool(causal or window_size is not None), window_size, sm_scale, config,
                                     backward_config, bool(deterministic))
    return (out, lse) if return_lse else out
