"""The FlashAttention forward as a TileLang kernel factory (chapters 03, 04 and 06).

One thread block owns ``block_M`` query rows of one (batch, head). It keeps Q in shared memory,
streams K/V through shared memory ``block_N`` keys at a time, and keeps the running row max
``m``, the running denominator ``l`` and the output accumulator in registers. Scores are scaled
by ``sm_scale · log2(e)`` so the exponentials are ``exp2``; the LSE written out is in natural log.

    python -m course_utils.check flash_fwd  # check against the reference (and time it, on a GPU)
"""

from typing import NamedTuple

import tilelang.language as T
from tilelang.layout import make_linear_layout

from .flash_pieces import (
    forward_epilogue,
    forward_tiles,
    init_running_max,
    key_block_range,
    mask_scores,
    online_softmax,
    prelude,
)
from .tiles import TileBackend

__all__ = ["flash_fwd_kernel", "ForwardTiling", "FORWARD_TILING"]


class ForwardTiling(NamedTuple):
    """The kernel's tiling: ``block_M`` query rows and ``block_N`` keys per tile, ``num_stages`` K/V tiles in
    flight, ``threads`` per block (a ``Tiling``'s four fields), and the layout of the shared tiles: TileLang's
    swizzled default, or with ``linear_smem`` plain row-major (GPU only; chapter 04 measures what swizzling is
    worth)."""

    block_M: int = 128
    block_N: int = 128
    num_stages: int = 2
    threads: int = 256
    linear_smem: bool = False


FORWARD_TILING = ForwardTiling()


def flash_fwd_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None,
    dtype="float16", target=None, tiling=FORWARD_TILING,
):
    """Return a ``@T.prim_func`` computing O and LSE for Q [B, H, S_q, D], K/V [B, H_kv, S_k, D].

    Parameters after ``*`` select the variant (GQA, causal, sliding window, sinks), the dtype and the
    target; ``tiling`` (a ``ForwardTiling``) the tile sizes, pipeline stages, threads and shared layout.
    ``Sinks`` is always a parameter (float32 [H]); it is read only when ``has_sinks``.
    """
    block_M, block_N, num_stages, threads, linear_smem = tiling
    tb = TileBackend(target)
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    accum = "float32"

    # region: launch
    @T.prim_func
    def flash_fwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], accum),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
    ):
        with tb.kernel(p.blocks(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_tiles(
                tb, block_M, block_N, dim, dtype)
            # endregion
            if linear_smem and tb.on_gpu:
                T.annotate_layout({buf: make_linear_layout(buf) for buf in (Q_s, K_s, V_s, O_s)})

            # region: setup
            # Causal: the last query blocks have the most key blocks; start them first.
            qb = (p.blocks(seq_q, block_M) - 1 - bx) if p.masked else bx
            kv_head = by // p.group
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
            k_start, k_end = key_block_range(p, qb, block_M, block_N)
            # endregion

            for kb in T.Pipelined(k_start, k_end, num_stages=num_stages):
                # region: scores
                T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                mask_scores(tb, p, S, qb, kb, block_M, block_N)
                # endregion

                # region: softmax
                online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
                T.copy(S, P)
                for i, j in tb.parallel(block_M, dim):
                    acc_o[i, j] *= alpha[i]
                # endregion

                # region: pv
                T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
                T.gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                # endregion

            forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim,
                             has_sinks)

    return flash_fwd
