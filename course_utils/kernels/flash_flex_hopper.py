"""FlexAttention's forward on Hopper: chapter 07's rotated loop, walking a block mask, with the modifiers inlined.

Same inputs and outputs as ``flash_flex.flex_fwd_kernel`` (Q, K, V, the BlockMask's KVCount, KVList and State,
the captured tensors; O and LSE), for sm_90 GPUs only. The key loop is ``flash_fwd_hopper.rotated_loop``, the
dense kernel's, with its two steps swapped: step ``t`` reads the mask's ``t``-th non-empty key block
(``KVList``) instead of block ``t``, and the scores go through ``score_mod`` and, on PARTIAL tiles, ``mask_mod``
(``flex_pieces.modify_scores``, the step of chapter 03's flex loop) instead of the causal or window mask.
"""

import tilelang.language as T

from .flash_fwd_hopper import rotated_loop
from .flash_pieces import NEG_INF, forward_epilogue, forward_tiles
from .flex_pieces import flex_prelude, forward_launch, mask_dims, modify_scores
from .flex_trace import ModifierPlan
from .tiles import TileBackend, Tiling

__all__ = ["flex_fwd_hopper_kernel", "HOPPER_FLEX_DIMS", "HOPPER_FLEX_BLOCK", "HOPPER_FORWARD_TILING"]

HOPPER_FLEX_DIMS = (64, 128)  # the head dimensions of the dense Hopper forward's tuned configurations
HOPPER_FLEX_BLOCK = (128, 128)  # the BlockMask's tile on a GPU (``flex.default_block``)
HOPPER_FORWARD_TILING = Tiling(*HOPPER_FLEX_BLOCK, 2, 256)  # two stages, two consumer warpgroups


def flex_fwd_hopper_kernel(batch, heads, seq_q, seq_k, dim, plan: ModifierPlan, mask_shape, *, heads_kv=None,
                           sm_scale=None, dtype="float16", tiling=HOPPER_FORWARD_TILING):
    """Return a ``@T.prim_func`` computing O and LSE with the modifiers of ``plan``; arguments and parameters as
    ``flex_fwd_kernel``'s (the mask's tiles must be the ``tiling``'s block_M × block_N), for CUDA on sm_90.

    ``tiling.threads`` counts the two consumer warpgroups; TileLang adds the TMA producer warpgroup. A query block
    whose mask lists no key block runs one step of the loop (P = 0) and ends with O = 0 and LSE = -inf.
    """
    block_M, block_N, num_stages, threads = tiling
    tb = TileBackend("cuda")
    p = flex_prelude(plan, heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)
    n_qb = mask_shape[2]
    b_step, h_step = mask_dims(mask_shape)

    @T.macro
    def flex_fwd_hopper(Q, K, V, KVCount, KVList, State, captured, Output, LSE, bx, by, bz):
        Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_tiles(
            tb, block_M, block_N, dim, dtype)
        stage_in_use = T.alloc_local([1], dtype)
        # Launched last query block first: under a causal mask the last blocks visit the most key blocks, and
        # starting the longest first shortens the tail (the dense kernel's order); any other mask is unharmed.
        qb = n_qb - 1 - bx
        kv_head = by // p.group
        mbz, mby = bz * b_step, by * h_step
        T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
        T.fill(acc_o, 0)
        T.fill(l, 0)
        T.fill(P, 0)
        T.fill(m, NEG_INF)

        # Step t reads the t-th listed key block; the loop clamps t, so every step reads a listed block (the
        # first one when the list is empty: its one step multiplies by P = 0, and O = 0 since l = 0).
        rotated_loop(tb, (Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l), stage_in_use, K, V,
                     bz, kv_head, 0, KVCount[mbz, mby, qb], lambda t: KVList[mbz, mby, qb, t],
                     lambda S, kb: modify_scores(tb, plan, captured, State, S, bz, by, mbz, mby, qb, kb, block_M,
                                                 block_N, seq_k, sm_scale),
                     block_M, block_N, dim, p.scale_log2, num_stages)

        forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, None, bz, by, qb, block_M, dim, False)

    return forward_launch("flex_fwd_hopper", tb, flex_fwd_hopper, (batch, heads, seq_q, seq_k, dim), p, mask_shape,
                          plan, dtype, threads)
