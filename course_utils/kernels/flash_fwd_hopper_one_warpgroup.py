"""The D = 64 Hopper forward as cuDNN tiles it: one warpgroup per block that issues its own TMA loads.

cuDNN's D = 64 forward kernel is named ``..._64x128x64_4x1x1_cga1x1x1_...``: 64 query rows, 128 keys, four
warps. The persistent kernel (``flash_fwd_hopper_persistent``) with one consumer warpgroup per 64 rows still
carries a producer warpgroup; two blocks per SM then leave every thread 128 registers at launch, and three
blocks of 64 × 128 tiles cannot be built (ptxas: "Insufficient registers"). Letting TileLang turn the loads
into ``cp.async`` from every thread (no warp specialisation) costs the warpgroup's issue slots instead.

This kernel keeps the TMA and drops the producer:

* a block is **one warpgroup** (128 threads) and one 64-row query tile; one elected thread issues the TMA
  loads, on the persistent kernel's *full* barriers, so a load costs the warpgroup a few instructions;
* a stage is **refilled by the warpgroup that read it**, at the end of the iteration that finished reading
  it, after the block has met (``T.sync_threads``: every warp's wgmma has read the slot);
* 154 registers a thread, so **three blocks share an SM** (``T.annotate_min_blocks_per_sm``): the warp
  schedulers interleave three blocks' matmuls and softmaxes, which is ping-pong without turns;
* O is staged in Q's shared tile (Q is no longer read after the last QKᵀ), so three blocks of two stages
  of 128 keys fit the SM's shared memory;
* not persistent: one block per (query block, head, batch), heaviest query blocks first under a mask.

The loop is chapter 07's rotated loop, peeled as in the persistent kernel: the first QKᵀ and softmax before
it, QKᵀ of block j with P·V of block j − 1 in it, the last P·V after it.

    python -m course_utils.check flash_fwd_hopper_one_warpgroup  # on an H100: check, then time against the peers
"""

from typing import NamedTuple

import tilelang.language as T

from .flash_fwd_hopper_persistent import load_dense_keys, load_dense_values
from .flash_pieces import (
    ACCUM,
    forward_epilogue,
    forward_fragments,
    init_running_max,
    key_block_range,
    mask_scores,
    online_softmax,
    prelude,
)
from .tiles import TileBackend

__all__ = ["flash_fwd_hopper_one_warpgroup_kernel", "OneWarpgroupTiling", "SHIPPED_TILING"]


@T.macro
def load_key_block(K, V, K_s, V_s, k_full, v_full, bz, kv_head, block_N, kb, stage, keys=True, values=True):
    """The persistent kernel's TMA loads of key block ``kb`` into ``stage`` (its keys, its values, or both), each
    followed by its arrival on the full barrier."""
    if keys:
        load_dense_keys(K, K_s, k_full, bz, kv_head, block_N, kb, stage)
        T.mbarrier_arrive(k_full[stage])
    if values:
        load_dense_values(V, V_s, v_full, bz, kv_head, block_N, kb, stage)


class OneWarpgroupTiling(NamedTuple):
    """The kernel's tiling and launch: one warpgroup (``threads = 128``) on ``block_M = 64`` query rows, ``block_N``
    keys per step through ``num_stages`` stages; ``blocks_per_sm`` blocks share an SM (the launch asks ptxas to
    fit their registers)."""

    block_M: int = 64
    block_N: int = 128
    num_stages: int = 2
    threads: int = 128
    blocks_per_sm: int = 3


SHIPPED_TILING = OneWarpgroupTiling()  # cuDNN's at D = 64: 64 × 128 tiles, 2 stages, three blocks per SM


def flash_fwd_hopper_one_warpgroup_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None, dtype="float16",
    tiling=SHIPPED_TILING,
):
    """Return a ``@T.prim_func`` computing O and LSE; the problem's parameters as in ``flash_fwd_hopper_kernel``,
    its ``tiling`` a ``OneWarpgroupTiling``."""
    block_M, block_N, num_stages, threads, blocks_per_sm = tiling
    if block_M != 64 or threads != 128:
        raise ValueError(f"this kernel is one warpgroup on 64 query rows: block_M=64, threads=128; got "
                         f"block_M={block_M}, threads={threads}")
    if blocks_per_sm not in (1, 2, 3, 4):
        raise ValueError(f"blocks_per_sm must be 1 to 4; got {blocks_per_sm}")
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    n_qb, n_kb = p.blocks(seq_q, block_M), p.blocks(seq_k, block_N)

    @T.prim_func
    def flash_fwd_hopper_one_warpgroup(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], ACCUM),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], ACCUM),
    ):
        with T.Kernel(n_qb, heads, batch, threads=threads) as (bx, by, bz):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            Q_s = T.alloc_shared([block_M, dim], dtype)  # Q, then O's staging tile
            K_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_fragments(  # noqa: E741
                tb, block_M, block_N, dim, dtype)
            q_full = T.alloc_barrier(threads)  # every thread arrives; the elected one also waits for the bytes
            k_full = T.alloc_barrier([threads] * num_stages)
            v_full = T.alloc_barrier([threads] * num_stages)

            qb = (n_qb - 1 - bx) if p.masked else bx  # heaviest query blocks first
            kv_head = by // p.group
            k_start, k_end = key_block_range(p, qb, block_M, block_N)
            n = T.max(k_end - k_start, 1)  # a tile that sees no key still runs once, fully masked, and writes 0
            # n again, in a register, for the refills' guards: TileLang 0.1.15 cannot lower a TMA load under a guard
            # it proves false (a short window bounds n), and a register's value is not for it to prove anything of.
            blocks = T.alloc_var("int32", init=0)
            blocks = n

            # region: first loads
            T.tma_copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s, barrier=q_full[0])
            T.mbarrier_arrive(q_full[0])
            for s in T.serial(num_stages):
                if s < n:
                    load_key_block(K, V, K_s, V_s, k_full, v_full, bz, kv_head, block_N,
                                   T.max(T.min(k_start + s, n_kb - 1), 0), s)
            # endregion
            T.fill(acc_o, 0)
            T.fill(l, 0)
            init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
            T.mbarrier_wait_parity(q_full[0], 0)

            # The first key block: scores and softmax only; then its key slot is refilled.
            T.mbarrier_wait_parity(k_full[0], 0)
            T.wgmma_gemm(Q_s, K_s[0, :, :], S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            T.wait_wgmma(0)
            mask_scores(tb, p, S, qb, T.max(T.min(k_start, n_kb - 1), 0), block_M, block_N)
            online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
            T.copy(S, P)
            if num_stages < blocks:
                T.sync_threads()
                load_key_block(K, V, K_s, V_s, k_full, v_full, bz, kv_head, block_N, k_start + num_stages, 0,
                               values=False)
            # region: loop
            for j in T.serial(1, n):
                ks, vs = j % num_stages, (j - 1) % num_stages
                T.mbarrier_wait_parity(k_full[ks], (j // num_stages) & 1)
                T.wgmma_gemm(Q_s, K_s[ks, :, :], S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                             clear_accum=True)
                T.mbarrier_wait_parity(v_full[vs], ((j - 1) // num_stages) & 1)
                T.wgmma_gemm(P, V_s[vs, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(1)  # the scores are ready; P·V may still be running
                mask_scores(tb, p, S, qb, k_start + j, block_M, block_N)
                online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
                T.wait_wgmma(0)
                for i, d in T.Parallel(block_M, dim):
                    acc_o[i, d] *= alpha[i]
                T.copy(S, P)
                # Key slot ks (block j) and value slot vs (block j - 1) have been read: refill them.
                if j - 1 + num_stages < blocks:
                    T.sync_threads()
                    if j + num_stages < blocks:
                        load_key_block(K, V, K_s, V_s, k_full, v_full, bz, kv_head, block_N,
                                       k_start + j + num_stages, ks, values=False)
                    load_key_block(K, V, K_s, V_s, k_full, v_full, bz, kv_head, block_N, k_start + j - 1 + num_stages,
                                   vs, keys=False)
            # endregion
            # The last key block: P·V only.
            vs = (n - 1) % num_stages
            T.mbarrier_wait_parity(v_full[vs], ((n - 1) // num_stages) & 1)
            T.wgmma_gemm(P, V_s[vs, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            T.sync_threads()  # every warp's last QKᵀ has read Q_s before O overwrites it
            forward_epilogue(tb, p, acc_o, l, m, shift, Q_s, Output, LSE, Sinks, bz, by, qb, block_M, dim, has_sinks)

    return flash_fwd_hopper_one_warpgroup
