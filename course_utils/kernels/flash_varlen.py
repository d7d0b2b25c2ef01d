"""Attention over packed variable-length batches (chapter 09): FlashAttention's ``varlen`` kernels.

A training batch of sequences of different lengths is stored *packed*: the tokens of all
sequences one after the other, ``Q [total_q, H, D]`` and ``K, V [total_k, H_kv, D]``, with the
prefix sums ``cu_seqlens_q``/``cu_seqlens_k`` (``[B + 1]``, int32) saying where each sequence
starts. Nothing is padded, so no FLOP and no byte is spent on padding, and each sequence is
attended independently.

The kernels are chapter 03–06's kernels with one new step at the start of each thread block:
find *which* sequence and which query (forward) or key (backward) block it owns, read that
sequence's lengths from ``cu_seqlens``, and build a per-sequence ``Prelude`` with run-time lengths
(``flash_pieces.with_lengths``). Everything after that (ranges, masks, the online softmax, the
epilogue) is the shared pieces, unchanged. Two ways to hand out the blocks (``schedule``):

* ``"grid"``: launch a grid sized for the longest sequence, ``⌈max_seqlen / block⌉ × H × B``; a
  block whose index lies past its sequence's last block has nothing to do and exits early;
* ``"list"``: launch exactly one block per real (sequence, block) pair and head, reading its pair
  from a *work list* made on the host (``varlen_work_list``), heaviest blocks first.

Rows of a tile that run past the end of their sequence hold the *next* sequence's tokens: the mask
hides those keys, and stores are guarded row by row so a block never writes another sequence's
rows.

This module holds the loops of chapters 03 and 05 under that prelude, which run on the CPU and on every
CUDA GPU (``flash_varlen_fwd_kernel``, ``flash_varlen_bwd_kernel``; the forward's ``hopper`` option swaps
in chapter 07's rotated loop, measured no faster here), and what every packed kernel shares: the two
schedules and their work lists, the backward's LSE layout (``lse_row_layout``) and the per-token kernels
of the backward (``varlen_delta_kernel``, ``scale_cast_kernel``).

On Hopper the same prelude sits under the faster loops, in ``flash_varlen_hopper``: chapter 07's
persistent forward (one block per SM walking a work list made on the device, so nothing is read back to
the host) and chapter 08's backward. FlashAttention-3's ``hopper/`` varlen kernels have the same
structure: a tile scheduler over (sequence, block) pairs and the sequence's bounds read per tile.

    python -m course_utils.check flash_varlen  # check against the reference (and time it, on a GPU)
"""

import tilelang
import tilelang.language as T
import torch

from .flash_pieces import (
    ACCUM,
    LOG2E,
    consumer_barrier,
    forward_tiles,
    init_running_max,
    key_block_range,
    mask_scores,
    natural_lse,
    normalise_rows,
    online_softmax,
    prelude,
    query_block_range,
    visible,
    with_lengths,
    zero_rows_past_end,
)
from .hopper_pieces import issue_matmuls, keep_stages_until_read
from .tiles import TileBackend, Tiling

__all__ = ["SCHEDULES", "OWN_BARRIERS_PASS_CONFIGS", "varlen_work_list", "flash_varlen_fwd_kernel",
           "flash_varlen_bwd_kernel", "varlen_delta_kernel", "scale_cast_kernel", "lse_row_layout", "FORWARD_TILING",
           "BACKWARD_TILING"]

SCHEDULES = ("grid", "list")
# ``own_barriers``: the kernel places its own barriers (compile it with these pass options). Nor may TileLang
# reuse shared memory then: on sm_90 it puts O's staging tile over Q's and waits for Q's TMA load only inside
# the key loop, so a query block that sees no key (causal with fewer keys, an empty key sequence) stored O
# while Q was still landing on it (wrong O on the H200, 2026-11-26; docs/varlen_and_decoding.md).
OWN_BARRIERS_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                             tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True}
_OWN_BARRIER = 5  # a named barrier id of our own (TileLang's syncs use 1–3)


def varlen_work_list(lengths_q, lengths_k, block, *, causal=False, by_keys=False):
    """The work list of the ``"list"`` schedule: int32 [items, 2] rows (sequence, block), heaviest first.

    Forward (``by_keys=False``): one item per query block of ``block`` rows. Backward: one per key
    block. An item's weight is the number of tiles it will visit (all of the other side's blocks, or
    with causal masking about half, growing with the block's position), so the longest-running
    blocks start first and the short ones fill the gaps at the end (longest processing time first).
    ``lengths_*``: the sequence lengths, a CPU int tensor.
    """
    own, other = (lengths_k, lengths_q) if by_keys else (lengths_q, lengths_k)
    blocks = (own + block - 1) // block
    seq = torch.repeat_interleave(torch.arange(len(own)), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    index = torch.arange(len(seq)) - first[seq]
    weight = other[seq].clone()
    if causal:  # the last query blocks see the most keys; the first key blocks are seen by the most queries
        past = (lengths_k - lengths_q)[seq]  # the diagonal is aligned bottom-right
        if by_keys:
            weight = torch.clamp(lengths_q[seq] - index * block + past, 0, None).minimum(weight)
        else:
            weight = torch.clamp((index + 1) * block + past, 0, None).minimum(weight)
    order = torch.argsort(weight, descending=True, stable=True)
    return torch.stack([seq[order], index[order]], dim=1).to(torch.int32)


FORWARD_TILING = Tiling(128, 128, 2, 256)  # flash_varlen_fwd_kernel's default (chapter 03's loop's)
BACKWARD_TILING = Tiling(64, 64, 2, 128)  # flash_varlen_bwd_kernel's (chapter 05's)


def flash_varlen_fwd_kernel(heads, dim, *, heads_kv=None, causal=False, window_size=None, sm_scale=None,
                            dtype="float16", target=None, tiling=FORWARD_TILING, schedule="list", hopper=False,
                            own_barriers=False):
    """Return a ``@T.prim_func`` computing O and LSE of packed sequences (sinks always on: -inf for none).

    Tensors: Q [total_q, H, D], K/V [total_k, H_kv, D], CuSeqlensQ/CuSeqlensK [B + 1] (int32), then
    MaxSeqlenQ (int32 scalar; ``schedule="grid"``) or WorkItems [items, 2] (int32; ``"list"``), Sinks
    [H] (float32), Output [total_q, H, D] and LSE [H, total_q] (natural log, float32). ``tiling``: a
    ``Tiling``. ``hopper`` uses chapter 07's rotated wgmma loop (sm_90 only; the tiling's ``threads`` counts
    its consumer threads). On the H100 it measured no faster than chapter 03's loop for packed batches, and
    its ping-pong variant never finished (docs/varlen_and_decoding.md), so it is not offered here.

    ``own_barriers`` (sm_90, chapter 03's loop; compile with ``OWN_BARRIERS_PASS_CONFIGS``): zeroing the
    value rows past a sequence's end writes shared memory, and TileLang then puts a barrier of all 256
    consumer threads before P·V in *every* iteration, lining up the two warpgroups that would otherwise
    overlap one's softmax with the other's matmuls. With this option the kernel places that barrier
    only on the tile that needs it (and the two its epilogue needs): 4–18% faster on the H100.
    """
    block_M, block_N, num_stages, threads = tiling
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    tb = TileBackend("cuda" if hopper else target)
    if own_barriers and (hopper or not tb.on_gpu):
        raise ValueError("own_barriers is for chapter 03's loop on sm_90 GPUs (hopper=False, target='cuda')")
    p_model = prelude(heads, 1, 1, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                      sm_scale=sm_scale)
    total_q, total_k, num_bounds, items = T.dynamic("total_q, total_k, num_bounds, work_items")
    batch = num_bounds - 1
    q_shape, kv_shape = [total_q, heads, dim], [total_k, p_model.heads_kv, dim]

    @T.macro
    def forward_block(Q, K, V, CuSeqlensQ, CuSeqlensK, Sinks, Output, LSE, b, slot, head, reverse):
        Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_tiles(
            tb, block_M, block_N, dim, dtype)
        stage_in_use = T.alloc_local([1], dtype)
        # region: per-sequence prelude
        q0, k0 = CuSeqlensQ[b], CuSeqlensK[b]  # where this sequence's tokens start
        seq_q, seq_k = CuSeqlensQ[b + 1] - q0, CuSeqlensK[b + 1] - k0  # bound once: read from memory once
        p = with_lengths(p_model, seq_q, seq_k)
        qb = (p.blocks(p.seq_q, block_M) - 1 - slot) if reverse else slot
        active = T.And(qb >= 0, qb * block_M < p.seq_q)  # a grid block past its sequence's end has no work
        qb = T.max(qb, 0)
        kv_head = head // p.group
        k_start, k_end = key_block_range(p, qb, block_M, block_N)
        k_end = T.if_then_else(active, k_end, k_start)  # an idle block runs no iteration
        # endregion
        T.copy(Q[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], Q_s)
        T.fill(acc_o, 0)
        T.fill(l, 0)
        init_running_max(tb, p, m, Sinks, head, block_M, True)

        if hopper:  # chapter 07's rotated loop: QKᵀ of block kb and P·V of block kb − 1 in flight together
            T.fill(P, 0)
            for kb in T.Pipelined(k_start, k_end + 1, num_stages=num_stages):
                k_blk = T.max(T.min(kb, k_end - 1), 0)
                v_blk = T.max(kb - 1, k_start)
                T.copy(K[k0 + k_blk * block_N:k0 + (k_blk + 1) * block_N, kv_head, :], K_s)
                T.copy(V[k0 + v_blk * block_N:k0 + (v_blk + 1) * block_N, kv_head, :], V_s)
                zero_rows_past_end(tb, V_s, v_blk * block_N, p.seq_k, block_N, dim)  # the next sequence's rows
                issue_matmuls(Q_s, K_s, V_s, S, P, acc_o)
                T.wait_wgmma(1)
                if kb < k_end:
                    mask_scores(tb, p, S, qb, kb, block_M, block_N)
                    online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
                    T.wait_wgmma(0)
                    for i, j in T.Parallel(block_M, dim):
                        acc_o[i, j] *= alpha[i]
                    T.copy(S, P)
                else:
                    T.wait_wgmma(0)
                keep_stages_until_read(stage_in_use, K_s, V_s)
        else:  # chapter 03's loop
            for kb in T.Pipelined(k_start, k_end, num_stages=num_stages):
                T.copy(K[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], K_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                mask_scores(tb, p, S, qb, kb, block_M, block_N)
                online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
                T.copy(S, P)
                for i, j in tb.parallel(block_M, dim):
                    acc_o[i, j] *= alpha[i]
                T.copy(V[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], V_s)
                zero_rows_past_end(tb, V_s, kb * block_N, p.seq_k, block_N, dim,  # the next sequence's rows
                                   barrier_id=_OWN_BARRIER if own_barriers else None)
                T.gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

        # region: guarded epilogue
        normalise_rows(tb, p, acc_o, l, m, shift, Sinks, head, block_M, dim, True)
        if own_barriers:
            consumer_barrier(_OWN_BARRIER)  # both warpgroups are done with Q_s, which O_s reuses
        T.copy(acc_o, O_s)
        if own_barriers:
            consumer_barrier(_OWN_BARRIER)
        for i, d in tb.parallel(block_M, dim):  # only this sequence's rows: the next ones belong to another
            if T.And(active, qb * block_M + i < p.seq_q):
                Output[q0 + qb * block_M + i, head, d] = O_s[i, d]
        for i in tb.parallel(block_M):
            if T.And(active, qb * block_M + i < p.seq_q):
                LSE[head, q0 + qb * block_M + i] = natural_lse(l[i], shift[i])
        # endregion

    if schedule == "grid":
        @T.prim_func
        def flash_varlen_fwd(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
            MaxSeqlenQ: T.int32, Sinks: T.Tensor([heads], ACCUM),
            Output: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, total_q], ACCUM),
        ):
            with tb.kernel(T.ceildiv(MaxSeqlenQ, block_M), heads, batch, threads=threads) as (bx, by, bz):
                # Causal: a sequence's last query blocks see the most keys; start them first.
                forward_block(Q, K, V, CuSeqlensQ, CuSeqlensK, Sinks, Output, LSE, bz, bx, by, p_model.masked)
    else:
        @T.prim_func
        def flash_varlen_fwd(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
            WorkItems: T.Tensor([items, 2], "int32"), Sinks: T.Tensor([heads], ACCUM),
            Output: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, total_q], ACCUM),
        ):
            with tb.kernel(items, heads, threads=threads) as (bx, by):
                forward_block(Q, K, V, CuSeqlensQ, CuSeqlensK, Sinks, Output, LSE, WorkItems[bx, 0],
                              WorkItems[bx, 1], by, False)

    return flash_varlen_fwd


def flash_varlen_bwd_kernel(heads, dim, *, heads_kv=None, causal=False, window_size=None, sm_scale=None,
                            dtype="float16", target=None, tiling=BACKWARD_TILING, schedule="list"):
    """Return a ``@T.prim_func`` computing dK, dV and the float32 dQ accumulator of packed sequences.

    Chapter 05's backward per sequence: a block owns ``block_N`` keys of one sequence and head, keeps
    K and V resident, and walks the query blocks that see them. Tensors: Q, K, V, dO as in the
    forward; LSE and Delta [H, rows] (float32) in the block-aligned layout of ``lse_row_layout``;
    CuSeqlensQ/K; MaxSeqlenK (``"grid"``) or WorkItems
    [items, 2] of (sequence, key block) (``"list"``); dQ_acc [total_q, H, D] float32, zero on entry
    (pre-scale, like chapter 05's); dK, dV [total_k, H_kv, D], in ``dtype`` for MHA, float32
    accumulators (zero on entry) for GQA. ``tiling``: a ``Tiling``.
    """
    block_M, block_N, num_stages, threads = tiling
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    tb = TileBackend(target)
    p_model = prelude(heads, 1, 1, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                      sm_scale=sm_scale)
    dkv_dtype = dtype if p_model.group == 1 else ACCUM
    total_q, total_k, num_bounds, items = T.dynamic("total_q, total_k, num_bounds, work_items")
    rows_padded = T.dynamic("rows_padded")  # lse_row_layout's rows
    batch = num_bounds - 1
    q_shape, kv_shape = [total_q, heads, dim], [total_k, p_model.heads_kv, dim]

    @T.macro
    def backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, b, kb, head):
        K_s = tb.shared([block_N, dim], dtype)
        V_s = tb.shared([block_N, dim], dtype)
        Q_s = tb.shared([block_M, dim], dtype)
        dO_s = tb.shared([block_M, dim], dtype)
        lse = tb.shared([block_M], ACCUM)
        delta = tb.shared([block_M], ACCUM)
        PT = tb.fragment([block_N, block_M], ACCUM)  # Sᵀ, then Pᵀ: keys are rows here
        dPT = tb.fragment([block_N, block_M], ACCUM)
        PT_cast = tb.fragment([block_N, block_M], dtype)
        dST_cast = tb.fragment([block_N, block_M], dtype)
        dST_s = tb.shared([block_N, block_M], dtype)
        dv = tb.fragment([block_N, dim], ACCUM)
        dk = tb.fragment([block_N, dim], ACCUM)
        dq = tb.fragment([block_M, dim], ACCUM)

        # region: per-sequence prelude
        q0, k0 = CuSeqlensQ[b], CuSeqlensK[b]
        seq_q, seq_k = CuSeqlensQ[b + 1] - q0, CuSeqlensK[b + 1] - k0
        r0 = (q0 + b * block_M) // block_M * block_M  # where its LSE and Δ start (lse_row_layout)
        p = with_lengths(p_model, seq_q, seq_k)
        active = kb * block_N < p.seq_k
        kv_head = head // p.group
        q_start, q_end = query_block_range(p, kb, block_M, block_N)
        q_end = T.if_then_else(active, q_end, q_start)
        # endregion
        T.copy(K[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], K_s)
        T.copy(V[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], V_s)
        T.clear(dv)
        T.clear(dk)

        # A one-key window makes the loop a single block; TVM's bound analysis rejects that loop unless it
        # counts from 0 (as in chapter 05's kernel).
        first, offset = (0, q_start) if p.window_size == 1 else (q_start, 0)
        for step in T.Pipelined(first, q_end - offset, num_stages=num_stages):
            qb = offset + step
            if step == first:
                # Rows past the sequence's end are the next sequence's tokens: zero them (and the query rows
                # below), so that nothing of another sequence, not even a NaN, reaches this one's gradients.
                # (Here, not before the loop: warp specialisation waits for K and V only inside it.)
                zero_rows_past_end(tb, K_s, kb * block_N, p.seq_k, block_N, dim)
                zero_rows_past_end(tb, V_s, kb * block_N, p.seq_k, block_N, dim)
            T.copy(Q[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], Q_s)
            zero_rows_past_end(tb, Q_s, qb * block_M, p.seq_q, block_M, dim)
            T.copy(LSE[head, r0 + qb * block_M:r0 + (qb + 1) * block_M], lse)
            T.clear(PT)
            T.gemm(K_s, Q_s, PT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            for j, i in tb.parallel(block_N, block_M):
                PT[j, i] = T.if_then_else(visible(p, qb * block_M + i, kb * block_N + j, guard_q=True),
                                          T.exp2(PT[j, i] * p.scale_log2 - lse[i] * LOG2E), 0)
            T.copy(dO[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], dO_s)
            zero_rows_past_end(tb, dO_s, qb * block_M, p.seq_q, block_M, dim)
            T.clear(dPT)
            T.gemm(V_s, dO_s, dPT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(PT, PT_cast)
            T.gemm(PT_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)  # dV += Pᵀ dO

            T.copy(Delta[head, r0 + qb * block_M:r0 + (qb + 1) * block_M], delta)
            zero_rows_past_end(tb, delta, qb * block_M, p.seq_q, block_M)
            for j, i in tb.parallel(block_N, block_M):
                dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i])  # dSᵀ, without the scale
            T.gemm(dST_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dSᵀ Q

            T.copy(dST_cast, dST_s)
            T.clear(dq)
            T.gemm(dST_s, K_s, dq, transpose_A=True)
            for i, d in tb.parallel(block_M, dim):
                if qb * block_M + i < p.seq_q:
                    T.atomic_add(dQ_acc[q0 + qb * block_M + i, head, d], dq[i, d])

        # region: guarded stores
        for j, d in tb.parallel(block_N, dim):
            dk[j, d] *= p.sm_scale
        for j, d in tb.parallel(block_N, dim):  # only this sequence's keys, and nothing from an idle block
            if T.And(active, kb * block_N + j < p.seq_k):
                if p.group == 1:
                    dV[k0 + kb * block_N + j, kv_head, d] = T.cast(dv[j, d], dkv_dtype)
                    dK[k0 + kb * block_N + j, kv_head, d] = T.cast(dk[j, d], dkv_dtype)
                else:
                    T.atomic_add(dV[k0 + kb * block_N + j, kv_head, d], dv[j, d])
                    T.atomic_add(dK[k0 + kb * block_N + j, kv_head, d], dk[j, d])
        # endregion

    if schedule == "grid":
        @T.prim_func
        def flash_varlen_bwd(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, rows_padded], ACCUM),
            Delta: T.Tensor([heads, rows_padded], ACCUM),
            CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
            MaxSeqlenK: T.int32, dQ_acc: T.Tensor(q_shape, ACCUM),
            dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
        ):
            with tb.kernel(T.ceildiv(MaxSeqlenK, block_N), heads, batch, threads=threads) as (bx, by, bz):
                backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, bz, bx, by)
    else:
        @T.prim_func
        def flash_varlen_bwd(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, rows_padded], ACCUM),
            Delta: T.Tensor([heads, rows_padded], ACCUM),
            CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
            WorkItems: T.Tensor([items, 2], "int32"), dQ_acc: T.Tensor(q_shape, ACCUM),
            dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
        ):
            with tb.kernel(items, heads, threads=threads) as (bx, by):
                backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, WorkItems[bx, 0],
                               WorkItems[bx, 1], by)

    return flash_varlen_bwd


def lse_row_layout(bounds_q, block_M):
    """Where the backward reads each query's LSE and Δ: (rows, index), index[t] the column of packed query t.

    The copy engine (TMA) faults (CUDA_ERROR_ILLEGAL_INSTRUCTION on the H100) when a row of LSE or Δ is
    loaded from a start that is not 16-byte aligned, as a sequence starting at any token would give.
    As FlashAttention-3 does, sequence b starts at ``(cu_seqlens_q[b] + b · block_M) // block_M · block_M``:
    every query block then starts on a block boundary, and each sequence gains at most ``block_M`` columns,
    so no two overlap. ``bounds_q``: cu_seqlens_q as a tuple of ints.
    """
    starts = [(q0 + b * block_M) // block_M * block_M for b, q0 in enumerate(bounds_q[:-1])]
    index = torch.cat([torch.arange(n, dtype=torch.int64) + r0
                       for r0, n in zip(starts, (bounds_q[b + 1] - bounds_q[b] for b in range(len(starts))))])
    rows = (bounds_q[-1] + len(starts) * block_M + block_M - 1) // block_M * block_M
    return rows, index


def varlen_delta_kernel(dim, *, dtype="float16", block=64, threads=128, target=None):
    """Δ[h, t] = Σ_d dO[t, h, d] · O[t, h, d] in float32, for packed [total, H, D] tensors (any total, H).

    Delta is [H, rows_padded], rows_padded ≥ total; columns past ``total`` hold 0."""
    tb = TileBackend(target)
    total, heads, rows_padded = T.dynamic("total, heads, rows_padded")

    @T.prim_func
    def varlen_delta(
        O: T.Tensor([total, heads, dim], dtype),
        dO: T.Tensor([total, heads, dim], dtype),
        Delta: T.Tensor([heads, rows_padded], ACCUM),
    ):
        with tb.kernel(T.ceildiv(total, block), heads, threads=threads) as (bx, by):
            o = tb.fragment([block, dim], ACCUM)
            do = tb.fragment([block, dim], ACCUM)
            delta = tb.fragment([block], ACCUM)
            T.copy(O[bx * block:(bx + 1) * block, by, :], o)
            T.copy(dO[bx * block:(bx + 1) * block, by, :], do)
            for i, d in tb.parallel(block, dim):
                o[i, d] *= do[i, d]
            T.reduce_sum(o, delta, dim=1)
            T.copy(delta, Delta[by, bx * block:(bx + 1) * block])

    return varlen_delta


def scale_cast_kernel(dim, *, dtype="float16", block=64, threads=128, target=None):
    """Out = scale · Acc for float32 rows Acc [rows, D], cast to ``dtype`` (``scale``: a run-time float)."""
    tb = TileBackend(target)
    rows = T.dynamic("rows")

    @T.prim_func
    def scale_cast(Acc: T.Tensor([rows, dim], ACCUM), scale: T.float32, Out: T.Tensor([rows, dim], dtype)):
        with tb.kernel(T.ceildiv(rows, block), threads=threads) as bx:
            acc = tb.fragment([block, dim], ACCUM)
            T.copy(Acc[bx * block:(bx + 1) * block, :], acc)
            for i, d in tb.parallel(block, dim):
                acc[i, d] *= scale
            T.copy(acc, Out[bx * block:(bx + 1) * block, :])

    return scale_cast
