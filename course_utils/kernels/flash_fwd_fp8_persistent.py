"""The FP8 forward on chapter 07's persistent kernel, its two consumer warpgroups taking turns (ping-pong).

Chapter 12's tile step (descales folded into the exponent, P rounded to e4m3 at ``P_SCALE``, P's columns and V's
keys in ``wgmma_key_slot`` order) inside the producer/consumer protocol of ``flash_fwd_hopper_persistent`` and its
peeled loop. Why it is faster than the rotated loop (``flash_fwd_fp8_hopper_kernel``): in FP8 the matmuls take half
the time of bf16's and the softmax (one ``exp2`` per score) does not get shorter, so the exponentials must run while
the tensor cores are busy. Within one warpgroup they do not: ptxas moves the wait for P·V up, before the
exponentials (``docs/fp8.md``). With ping-pong one warpgroup's softmax runs while the other's matmuls do, which is
how FlashAttention-3 schedules its FP8 forward at D = 128 (its ``UseSchedulerBarrier``).

Arguments and results as ``flash_fwd_fp8_hopper_kernel``'s (Vᵀ in, keys padded to ``v_keys``); ``tiling`` a
``PersistentTiling`` (one persistent block per SM: ``num_ctas``).
"""

from functools import partial

import tilelang.language as T

from .flash_fwd_fp8 import FP8_DTYPE, P_SCALE_LOG2, fp8_softmax_scaled, wgmma_key_slot
from .flash_fwd_hopper_persistent import (
    ConsumerTiles,
    LoopTiling,
    PersistentTiling,
    ProbabilitySteps,
    first_turn,
    launched_blocks,
    load_dense_keys,
    peeled_key_loop,
    produce_tiles,
    stage_barriers,
    tile_count,
    tile_index,
    tile_order,
    tiles_per_block,
)
from .flash_pieces import LOG2E, NEG_INF, key_block_range, prelude
from .tiles import TileBackend

__all__ = ["flash_fwd_fp8_persistent_kernel", "FP8_PERSISTENT_TILING"]

# Two consumer warpgroups of 64 query rows, 128 keys per step, two stages, taking turns.
FP8_PERSISTENT_TILING = PersistentTiling(block_M=128, block_N=128, num_stages=2, threads=256, pingpong=True)


@T.macro
def load_values_transposed(V, V_s, v_full, bz, kv_head, block_N, kb, stage):
    """``produce_key_blocks``' value load: key block ``kb`` of Vᵀ [D, keys] by TMA, then its full barrier."""
    T.tma_copy(V[bz, kv_head, :, kb * block_N:(kb + 1) * block_N], V_s[stage, :, :], barrier=v_full[stage])
    T.mbarrier_arrive(v_full[stage])


@T.macro
def store_scaled_p(S, P):
    """P's e4m3 tile from ``S`` (which holds P · P_SCALE), column j at ``wgmma_key_slot(j)``: its own thread's."""
    for i, j in T.Parallel(S.shape[0], S.shape[1]):
        P[i, wgmma_key_slot(j)] = S[i, j]


def flash_fwd_fp8_persistent_kernel(batch, heads, seq_q, seq_k, dim, *, heads_kv=None, causal=False, sm_scale=None,
                                    v_keys=None, tiling=FP8_PERSISTENT_TILING, out_dtype="float32", exp2=None):
    """A ``@T.prim_func`` (Q, K, Vᵀ, Q_descale, K_descale, V_descale) -> (O, LSE) for sm_90a: see the module.
    ``exp2``: the softmax's exponential, as ``fp8_softmax_scaled`` takes it (None: the SFU's)."""
    block_M, block_N, num_stages, threads, pingpong, num_ctas, blocks_per_sm = tiling
    if threads != 2 * block_M or block_M % 64 or blocks_per_sm != 1:
        raise ValueError(f"the FP8 persistent kernel runs one consumer warpgroup per 64 query rows, one block per "
                         f"SM: threads = 2 * block_M, block_M a multiple of 64, blocks_per_sm = 1; got {tiling}")
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, sm_scale=sm_scale)
    f32, fp8 = "float32", FP8_DTYPE
    consumers = block_M // 64
    q_blocks, n_kb = p.blocks(seq_q, block_M), p.blocks(seq_k, block_N)
    total = tile_count(p, batch, block_M)
    num_ctas = launched_blocks(num_ctas, total)
    softmax = fp8_softmax_scaled(block_M, block_N, exp2)
    loop_tiling = LoopTiling(block_M, block_N, num_stages, pingpong)

    @T.macro
    def scaled_softmax(q_descale, K_descale, bz, kv_head, tiles, kb):
        # row_sum doubles as the row max: the max is used up before the sum is written
        softmax(tiles.S, q_descale * K_descale[bz, kv_head, kb] * p.scale_log2, tiles.m,
                tiles.m_prev, tiles.alpha, tiles.shift, tiles.l, tiles.row_sum, tiles.row_sum)

    @T.prim_func
    def flash_fwd_fp8_persistent(Q: T.Tensor([batch, heads, seq_q, dim], fp8),
                                 K: T.Tensor([batch, p.heads_kv, seq_k, dim], fp8),
                                 V: T.Tensor([batch, p.heads_kv, dim, v_keys or seq_k], fp8),
                                 Q_descale: T.Tensor([batch, heads, q_blocks], f32),
                                 K_descale: T.Tensor([batch, p.heads_kv, n_kb], f32),
                                 V_descale: T.Tensor([batch, p.heads_kv], f32),
                                 O: T.Tensor([batch, heads, seq_q, dim], out_dtype),
                                 LSE: T.Tensor([batch, heads, seq_q], f32)):
        with T.Kernel(num_ctas, threads=threads + 128) as cta:
            Q_s = T.alloc_shared([block_M, dim], fp8)
            K_s = T.alloc_shared([num_stages, block_N, dim], fp8)
            V_s = T.alloc_shared([num_stages, dim, block_N], fp8)
            O_s = T.alloc_shared([block_M, dim], out_dtype)
            S, P = T.alloc_fragment([block_M, block_N], f32), T.alloc_fragment([block_M, block_N], fp8)
            acc_o = T.alloc_fragment([block_M, dim], f32)
            m, m_prev, shift, alpha, row_sum, l, lse = (T.alloc_fragment([block_M], f32) for _ in range(7))
            q_full, barriers = stage_barriers(threads, num_stages)
            k_full, v_full = barriers.k_full, barriers.v_full
            it = T.alloc_var("int32", init=0)  # key blocks passed so far, over all tiles of this block
            # Q's descale, read once a tile. (Read in every step, TileLang 0.1.15's ThreadSync failed to lower some
            # causal shapes of 129-255 queries: "a divergent region with 255 participating threads".)
            q_descale = T.alloc_var(f32)
            tiles = ConsumerTiles(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l)

            if T.get_thread_binding() < 128:
                # region: producer
                produce_tiles(p, Q, Q_s, q_full, barriers, it, tiles_per_block(total, num_ctas, cta),
                              lambda w: tile_order(p, tile_index(num_ctas, cta, w), block_M),
                              lambda bz, by, qb: key_block_range(p, qb, block_M, block_N),
                              lambda bz, by, kv_head, qb: (
                                  partial(load_dense_keys, K, K_s, k_full, bz, kv_head, block_N),
                                  partial(load_values_transposed, V, V_s, v_full, bz, kv_head, block_N)),
                              block_M, n_kb, num_stages)
                # endregion
            else:
                T.set_max_nreg(240 if consumers == 2 else 160, 1)
                if pingpong:
                    first_turn(consumers)
                for w in T.serial(tiles_per_block(total, num_ctas, cta)):
                    bz, by, qb = tile_order(p, tile_index(num_ctas, cta, w), block_M)
                    kv_head = by // p.group
                    k_start, k_end = key_block_range(p, qb, block_M, block_N)
                    T.fill(acc_o, 0)
                    T.fill(l, 0)
                    T.fill(m, NEG_INF)
                    q_descale = Q_descale[bz, by, qb]
                    T.mbarrier_wait_parity(q_full[0], w & 1)
                    steps = ProbabilitySteps(partial(scaled_softmax, q_descale, K_descale, bz, kv_head),
                                             store_scaled_p, values_transposed=True)
                    peeled_key_loop(tb, p, tiles, barriers, it, qb, k_start, k_end, n_kb, loop_tiling, steps)
                    # region: epilogue
                    # l holds ℓ · P_SCALE; V's descale and P's scale are undone with the division by ℓ.
                    for i in T.Parallel(block_M):
                        lse[i] = T.if_then_else(l[i] == 0, NEG_INF, (m[i] + T.log2(l[i]) - P_SCALE_LOG2) / LOG2E)
                    for i, d in T.Parallel(block_M, dim):
                        acc_o[i, d] = T.if_then_else(l[i] == 0, 0, acc_o[i, d] * V_descale[bz, kv_head] / l[i])
                    T.tma_store_wait()  # the previous tile's O has left O_s
                    T.copy(acc_o, O_s)
                    T.tma_copy(O_s, O[bz, by, qb * block_M:(qb + 1) * block_M, :])
                    for i in T.Parallel(block_M):
                        if qb * block_M + i < seq_q:
                            LSE[bz, by, qb * block_M + i] = lse[i]
                    # endregion
                T.tma_store_wait()  # the last O store must have read shared memory before the block exits

    return flash_fwd_fp8_persistent
