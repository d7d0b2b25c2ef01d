"""The Hopper forward of chapter 07: softmax overlapped with the tensor cores (FlashAttention-3's idea).

Same inputs, outputs and variants as ``flash_fwd_kernel`` (GQA, causal, sliding window, sinks,
natural-log LSE), for sm_90 GPUs only. What changes is the schedule of one thread block:

* the loop is *rotated*: iteration ``kb`` issues the scores of key block ``kb`` (QKᵀ) and the
  output update of key block ``kb - 1`` (P·V) as two asynchronous wgmma batches, then computes
  the softmax of block ``kb`` while P·V is still running on the tensor cores
  (``T.wgmma_gemm`` issues without waiting; ``T.wait_wgmma(n)`` waits until at most ``n``
  batches are in flight);
* with ``pingpong`` the two consumer warpgroups take turns issuing their matmuls, so one
  warpgroup's softmax runs while the other's matmuls use the tensor cores;
* with ``rescale_threshold`` t, the running max only moves when a block's max exceeds it by more
  than t (in log2 units), so most blocks skip the rescale of the output accumulator.

TileLang still adds the producer warpgroup that streams K and V with TMA (warp specialisation).
"""


import math

import tilelang.language as T

from .flash_fwd import LOG2E

__all__ = ["flash_fwd_hopper_kernel"]


def flash_fwd_hopper_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None,
    dtype="float16", block_M=128, block_N=128, num_stages=2, threads=256,
    rescale_threshold=None, heavy_first=True, conditional_issue=False, pingpong=False,
):
    """Return a ``@T.prim_func`` computing O and LSE; parameters as in ``flash_fwd_kernel``.

    ``threads`` counts the consumer threads (two warpgroups); TileLang adds a producer warpgroup.
    ``heavy_first`` starts the query blocks with the most key blocks first when masking.
    ``conditional_issue`` skips the two idle matmuls (first P·V, last QKᵀ) with branches; chapter 07
    shows why that is slower. ``pingpong`` makes the two consumer warpgroups take turns issuing their
    matmuls (FlashAttention-3's inter-warpgroup schedule).
    """
    heads_kv = heads if heads_kv is None else heads_kv
    group = heads // heads_kv
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else sm_scale
    scale_log2 = sm_scale * LOG2E
    past = seq_k - seq_q
    masked = causal or window_size is not None
    accum = "float32"
    neg_inf = -T.infinity(accum)
    num_q_blocks = (seq_q + block_M - 1) // block_M
    num_k_blocks = (seq_k + block_N - 1) // block_N

    def visible(q_pos, k_pos):
        cond = k_pos < seq_k
        if masked:
            cond = T.And(cond, k_pos <= q_pos + past)
        if window_size is not None:
            cond = T.And(cond, k_pos > q_pos + past - window_size)
        return cond

    def block_needs_mask(qb, kb):
        """Whether any (query, key) pair of this block pair is hidden (a uniform branch)."""
        cond = (kb + 1) * block_N > seq_k
        if masked:
            cond = T.Or(cond, (kb + 1) * block_N - 1 > qb * block_M + past)
        if window_size is not None:
            cond = T.Or(cond, kb * block_N <= (qb + 1) * block_M - 1 + past - window_size)
        return cond

    @T.prim_func
    def flash_fwd_hopper(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], accum),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
    ):
        with T.Kernel(num_q_blocks, heads, batch, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([block_M, dim], dtype)
            K_s = T.alloc_shared([block_N, dim], dtype)
            V_s = T.alloc_shared([block_N, dim], dtype)
            O_s = T.alloc_shared([block_M, dim], dtype)
            S = T.alloc_fragment([block_M, block_N], accum)
            P = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], accum)
            m = T.alloc_fragment([block_M], accum)
            m_prev = T.alloc_fragment([block_M], accum)
            shift = T.alloc_fragment([block_M], accum)
            alpha = T.alloc_fragment([block_M], accum)
            row_sum = T.alloc_fragment([block_M], accum)
            l = T.alloc_fragment([block_M], accum)
            stage_in_use = T.alloc_local([1], dtype)
            rescale = T.alloc_local([1], "int32")

            qb = (num_q_blocks - 1 - bx) if masked and heavy_first else bx
            kv_head = by // group
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(P, 0)
            T.fill(m, neg_inf)

            k_end = num_k_blocks
            if masked:
                k_end = T.min(num_k_blocks, T.ceildiv((qb + 1) * block_M + past, block_N))
            k_start = 0
            if window_size is not None:
                k_start = T.max(0, (qb * block_M + past - window_size + 1) // block_N)

            # One extra iteration: iteration kb computes QKᵀ of block kb and P·V of block kb - 1.
            for kb in T.Pipelined(k_start, k_end + 1, num_stages=num_stages):
                k_blk = T.max(T.min(kb, k_end - 1), 0)
                v_blk = T.max(kb - 1, k_start)
                T.copy(K[bz, kv_head, k_blk * block_N:(k_blk + 1) * block_N, :], K_s)
                T.copy(V[bz, kv_head, v_blk * block_N:(v_blk + 1) * block_N, :], V_s)
                # Both matmuls are issued in every iteration (P is 0 in the first, the scores of the last are
                # unused): ptxas serialises wgmma batches whose issue is conditional (conditional_issue shows it).
                if pingpong:
                    # Named barriers 8 and 9 pass the turn to issue matmuls between the two warpgroups.
                    # Plain extern calls: TileLang's warp specialisation would move T.sync_threads into
                    # the producer branch.
                    warpgroup = T.get_thread_binding() // 128
                    if kb == k_start and warpgroup == 1:
                        T.call_extern("handle", "tl::__named_barrier_arrive", 8, 256)  # warpgroup 0 goes first
                    T.call_extern("handle", "tl::__sync_thread_partial", 8 + warpgroup, 256)  # wait for my turn
                if conditional_issue:
                    if kb < k_end:
                        T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    if kb > k_start:
                        T.wgmma_gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                else:
                    T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    T.wgmma_gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                if pingpong:
                    T.call_extern("handle", "tl::__named_barrier_arrive", 9 - warpgroup, 256)  # your turn
                T.wait_wgmma(1)  # the scores are ready; P·V may still be running
                if kb < k_end:
                    if block_needs_mask(qb, kb):
                        for i, j in T.Parallel(block_M, block_N):
                            S[i, j] = T.if_then_else(visible(qb * block_M + i, kb * block_N + j), S[i, j], neg_inf)
                    T.copy(m, m_prev)
                    if rescale_threshold is None:
                        T.reduce_max(S, m, dim=1, clear=False)
                    else:
                        T.reduce_max(S, row_sum, dim=1, clear=True)
                        for i in T.Parallel(block_M):
                            # Keep a stale max unless the new one is larger by more than the threshold:
                            # then alpha is exactly 1 and P stays below 2^threshold.
                            m[i] = T.if_then_else(
                                (row_sum[i] - m_prev[i]) * scale_log2 > rescale_threshold, row_sum[i], m_prev[i])
                    for i in T.Parallel(block_M):
                        shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
                        alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
                    for i, j in T.Parallel(block_M, block_N):
                        S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])
                    T.reduce_sum(S, row_sum, dim=1)
                    for i in T.Parallel(block_M):
                        l[i] = l[i] * alpha[i] + row_sum[i]
                    T.wait_wgmma(0)
                    if rescale_threshold is None:
                        for i, j in T.Parallel(block_M, dim):
                            acc_o[i, j] *= alpha[i]
                    else:
                        # Each thread holds whole rows' worth of alpha: it skips the rescale when all are 1.
                        rescale[0] = 0
                        for i in T.Parallel(block_M):
                            if alpha[i] != 1:
                                rescale[0] = 1
                        if rescale[0] != 0:
                            for i, j in T.Parallel(block_M, dim):
                                acc_o[i, j] *= alpha[i]
                    T.copy(S, P)
                else:
                    T.wait_wgmma(0)
                # Reading both stage buffers here keeps them owned until the wgmmas reading them are done.
                stage_in_use[0] = K_s[0, 0] + V_s[0, 0]

            for i in T.Parallel(block_M):
                shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
            if has_sinks:
                for i in T.Parallel(block_M):
                    l[i] += T.exp2(Sinks[by] * LOG2E - shift[i])
            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] = T.if_then_else(l[i] > 0, acc_o[i, j] / l[i], 0)
            T.copy(acc_o, O_s)
            T.copy(O_s, Output[bz, by, qb * block_M:(qb + 1) * block_M, :])
            for i in T.Parallel(block_M):
                if qb * block_M + i < seq_q:
                    LSE[bz, by, qb * block_M + i] = T.if_then_else(
                        l[i] > 0, (shift[i] + T.log2(l[i])) / LOG2E, neg_inf)

    return flash_fwd_hopper
