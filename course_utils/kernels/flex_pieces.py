"""The pieces of chapter 11's flex kernels that chapter 05's loop (``flash_flex``) and chapter 08's Hopper loop
(``flash_flex_hopper_bwd``) share: the three states of a block mask's tile, the mask's (batch, head) strides,
and Pᵀ recomputed with the modifiers in the backward.
"""

import tilelang.language as T

from .flash_pieces import LOG2E, NEG_INF

__all__ = ["EMPTY", "PARTIAL", "FULL", "mask_dims", "recompute_probabilities"]

EMPTY, PARTIAL, FULL = 0, 1, 2  # the three states of a (query block, key block) pair of a block mask


def mask_dims(state_shape):
    """The mask's (batch, head) strides: 0 for a dimension the mask shares (B' or H' = 1)."""
    return (1 if state_shape[0] > 1 else 0), (1 if state_shape[1] > 1 else 0)


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
