"""FlexAttention's kernels in TileLang: chapter 03's forward and chapter 05's backward, with modifiers.

The factories take a ``flex_trace.ModifierPlan`` and call its ``score``, ``score_and_derivative`` and
``mask`` on their index expressions while they build the ``@T.prim_func``: the modifiers' formulas
are inlined into the generated code. The loops walk the lists of a ``flex.BlockMask``: the
forward visits, for its query block, only the key blocks that are not EMPTY and evaluates the
mask only on PARTIAL ones; the backward visits, for its key block, only the query blocks that
are not EMPTY. The backward's query tile may be a fraction of the mask's query block (64 rows of
128 on a GPU), so one mask serves both.

On an sm_90 GPU the forward runs chapter 07's rotated loop instead (``flash_flex_hopper``) and the backward
chapter 08's Hopper loop (``flash_flex_hopper_bwd``), where they apply. ``api.flex`` picks, compiles and runs them
(registry rows ``FLEX``).

    python -m course_utils.check flex     # check against the float64 reference (and time it, on a GPU)
"""

import tilelang.language as T

from .flash_pieces import NEG_INF, forward_epilogue, forward_tiles, online_softmax, prelude, store_dkv
from .flex_pieces import (
    EMPTY,
    FULL,
    PARTIAL,
    flex_prelude,
    forward_launch,
    mask_dims,
    modify_scores,
    recompute_probabilities,
)
from .flex_trace import ModifierPlan
from .tiles import TileBackend, Tiling

__all__ = ["flex_fwd_kernel", "flex_bwd_kernel", "recompute_probabilities", "FORWARD_TILING", "BACKWARD_TILING",
           "EMPTY", "PARTIAL", "FULL"]

FORWARD_TILING = Tiling(128, 128, 1, 256)  # chapter 04's tuned forward's threads, on the GPU's 128 × 128 mask tiles
BACKWARD_TILING = Tiling(64, 128, 1, 256)  # chapter 05's tuned backward's: 64-row query steps, 128 resident keys


def flex_fwd_kernel(batch, heads, seq_q, seq_k, dim, plan: ModifierPlan, mask_shape, *, heads_kv=None, sm_scale=None,
                    dtype="float16", tiling=FORWARD_TILING, target=None):
    """Return a ``@T.prim_func`` computing O and LSE with the modifiers of ``plan`` (a ``ModifierPlan``).

    ``mask_shape`` is the shape of the BlockMask's ``state`` [B', H', S_q blocks, S_k blocks], whose
    tiles must be the ``tiling``'s block_M × block_N (a ``Tiling``). Inputs after V: KVCount, KVList,
    State (the BlockMask's), the packed captured tensors (``plan.pack``); outputs O and LSE.
    """
    block_M, block_N, num_stages, threads = tiling
    tb = TileBackend(target)
    p = flex_prelude(plan, heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)
    b_step, h_step = mask_dims(mask_shape)

    # One block per (query block, head, batch entry), as chapter 03's kernel (``flex_pieces.forward_launch``).
    @T.macro
    def flex_fwd(Q, K, V, KVCount, KVList, State, captured, Output, LSE, bx, by, bz):
        Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_tiles(
            tb, block_M, block_N, dim, dtype)
        qb = bx
        kv_head = by // p.group
        mbz, mby = bz * b_step, by * h_step
        T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(m, NEG_INF)

        for t in T.Pipelined(KVCount[mbz, mby, qb], num_stages=num_stages):
            # region: scores
            kb = KVList[mbz, mby, qb, t]  # only the key blocks the mask does not leave empty
            T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
            T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            # endregion
            modify_scores(tb, plan, captured, State, S, bz, by, mbz, mby, qb, kb, block_M, block_N, seq_k, sm_scale)

            online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
            T.copy(S, P)
            for i, j in tb.parallel(block_M, dim):
                acc_o[i, j] *= alpha[i]
            T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
            T.gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

        forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, None, bz, by, qb, block_M, dim, False)

    return forward_launch("flex_fwd", tb, flex_fwd, (batch, heads, seq_q, seq_k, dim), p, mask_shape, plan, dtype,
                          threads)


def flex_bwd_kernel(batch, heads, seq_q, seq_k, dim, plan: ModifierPlan, mask_shape, mask_block, *, heads_kv=None,
                    sm_scale=None, dtype="float16", tiling=BACKWARD_TILING, target=None):
    """Return a ``@T.prim_func`` computing dK, dV and the float32 dQ accumulator (before its scale).

    One block per (mask key block, query head, batch entry): the ``tiling``'s ``block_N`` is the mask's
    key block (``mask_block`` [1]), resident; it walks the mask's non-empty query blocks in ``block_M``-row
    steps. With a score_mod, dS = P ∘ (dP − Δ) ∘ score_mod′(s), the derivative from a Dual evaluation.
    Accumulator contract as ``flash_bwd.flash_bwd_kernel`` (dQ_acc, and the GQA dK/dV, zero on entry).
    """
    block_M, block_N, num_stages, threads = tiling
    if block_N != mask_block[1]:
        raise ValueError(f"the backward's key block ({block_N}) must be the mask's ({mask_block[1]})")
    tb = TileBackend(target)
    has_score = plan.score_mod is not None
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)
    mb, mh, n_qb, n_kb = mask_shape
    mask_M = mask_block[0]
    if mask_M % block_M:
        raise ValueError(f"the backward's query tile ({block_M}) must divide the mask's query block ({mask_M})")
    steps = mask_M // block_M  # backward query tiles per mask query block
    b_step, h_step = mask_dims(mask_shape)
    n_float, n_int = plan.sizes
    accum = "float32"
    dkv_dtype = dtype if p.group == 1 else accum

    @T.prim_func
    def flex_bwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        dO: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
        Delta: T.Tensor([batch, heads, seq_q], accum),
        QCount: T.Tensor([mb, mh, n_kb], "int32"),
        QList: T.Tensor([mb, mh, n_kb, n_qb], "int32"),
        State: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        CapturedF: T.Tensor([n_float], "float32"),
        CapturedI: T.Tensor([n_int], "int32"),
        dQ_acc: T.Tensor([batch, heads, seq_q, dim], accum),
        dK: T.Tensor([batch, p.heads_kv, seq_k, dim], dkv_dtype),
        dV: T.Tensor([batch, p.heads_kv, seq_k, dim], dkv_dtype),
    ):
        with tb.kernel(n_kb, heads, batch, threads=threads) as (bx, by, bz):
            K_s = tb.shared([block_N, dim], dtype)
            V_s = tb.shared([block_N, dim], dtype)
            Q_s = tb.shared([block_M, dim], dtype)
            dO_s = tb.shared([block_M, dim], dtype)
            lse = tb.shared([block_M], accum)
            delta = tb.shared([block_M], accum)
            PT = tb.fragment([block_N, block_M], accum)  # Sᵀ, then Pᵀ
            GT = tb.fragment([block_N, block_M], accum)  # score_mod′(s)ᵀ (0 where hidden)
            dPT = tb.fragment([block_N, block_M], accum)
            PT_cast = tb.fragment([block_N, block_M], dtype)
            dST_cast = tb.fragment([block_N, block_M], dtype)
            dST_s = tb.shared([block_N, block_M], dtype)
            dv = tb.fragment([block_N, dim], accum)
            dk = tb.fragment([block_N, dim], accum)
            dq = tb.fragment([block_M, dim], accum)
            captured = (CapturedF, CapturedI)
            kv_head = by // p.group
            mbz, mby = bz * b_step, by * h_step
            T.copy(K[bz, kv_head, bx * block_N:(bx + 1) * block_N, :], K_s)
            T.copy(V[bz, kv_head, bx * block_N:(bx + 1) * block_N, :], V_s)
            T.clear(dv)
            T.clear(dk)

            for step in T.Pipelined(QCount[mbz, mby, bx] * steps, num_stages=num_stages):
                # region: recompute P
                mask_qb = QList[mbz, mby, bx, step // steps]
                qb = mask_qb * steps + step % steps
                T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
                T.copy(LSE[bz, by, qb * block_M:(qb + 1) * block_M], lse)
                T.clear(PT)
                T.gemm(K_s, Q_s, PT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # A FULL tile skips the mask; only a PARTIAL one evaluates mask_mod (and the ends of the sequences).
                if State[mbz, mby, mask_qb, bx] == FULL:
                    recompute_probabilities(tb, plan, captured, PT, GT, lse, bz, by, qb, bx, block_M, block_N, seq_q,
                                            seq_k, sm_scale, p.scale_log2, False)
                else:
                    recompute_probabilities(tb, plan, captured, PT, GT, lse, bz, by, qb, bx, block_M, block_N, seq_q,
                                            seq_k, sm_scale, p.scale_log2, True)
                # endregion
                T.copy(dO[bz, by, qb * block_M:(qb + 1) * block_M, :], dO_s)
                T.clear(dPT)
                T.gemm(V_s, dO_s, dPT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(PT, PT_cast)
                T.gemm(PT_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)  # dV += Pᵀ dO
                # region: chain rule
                T.copy(Delta[bz, by, qb * block_M:(qb + 1) * block_M], delta)
                if has_score:
                    for j, i in tb.parallel(block_N, block_M):
                        dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i]) * GT[j, i]  # through score_mod
                else:
                    for j, i in tb.parallel(block_N, block_M):
                        dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i])
                # endregion
                T.gemm(dST_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dSᵀ Q
                T.copy(dST_cast, dST_s)
                T.clear(dq)
                T.gemm(dST_s, K_s, dq, transpose_A=True)
                for i, d in tb.parallel(block_M, dim):
                    if qb * block_M + i < seq_q:
                        T.atomic_add(dQ_acc[bz, by, qb * block_M + i, d], dq[i, d])

            store_dkv(tb, p, dk, dv, dK, dV, (bz, kv_head, bx), block_N, dim)

    return flex_bwd
