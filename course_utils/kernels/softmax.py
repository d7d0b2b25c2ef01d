"""Online softmax (chapter 02): block-wise softmax in PyTorch and row-softmax kernels in TileLang.

The online normaliser (Milakov & Gimelshein, 2018, "Online normalizer calculation for softmax")
keeps, for each row, the running maximum ``m`` and the running denominator ``l = Σ exp(x − m)``.
When a new block of scores raises the maximum from ``m_old`` to ``m_new``, the old sum is
rescaled by ``exp(m_old − m_new)``; FlashAttention applies the same factor to its output
accumulator. Everything here follows one convention for masked scores (``-inf``): while a row has
seen only ``-inf``, its shift is 0 rather than ``-inf``, so ``exp(-inf − shift)`` is 0 and never
``exp(-inf − (-inf)) = NaN``. A row with no finite score at all has l = 0 and, as in
``torch.softmax``, NaN probabilities.

PyTorch functions work on any leading dimensions, in the dtype they are given. The TileLang
factories take a [M, N] float32 matrix and are written once for both targets through
``TileBackend``.
"""

from __future__ import annotations

import math

import tilelang.language as T
import torch

from ..core.reference import visibility_mask
from .flash_pieces import LOG2E
from .tiles import TileBackend

__all__ = ["LOG2E", "naive_softmax", "safe_softmax", "safe_shift", "online_softmax_update",
           "blockwise_softmax", "blockwise_attention", "online_softmax_trace", "merge_attention_states",
           "merge_attention",
           "softmax_row_kernel", "softmax_online_kernel"]


def naive_softmax(x):
    """exp(x) / Σ exp(x) along the last dimension, exactly as the formula reads (overflows)."""
    e = torch.exp(x)
    return e / e.sum(dim=-1, keepdim=True)


def safe_softmax(x):
    """Softmax with the row maximum subtracted first: every exponent is ≤ 0, so exp(·) ≤ 1."""
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True)


def safe_shift(m):
    """The value subtracted before exp: the running max, or 0 where it is still -inf (all masked)."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def online_softmax_update(m, l, scores):
    """One step of the online normaliser: fold a block of ``scores`` [..., block] into (m, l) [...].

    Returns the new (m, l) and ``alpha = exp(m_old − m_new)``, the factor the old state was scaled by.
    """
    m_new = torch.maximum(m, scores.amax(dim=-1))
    shift = safe_shift(m_new)
    alpha = torch.exp(m - shift)
    l_new = l * alpha + torch.exp(scores - shift[..., None]).sum(dim=-1)
    return m_new, l_new, alpha


def blockwise_softmax(x, block_N):
    """Softmax of ``x`` [..., N] in two passes over blocks of ``block_N`` columns.

    Pass 1 finds each row's (m, l) online; pass 2 writes exp(x − m) / l block by block.
    """
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[-1], block_N):
        m, l, _ = online_softmax_update(m, l, x[..., start:start + block_N])
    out = torch.empty_like(x)
    for start in range(0, x.shape[-1], block_N):
        block = x[..., start:start + block_N]
        out[..., start:start + block_N] = torch.exp(block - safe_shift(m)[..., None]) / l[..., None]
    return out


def blockwise_attention(q, k, v, block_N, *, causal=False, sm_scale=None, return_lse=False):
    """softmax(Q Kᵀ · scale) V in one pass over blocks of ``block_N`` keys, as FlashAttention does.

    q [..., S_q, D], k [..., S_k, D], v [..., S_k, D_v] (same leading dimensions). The output
    accumulator ``o`` is rescaled by the same ``alpha`` as ``l`` and divided by ``l`` once at the end.
    With ``return_lse`` also returns the log-sum-exp m + log l of each row's scaled scores (natural log).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    visible = visibility_mask(seq_q, seq_k, causal=causal, device=q.device)
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)
    o = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    # region: loop
    for start in range(0, seq_k, block_N):
        k_blk, v_blk = k[..., start:start + block_N, :], v[..., start:start + block_N, :]
        s = (q @ k_blk.transpose(-1, -2)) * scale
        s = s.masked_fill(~visible[:, start:start + block_N], float("-inf"))
        m, l, alpha = online_softmax_update(m, l, s)
        p = torch.exp(s - safe_shift(m)[..., None])
        o = o * alpha[..., None] + p @ v_blk
    o = o / l[..., None]
    # endregion
    if not return_lse:
        return o
    return o, safe_shift(m) + torch.log(l)


def merge_attention_states(o, lse, dim=0):
    """Combine attention results computed over disjoint sets of keys into the result over all of them.

    ``o`` [..., D] holds the parts' outputs (each normalised over its own keys) and ``lse`` their
    natural-log log-sum-exps, the parts along ``dim`` (an index of ``lse``'s dimensions, the same in
    ``o``). With LSE = log Σ_s e^{LSE_s}, each part's share of the total denominator is
    e^{LSE_s − LSE}, so O = Σ_s e^{LSE_s − LSE} · O_s: the online normaliser's merge over any number of
    parts (split-KV decoding, chapter 09). A part that saw no key (LSE_s = -inf) weighs 0; if none
    did, O = 0 and LSE = -inf.
    """
    total = torch.logsumexp(lse, dim=dim)
    weights = torch.exp(lse - safe_shift(total).unsqueeze(dim))
    return (weights.unsqueeze(-1) * o).sum(dim=dim), total


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Attention over the keys A ∪ B from the results over A and over B (disjoint key sets).

    ``out_*`` [..., S, D] and ``lse_*`` [..., S] are what ``flash_attention(..., return_lse=True)``
    returns; this is ``merge_attention_states`` for two parts (ring attention merges one K/V shard
    at a time), computed in float32 (or float64), whatever the inputs' dtype.
    """
    dtype = torch.promote_types(out_a.dtype, torch.float32)
    return merge_attention_states(torch.stack([out_a.to(dtype), out_b.to(dtype)]),
                                  torch.stack([lse_a.to(dtype), lse_b.to(dtype)]), dim=0)


def online_softmax_trace(x, block_N):
    """The running max after each block and the rescale factors exp(m_old − m_new), for plots.

    Returns two tensors of shape [num_blocks, *x.shape[:-1]]; the first block's factor is 0
    (there is no old state to rescale; its l was 0).
    """
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)
    l = torch.zeros_like(m)
    maxima, alphas = [], []
    for start in range(0, x.shape[-1], block_N):
        m, l, alpha = online_softmax_update(m, l, x[..., start:start + block_N])
        maxima.append(m)
        alphas.append(alpha)
    return torch.stack(maxima), torch.stack(alphas)


def softmax_row_kernel(M, N, *, scale=1.0, block_M=32, threads=128, target=None):
    """Y = softmax(scale · X) for X [M, N] float32, one pass: each block holds ``block_M`` whole rows."""
    tb = TileBackend(target)
    dtype = "float32"
    scale_log2 = scale * LOG2E  # exp(scale·(x − m)) = exp2(x·scale_log2 − m·scale_log2)

    @T.prim_func
    def softmax_row(X: T.Tensor([M, N], dtype), Y: T.Tensor([M, N], dtype)):
        with tb.kernel(T.ceildiv(M, block_M), threads=threads) as bx:
            x = tb.fragment([block_M, N], dtype)
            m = tb.fragment([block_M], dtype)
            l = tb.fragment([block_M], dtype)
            T.copy(X[bx * block_M:(bx + 1) * block_M, :], x)
            T.reduce_max(x, m, dim=1)
            for i, j in tb.parallel(block_M, N):
                x[i, j] = T.exp2(x[i, j] * scale_log2 - m[i] * scale_log2)
            T.reduce_sum(x, l, dim=1)
            for i, j in tb.parallel(block_M, N):
                x[i, j] = x[i, j] / l[i]
            T.copy(x, Y[bx * block_M:(bx + 1) * block_M, :])

    return softmax_row


def softmax_online_kernel(M, N, *, scale=1.0, block_M=32, block_N=64, threads=128, target=None):
    """Y = softmax(scale · X) and LSE for X [M, N] float32, streaming ``block_N`` columns at a time.

    Pass 1 keeps the running max ``m`` and sum ``l`` of each row (the online normaliser); pass 2
    reads X again and writes exp2(x·scale_log2 − m·scale_log2) / l. LSE is in natural log.
    """
    if N % block_N:
        raise ValueError(f"N ({N}) must be a multiple of block_N ({block_N})")
    tb = TileBackend(target)
    dtype = "float32"
    scale_log2 = scale * LOG2E
    neg_inf = -T.infinity(dtype)

    @T.prim_func
    def softmax_online(X: T.Tensor([M, N], dtype), Y: T.Tensor([M, N], dtype), LSE: T.Tensor([M], dtype)):
        with tb.kernel(T.ceildiv(M, block_M), threads=threads) as bx:
            x = tb.fragment([block_M, block_N], dtype)
            m = tb.fragment([block_M], dtype)  # running max of the raw scores
            m_prev = tb.fragment([block_M], dtype)
            shift = tb.fragment([block_M], dtype)  # m · scale_log2, or 0 while m is -inf
            l = tb.fragment([block_M], dtype)  # running sum of exp2(x·scale_log2 − shift)
            row_sum = tb.fragment([block_M], dtype)
            # region: passes
            T.fill(m, neg_inf)
            T.fill(l, 0)
            for kb in T.serial(N // block_N):  # pass 1: the online normaliser
                T.copy(X[bx * block_M:(bx + 1) * block_M, kb * block_N:(kb + 1) * block_N], x)
                T.copy(m, m_prev)
                T.reduce_max(x, m, dim=1, clear=False)  # m = max(m_prev, max of this block)
                for i in tb.parallel(block_M):
                    shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
                for i, j in tb.parallel(block_M, block_N):
                    x[i, j] = T.exp2(x[i, j] * scale_log2 - shift[i])
                T.reduce_sum(x, row_sum, dim=1)
                for i in tb.parallel(block_M):
                    l[i] = l[i] * T.exp2(m_prev[i] * scale_log2 - shift[i]) + row_sum[i]
            for kb in T.serial(N // block_N):  # pass 2: normalise
                T.copy(X[bx * block_M:(bx + 1) * block_M, kb * block_N:(kb + 1) * block_N], x)
                for i, j in tb.parallel(block_M, block_N):
                    x[i, j] = T.exp2(x[i, j] * scale_log2 - shift[i]) / l[i]
                T.copy(x, Y[bx * block_M:(bx + 1) * block_M, kb * block_N:(kb + 1) * block_N])
            for i in tb.parallel(block_M):
                if bx * block_M + i < M:
                    LSE[bx * block_M + i] = (shift[i] + T.log2(l[i])) / LOG2E
            # endregion

    return softmax_online
