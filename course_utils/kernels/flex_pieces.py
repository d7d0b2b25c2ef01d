"""The pieces of chapter 11's flex kernels that their loops share (chapter 03's and chapter 07's rotated forward,
chapter 05's and chapter 08's Hopper backward): the states of a block mask's tiles, how a mask shared across batch
entries or heads is indexed, the forwards' inputs and launch, the forward's step that puts the score tile through
``score_mod`` and ``mask_mod``, and the backward's Pᵀ recomputed with the modifiers.

Like ``flash_pieces``, everything here is evaluated while a factory builds its ``@T.prim_func``: ``plan.score``
and ``plan.mask`` return the modifiers' formulas as TileLang expressions, inlined where the step is called.
"""

import tilelang.language as T

from .flash_pieces import LOG2E, NEG_INF, prelude

__all__ = ["EMPTY", "PARTIAL", "FULL", "flex_prelude", "mask_dims", "forward_launch", "modify_scores",
           "recompute_probabilities"]

EMPTY, PARTIAL, FULL = 0, 1, 2  # the three states of a (query block, key block) pair of a block mask


def flex_prelude(plan, heads, seq_q, seq_k, dim, *, heads_kv=None, sm_scale=None):
    """The ``Prelude`` of a flex forward. With a score_mod the scores are scaled (and modified) before the softmax,
    which then works in natural units: the prelude's scale is 1. Without one, the scale is folded into exp2 as in
    chapter 03."""
    return prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv,
                   sm_scale=1.0 if plan.score_mod is not None else sm_scale)


def mask_dims(state_shape):
    """The mask's (batch, head) strides: 0 for a dimension the mask shares (B' or H' = 1)."""
    return (1 if state_shape[0] > 1 else 0), (1 if state_shape[1] > 1 else 0)


def forward_launch(name, tb, body, shape, p, mask_shape, plan, dtype, threads, num_ctas=None, rows_by_cost=False):
    """The ``@T.prim_func`` ``name`` of a flex forward: inputs Q, K, V [batch, heads (p.heads_kv), seq, dim] of
    ``shape``, the BlockMask's KVCount, KVList and State (``mask_shape``), the captured tensors packed as
    ``plan.sizes``; outputs O and LSE. One block of ``threads`` per (query block, head, batch entry) runs the macro
    ``body(Q, K, V, KVCount, KVList, State, captured, Output, LSE, bx, by, bz)``, ``captured`` the two packed
    inputs: chapter 03's loop or chapter 07's rotated one. With ``num_ctas``, that many persistent blocks run
    ``body(..., Output, LSE, cta)`` instead: chapter 07's persistent kernel; with ``rows_by_cost`` too, one more
    input after the captured ones, RowsByCost [B', H', query blocks] int32 (``BlockMask.rows_by_cost``: the
    persistent kernel's sorted tile order), passed to ``body`` before Output."""
    batch, heads, seq_q, seq_k, dim = shape
    mb, mh, n_qb, n_kb = mask_shape
    n_float, n_int = plan.sizes

    if rows_by_cost:
        return _sorted_forward_launch(name, body, shape, p, mask_shape, plan, dtype, threads, num_ctas)

    @T.prim_func
    def flex_fwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        KVCount: T.Tensor([mb, mh, n_qb], "int32"),
        KVList: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        State: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        CapturedF: T.Tensor([n_float], "float32"),
        CapturedI: T.Tensor([n_int], "int32"),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], "float32"),
    ):
        if num_ctas is None:
            with tb.kernel(n_qb, heads, batch, threads=threads) as (bx, by, bz):
                body(Q, K, V, KVCount, KVList, State, (CapturedF, CapturedI), Output, LSE, bx, by, bz)
        else:
            with T.Kernel(num_ctas, threads=threads) as cta:
                body(Q, K, V, KVCount, KVList, State, (CapturedF, CapturedI), Output, LSE, cta)

    return flex_fwd.with_attr("global_symbol", name)


def _sorted_forward_launch(name, body, shape, p, mask_shape, plan, dtype, threads, num_ctas):
    """``forward_launch``'s persistent kernel with one more input, RowsByCost, after the captured ones."""
    batch, heads, seq_q, seq_k, dim = shape
    mb, mh, n_qb, n_kb = mask_shape
    n_float, n_int = plan.sizes

    @T.prim_func
    def flex_fwd_sorted(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        KVCount: T.Tensor([mb, mh, n_qb], "int32"),
        KVList: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        State: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        CapturedF: T.Tensor([n_float], "float32"),
        CapturedI: T.Tensor([n_int], "int32"),
        RowsByCost: T.Tensor([mb, mh, n_qb], "int32"),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], "float32"),
    ):
        with T.Kernel(num_ctas, threads=threads) as cta:
            body(Q, K, V, KVCount, KVList, State, (CapturedF, CapturedI), RowsByCost, Output, LSE, cta)

    return flex_fwd_sorted.with_attr("global_symbol", name)


@T.macro
def modify_scores(tb, plan, captured, State, S, bz, by, mbz, mby, qb, kb, block_M, block_N, seq_k, sm_scale):
    """Put the raw scores ``S`` of tile (query block ``qb``, key block ``kb``) of batch entry ``bz``, head ``by``
    through the modifiers of ``plan``: ``score_mod`` on the scaled scores (if there is one), then, only where the
    block mask (``State``, at its own indices ``mbz``, ``mby``) says the tile is PARTIAL, ``mask_mod`` and the end
    of the keys. Hidden scores become -inf by selection, as ``flash_pieces.mask_scores`` does.
    """
    # region: score_mod
    if plan.score_mod is not None:
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = plan.score(captured, S[i, j] * sm_scale, bz, by, qb * block_M + i, kb * block_N + j)
    # endregion
    # region: mask_mod
    if State[mbz, mby, qb, kb] == PARTIAL:  # a FULL block skips this pass
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.if_then_else(
                T.And(kb * block_N + j < seq_k, plan.mask(captured, bz, by, qb * block_M + i, kb * block_N + j)),
                S[i, j], NEG_INF)
    # endregion


def _seen(plan, captured, b, h, q_pos, k_pos, seq_q, seq_k, masked):
    """Whether the pair counts: always in a FULL tile; in a PARTIAL one, inside both sequences and by mask_mod."""
    if not masked:
        return T.bool(True)
    return T.And(T.And(q_pos < seq_q, k_pos < seq_k), plan.mask(captured, b, h, q_pos, k_pos))


@T.macro
def recompute_probabilities(tb, plan, captured, PT, GT, lse, bz, by, qb, bx, block_M, block_N, seq_q, seq_k, sm_scale,
                            scale_log2, masked):
    """Pᵀ of one tile from the raw scores Kᵀ·Qᵀ in ``PT`` and the forward's LSE, 0 where the pair is hidden;
    with a score_mod, also score_mod′ᵀ in ``GT`` (one Dual evaluation gives both)."""
    for j, i in tb.parallel(block_N, block_M):
        seen = _seen(plan, captured, bz, by, qb * block_M + i, bx * block_N + j, seq_q, seq_k, masked)
        if plan.score_mod is not None:
            value, slope = plan.score_and_derivative(captured, PT[j, i] * sm_scale, bz, by, qb * block_M + i,
                                                     bx * block_N + j)
            # A score the modifier sets to −∞ has P = 0 (and no gradient), even in a row whose LSE is −∞ too.
            live = T.And(seen, value > NEG_INF)
            GT[j, i] = T.if_then_else(live, slope, 0)
            PT[j, i] = T.if_then_else(live, T.exp2((value - lse[i]) * LOG2E), 0)
        else:
            PT[j, i] = T.if_then_else(seen, T.exp2(PT[j, i] * scale_log2 - lse[i] * LOG2E), 0)
