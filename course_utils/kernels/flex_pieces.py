"""The pieces FlexAttention's forward kernels share (chapter 03's loop and chapter 07's rotated one): the states
of a block mask's tiles, how a mask shared across batch entries or heads is indexed, and the step that puts the
score tile through ``score_mod`` and ``mask_mod``.

Like ``flash_pieces``, everything here is evaluated while a factory builds its ``@T.prim_func``: ``plan.score``
and ``plan.mask`` return the modifiers' formulas as TileLang expressions, inlined where the step is called.
"""

import tilelang.language as T

from .flash_pieces import NEG_INF, prelude

__all__ = ["EMPTY", "PARTIAL", "FULL", "flex_prelude", "mask_dims", "modify_scores"]

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
