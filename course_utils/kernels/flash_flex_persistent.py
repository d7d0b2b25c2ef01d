"""FlexAttention's forward on chapter 07's persistent kernel: the dense forward the course ships, walking a block mask.

``flash_flex_hopper`` puts the modifiers into chapter 07's rotated loop, one thread block per query tile. The dense
``flash_attention`` runs faster than that on Hopper: its persistent kernel keeps one block per SM, which loads the
next tile while it stores the last one, and takes the tiles of a head in folded pairs. This module gives that
kernel the block mask's steps (``PersistentPieces.modifiers``), the way ``flash_flex_hopper_bwd`` does for
chapter 08's backward:

* a tile's key range is the mask's list of non-empty key blocks (``KVCount``, ``KVList``), and the producer's TMA
  loads the listed block of each step;
* the scores of each step go through ``score_mod`` and, on PARTIAL tiles, ``mask_mod`` (``modify_scores``);
* the tiles are taken in the causal mask's folded order (the heaviest query block of a head with its lightest):
  most block masks of the chapter put their long rows at the bottom. With ``tile_order="sorted"`` they are taken in
  the block mask's own order of cost instead (``sorted_tile``): whatever the mask, the longest rows first, each
  persistent block striding over the list, so the last tiles to start are the shortest (longest processing time
  first), for masks whose rows do not grow down (documents).

Same inputs and outputs as ``flash_flex.flex_fwd_kernel`` (the sorted order adds one input after them:
``BlockMask.rows_by_cost``); sm_90 GPUs, 128 × 128 block masks.
"""

import dataclasses
from functools import partial

import tilelang.language as T

from .flash_fwd_hopper_persistent import (
    H100_SMS,
    PersistentPieces,
    PersistentTiling,
    evaluate,
    evaluated_walk,
    flash_fwd_hopper_persistent_kernel,
    launched_blocks,
    tile_index,
    tile_order,
    tiles_per_block,
)
from .flash_pieces import NEG_INF
from .flex_pieces import flex_prelude, forward_launch, mask_dims, modify_scores
from .tiles import TileBackend, Tiling

__all__ = ["flex_fwd_hopper_persistent_kernel", "ListedKeySteps", "folded_order", "strided_tile_count",
           "strided_tile_index", "sorted_tile", "sorted_schedule", "TILE_ORDERS", "FLEX_TILING"]

_GPU = TileBackend("cuda")
# The dense D = 128 forward's tiling (``HOPPER_FORWARD_CONFIGS``); 128 × 128 is the block mask's tile.
FLEX_TILING = Tiling(128, 128, 2, 256)
# "folded": the causal mask's folded order (``folded_order``); "sorted": the block mask's rows longest first
# (``BlockMask.rows_by_cost``, an input of the kernel), taken by ``strided_tile_index``.
TILE_ORDERS = ("folded", "sorted")


def folded_order(p, index, block_M):
    """``tile_order`` with the query blocks of a head folded as under a causal mask, whatever the mask."""
    return tile_order(dataclasses.replace(p, causal=True), index, block_M)


def strided_tile_count(total, num_ctas, cta):
    """How many of ``total`` tiles persistent block ``cta`` takes in the strided walk (``strided_tile_index``)."""
    rounds, rest = total // num_ctas, total % num_ctas
    last = cta if rounds % 2 == 0 else num_ctas - 1 - cta  # block cta's place in the last, partial round
    return rounds + T.if_then_else(last < rest, 1, 0)


def strided_tile_index(num_ctas, cta, w):
    """The list index of block ``cta``'s ``w``-th tile: round ``w`` of the list (``num_ctas`` tiles, one each), the
    blocks taking them forwards in even rounds and backwards in odd ones, so no block always gets the longest tile
    of a round."""
    return w * num_ctas + T.if_then_else(w % 2 == 0, cta, num_ctas - 1 - cta)


def sorted_tile(heads, rows_by_cost, b_step, h_step, batch, index):
    """The (batch, head, query block) of the ``index``-th tile of the sorted list: rank ``index // (batch · heads)``
    of every (batch entry, head) in turn, the rank-th longest query block of its mask row (``rows_by_cost``
    [B', H', query blocks], at the mask's own indices). With a mask shared across b and h the list is sorted by
    cost exactly; with one that depends on them, the r-th longest rows of all heads come in round r."""
    bh_count = batch * heads
    rank, bh = index // bh_count, index % bh_count
    bz, by = bh // heads, bh % heads
    return bz, by, rows_by_cost[bz * b_step, by * h_step, rank]


def sorted_schedule(rows_by_cost, batch, heads, num_ctas):
    """The (batch, head, query block) tiles each persistent block takes in the sorted order, in order: the kernel's
    walk (``strided_tile_count``, ``strided_tile_index``, ``sorted_tile``) evaluated in Python on a
    ``BlockMask.rows_by_cost`` (for tests and pictures)."""
    total = batch * heads * rows_by_cost.shape[2]
    num_ctas = launched_blocks(num_ctas, total)
    b_step, h_step = mask_dims(rows_by_cost.shape)
    return evaluated_walk(lambda cta: strided_tile_count(total, num_ctas, cta),
                          lambda cta, w: sorted_tile(heads, rows_by_cost, b_step, h_step, batch,
                                                     evaluate(strided_tile_index(num_ctas, cta, w))), num_ctas)


@T.macro
def load_listed_keys(K, K_s, k_full, KVList, bz, kv_head, mbz, mby, qb, block_N, step, stage):
    """The producer's load of the ``step``-th key block the mask lists for query block ``qb``."""
    kb = KVList[mbz, mby, qb, step]
    T.tma_copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s[stage, :, :], barrier=k_full[stage])


@T.macro
def load_listed_values(V, V_s, v_full, KVList, bz, kv_head, mbz, mby, qb, block_N, step, stage):
    """Its values, then their full barrier."""
    kb = KVList[mbz, mby, qb, step]
    T.tma_copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s[stage, :, :], barrier=v_full[stage])
    T.mbarrier_arrive(v_full[stage])


@T.macro
def listed_scores(plan, captured, KVCount, KVList, State, S, bz, by, mbz, mby, qb, step, block_M, block_N, seq_k,
                  sm_scale):
    """The scores of the ``step``-th listed key block through the modifiers; all hidden where the mask lists no
    block for this query block (its one step then reads the first key block, and the tile ends with O = 0)."""
    modify_scores(_GPU, plan, captured, State, S, bz, by, mbz, mby, qb, KVList[mbz, mby, qb, step], block_M, block_N,
                  seq_k, sm_scale)
    if KVCount[mbz, mby, qb] == 0:
        for i, j in T.Parallel(block_M, block_N):
            S[i, j] = NEG_INF


class ListedKeySteps:
    """The steps of ``flash_fwd_hopper_persistent_kernel`` that a block mask and a ``ModifierPlan`` swap in
    (``PersistentPieces.modifiers``). ``block_mask`` in each method is the tuple of the kernel's inputs
    (KVCount, KVList, State, CapturedF, CapturedI, and RowsByCost with ``tile_order="sorted"``) that ``launch``
    passes to the tile walk."""

    def __init__(self, shape, plan, mask_shape, *, heads_kv, sm_scale, dtype, block_N, tile_order="folded"):
        self.shape, self.seq_k, self.plan, self.mask_shape, self.dtype = shape, shape[3], plan, tuple(mask_shape), dtype
        self.p = flex_prelude(plan, *shape[1:], heads_kv=heads_kv, sm_scale=sm_scale)
        self.sm_scale, self.block_N = sm_scale, block_N
        self.b_step, self.h_step = mask_dims(mask_shape)
        if tile_order not in TILE_ORDERS:
            raise ValueError(f"tile_order must be one of {TILE_ORDERS}; got {tile_order!r}")
        self.tile_order = tile_order

    def tile_walk(self, p, order, total, num_ctas, block_M):
        """``(count(block_mask, cta), tile(block_mask, cta, w))``: how many tiles persistent block ``cta`` takes and
        the (batch, head, query block) of its ``w``-th. Folded: the dense kernel's walk over ``order``; sorted: the
        strided walk over the block mask's RowsByCost."""
        if self.tile_order == "folded":
            return (lambda block_mask, cta: tiles_per_block(total, num_ctas, cta),
                    lambda block_mask, cta, w: order(p, tile_index(num_ctas, cta, w), block_M))
        batch = self.shape[0]
        return (lambda block_mask, cta: strided_tile_count(total, num_ctas, cta),
                lambda block_mask, cta, w: sorted_tile(p.heads, block_mask[5], self.b_step, self.h_step, batch,
                                                       strided_tile_index(num_ctas, cta, w)))

    def _mask_index(self, bz, by):
        return bz * self.b_step, by * self.h_step

    def key_range(self, block_mask, bz, by, qb):
        """Steps ``0 … KVCount − 1`` of the tile (the walk runs at least one)."""
        mbz, mby = self._mask_index(bz, by)
        return 0, block_mask[0][mbz, mby, qb]

    def key_loads(self, K, V, K_s, V_s, k_full, v_full, block_mask, bz, by, kv_head, qb):
        """The producer's two loads of a step, reading the mask's list."""
        mbz, mby = self._mask_index(bz, by)
        listed = (block_mask[1], bz, kv_head, mbz, mby, qb, self.block_N)
        return (partial(load_listed_keys, K, K_s, k_full, *listed),
                partial(load_listed_values, V, V_s, v_full, *listed))

    def score_step(self, block_mask, bz, by, qb):
        """``peeled_key_loop``'s score step: ``step(S, j)`` puts the scores of the j-th listed block through the
        modifiers."""
        kv_count, kv_list, state, captured_f, captured_i = block_mask[:5]
        mbz, mby = self._mask_index(bz, by)

        def step(S, j):
            listed_scores(self.plan, (captured_f, captured_i), kv_count, kv_list, state, S, bz, by, mbz, mby, qb, j,
                          S.shape[0], S.shape[1], self.seq_k, self.sm_scale)

        return step

    def launch(self, walk_tiles, num_ctas, threads):
        """The ``@T.prim_func`` with ``flex_fwd_kernel``'s inputs and outputs, around the persistent tile walk."""

        if self.tile_order == "folded":
            def body(Q, K, V, KVCount, KVList, State, captured, Output, LSE, cta):
                walk_tiles(Q, K, V, None, Output, LSE, cta, (KVCount, KVList, State, *captured))

            return forward_launch("flex_fwd_hopper_persistent", _GPU, body, self.shape, self.p, self.mask_shape,
                                  self.plan, self.dtype, threads, num_ctas=num_ctas)

        def sorted_body(Q, K, V, KVCount, KVList, State, captured, RowsByCost, Output, LSE, cta):
            walk_tiles(Q, K, V, None, Output, LSE, cta, (KVCount, KVList, State, *captured, RowsByCost))

        return forward_launch("flex_fwd_hopper_persistent_sorted", _GPU, sorted_body, self.shape, self.p,
                              self.mask_shape, self.plan, self.dtype, threads, num_ctas=num_ctas, rows_by_cost=True)


def flex_fwd_hopper_persistent_kernel(batch, heads, seq_q, seq_k, dim, plan, mask_shape, *, heads_kv=None,
                                      sm_scale=None, dtype="float16", tiling=FLEX_TILING, num_ctas=H100_SMS,
                                      tile_order="folded"):
    """Return a ``@T.prim_func`` with ``flex_fwd_kernel``'s contract on the persistent kernel (sm_90): ``tiling`` a
    ``Tiling`` whose block_M × block_N is the mask's tile (two consumer warpgroups: threads = 2 · block_M, taking
    turns to issue their matmuls, as the dense kernel at D = 128), ``num_ctas`` persistent blocks (one per SM).
    ``tile_order`` (``TILE_ORDERS``): "folded", the causal mask's folded order; "sorted", the block mask's rows
    longest first, read from one more input after CapturedI, RowsByCost [B', H', query blocks] int32
    (``BlockMask.rows_by_cost``): O and LSE are then parameters 9 and 10."""
    heads_kv = heads if heads_kv is None else heads_kv
    sm_scale = dim ** -0.5 if sm_scale is None else float(sm_scale)
    steps = ListedKeySteps((batch, heads, seq_q, seq_k, dim), plan, mask_shape, heads_kv=heads_kv, sm_scale=sm_scale,
                           dtype=dtype, block_N=tiling.block_N, tile_order=tile_order)
    return flash_fwd_hopper_persistent_kernel(
        batch, heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=steps.p.sm_scale, dtype=dtype,
        tiling=PersistentTiling(*tiling, pingpong=True, num_ctas=num_ctas),
        pieces=PersistentPieces(order=folded_order, modifiers=steps))
