"""Attention over packed variable-length batches on Hopper (chapter 09): the packed prelude under chapter 07's
and 08's loops.

``flash_varlen_fwd_persistent_kernel`` is chapter 07's persistent forward: one block per SM walking
``varlen_pair_list``, a work list made on the device, so nothing is read back to the host.
``flash_varlen_bwd_hopper_kernel`` is chapter 08's backward. Both keep the contracts of ``flash_varlen``'s
kernels (the packed layout, the guarded stores, the LSE in ``lse_row_layout``). FlashAttention-3's ``hopper/``
varlen kernels have the same structure: a tile scheduler over (sequence, block) pairs and the sequence's bounds
read per tile. sm_90 only.
"""

from functools import partial
from typing import NamedTuple

import tilelang.language as T
import torch

from .flash_fwd_hopper_persistent import (
    SHIPPED_TILING,
    ConsumerTiles,
    LoopTiling,
    first_turn,
    online_probabilities,
    peeled_key_loop,
    produce_key_blocks,
    stage_barriers,
)
from .flash_pieces import (
    ACCUM,
    consumer_barrier,
    forward_fragments,
    init_running_max,
    key_block_range,
    natural_lse,
    normalise_rows,
    prelude,
    with_lengths,
    zero_rows_past_end,
)
from .flash_varlen import SCHEDULES
from .hopper_pieces import keep_stages_until_read
from .tiles import TileBackend, Tiling

__all__ = ["varlen_pair_list", "flash_varlen_fwd_persistent_kernel", "flash_varlen_bwd_hopper_kernel",
           "PackedForwardPieces", "PackedBackwardPieces"]


@T.macro
def load_packed_keys(K, K_s, k_full, k0, kv_head, block_N, kb, stage):
    """``produce_key_blocks``' key load of the packed persistent forward."""
    T.tma_copy(K[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], K_s[stage, :, :], barrier=k_full[stage])


@T.macro
def load_packed_values(V, V_s, v_full, v_edge, edges: T.Ref, tx, p, k0, kv_head, block_N, dim, dtype, kb, stage):
    """``produce_key_blocks``' value load of the packed persistent forward: a tile that runs past its
    sequence's end is loaded on the producer's own barrier, its rows of the next sequence zeroed and
    fenced, and only then handed to the consumers."""
    if (kb + 1) * block_N > p.seq_k:  # rows of the next sequence: zero them first
        T.tma_copy(V[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :],
                   V_s[stage, :, :], barrier=v_edge[0])
        T.mbarrier_arrive(v_edge[0])
        T.mbarrier_wait_parity(v_edge[0], edges & 1)
        for i in T.serial(block_N):
            if kb * block_N + i >= p.seq_k:
                for c in T.serial(T.ceildiv(dim, 128)):
                    if c * 128 + tx < dim:
                        V_s[stage, i, c * 128 + tx] = T.cast(0, dtype)
        T.fence_proxy_async()  # the zeros before the tensor cores' reads
        T.mbarrier_arrive(v_full[stage])
        edges = edges + 1
    else:
        T.tma_copy(V[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :],
                   V_s[stage, :, :], barrier=v_full[stage])
        T.mbarrier_arrive(v_full[stage])


def varlen_pair_list(cu_seqlens_q, cu_seqlens_k, heads, block_M, max_seqlen_q):
    """The persistent packed forward's work list, made on the device (no wait for the GPU): (pairs, count).

    ``pairs`` int32 [B · H · J, 3] rows (sequence, head, j), J = ⌈⌈max_seqlen_q / block_M⌉ / 2⌉; the first
    ``count[0]`` rows are real. Pair j of a (sequence, head) is its query blocks ``n_qb − 1 − j`` and ``j``
    (one block when they coincide): under a causal mask the heaviest with the lightest, so every pair of
    a sequence costs about the same (chapter 07's fold). The sequences come longest first, so the pairs
    taken last are the cheapest (longest processing time first), and the pairs of one (sequence, head)
    are consecutive, so the blocks working on them at once share its K and V through L2.
    """
    device = cu_seqlens_q.device
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    lengths_q, lengths_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    batch = lengths_q.shape[0]
    per_seq = ((lengths_q + block_M - 1) // block_M + 1) // 2  # pairs of each (sequence, head)
    most = max(1, ((max_seqlen_q + block_M - 1) // block_M + 1) // 2)
    order = torch.argsort(lengths_k * (lengths_q > 0), descending=True, stable=True)  # longest first
    seq = order[:, None, None].expand(batch, heads, most)
    head = torch.arange(heads, device=device)[None, :, None].expand(batch, heads, most)
    j = torch.arange(most, device=device)[None, None, :].expand(batch, heads, most)
    real = (j < per_seq[order][:, None, None]).reshape(-1)
    first = torch.argsort((~real).to(torch.int8), stable=True)  # the real pairs first, in their order
    pairs = torch.stack([seq.reshape(-1), head.reshape(-1), j.reshape(-1)], dim=1)[first].to(torch.int32)
    return pairs.contiguous(), real.sum().to(torch.int32).reshape(1)


class PackedForwardPieces(NamedTuple):
    """What the packed persistent forward swaps: ``o_by_tma`` (the default: a tile whose rows are all its
    sequence's stores O through shared memory by TMA; off: every tile row by row)."""

    o_by_tma: bool = True


class PackedBackwardPieces(NamedTuple):
    """The dense Hopper backward's ``BackwardConfig`` fields the packed one takes, with the same meaning."""

    dv_under_ds: bool = False
    dkdv_by_tma: bool = False
    longest_first: bool = False
    defer_dq_wait: bool = False


O_BY_TMA = PackedForwardPieces()
PLAIN_BACKWARD = PackedBackwardPieces()  # FlashAttention-3's step
BACKWARD_TILING = Tiling(64, 128, 2, 256)

def flash_varlen_fwd_persistent_kernel(heads, dim, *, heads_kv=None, causal=False, window_size=None, sm_scale=None,
                                       dtype="float16", tiling=SHIPPED_TILING, pieces=O_BY_TMA):
    """Return a ``@T.prim_func`` computing O and LSE of packed sequences with chapter 07's persistent kernel.

    ``flash_fwd_hopper_persistent_kernel`` (its producer/consumer protocol, peeled rotated loop and
    ping-pong) under the packed prelude: one block per SM walks the pairs of query blocks of
    ``varlen_pair_list``, round ``r`` taking pair ``r · num_ctas + cta`` (the other way round on odd
    rounds, so that a block that took an early, dearer pair takes a later, cheaper one next). As
    FlashAttention-3's varlen forward, it needs no host copy of ``cu_seqlens``.

    Tensors: Q [total_q, H, D], K/V [total_k, H_kv, D], CuSeqlensQ/K [B + 1] (int32), Pairs [n, 3] and
    Count [1] (int32, ``varlen_pair_list``), Sinks [H] (float32, -inf for none), Output [total_q, H, D],
    LSE [H, total_q] (float32, natural log). sm_90 only.

    What packing changes: (1) the value rows past a sequence's end (the next sequence's tokens) are
    zeroed by the producer, on the tile that holds them only: it waits for that tile's load itself,
    zeroes, fences and only then signals the consumers, who never meet in a barrier of their own;
    (2) a sequence's last, ragged tile stores O from registers, row by row, only this sequence's rows (a TMA
    store of the whole tile would write the next sequence's rows, which another block owns); a tile whose rows
    are all its sequence's stores O as the dense kernel does (``o_by_tma``, the default: through shared memory
    by TMA, the store left in flight under the next tile; +0…+6% over every tile row by row on the H100,
    docs/varlen_and_decoding.md). The LSE is always stored row by row.

    ``tiling``: a ``PersistentTiling`` (one block per SM: ``blocks_per_sm`` 1); ``pieces``: a ``PackedForwardPieces``.
    """
    block_M, block_N, num_stages, threads, pingpong, num_ctas, blocks_per_sm = tiling
    (o_by_tma,) = pieces
    if blocks_per_sm != 1:
        raise ValueError(f"the packed persistent forward runs one block per SM; got blocks_per_sm={blocks_per_sm}")
    if threads != 2 * block_M or block_M % 64:
        raise ValueError(f"the persistent kernel runs one consumer warpgroup per 64 query rows: block_M must be "
                         f"a multiple of 64 and threads = 2 * block_M; got block_M={block_M}, threads={threads}")
    tb = TileBackend("cuda")
    p_model = prelude(heads, 1, 1, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                      sm_scale=sm_scale)
    consumers = block_M // 64
    tiling = LoopTiling(block_M, block_N, num_stages, pingpong)
    total_q, total_k, num_bounds, num_pairs = T.dynamic("total_q, total_k, num_bounds, num_pairs")
    q_shape, kv_shape = [total_q, heads, dim], [total_k, p_model.heads_kv, dim]

    @T.prim_func
    def flash_varlen_fwd_persistent(
        Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
        CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
        Pairs: T.Tensor([num_pairs, 3], "int32"), Count: T.Tensor([1], "int32"), Sinks: T.Tensor([heads], ACCUM),
        Output: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, total_q], ACCUM),
    ):
        with T.Kernel(num_ctas, threads=threads + 128) as cta:
            Q_s = T.alloc_shared([block_M, dim], dtype)
            K_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_fragments(  # noqa: E741
                tb, block_M, block_N, dim, dtype)
            if o_by_tma:
                O_s = T.alloc_shared([block_M, dim], dtype)
            q_full, barriers = stage_barriers(threads, num_stages)
            q_empty, k_full, k_empty, v_full, v_empty = barriers
            v_edge = T.alloc_barrier(128)  # the producer's own wait for a tile it must zero rows of
            it = T.alloc_var("int32", init=0)  # key blocks passed so far, over all tiles of this block
            done = T.alloc_var("int32", init=0)  # tiles done so far (the parity of Q's barriers)
            edges = T.alloc_var("int32", init=0)  # tiles zeroed so far (the parity of v_edge)
            tiles = ConsumerTiles(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l)
            n_pairs = Count[0]
            rounds = T.ceildiv(n_pairs, num_ctas)
            rows_left = T.alloc_var("int32", init=0)  # the tile's rows in its sequence (consumers)
            out_row = T.alloc_var("int32", init=0)  # its first row in the packed tensors
            out_head = T.alloc_var("int32", init=0)

            if T.get_thread_binding() < 128:
                # region: producer
                T.set_max_nreg(24, 0)
                tx = T.get_thread_binding()
                for w in T.serial(2 * rounds):
                    # region: which tile (bound once: every later use reads a register)
                    r = w // 2
                    slot = r * num_ctas + T.if_then_else(r % 2 == 0, cta, num_ctas - 1 - cta)
                    row = T.min(slot, num_pairs - 1)
                    b, head, pair = Pairs[row, 0], Pairs[row, 1], Pairs[row, 2]
                    q0, k0 = CuSeqlensQ[b], CuSeqlensK[b]
                    seq_q, seq_k = CuSeqlensQ[b + 1] - q0, CuSeqlensK[b + 1] - k0
                    p = with_lengths(p_model, seq_q, seq_k)
                    n_qb = p.blocks(seq_q, block_M)
                    qb = T.if_then_else(w % 2 == 0, n_qb - 1 - pair, pair)
                    valid = T.And(slot < n_pairs, T.Or(w % 2 == 0, pair != n_qb - 1 - pair))
                    # endregion
                    if valid:
                        kv_head = head // p.group
                        k_start, k_end = key_block_range(p, qb, block_M, block_N)
                        n_kb = p.blocks(p.seq_k, block_N)
                        T.mbarrier_wait_parity(q_empty[0], (done & 1) ^ 1)  # the previous tile's last QKᵀ is done
                        T.tma_copy(Q[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], Q_s, barrier=q_full[0])
                        T.mbarrier_arrive(q_full[0])
                        produce_key_blocks(partial(load_packed_keys, K, K_s, k_full, k0, kv_head, block_N),
                                           partial(load_packed_values, V, V_s, v_full, v_edge, edges, tx, p, k0,
                                                   kv_head, block_N, dim, dtype),
                                           k_full, k_empty, v_empty, it, k_start, k_end, n_kb, num_stages)
                        done = done + 1
                # endregion
            else:
                T.set_max_nreg(240 if consumers == 2 else 160, 1)
                if pingpong:
                    first_turn(consumers)
                for w in T.serial(2 * rounds):
                    r = w // 2
                    slot = r * num_ctas + T.if_then_else(r % 2 == 0, cta, num_ctas - 1 - cta)
                    row = T.min(slot, num_pairs - 1)
                    b, head, pair = Pairs[row, 0], Pairs[row, 1], Pairs[row, 2]
                    q0, k0 = CuSeqlensQ[b], CuSeqlensK[b]
                    seq_q, seq_k = CuSeqlensQ[b + 1] - q0, CuSeqlensK[b + 1] - k0
                    p = with_lengths(p_model, seq_q, seq_k)
                    n_qb = p.blocks(seq_q, block_M)
                    qb = T.if_then_else(w % 2 == 0, n_qb - 1 - pair, pair)
                    valid = T.And(slot < n_pairs, T.Or(w % 2 == 0, pair != n_qb - 1 - pair))
                    if valid:
                        k_start, k_end = key_block_range(p, qb, block_M, block_N)
                        n_kb = p.blocks(p.seq_k, block_N)
                        T.fill(acc_o, 0)
                        T.fill(l, 0)
                        init_running_max(tb, p, m, Sinks, head, block_M, True)
                        T.mbarrier_wait_parity(q_full[0], done & 1)

                        # region: peeled loop (chapter 07's)
                        peeled_key_loop(tb, p, tiles, barriers, it, qb, k_start, k_end, n_kb, tiling,
                                        online_probabilities(tb, p, tiling))
                        # endregion

                        # region: guarded epilogue, from registers
                        normalise_rows(tb, p, acc_o, l, m, shift, Sinks, head, block_M, dim, True)
                        # Held in variables: TileLang's vectoriser would otherwise try to prove things about the
                        # whole chain of loads behind them (minutes of Z3 per loop).
                        rows_left = p.seq_q - qb * block_M
                        out_row = q0 + qb * block_M
                        out_head = head
                        if o_by_tma and rows_left >= block_M:  # every row is this sequence's: the dense store
                            T.tma_store_wait()  # the previous tile's store has read O_s
                            T.copy(acc_o, O_s)
                            T.tma_copy(O_s, Output[out_row:out_row + block_M, out_head, :])
                        else:
                            for i, d in T.Parallel(block_M, dim):
                                if i < rows_left:
                                    Output[out_row + i, out_head, d] = T.cast(acc_o[i, d], dtype)
                        for i in T.Parallel(block_M):
                            if i < rows_left:
                                LSE[out_head, out_row + i] = natural_lse(l[i], shift[i])
                        # endregion
                        done = done + 1
                if o_by_tma:
                    T.tma_store_wait()  # the last O store must have read shared memory before the block exits

    return flash_varlen_fwd_persistent


_ZERO_BARRIER = 7  # the Hopper backward's barrier after zeroing rows past a sequence's end (5 and 6 are its own)


def flash_varlen_bwd_hopper_kernel(heads, dim, *, heads_kv=None, causal=False, window_size=None, sm_scale=None,
                                   dtype="float16", tiling=BACKWARD_TILING, schedule="grid",
                                   pieces=PLAIN_BACKWARD):
    """Return a ``@T.prim_func`` with ``flash_varlen_bwd_kernel``'s contract, built on chapter 08's Hopper loop.

    ``flash_bwd_hopper_kernel``'s step (Sᵀ and dPᵀ issued together, dSᵀ through two shared buffers, dQ
    added by the copy engine, its own barriers: compile with ``flash_bwd_hopper.PASS_CONFIGS``) under
    the packed prelude. What packing changes: the rows of K and V past a sequence's end (zeroed on the
    first step of a block that holds them), of Q and dO (zeroed on a query block that runs past the
    end), and of dQ (zero rows added, so a NaN of this sequence reaches no other) are another
    sequence's; each zeroing is followed by a barrier of the 256 consumer threads, on those tiles only.
    dK and dV are stored row by row, only this sequence's rows. sm_90 only.

    The dense kernel's ``BackwardConfig`` fields, with the same meaning: ``dv_under_ds`` (dV issued under dSᵀ),
    ``dkdv_by_tma`` (a block whose keys all belong to its sequence writes dK and dV by TMA; a sequence's last,
    ragged block row by row) and ``longest_first`` (the "grid" schedule only: as in the dense kernel, one
    sequence after the other, and within it key block 0 of every head first, then key block 1...; the "list"
    schedule has its own order) and ``defer_dq_wait`` (dQ's reduce-add waited for at the next dSᵀ barrier), in
    one ``PackedBackwardPieces``; ``tiling``: a ``Tiling``.
    """
    block_M, block_N, num_stages, threads = tiling
    dv_under_ds, dkdv_by_tma, longest_first, defer_dq_wait = pieces
    from .flash_bwd_hopper import (
        _DQ_BARRIER,
        _DS_BARRIER,
        issue_dq_then_dk,
        issue_scores,
        padded_rows,
        probabilities_t,
        probabilities_then_ds,
        query_steps,
        stage_dq,
        store_dkdv_by_tma,
        wait_for_reduce_read,
    )

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    tb = TileBackend("cuda")
    p_model = prelude(heads, 1, 1, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                      sm_scale=sm_scale)
    swap_dq = block_M % 64 != 0
    stat_rows = padded_rows(block_M)
    dkv_dtype = dtype if p_model.group == 1 else ACCUM
    dq_shape = [dim, block_M] if swap_dq else [block_M, dim]
    total_q, total_k, num_bounds, items = T.dynamic("total_q, total_k, num_bounds, work_items")
    rows_padded = T.dynamic("rows_padded")
    batch = num_bounds - 1
    q_shape, kv_shape = [total_q, heads, dim], [total_k, p_model.heads_kv, dim]

    @T.macro
    def backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, b, kb, head):
        K_s = T.alloc_shared([block_N, dim], dtype)
        V_s = T.alloc_shared([block_N, dim], dtype)
        Q_s = T.alloc_shared([block_M, dim], dtype)
        dO_s = T.alloc_shared([block_M, dim], dtype)
        lse = T.alloc_shared([stat_rows], ACCUM)
        delta = T.alloc_shared([stat_rows], ACCUM)
        PT = T.alloc_fragment([block_N, block_M], ACCUM)
        dPT = T.alloc_fragment([block_N, block_M], ACCUM)
        PT_cast = T.alloc_fragment([block_N, block_M], dtype)
        dST_cast = T.alloc_fragment([block_N, block_M], dtype)
        dv = T.alloc_fragment([block_N, dim], ACCUM)
        dk = T.alloc_fragment([block_N, dim], ACCUM)
        stage_in_use = T.alloc_local([1], dtype)
        dST_s = T.alloc_shared([2, block_N, block_M], dtype)
        dq = T.alloc_fragment(dq_shape, ACCUM)
        dq_s = T.alloc_shared([block_M, dim], ACCUM)
        keys_left = T.alloc_var("int32", init=0)  # this block's keys in its sequence
        key_row = T.alloc_var("int32", init=0)  # the first of them in the packed K, V

        # region: per-sequence prelude
        q0, k0 = CuSeqlensQ[b], CuSeqlensK[b]
        seq_q, seq_k = CuSeqlensQ[b + 1] - q0, CuSeqlensK[b + 1] - k0
        r0 = (q0 + b * block_M) // block_M * block_M  # where its LSE and Δ start (lse_row_layout)
        p = with_lengths(p_model, seq_q, seq_k)
        active = kb * block_N < p.seq_k
        kv_head = head // p.group
        first, end, offset = query_steps(p, kb, block_M, block_N)
        end = T.if_then_else(active, end, first)  # an idle block runs no step
        # endregion
        T.copy(K[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], K_s)
        T.copy(V[k0 + kb * block_N:k0 + (kb + 1) * block_N, kv_head, :], V_s)
        T.clear(dv)
        T.clear(dk)
        for step in T.Pipelined(first, end, num_stages=num_stages):
            qb = offset + step
            T.copy(Q[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], Q_s)
            T.copy(dO[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], dO_s)
            T.copy(LSE[head, r0 + qb * block_M:r0 + (qb + 1) * block_M], lse[0:block_M])
            T.copy(Delta[head, r0 + qb * block_M:r0 + (qb + 1) * block_M], delta[0:block_M])
            # region: rows of another sequence zeroed (K, V on the first step; Q, dO on the last query block)
            if T.And(step == first, (kb + 1) * block_N > p.seq_k):
                zero_rows_past_end(tb, K_s, kb * block_N, p.seq_k, block_N, dim)
                zero_rows_past_end(tb, V_s, kb * block_N, p.seq_k, block_N, dim, barrier_id=_ZERO_BARRIER)
            if (qb + 1) * block_M > p.seq_q:
                zero_rows_past_end(tb, Q_s, qb * block_M, p.seq_q, block_M, dim)
                zero_rows_past_end(tb, dO_s, qb * block_M, p.seq_q, block_M, dim, barrier_id=_ZERO_BARRIER)
            # endregion
            issue_scores(K_s, V_s, Q_s, dO_s, PT, dPT)
            probabilities_t(p, PT, lse, qb, kb, block_M, block_N)  # needs_mask: a run-time length may be ragged
            probabilities_then_ds(PT, PT_cast, dPT, dST_cast, dO_s, dv, delta, block_M, block_N, dv_under_ds)
            T.copy(dST_cast, dST_s[step % 2, :, :])
            if defer_dq_wait:  # the last step's dQ tile read: dq_s is written again after this barrier
                wait_for_reduce_read()
            consumer_barrier(_DS_BARRIER)
            if not dv_under_ds:
                T.wgmma_gemm(PT_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)
            issue_dq_then_dk(K_s, Q_s, dST_s[step % 2, :, :], dST_cast, dq, dk, swap_dq)
            stage_dq(dq, dq_s, swap_dq, block_M, dim)
            consumer_barrier(_DQ_BARRIER)
            # Rows past the end get + 0 (the next sequence's, or cut off by the copy engine past the tensor):
            # dS is 0 there, and so is dQ unless this sequence's K holds a NaN, hence the select.
            if (qb + 1) * block_M > p.seq_q:
                for i, d in T.Parallel(block_M, dim):
                    dq_s[i, d] = T.if_then_else(qb * block_M + i < p.seq_q, dq_s[i, d], 0)
                consumer_barrier(_DQ_BARRIER)
            T.atomic_add(dQ_acc[q0 + qb * block_M:q0 + (qb + 1) * block_M, head, :], dq_s, use_tma=True)
            T.wait_wgmma(0)
            keep_stages_until_read(stage_in_use, Q_s, dO_s)
        if defer_dq_wait:  # the last reduce-add reads shared memory that must outlive it
            wait_for_reduce_read()

        # region: guarded stores
        keys_left = T.if_then_else(active, p.seq_k - kb * block_N, 0)
        key_row = k0 + kb * block_N
        if dkdv_by_tma and p.group == 1 and keys_left >= block_N:  # every row of the tile is this sequence's
            rows = slice(key_row, key_row + block_N)
            store_dkdv_by_tma(p, dk, dv, dK[rows, kv_head, :], dV[rows, kv_head, :], K_s, V_s, block_N, dim)
        else:
            for j, d in T.Parallel(block_N, dim):
                dk[j, d] *= p.sm_scale
            for j, d in T.Parallel(block_N, dim):
                if j < keys_left:
                    if p.group == 1:
                        dV[key_row + j, kv_head, d] = T.cast(dv[j, d], dkv_dtype)
                        dK[key_row + j, kv_head, d] = T.cast(dk[j, d], dkv_dtype)
                    else:
                        T.atomic_add(dV[key_row + j, kv_head, d], dv[j, d])
                        T.atomic_add(dK[key_row + j, kv_head, d], dk[j, d])
        # endregion

    if schedule == "grid":
        @T.prim_func
        def flash_varlen_bwd_hopper(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, rows_padded], ACCUM),
            Delta: T.Tensor([heads, rows_padded], ACCUM),
            CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
            MaxSeqlenK: T.int32, dQ_acc: T.Tensor(q_shape, ACCUM),
            dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
        ):
            if longest_first:  # within a sequence, key block 0 of every head first, then key block 1...
                with T.Kernel(heads, T.ceildiv(MaxSeqlenK, block_N), batch, threads=threads) as (bx, by, bz):
                    backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, bz, by, bx)
            else:
                with T.Kernel(T.ceildiv(MaxSeqlenK, block_N), heads, batch, threads=threads) as (bx, by, bz):
                    backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, bz, bx, by)
    else:
        @T.prim_func
        def flash_varlen_bwd_hopper(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype), LSE: T.Tensor([heads, rows_padded], ACCUM),
            Delta: T.Tensor([heads, rows_padded], ACCUM),
            CuSeqlensQ: T.Tensor([num_bounds], "int32"), CuSeqlensK: T.Tensor([num_bounds], "int32"),
            WorkItems: T.Tensor([items, 2], "int32"), dQ_acc: T.Tensor(q_shape, ACCUM),
            dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
        ):
            with T.Kernel(items, heads, threads=threads) as (bx, by):
                backward_block(Q, K, V, dO, LSE, Delta, CuSeqlensQ, CuSeqlensK, dQ_acc, dK, dV, WorkItems[bx, 0],
                               WorkItems[bx, 1], by)

    return flash_varlen_bwd_hopper
