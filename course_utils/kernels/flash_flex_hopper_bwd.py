"""FlexAttention's backward on chapter 08's Hopper loop: chapter 11's modifiers in FlashAttention-3's schedule.

``flex_bwd_hopper_kernel`` has ``flash_flex.flex_bwd_kernel``'s inputs, outputs and accumulator contract, and
runs ``flash_bwd_hopper_kernel``'s loop (keys resident, Sᵀ and dPᵀ issued together by wgmma, dSᵀ through two
shared buffers, dQ added by the copy engine) with three of its steps swapped through ``BackwardPieces.modifiers``:

    which query blocks       the block mask's list for this key block, ``QList[b', h', kb, :QCount]``, each of
                             the mask's query blocks in steps of ``block_M`` rows (as the sm_80 kernel walks it)
    Pᵀ                       recomputed with score_mod, and score_mod′ from the same Dual evaluation; mask_mod
                             only on PARTIAL tiles (``flex_pieces.recompute_probabilities``)
    dSᵀ                      Pᵀ ∘ (dPᵀ − Δ) ∘ score_mod′ᵀ (``flash_bwd_hopper.ds_t``)

A score the score_mod sets to −∞ has P = 0 and no gradient. A key block that no query sees still runs one step
(chapter 08's loop waits for K and V inside its first step): the first query block of its list, a tile the mask
leaves EMPTY, so mask_mod hides every pair of it, and every gradient gets exactly 0 from it. sm_90 only;
compile with ``flash_bwd_hopper.PASS_CONFIGS``.
"""

import tilelang.language as T

from .flash_bwd_hopper import ACCUM, BackwardPieces, flash_bwd_hopper_kernel
from .flash_pieces import prelude
from .flex_pieces import FULL, mask_dims, recompute_probabilities
from .flex_trace import ModifierPlan
from .tiles import TileBackend, Tiling

__all__ = ["flex_bwd_hopper_kernel", "FLEX_BACKWARD_PIECES", "BlockMaskSteps", "HOPPER_FLEX_DIMS", "HOPPER_FLEX_BLOCK",
           "HOPPER_BACKWARD_TILING"]

_GPU = TileBackend("cuda")
HOPPER_FLEX_DIMS = (64, 128)  # head dims the kernel is built and checked for
HOPPER_FLEX_BLOCK = (128, 128)  # the block mask's tile it walks (FlexAttention's default)
HOPPER_BACKWARD_TILING = Tiling(64, HOPPER_FLEX_BLOCK[1], 2, 256)  # 64-row steps, two stages, two consumer warpgroups


# Chapter 08's options that the flex backward takes, measured on its loop (docs/flex_hopper.md): dQ's reduce-add
# waited for at the next step's dSᵀ barrier (version 22, as every shipped BackwardConfig), and dK and dV stored by
# TMA where a block owns its rows (version 19): 1.005-1.036 × without it (medians) over the five modifiers of
# chapter 11's record, in two runs on an H200. ``dv_under_ds`` is not taken: level or slower, with a larger dQ error.
FLEX_BACKWARD_PIECES = BackwardPieces(defer_dq_wait=True, dkdv_by_tma=True)


@T.macro
def tile_probabilities(plan, captured, State, PT, GT, lse, mask_b, mask_h, mask_qb, bz, head, qb, kb, block_M,
                       block_N, seq_q, seq_k, sm_scale, scale_log2):
    """Pᵀ (and score_mod′ᵀ) of one tile; a FULL tile skips mask_mod, any other evaluates it."""
    if State[mask_b, mask_h, mask_qb, kb] == FULL:
        recompute_probabilities(_GPU, plan, captured, PT, GT, lse, bz, head, qb, kb, block_M, block_N, seq_q, seq_k,
                                sm_scale, scale_log2, False)
    else:
        recompute_probabilities(_GPU, plan, captured, PT, GT, lse, bz, head, qb, kb, block_M, block_N, seq_q, seq_k,
                                sm_scale, scale_log2, True)


class BlockMaskSteps:
    """The steps of ``flash_bwd_hopper_kernel``'s loop that a block mask and a ``ModifierPlan`` swap in
    (``BackwardPieces.modifiers``). ``block_mask`` in each method is the tuple of the kernel's inputs
    (QCount, QList, State, CapturedF, CapturedI) that ``launch`` passes to the loop."""

    def __init__(self, batch, heads, seq_q, seq_k, dim, plan: ModifierPlan, mask_shape, mask_block, *, heads_kv,
                 sm_scale, dtype, block_M):
        self.batch, self.heads, self.seq_q, self.seq_k, self.dim = batch, heads, seq_q, seq_k, dim
        self.plan, self.mask_shape, self.dtype, self.block_M = plan, tuple(mask_shape), dtype, block_M
        self.block_N = mask_block[1]
        self.p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)
        self.steps = mask_block[0] // block_M  # the loop's query steps per mask query block
        self.b_step, self.h_step = mask_dims(mask_shape)

    def _mask_index(self, bz, by):
        return bz * self.b_step, by * self.h_step

    def derivative_tile(self, block_N, block_M):
        """The fragment of score_mod′ᵀ, or None without a score_mod (dSᵀ then has no third factor)."""
        if self.plan.score_mod is None:
            return None
        return T.alloc_fragment([block_N, block_M], ACCUM)

    def query_steps(self, block_mask, bz, by, kb):
        """``(first, end, offset)`` of the loop: every step of the listed query blocks, and at least one."""
        q_count = block_mask[0]
        mask_b, mask_h = self._mask_index(bz, by)
        return 0, T.max(q_count[mask_b, mask_h, kb] * self.steps, 1), 0

    def query_block(self, block_mask, bz, by, kb, step):
        """The query block (of ``block_M`` rows) of loop step ``step``."""
        q_list = block_mask[1]
        mask_b, mask_h = self._mask_index(bz, by)
        return q_list[mask_b, mask_h, kb, step // self.steps] * self.steps + step % self.steps

    def probabilities(self, block_mask, PT, GT, lse, bz, head, qb, kb):
        """Pᵀ from the raw scores in ``PT`` (and score_mod′ᵀ in ``GT``), with the modifiers."""
        _, _, state, captured_f, captured_i = block_mask
        mask_b, mask_h = self._mask_index(bz, head)
        tile_probabilities(self.plan, (captured_f, captured_i), state, PT, GT, lse, mask_b, mask_h,
                           qb // self.steps, bz, head, qb, kb, self.block_M, self.block_N, self.seq_q,
                           self.seq_k, self.p.sm_scale, self.p.scale_log2)

    def launch(self, main_loop, grid, threads, dkv_dtype):
        """The ``@T.prim_func`` with ``flex_bwd_kernel``'s inputs, around chapter 08's loop."""
        batch, heads, seq_q, seq_k, dim, dtype = self.batch, self.heads, self.seq_q, self.seq_k, self.dim, self.dtype
        mb, mh, n_qb, n_kb = self.mask_shape
        n_float, n_int = self.plan.sizes
        q_shape, kv_shape = [batch, heads, seq_q, dim], [batch, self.p.heads_kv, seq_k, dim]

        @T.prim_func
        def flex_bwd_hopper(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype), LSE: T.Tensor(q_shape[:3], ACCUM), Delta: T.Tensor(q_shape[:3], ACCUM),
            QCount: T.Tensor([mb, mh, n_kb], "int32"), QList: T.Tensor([mb, mh, n_kb, n_qb], "int32"),
            State: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
            CapturedF: T.Tensor([n_float], "float32"), CapturedI: T.Tensor([n_int], "int32"),
            dQ_acc: T.Tensor(q_shape, ACCUM), dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
        ):
            with T.Kernel(*grid, threads=threads) as (bx, by, bz):
                main_loop(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, bx, by, bz,
                          (QCount, QList, State, CapturedF, CapturedI))

        return flex_bwd_hopper


def flex_bwd_hopper_kernel(batch, heads, seq_q, seq_k, dim, plan: ModifierPlan, mask_shape, mask_block, *,
                           heads_kv=None, sm_scale=None, dtype="float16", tiling=HOPPER_BACKWARD_TILING,
                           pieces=FLEX_BACKWARD_PIECES):
    """Return a ``@T.prim_func`` with ``flex_bwd_kernel``'s contract, on chapter 08's Hopper loop.

    ``(Q, K, V, dO, LSE, Δ, QCount, QList, State, CapturedF, CapturedI, dQ_acc, dK, dV)``: dQ_acc (and, with
    GQA, the float32 dK and dV) zero on entry; dQ_acc receives Σ dS·K before its scale. ``mask_block``: the
    BlockMask's tile, whose keys are the block's resident ``tiling.block_N``; its query rows are walked in
    ``tiling.block_M`` steps (a multiple of 64: a warpgroup's wgmma owns 64 rows of dQ). ``pieces``: chapter 08's
    options (a ``BackwardPieces`` without ``modifiers``, which this factory adds); by default those of
    ``FLEX_BACKWARD_PIECES``.
    """
    block_M, block_N, num_stages, threads = tiling
    mask_M = mask_block[0]
    if block_N != mask_block[1]:
        raise ValueError(f"the backward's key block ({block_N}) must be the mask's ({mask_block[1]})")
    if block_M % 64 or mask_M % block_M:
        raise ValueError(f"the Hopper flex backward walks the mask's query block ({mask_M} rows) in steps of a "
                         f"multiple of 64 rows that divides it; got block_M={block_M}")
    if len(mask_shape) != 4 or mask_shape[3] != -(-seq_k // block_N) or mask_shape[2] != -(-seq_q // mask_M):
        raise ValueError(f"mask_shape {tuple(mask_shape)} is not the state of a {mask_M} x {block_N} block mask of "
                         f"{seq_q} queries and {seq_k} keys")
    steps = BlockMaskSteps(batch, heads, seq_q, seq_k, dim, plan, mask_shape, mask_block, heads_kv=heads_kv,
                           sm_scale=sm_scale, dtype=dtype, block_M=block_M)
    pieces = pieces._replace(modifiers=steps)
    return flash_bwd_hopper_kernel(batch, heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale, dtype=dtype,
                                   tiling=Tiling(block_M, block_N, num_stages, threads), pieces=pieces)
