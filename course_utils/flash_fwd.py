"""The FlashAttention forward as a TileLang kernel factory (chapters 03, 04 and 06).

One thread block owns ``block_M`` query rows of one (batch, head). It keeps Q in shared memory,
streams K/V through shared memory ``block_N`` keys at a time, and keeps the running row max
``m``, the running denominator ``l`` and the output accumulator in registers. Scores are scaled
by ``sm_scale · log2(e)`` so the exponentials are ``exp2``; the LSE written out is in natural log.
"""


import math

import tilelang.language as T
from tilelang.layout import make_linear_layout

from .tiles import TileBackend

__all__ = ["LOG2E", "flash_fwd_kernel"]

LOG2E = 1.4426950408889634


def flash_fwd_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None,
    dtype="float16", block_M=128, block_N=128, num_stages=2, threads=256, target=None,
    linear_smem=False,
):
    """Return a ``@T.prim_func`` computing O and LSE for Q [B, H, S_q, D], K/V [B, H_kv, S_k, D].

    Parameters after ``*`` select the variant (GQA, causal, sliding window, sinks) and the tiling.
    ``Sinks`` is always a parameter (float32 [H]); it is read only when ``has_sinks``.
    ``linear_smem`` forces plain row-major shared-memory tiles instead of TileLang's swizzled
    default (GPU only; chapter 04 measures what swizzling is worth).
    """
    tb = TileBackend(target)
    heads_kv = heads if heads_kv is None else heads_kv
    group = heads // heads_kv
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    scale_log2 = sm_scale * LOG2E
    past = seq_k - seq_q  # bottom-right alignment of the causal diagonal
    masked = causal or window_size is not None
    accum = "float32"
    neg_inf = -T.infinity(accum)
    num_q_blocks = (seq_q + block_M - 1) // block_M
    num_k_blocks = (seq_k + block_N - 1) // block_N


    def visible(q_pos, k_pos):
        """Whether key position k_pos is visible from query position q_pos (both absolute)."""
        cond = k_pos < seq_k
        if masked:
            cond = T.And(cond, k_pos <= q_pos + past)
        if window_size is not None:
            cond = T.And(cond, k_pos > q_pos + past - window_size)
        return cond

    @T.prim_func
    def flash_fwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], accum),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
    ):
        with tb.kernel(num_q_blocks, heads, batch, threads=threads) as (bx, by, bz):
            Q_s = tb.shared([block_M, dim], dtype)
            K_s = tb.shared([block_N, dim], dtype)
            V_s = tb.shared([block_N, dim], dtype)
            O_s = tb.shared([block_M, dim], dtype)
            S = tb.fragment([block_M, block_N], accum)  # scores, then probabilities
            P = tb.fragment([block_M, block_N], dtype)  # probabilities rounded for the PV gemm
            acc_o = tb.fragment([block_M, dim], accum)
            m = tb.fragment([block_M], accum)  # running row max of the raw scores
            m_prev = tb.fragment([block_M], accum)
            shift = tb.fragment([block_M], accum)  # m · scale_log2, or 0 for a row that saw nothing yet
            alpha = tb.fragment([block_M], accum)  # rescale factor of the old accumulators
            row_sum = tb.fragment([block_M], accum)
            l = tb.fragment([block_M], accum)  # running softmax denominator
            if linear_smem and tb.on_gpu:
                T.annotate_layout({buf: make_linear_layout(buf) for buf in (Q_s, K_s, V_s, O_s)})

            # Causal: the last query blocks have the most key blocks; start them first.
            qb = (num_q_blocks - 1 - bx) if masked else bx
            kv_head = by // group
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, neg_inf)

            k_end = num_k_blocks
            if masked:
                k_end = T.min(num_k_blocks, T.ceildiv((qb + 1) * block_M + past, block_N))
            k_start = 0
            if window_size is not None:
                k_start = T.max(0, (qb * block_M + past - window_size + 1) // block_N)

            for kb in T.Pipelined(k_start, k_end, num_stages=num_stages):
                T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
                for i, j in tb.parallel(block_M, block_N):
                    S[i, j] = T.if_then_else(visible(qb * block_M + i, kb * block_N + j), 0, neg_inf)
                T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)

                T.copy(m, m_prev)
                T.reduce_max(S, m, dim=1, clear=False)  # m = max(m_prev, this block's row max)
                for i in tb.parallel(block_M):
                    # A row whose keys so far were all masked has m = -inf; -inf - -inf would be NaN.
                    shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
                    alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
                for i, j in tb.parallel(block_M, block_N):
                    S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])
                T.reduce_sum(S, row_sum, dim=1)
                for i in tb.parallel(block_M):
                    l[i] = l[i] * alpha[i] + row_sum[i]
                T.copy(S, P)
                for i, j in tb.parallel(block_M, dim):
                    acc_o[i, j] *= alpha[i]

                T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
                T.gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for i in tb.parallel(block_M):
                shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
            if has_sinks:
                for i in tb.parallel(block_M):
                    l[i] += T.exp2(Sinks[by] * LOG2E - shift[i])  # the sink's term: no value row
            for i, j in tb.parallel(block_M, dim):
                acc_o[i, j] = T.if_then_else(l[i] > 0, acc_o[i, j] / l[i], 0)
            T.copy(acc_o, O_s)
            T.copy(O_s, Output[bz, by, qb * block_M:(qb + 1) * block_M, :])
            for i in tb.parallel(block_M):
                if qb * block_M + i < seq_q:
                    LSE[bz, by, qb * block_M + i] = T.if_then_else(
                        l[i] > 0, (shift[i] + T.log2(l[i])) / LOG2E, neg_inf)

    return flash_fwd
