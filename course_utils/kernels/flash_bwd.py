"""The FlashAttention backward as three TileLang kernel factories (chapters 05 and 06).

With P = softmax(S), S = Q Kᵀ · scale, and the forward's LSE:
    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − Δ) with Δ = rowsum(dO ∘ O),
    dQ = scale · dS K,   dK = scale · dSᵀ Q.
P is recomputed from Q, K and the LSE instead of being stored. One thread block owns
``block_N`` keys of one (batch, query head): K and V stay resident, dK and dV accumulate in
registers, and the block walks over the query blocks that can see its keys. dQ gets
contributions from every key block, so it is accumulated in float32 with atomic adds and
cast by a last, small kernel.

    python -m course_utils.check flash_bwd  # check against the reference (and time it, on a GPU)
"""

import tilelang.language as T

from .flash_pieces import LOG2E, prelude, query_block_range, store_dkv, visible
from .tiles import TileBackend, Tiling

__all__ = ["flash_bwd_preprocess_kernel", "flash_bwd_kernel", "flash_bwd_postprocess_kernel", "BACKWARD_TILING"]

BACKWARD_TILING = Tiling(64, 64, 2, 128)  # 64 queries per step, 64 resident keys, two stages, 128 threads


def flash_bwd_preprocess_kernel(batch, heads, seq_q, dim, *, dtype="float16", block=64, threads=128, target=None):
    """Δ[b, h, i] = Σ_d dO[b, h, i, d] · O[b, h, i, d], in float32."""
    tb = TileBackend(target)

    @T.prim_func
    def flash_bwd_preprocess(
        O: T.Tensor([batch, heads, seq_q, dim], dtype),
        dO: T.Tensor([batch, heads, seq_q, dim], dtype),
        Delta: T.Tensor([batch, heads, seq_q], "float32"),
    ):
        with tb.kernel(T.ceildiv(seq_q, block), heads, batch, threads=threads) as (bx, by, bz):
            o = tb.fragment([block, dim], "float32")
            do = tb.fragment([block, dim], "float32")
            delta = tb.fragment([block], "float32")
            T.copy(O[bz, by, bx * block:(bx + 1) * block, :], o)
            T.copy(dO[bz, by, bx * block:(bx + 1) * block, :], do)
            for i, d in tb.parallel(block, dim):
                o[i, d] *= do[i, d]
            T.reduce_sum(o, delta, dim=1)
            T.copy(delta, Delta[bz, by, bx * block:(bx + 1) * block])

    return flash_bwd_preprocess


def flash_bwd_postprocess_kernel(batch, heads, seq, dim, *, scale=1.0, dtype="float16", block=64, threads=128,
                                 target=None):
    """Out = scale · Acc, cast from the float32 accumulator to ``dtype``."""
    tb = TileBackend(target)

    @T.prim_func
    def flash_bwd_postprocess(
        Acc: T.Tensor([batch, heads, seq, dim], "float32"),
        Out: T.Tensor([batch, heads, seq, dim], dtype),
    ):
        with tb.kernel(T.ceildiv(seq, block), heads, batch, threads=threads) as (bx, by, bz):
            acc = tb.fragment([block, dim], "float32")
            T.copy(Acc[bz, by, bx * block:(bx + 1) * block, :], acc)
            for i, d in tb.parallel(block, dim):
                acc[i, d] *= scale
            T.copy(acc, Out[bz, by, bx * block:(bx + 1) * block, :])

    return flash_bwd_postprocess


def flash_bwd_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, sm_scale=None,
    dtype="float16", target=None, tiling=BACKWARD_TILING,
):
    """Return a ``@T.prim_func`` computing dK, dV and the float32 dQ accumulator (pre-scale).

    dQ_acc must be zero on entry; it receives Σ over key blocks of dS·K (multiply by ``sm_scale``
    afterwards). With GQA (heads_kv < heads) several query heads add into one K/V head, so dK and
    dV are float32 accumulators that must also be zero on entry; with heads_kv == heads they are
    written directly in ``dtype``. ``tiling`` (a ``Tiling``): ``block_M`` is the query block, ``block_N``
    the resident key block.
    """
    block_M, block_N, num_stages, threads = tiling
    tb = TileBackend(target)
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    accum = "float32"
    # region: gqa accumulators
    dkv_dtype = dtype if p.group == 1 else accum  # GQA: several query heads add into one dK/dV head
    # endregion

    # region: launch
    @T.prim_func
    def flash_bwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        dO: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
        Delta: T.Tensor([batch, heads, seq_q], accum),
        dQ_acc: T.Tensor([batch, heads, seq_q, dim], accum),
        dK: T.Tensor([batch, p.heads_kv, seq_k, dim], dkv_dtype),
        dV: T.Tensor([batch, p.heads_kv, seq_k, dim], dkv_dtype),
    ):
        with tb.kernel(p.blocks(seq_k, block_N), heads, batch, threads=threads) as (bx, by, bz):
            K_s = tb.shared([block_N, dim], dtype)
            V_s = tb.shared([block_N, dim], dtype)
            Q_s = tb.shared([block_M, dim], dtype)
            dO_s = tb.shared([block_M, dim], dtype)
            lse = tb.shared([block_M], accum)
            delta = tb.shared([block_M], accum)
            PT = tb.fragment([block_N, block_M], accum)  # Sᵀ, then Pᵀ: keys are rows here
            dPT = tb.fragment([block_N, block_M], accum)
            PT_cast = tb.fragment([block_N, block_M], dtype)
            dST_cast = tb.fragment([block_N, block_M], dtype)
            dST_s = tb.shared([block_N, block_M], dtype)
            dv = tb.fragment([block_N, dim], accum)
            dk = tb.fragment([block_N, dim], accum)
            dq = tb.fragment([block_M, dim], accum)
            # endregion

            # region: setup
            kv_head = by // p.group
            T.copy(K[bz, kv_head, bx * block_N:(bx + 1) * block_N, :], K_s)
            T.copy(V[bz, kv_head, bx * block_N:(bx + 1) * block_N, :], V_s)
            T.clear(dv)
            T.clear(dk)

            # Only the query blocks that can see these keys.
            q_start, q_end = query_block_range(p, bx, block_M, block_N)
            # endregion

            # A one-key window makes the range from q_start to q_end a single block, and TVM's bound
            # analysis then rejects the loop; counting from 0 avoids that. Every other kernel loops over
            # qb itself, which lets TVM prove qb < num_q_blocks and drop a bounds check.
            first, offset = (0, q_start) if p.window_size == 1 else (q_start, 0)
            for step in T.Pipelined(first, q_end - offset, num_stages=num_stages):
                # region: recompute P
                qb = offset + step
                T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
                T.copy(LSE[bz, by, qb * block_M:(qb + 1) * block_M], lse)
                T.clear(PT)
                T.gemm(K_s, Q_s, PT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for j, i in tb.parallel(block_N, block_M):
                    PT[j, i] = T.if_then_else(visible(p, qb * block_M + i, bx * block_N + j, guard_q=True),
                                              T.exp2(PT[j, i] * p.scale_log2 - lse[i] * LOG2E), 0)
                # endregion
                # region: dV
                T.copy(dO[bz, by, qb * block_M:(qb + 1) * block_M, :], dO_s)
                T.clear(dPT)
                T.gemm(V_s, dO_s, dPT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(PT, PT_cast)
                T.gemm(PT_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)  # dV += Pᵀ dO
                # endregion

                # region: dK
                T.copy(Delta[bz, by, qb * block_M:(qb + 1) * block_M], delta)
                for j, i in tb.parallel(block_N, block_M):
                    dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i])  # dSᵀ, without the scale
                T.gemm(dST_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dSᵀ Q
                # endregion

                # region: dQ
                T.copy(dST_cast, dST_s)
                T.clear(dq)
                T.gemm(dST_s, K_s, dq, transpose_A=True)  # this key block's share of dS K
                for i, d in tb.parallel(block_M, dim):
                    if qb * block_M + i < seq_q:
                        T.atomic_add(dQ_acc[bz, by, qb * block_M + i, d], dq[i, d])
                # endregion

            # region: store
            store_dkv(tb, p, dk, dv, dK, dV, (bz, kv_head, bx), block_N, dim)  # dK scaled; added atomically with GQA
            # endregion

    return flash_bwd
