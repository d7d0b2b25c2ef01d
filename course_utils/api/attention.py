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

from ..core.device import is_hopper
from ..core.problem import AttentionProblem
from ..kernels.flash_bwd_hopper import DQ_BY_ROWS
from ..kernels.tiles import allocating_launcher, attention_launcher, launcher
from .compiled import CACHE_SIZE, compiled
from .inputs import (
    PLAN_SCALAR_TYPES,
    SUPPORTED,
    PlanCache,
    check_attention_inputs,
    check_sm_scale,
    sink_logits,
    sink_probability,
)
from .registry import BACKWARD, FORWARD, HELPERS, backward_row, forward_row

__all__ = ["flash_attention", "attention_backward", "forward_kernel", "backward_kernels", "BackwardKernels",
           "ForwardConfig", "BackwardConfig", "sink_logits", "check_sm_scale", "default_forward_config",
           "default_backward_config", "is_hopper", "SUPPORTED", "TUNED_FORWARD_CONFIG", "HOPPER_FORWARD_CONFIGS",
           "THREE_WARPGROUPS_MIN_SEQ", "ONE_WARPGROUP_FORWARD_CONFIG",
           "D64_SHORT_FORWARD_CONFIGS", "SHORT_MASKED_MAX_SEQ", "hopper_forward_config", "FORWARD_KERNELS",
           "BACKWARD_KERNELS", "TUNED_BACKWARD_CONFIG", "HOPPER_BACKWARD_CONFIGS", "HOPPER_DQ_TILES"]

# The kernels a ForwardConfig or BackwardConfig can select, by name: their factories (the rows of
# ``registry``, which also say where each runs and how it is compiled).
FORWARD_KERNELS = {name: row.factory for name, row in FORWARD.items()}
BACKWARD_KERNELS = {name: row.factory for name, row in BACKWARD.items()}


class ForwardConfig(NamedTuple):
    """Which forward kernel (``FORWARD_KERNELS``) and its tiling."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    kernel: str = "flash_fwd"
    pingpong: bool = False  # Hopper kernels only: the consumer warpgroups take turns issuing their matmuls
    blocks_per_sm: int = 1  # kernels of one consumer warpgroup per block: how many blocks share an SM

    def tiling(self):
        """The tiling as keyword arguments of a kernel factory."""
        return dict(block_M=self.block_M, block_N=self.block_N, num_stages=self.num_stages, threads=self.threads)


# Best of the chapter 04 sweep on the H100 (figures/ch04_forward_sweep_h100.json), causal and not.
TUNED_FORWARD_CONFIG = ForwardConfig(128, 128, 1, 256)
# Chapter 07's persistent kernel, tiled per (head dim, causal or window mask) from its ablation and
# its persistent-vs-rotated record on the H100 (figures/ch07_forward_ablation_h100.json,
# ch07_persistent_vs_rotated_h100.json; chapter 07 checks the choice against the first): the
# consumer warpgroups take turns issuing their matmuls (ping-pong), and at D = 64 three of them share
# each K/V tile (192 query rows per block, as FlashAttention-3).
HOPPER_FORWARD_CONFIGS = {
    (128, False): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True),
    (128, True): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True),
    (64, False): ForwardConfig(192, 128, 2, 384, kernel="flash_fwd_hopper_persistent", pingpong=True),
    (64, True): ForwardConfig(64, 128, 2, 128, kernel="flash_fwd_hopper_one_warpgroup", blocks_per_sm=3),
}
# At D = 64: cuDNN's tiling, one warpgroup per block of 64 query rows that issues its own TMA loads, three
# blocks per SM (``flash_fwd_hopper_one_warpgroup``). H100, 2026-11-27 (docs/hopper_forward.md,
# commit acba3b6): 1.05-1.09 × cuDNN at S = 1k-2k where every earlier tiling was 0.93-1.00, and ahead of
# three warpgroups with ping-pong at every causal length (1.07 against 0.97-1.07 at 4k-16k) and without a mask
# up to 4k (1.05 against 1.03-1.04); from 8k without a mask three warpgroups stay ahead (1.09 against 1.05 at 8k,
# fp16) or level. With gpt-oss's 128-key window (bf16, sinks, GQA 64/8) 1.31-1.42 × two warpgroups of the persistent
# kernel, 1.19 × with a 1024-key window (commit a6a4155).
ONE_WARPGROUP_FORWARD_CONFIG = HOPPER_FORWARD_CONFIGS[64, True]
# Without a mask, from this many queries on: three consumer warpgroups of the persistent kernel (FlashAttention-3's
# tiling at D = 64), each K/V tile feeding 192 query rows.
THREE_WARPGROUPS_MIN_SEQ = 8192
# The persistent kernel's own one-warpgroup tilings (a producer warpgroup beside the consumer, two or three blocks
# per SM): the default at D = 64 below 2k-3k queries before the kernel above, kept for chapter 07's comparison.
# Keyed by (causal mask, at most SHORT_MASKED_MAX_SEQ queries).
SHORT_MASKED_MAX_SEQ = 1024
D64_SHORT_FORWARD_CONFIGS = {
    (False, False): ForwardConfig(64, 128, 2, 128, kernel="flash_fwd_hopper_persistent", blocks_per_sm=2),
    (False, True): ForwardConfig(64, 128, 2, 128, kernel="flash_fwd_hopper_persistent", blocks_per_sm=2),
    (True, False): ForwardConfig(64, 128, 3, 128, kernel="flash_fwd_hopper_persistent", blocks_per_sm=2),
    (True, True): ForwardConfig(64, 64, 2, 128, kernel="flash_fwd_hopper_persistent", blocks_per_sm=3),
}


def hopper_forward_config(dim, masked=False, *, seq_len=None, window=False):
    """The forward ``flash_attention`` runs on a Hopper GPU (whichever device this runs on).

    ``HOPPER_FORWARD_CONFIGS[dim, masked]`` (a sliding window is a mask), except at D = 64 without a mask:
    fewer than ``THREE_WARPGROUPS_MIN_SEQ`` queries get one warpgroup per block
    (``ONE_WARPGROUP_FORWARD_CONFIG``) instead of three warpgroups. ``window`` is kept for the callers that
    pass it; every tiling chosen here takes a window.
    """
    config = HOPPER_FORWARD_CONFIGS[dim, bool(masked or window)]
    if dim == 64 and not (masked or window) and seq_len is not None and seq_len < THREE_WARPGROUPS_MIN_SEQ:
        return ONE_WARPGROUP_FORWARD_CONFIG
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
    # Chapter 08's kernel only: dV issued as soon as the 16-bit P exists, dSᵀ formed from that rounded P
    # while dV runs (the ablation's version 14); off: FlashAttention-3's order, dSᵀ first.
    dv_under_ds: bool = False
    # Chapter 08's kernel only: how its two consumer warpgroups split each product, five names ("row", "col",
    # "square") for Sᵀ, dPᵀ, dV, dK, dQ (``flash_bwd_hopper.gemm_policies``); None: the shipped split.
    policies: tuple | None = None
    # Chapter 08's kernel only: dK and dV written through shared memory by TMA (the ablation's version 19).
    dkdv_by_tma: bool = False
    # Chapter 08's kernel only: key block 0 of every head launched first, then key block 1... (FlashAttention-3's
    # longest-processing-time order for the causal mask; the ablation's version 21).
    longest_first: bool = False
    # Chapter 08's kernel only: the dQ reduce-add's wait moved from right after it to the next step's dSᵀ barrier
    # (the ablation's version 22; kernels/generated_code.py).
    defer_dq_wait: bool = False
    # Chapter 08's kernel only: each consumer warpgroup stages its own box of dQ, meets only its own 128 threads on
    # a named barrier of its own and adds that box by the copy engine; the two warpgroups never meet for dQ
    # (FlashAttention-4's per-warpgroup handoff, without its writer warp). Off in every shipped config: unmeasured.
    dq_per_warpgroup: bool = False

    tiling = ForwardConfig.tiling


# Best of the chapter 05 sweep on the H100 (figures/ch05_backward_sweep_h100.json), causal and not.
TUNED_BACKWARD_CONFIG = BackwardConfig(64, 128, 1, 256)
# Chapter 08's Hopper backward, tiled per (head dim, causal or window mask) as FlashAttention-3 tiles
# it (block_M queries per step, block_N resident keys), checked by chapter 08's ablation on the H100.
HOPPER_BACKWARD_CONFIGS = {
    # Every config: dQ's reduce-add waited for at the next step's dSᵀ barrier, not right after it (version 22):
    # +10…+14% at D = 128 without a mask, +1…+9% with it, +4…+8% at D = 64, S = 4k and 16k, 3 blocks each
    # (docs/hopper_backward.md, commit 4a3ebb5).
    # dV issued under dSᵀ, and dK and dV stored by TMA: +2.5…+8.3% (fp16), −3.9…+5.8% (bf16; 2 of 24 blocks below
    # 0) over version 9 at S = 2k-16k, both masks, 3 blocks of alternated rounds each
    # (docs/hopper_backward.md; version 20).
    (128, False): BackwardConfig(80, 128, 2, 256, kernel="flash_bwd_hopper", dv_under_ds=True, dkdv_by_tma=True,
                                 defer_dq_wait=True),
    # With the causal mask, every head's first (longest) key blocks launched first as well: +0.8…+6.9% over
    # version 20 at S = 2k-8k, −0.9…+1.4% at 16k, 3 blocks each (docs/hopper_backward.md; version 21).
    # And 80 query rows per step, as without a mask (version 23): once dQ's wait moved (version 22) they gain over
    # 64 rows at every length, +1.6…+2.1% at 1k, +3.6…+5.4% at 2k, +7…+8.5% at 4k, +9…+16% at 8k-16k, fp16 and
    # bf16, 2-5 blocks each (docs/hopper_backward.md, commit c5e7730).
    (128, True): BackwardConfig(80, 128, 2, 256, kernel="flash_bwd_hopper", dv_under_ds=True, dkdv_by_tma=True,
                                longest_first=True, defer_dq_wait=True),
    # dQ split by query rows (FlashAttention-3's AtomLayoutMdQ = 2): +1-7% over S = 1k-16k in the records' method,
    # -0.2…+5.8% under do_bench (docs/hopper_backward.md; version 17).
    (64, False): BackwardConfig(128, 128, 2, 256, kernel="flash_bwd_hopper", policies=DQ_BY_ROWS, defer_dq_wait=True),
    # dQ split by query rows (FlashAttention-3's AtomLayoutMdQ = 2) and dV issued under dSᵀ: +3-13% at
    # D = 64 causal over S = 1k-16k in both timing methods (docs/hopper_backward.md; versions 17, 14 and 18).
    (64, True): BackwardConfig(128, 128, 2, 256, kernel="flash_bwd_hopper", dv_under_ds=True, policies=DQ_BY_ROWS,
                               defer_dq_wait=True),
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


def _compiled_forward(problem, config):
    row = forward_row(config)
    row.check(problem, config)
    return compiled(row, problem, config)


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


# The backward's kernels come from the one compile cache; this keeps their launchers, found once per kernel
# (finding a compiled kernel's entry point costs host time that a short backward would pay at every call).
@functools.lru_cache(maxsize=CACHE_SIZE)
def _compiled_backward(problem, config, deterministic=False):
    pr = problem
    small = dict(block=16, threads=1) if pr.target == "c" else dict(block=64, threads=128)
    out_dtype = getattr(torch, pr.dtype)

    # The kernels are called through their TVM-FFI ``main`` with outputs allocated here (``tiles.launcher``):
    # TileLang's wrapper around each call cost about as much host time as a short backward's GPU time.
    def like_input(acc):  # a float32 accumulator -> the gradient in the input dtype
        return (torch.empty(acc.shape, dtype=out_dtype, device=acc.device),)

    pre = allocating_launcher(compiled(HELPERS["bwd_preprocess"], pr, **small),
                              lambda out, d_out: (torch.empty(out.shape[:3], dtype=torch.float32, device=out.device),))
    row = backward_row(config)
    row.check(pr, config, deterministic)
    main = launcher(_compile_main(row, pr, config, deterministic))
    if deterministic:
        block_M, block_N = HOPPER_DQ_TILES[pr.dim]
        dq = compiled(HELPERS["bwd_hopper_dq"], pr, block_M=block_M, block_N=block_N)
        dq = allocating_launcher(dq, lambda q, *rest: (torch.empty(q.shape, dtype=q.dtype, device=q.device),))
        return BackwardKernels(pre, main, None, None, dq)
    post_q = allocating_launcher(compiled(HELPERS["bwd_postprocess_dq"], pr, **small), like_input)
    post_kv = None
    if pr.heads_kv != pr.heads:
        post_kv = allocating_launcher(compiled(HELPERS["bwd_postprocess_dkv"], pr, **small), like_input)
    return BackwardKernels(pre, main, post_q, post_kv)


def _registers_ran_out(exc):
    return "Register allocation failed" in str(exc)


def _compile_main(row, problem, config, deterministic):
    """The backward's main kernel. ptxas fails to allocate chapter 08's kernel's registers at a few tiny query
    counts (S_q = 1, 2, 3 or 6 at D = 128 among those tried; 4, 8, 32 and 64 compile): there it is built with 64-row
    query blocks, and failing that the default backward runs chapter 05's kernel, which takes the same arguments
    and computes the same gradients. The deterministic one has no such second choice: it raises
    ``DeterministicRegistersError``, and ``attention_backward`` runs it with rows in front of the queries
    (``backward_with_rows_in_front``)."""
    options = dict(deterministic=deterministic) if row.deterministic else {}
    try:
        return compiled(row, problem, config, **options)
    except Exception as exc:
        if not _registers_ran_out(exc) or config.kernel != "flash_bwd_hopper" or config.block_M == 64:
            raise
        failure = exc
    try:
        return compiled(row, problem, config._replace(block_M=64), **options)
    except Exception as exc:
        if not _registers_ran_out(exc):
            raise
    if deterministic:
        raise DeterministicRegistersError(
            f"deterministic=True: ptxas cannot allocate the registers of chapter 08's deterministic backward at "
            f"S_q={problem.seq_q}, S_k={problem.seq_k}, D={problem.dim} ({problem.dtype}); the default backward "
            "runs this shape") from failure
    return compiled(backward_row(TUNED_BACKWARD_CONFIG), problem, TUNED_BACKWARD_CONFIG)


class DeterministicRegistersError(ValueError):
    """ptxas could not compile the deterministic backward's kernel for this shape (``_compile_main``)."""


def forward_kernel(q, k, *, causal=False, window_size=None, has_sinks=False, sm_scale=None, config=None):
    """The compiled forward ``flash_attention`` runs for queries like ``q`` and keys like ``k``.

    Call it as ``kernel(q, k, v, sink_logits) -> (out, lse)``, with float32 sink logits of shape [H]
    (all -inf for no sinks). ``config`` defaults to ``default_forward_config``.
    """
    problem = AttentionProblem.dense(q, k, causal=causal, window_size=window_size, has_sinks=has_sinks,
                                     sm_scale=sm_scale)
    if config is None:
        config = default_forward_config(q.device.type, q.shape[-1], problem.causal, seq_len=q.shape[2],
                                        window=window_size is not None)
    return _compiled_forward(problem, ForwardConfig(*config))


def backward_kernels(q, k, *, causal=False, window_size=None, sm_scale=None, config=None, deterministic=False):
    """The compiled ``BackwardKernels`` ``flash_attention``'s backward runs for these shapes."""
    problem = AttentionProblem.dense(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale)
    config = (BackwardConfig(*config) if config is not None
              else default_backward_config(q.device.type, q.shape[-1], problem.causal))
    return _compiled_backward(problem, config, bool(deterministic))


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
    try:
        kernels = backward_kernels(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale, config=config,
                                   deterministic=deterministic)
    except DeterministicRegistersError:
        rows = -(-q.shape[2] // QUERY_PADDING) * QUERY_PADDING - q.shape[2]
        if not rows:
            raise
        return backward_with_rows_in_front(rows, q, k, v, out, lse, d_out, d_lse=d_lse, causal=causal,
                                           window_size=window_size, sinks=sinks, sm_scale=sm_scale, config=config,
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
        p_sink = sink_probability(sinks.detach().float()[None, :, None], lse)
        d_sinks = -(p_sink * delta).sum(dim=(0, 2))
    # endregion
    return dq, dk, dv, d_sinks


# The deterministic backward's kernel fails ptxas's register allocation at a few small query counts (1, 2, 3, 6
# at D = 128 among those tried); a multiple of 64 queries compiles, so such a problem runs with rows put in front.
QUERY_PADDING = 64


def backward_with_rows_in_front(rows, q, k, v, out, lse, d_out, *, d_lse=None, **options):
    """``attention_backward`` run with ``rows`` query rows put in front of the given ones, and their gradients
    dropped. The rows change nothing: their dO is 0, so their dP and Δ are 0 and they add nothing to dK, dV or
    the sinks' gradient (their LSE is +∞ as well, so that each of their probabilities is exp(S − ∞) = 0 outright).
    In front, they leave the given rows' places relative to the last key, where a causal mask and a window are
    aligned, as they were."""
    def in_front(x, value=0.0):
        return torch.cat([x.new_full((*x.shape[:2], rows, *x.shape[3:]), value), x], dim=2)

    dq, dk, dv, d_sinks = attention_backward(in_front(q), k, v, in_front(out), in_front(lse, math.inf),
                                             in_front(d_out), d_lse=None if d_lse is None else in_front(d_lse),
                                             **options)
    return dq[:, :, rows:], dk, dv, d_sinks


class _ForwardPlan(NamedTuple):
    """What ``flash_attention`` concluded from one signature of its arguments (``_plan_key``): every check
    and choice that does not read a tensor's values, so one lookup replaces them at the next call."""

    launch: object  # (q, k, v, sink logits) -> (O, LSE): the compiled forward, called with the least host work
    first_key: int  # keys before it are seen by no query (a window behind S_k − S_q): the kernels never get them
    no_sinks: object  # the -inf sink logits of every head, or None when sinks are given
    heads: int
    backward: dict  # attention_backward's options: causal, window_size, sm_scale, config, deterministic


_PLANS = PlanCache(max_size=256)  # signatures kept: a model calls attention with a handful
_Tensor = torch.Tensor


def _plan_key(q, k, v, causal, sm_scale, window_size, sinks, config, backward_config, deterministic):
    """Everything ``_forward_plan``'s checks and choices depend on, or None where an argument is of a kind the
    signature cannot describe (the checks then run at every call). Scalars are keyed with their type, tensors
    by type, shape, dtype and device; values never. Written inline: it runs at every call."""
    if not (isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(v, _Tensor)
            and (sinks is None or isinstance(sinks, _Tensor))):
        return None
    types = (type(causal), type(sm_scale), type(window_size), type(deterministic))
    if not PLAN_SCALAR_TYPES.issuperset(types):
        return None
    configs = (type(config), config, type(backward_config), backward_config)
    try:
        hash(configs)
    except TypeError:
        return None
    return (types, causal, sm_scale, window_size, deterministic, configs,
            type(q), q.shape, q.dtype, q.device, type(k), k.shape, k.dtype, k.device,
            type(v), v.shape, v.dtype, v.device,
            None if sinks is None else (type(sinks), sinks.shape, sinks.dtype, sinks.device))


def unseen_leading_keys(seq_q, seq_k, window_size):
    """How many keys at the start no query sees: those more than ``window_size`` − 1 positions behind the
    first query's diagonal (which sits at key S_k − S_q). Without a window every key is seen by the last query."""
    if window_size is None:
        return 0
    return max(0, seq_k - seq_q - window_size + 1)


def _forward_plan(q, k, v, causal, sm_scale, window_size, sinks, config, backward_config, deterministic):
    """Every check of ``flash_attention`` that the host can make without reading a value, and its choices."""
    check_attention_inputs("flash_attention", q, k, v, window_size=window_size, sinks=sinks, sm_scale=sm_scale)
    if window_size is not None and window_size >= k.shape[2]:
        window_size = None  # a window as long as the keys hides nothing that causal masking does not
        causal = True
    masked = bool(causal or window_size is not None)
    first_key = unseen_leading_keys(q.shape[2], k.shape[2], window_size)
    k = k[:, :, first_key:]  # a view: only its shape reaches the compilers
    bwd = (BackwardConfig(*backward_config) if backward_config is not None
           else default_backward_config(q.device.type, q.shape[-1], masked))
    backward_row(bwd).check(AttentionProblem.dense(q, k, causal=masked, window_size=window_size, sm_scale=sm_scale),
                            bwd, deterministic)  # raised now, not at the backward
    fwd = forward_kernel(q, k, causal=masked, window_size=window_size, has_sinks=sinks is not None,
                         sm_scale=sm_scale, config=config)
    return _ForwardPlan(launch=attention_launcher(fwd), first_key=first_key, heads=q.shape[1],
                        no_sinks=sink_logits(None, q.shape[1], q.device) if sinks is None else None,
                        backward=dict(causal=masked, window_size=window_size, sm_scale=sm_scale,
                                      config=backward_config, deterministic=bool(deterministic)))


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, plan):
        logits = plan.no_sinks if sinks is None else sink_logits(sinks, plan.heads, q.device)
        out, lse = plan.launch(q, k, v, logits)
        ctx.save_for_backward(q, k, v, out, lse, logits)
        ctx.options = plan.backward
        ctx.has_sinks = sinks is not None
        # An output the loss does not use reaches the backward as None, not as zeros autograd would fill (a
        # loss of O alone, the usual case, would otherwise pay a fill and a subtraction for the LSE's zeros).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable  # the backward is kernels, not PyTorch ops: a second derivative must raise, not drop terms
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, logits = ctx.saved_tensors
        sinks = logits if ctx.has_sinks and ctx.needs_input_grad[3] else None
        if d_out is None:  # only the LSE was used
            d_out = torch.zeros_like(out)
        dq, dk, dv, d_sinks = attention_backward(q, k, v, out, lse, d_out, d_lse=d_lse, sinks=sinks, **ctx.options)
        return dq, dk, dv, d_sinks, None


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

    The checks and choices that depend only on shapes, dtypes, devices and options run once per such
    signature (``_forward_plan``); later calls with the same signature skip to the kernel.
    """
    args = (q, k, v, causal, sm_scale, window_size, sinks, config, backward_config, deterministic)
    plan = _PLANS.plan(_plan_key(*args), _forward_plan, *args)
    if plan.first_key:  # keys no query sees: left out, so they cannot influence anything (their gradients are 0)
        k, v = k[:, :, plan.first_key:], v[:, :, plan.first_key:]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        out, lse = _FlashAttention.apply(q, k, v, sinks, plan)
    else:  # nothing to differentiate: the kernel without autograd's bookkeeping
        out, lse = plan.launch(q, k, v, plan.no_sinks if sinks is None else sink_logits(sinks, plan.heads, q.device))
    return (out, lse) if return_lse else out
