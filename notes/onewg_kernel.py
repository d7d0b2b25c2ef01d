"""Seventeenth session's candidate (issue 26): a D = 64 forward block of ONE warpgroup that issues its own TMA loads.

cuDNN's D=64 forward kernel is named ``..._64x128x64_4x1x1_cga1x1x1_...``: 64 query rows, 128 keys, four warps.
Ours at 1k-2k (``D64_SHORT_FORWARD_CONFIGS``) is one consumer warpgroup plus a producer warpgroup per block, so a
launch of two blocks per SM caps every thread at 128 registers and three blocks of 64 x 128 tiles cannot be built
(ptxas C7602). The fourteenth session's block without a producer let TileLang turn the loads into cp.async from
every thread (W1: 0.86-0.91 of cuDNN). Here the block has no producer either, but one elected thread issues TMA loads
(the persistent kernel's barriers, ``k_full``/``v_full``), so the loads cost the warpgroup a few instructions a tile,
and 128 threads a block leave room for 168 registers at three blocks per SM.

Not persistent: one block per (query block, head, batch), heaviest query blocks first when masked; the hardware
hands them out. A slot is refilled at the end of the iteration that finished reading it, after the whole block has
met (``T.sync_threads``: the four warps' wgmma have all read it).
"""
import tilelang.language as T

from course_utils.kernels.flash_pieces import (
    ACCUM,
    forward_epilogue,
    init_running_max,
    key_block_range,
    mask_scores,
    online_softmax,
    prelude,
)
from course_utils.kernels.tiles import TileBackend


def flash_fwd_one_warpgroup_kernel(batch, heads, seq_q, seq_k, dim, *, heads_kv=None, causal=False,
                                   window_size=None, has_sinks=False, sm_scale=None, dtype="float16",
                                   block_N=128, num_stages=2, blocks_per_sm=3, o_in_q=True):
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    block_M, threads = 64, 128
    n_qb, n_kb = p.blocks(seq_q, block_M), p.blocks(seq_k, block_N)

    @T.prim_func
    def flash_fwd_one_warpgroup(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], ACCUM),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], ACCUM),
    ):
        with T.Kernel(n_qb, heads, batch, threads=threads) as (bx, by, bz):
            T.annotate_min_blocks_per_sm(blocks_per_sm)
            Q_s = T.alloc_shared([block_M, dim], dtype)
            K_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            O_s = Q_s if o_in_q else T.alloc_shared([block_M, dim], dtype)
            S = T.alloc_fragment([block_M, block_N], ACCUM)
            P = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], ACCUM)
            m = T.alloc_fragment([block_M], ACCUM)
            m_prev = T.alloc_fragment([block_M], ACCUM)
            shift = T.alloc_fragment([block_M], ACCUM)
            alpha = T.alloc_fragment([block_M], ACCUM)
            row_sum = T.alloc_fragment([block_M], ACCUM)
            l = T.alloc_fragment([block_M], ACCUM)  # noqa: E741
            q_full = T.alloc_barrier(threads)
            k_full = T.alloc_barrier([threads] * num_stages)
            v_full = T.alloc_barrier([threads] * num_stages)

            qb = (n_qb - 1 - bx) if p.masked else bx
            kv_head = by // p.group
            k_start, k_end = key_block_range(p, qb, block_M, block_N)
            n = T.max(k_end - k_start, 1)  # a tile that sees no key still runs once, fully masked, and writes 0

            T.tma_copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s, barrier=q_full[0])
            T.mbarrier_arrive(q_full[0])
            for s in T.serial(num_stages):
                if s < n:
                    kb = T.max(T.min(k_start + s, n_kb - 1), 0)
                    T.tma_copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s[s, :, :], barrier=k_full[s])
                    T.mbarrier_arrive(k_full[s])
                    T.tma_copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s[s, :, :], barrier=v_full[s])
                    T.mbarrier_arrive(v_full[s])
            T.fill(acc_o, 0)
            T.fill(l, 0)
            init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
            T.mbarrier_wait_parity(q_full[0], 0)

            T.mbarrier_wait_parity(k_full[0], 0)
            T.wgmma_gemm(Q_s, K_s[0, :, :], S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            T.wait_wgmma(0)
            mask_scores(tb, p, S, qb, T.max(T.min(k_start, n_kb - 1), 0), block_M, block_N)
            online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
            T.copy(S, P)
            if num_stages < n:  # block 0's key slot is free: its replacement
                T.sync_threads()
                kb = k_start + num_stages
                T.tma_copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s[0, :, :], barrier=k_full[0])
                T.mbarrier_arrive(k_full[0])
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
                # Key slot ks (block j) and value slot vs (block j - 1) are read: refill them.
                if j - 1 + num_stages < n:
                    T.sync_threads()
                    if j + num_stages < n:
                        kb = k_start + j + num_stages
                        T.tma_copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s[ks, :, :],
                                   barrier=k_full[ks])
                        T.mbarrier_arrive(k_full[ks])
                    vb = k_start + j - 1 + num_stages
                    T.tma_copy(V[bz, kv_head, vb * block_N:(vb + 1) * block_N, :], V_s[vs, :, :], barrier=v_full[vs])
                    T.mbarrier_arrive(v_full[vs])
            vs = (n - 1) % num_stages
            T.mbarrier_wait_parity(v_full[vs], ((n - 1) // num_stages) & 1)
            T.wgmma_gemm(P, V_s[vs, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(0)
            if o_in_q:
                T.sync_threads()  # every warp's last QKᵀ has read Q_s before O overwrites it
            forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim,
                             has_sinks)

    return flash_fwd_one_warpgroup
