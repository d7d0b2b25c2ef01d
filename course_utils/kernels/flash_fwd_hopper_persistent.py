"""The persistent Hopper forward: chapter 07's rotated loop with the producer/consumer protocol written out.

``flash_fwd_hopper_kernel`` leaves the warp specialisation to TileLang: one thread block per
query tile, and a producer warpgroup that TileLang derives from the ``T.Pipelined`` loop. Short
sequences and causal masks pay for that twice. Each block loads Q and the first K tile, and
stores O, with its tensor cores idle; and the hardware hands out blocks head by head, so the
heavy causal tiles of the last heads start late and leave SMs idle at the end.

This kernel (FlashAttention-3's structure, written with TileLang's explicit barriers):

* is **persistent**: one block per SM walks a list of tiles, so the producer loads the next
  tile's Q, K and V while the consumers finish the current tile's last P·V and store its O;
* **folds the causal triangle**: a block takes the tiles of a head in pairs, the heaviest query
  block with the lightest (7 with 0, 6 with 1, ...), so every pair costs the same and a static
  round-robin keeps all SMs equally busy; consecutive pairs stay in one head, so its K and V are
  read from L2 by many SMs at once;
* **peels the rotated loop**: the first QKᵀ and softmax run before the loop and the last P·V after
  it, so no idle matmul is issued (``flash_fwd_hopper_kernel`` issues two per tile instead);
* runs ``block_M // 64`` consumer warpgroups (3 at block_M = 192: FlashAttention-3's tiling for
  D = 64), optionally taking turns to issue their matmuls (``pingpong``).

The protocol: for each shared buffer, a *full* mbarrier (the producer's TMA has landed) and an
*empty* one (every consumer thread is done reading). Producer and consumers walk the same tiles
and count the key blocks they have passed (``it``): a block's stage is ``it % stages`` and the
parity to wait for flips each time the stages wrap around.

    python -m course_utils.check flash_fwd_hopper_persistent# on an H100: check, then time against the peers
"""

from functools import partial
from typing import NamedTuple

import tilelang.language as T

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

__all__ = ["flash_fwd_hopper_persistent_kernel", "tile_count", "tile_order", "tiles_per_block", "tile_index",
           "persistent_schedule", "evaluated_walk", "evaluate", "launched_blocks", "H100_SMS", "peeled_key_loop",
           "ConsumerTiles", "ConsumerBarriers", "stage_barriers", "produce_tiles", "load_dense_keys",
           "first_turn", "LoopTiling", "SoftmaxPieces", "ProbabilitySteps", "online_probabilities", "values_by_v",
           "SHIPPED_SOFTMAX", "PersistentTiling", "PersistentPieces", "SHIPPED_PIECES", "SHIPPED_TILING"]

H100_SMS = 132  # multiprocessors of an H100 SXM5: one persistent block each
_TURN_BARRIER = 8  # named barriers 8, 9, 10: one per consumer warpgroup (TileLang uses the low ids)


def tile_count(p, batch, block_M):
    """How many (batch, head, query block) tiles the problem has."""
    return batch * p.heads * p.blocks(p.seq_q, block_M)


def tile_order(p, index, block_M):
    """The (batch, head, query block) of the ``index``-th tile, in the order the blocks take them.

    Tiles of one head are consecutive. With a mask the query blocks of a head go heaviest,
    lightest, second heaviest, ... so that the two tiles of every pair cost about the same in
    total (the causal triangle folded in half).
    """
    n_qb = p.blocks(p.seq_q, block_M)
    bh, i = index // n_qb, index % n_qb
    qb = T.if_then_else(i % 2 == 0, n_qb - 1 - i // 2, i // 2) if p.masked else i
    return bh // p.heads, bh % p.heads, qb


def tiles_per_block(total, num_ctas, cta):
    """How many tiles persistent block ``cta`` takes: pairs ``cta``, ``cta + num_ctas``, ... of the tile list."""
    pairs = (total + 1) // 2
    own_last_odd_pair = (total % 2) * T.if_then_else(cta == (pairs - 1) % num_ctas, 1, 0)
    return 2 * T.ceildiv(T.max(pairs - cta, 0), num_ctas) - own_last_odd_pair


def tile_index(num_ctas, cta, w):
    """The tile list index of block ``cta``'s ``w``-th tile (two consecutive tiles per pair)."""
    return 2 * (cta + (w // 2) * num_ctas) + w % 2


def launched_blocks(num_ctas, total):
    """How many persistent blocks the kernel launches for ``total`` tiles: ``num_ctas``, but no more than the pairs
    of tiles (a block takes at least one pair)."""
    return max(1, min(num_ctas, (total + 1) // 2))


def evaluate(expr):
    """An index expression of the tile walk as a Python int (its inputs are all known)."""
    from tilelang import tvm

    if isinstance(expr, tvm.ir.PrimExpr):
        return int(tvm.arith.Analyzer().simplify(expr))
    return int(expr)


def evaluated_walk(count, tile, num_ctas):
    """The tiles each of ``num_ctas`` persistent blocks takes, in order: a kernel's walk functions, ``count(cta)``
    tiles and the ``w``-th ``tile(cta, w)``, evaluated in Python (for pictures and tests)."""
    return [[tuple(evaluate(x) for x in tile(cta, w)) for w in range(evaluate(count(cta)))]
            for cta in range(num_ctas)]


def persistent_schedule(p, batch, block_M, num_ctas):
    """The (batch, head, query block) tiles each persistent block takes, in order: the kernel's own
    schedule functions evaluated in Python (for pictures and tests)."""
    total = tile_count(p, batch, block_M)
    num_ctas = launched_blocks(num_ctas, total)
    return evaluated_walk(lambda cta: tiles_per_block(total, num_ctas, cta),
                          lambda cta, w: tile_order(p, evaluate(tile_index(num_ctas, cta, w)), block_M), num_ctas)


@T.macro
def wait_for_turn(n_warpgroups):
    """Block until the previous consumer warpgroup has issued its matmuls (ping-pong, any count)."""
    warpgroup = T.get_thread_binding() // 128 - 1
    T.call_extern("handle", "tl::__sync_thread_partial", _TURN_BARRIER + warpgroup, 256)


@T.macro
def pass_turn(n_warpgroups):
    """Let the next consumer warpgroup issue its matmuls."""
    warpgroup = T.get_thread_binding() // 128 - 1
    T.call_extern("handle", "tl::__named_barrier_arrive", _TURN_BARRIER + (warpgroup + 1) % n_warpgroups, 256)


@T.macro
def first_turn(n_warpgroups):
    """The last warpgroup hands the first turn to warpgroup 0, once per kernel."""
    if T.get_thread_binding() // 128 - 1 == n_warpgroups - 1:
        T.call_extern("handle", "tl::__named_barrier_arrive", _TURN_BARRIER, 256)


@T.macro
def produce_key_blocks(load_k, load_v, k_full, k_empty, v_empty, it: T.Ref, k_start, k_end, n_kb, num_stages):
    """The producer's loads of one tile's key blocks into the stage buffers, ``it`` counting them.

    ``load_k(kb, stage)`` issues the TMA load of key block ``kb`` on ``k_full[stage]``; ``load_v(kb,
    stage)`` loads its values and arrives on their full barrier (the packed kernel zeroes the rows of
    another sequence first). Shared by the dense and the packed persistent forwards.
    """
    # At least one key block, so a tile that sees no key still runs (fully masked) and writes 0.
    for j in T.serial(T.max(k_end - k_start, 1)):
        kb = T.max(T.min(k_start + j, n_kb - 1), 0)
        stage, phase = it % num_stages, (it // num_stages) & 1
        T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
        load_k(kb, stage)
        T.mbarrier_arrive(k_full[stage])
        T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
        load_v(kb, stage)
        it = it + 1


@T.macro
def produce_tiles(p, Q, Q_s, q_full, barriers, it: T.Ref, count, tile, key_range, key_loads, block_M, n_kb,
                  num_stages):
    """The producer warpgroup of a persistent kernel: for each of its ``count`` tiles, ``tile(w)`` = (batch, head,
    query block), Q's load once the previous tile's last QKᵀ is done, then the key blocks ``key_range(bz, by, qb)``
    through ``key_loads(bz, by, kv_head, qb)`` = (load_k, load_v) (``produce_key_blocks``)."""
    T.set_max_nreg(24, 0)
    for w in T.serial(count):
        bz, by, qb = tile(w)
        kv_head = by // p.group
        k_start, k_end = key_range(bz, by, qb)
        T.mbarrier_wait_parity(barriers.q_empty[0], (w & 1) ^ 1)  # the previous tile's last QKᵀ is done
        T.tma_copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s, barrier=q_full[0])
        T.mbarrier_arrive(q_full[0])
        load_k, load_v = key_loads(bz, by, kv_head, qb)
        produce_key_blocks(load_k, load_v, barriers.k_full, barriers.k_empty, barriers.v_empty, it, k_start, k_end,
                           n_kb, num_stages)


@T.macro
def load_dense_values(V, V_s, v_full, bz, kv_head, block_N, kb, stage):
    """``produce_key_blocks``' value load of the dense kernel: a TMA load, then its full barrier."""
    T.tma_copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s[stage, :, :], barrier=v_full[stage])
    T.mbarrier_arrive(v_full[stage])


@T.macro
def load_dense_keys(K, K_s, k_full, bz, kv_head, block_N, kb, stage):
    """``produce_key_blocks``' key load of the dense kernel."""
    T.tma_copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s[stage, :, :], barrier=k_full[stage])


class ConsumerTiles(NamedTuple):
    """A consumer's tiles: Q's and the ``num_stages`` K and V stages in shared memory, and the registers of
    ``forward_fragments``."""

    Q_s: object
    K_s: object
    V_s: object
    S: object
    P: object
    acc_o: object
    m: object
    m_prev: object
    shift: object
    alpha: object
    row_sum: object
    l: object  # noqa: E741


class ConsumerBarriers(NamedTuple):
    """The barriers a consumer waits on (``*_full``: the producer's TMA has landed) and arrives at (``*_empty``:
    its stage may be loaded again)."""

    q_empty: object
    k_full: object
    k_empty: object
    v_full: object
    v_empty: object


@T.macro
def stage_barriers(threads, num_stages):
    """The mbarriers of a persistent kernel's stages: ``(q_full, ConsumerBarriers)``, Q's one stage and K's and V's
    ``num_stages``. Full: the 128 producer threads arrive and the TMA bytes land. Empty: every one of the
    ``threads`` consumer threads arrives."""
    q_full = T.alloc_barrier(128)
    q_empty = T.alloc_barrier(threads)
    k_full = T.alloc_barrier([128] * num_stages)
    k_empty = T.alloc_barrier([threads] * num_stages)
    v_full = T.alloc_barrier([128] * num_stages)
    v_empty = T.alloc_barrier([threads] * num_stages)
    return q_full, ConsumerBarriers(q_empty, k_full, k_empty, v_full, v_empty)


class LoopTiling(NamedTuple):
    """How the peeled loop walks a tile: ``block_M`` query rows (one consumer warpgroup per 64), ``block_N``
    keys per step through ``num_stages`` stages, the warpgroups taking turns to issue with ``pingpong``."""

    block_M: int
    block_N: int
    num_stages: int
    pingpong: bool


class SoftmaxPieces(NamedTuple):
    """``online_softmax``'s swapped steps (chapter 07's ablation); None is the shipped step."""

    exp2: object = None
    add_row_sums: object = None
    row_parts: object = None


SHIPPED_SOFTMAX = SoftmaxPieces()


class ProbabilitySteps(NamedTuple):
    """What ``peeled_key_loop`` does between a key block's scores and its P·V: ``softmax(tiles, kb)`` turns the
    masked raw scores of key block ``kb`` in ``tiles.S`` into P's values and updates the row statistics;
    ``store_p(S, P)`` writes them into P; ``values_transposed``: the V stages hold Vᵀ [D, keys] (FP8 ``wgmma``
    reads B K-major only). ``online_probabilities`` gives the 16-bit forwards'; chapter 12's FP8 forward has its own."""

    softmax: object
    store_p: object
    values_transposed: bool


def online_probabilities(tb, p, tiling, softmax=SHIPPED_SOFTMAX):
    """The 16-bit forwards' ``ProbabilitySteps``: ``online_softmax`` (with ``softmax``'s swapped steps, chapter 07's
    ablation; ``SHIPPED_SOFTMAX``: none), P a copy of S in the inputs' dtype, V as it is stored."""

    def online_step(tiles, kb):  # calls the macro itself: a macro of its own would rename the loop variable kb
        online_softmax(tb, tiles.S, tiles.m, tiles.m_prev, tiles.shift, tiles.alpha, tiles.row_sum, tiles.l,
                       tiling.block_M, tiling.block_N, p.scale_log2, exp2=softmax.exp2,
                       add_row_sums=softmax.add_row_sums, row_parts=softmax.row_parts)

    @T.macro
    def copy_p(S, P):
        T.copy(S, P)

    return ProbabilitySteps(online_step, copy_p, values_transposed=False)


@T.macro
def values_by_v(tiles, v_stage, probabilities):
    """Issue ``acc_o += P · V`` on V's stage ``v_stage`` (Vᵀ's where ``probabilities`` say so)."""
    if probabilities.values_transposed:
        T.wgmma_gemm(tiles.P, tiles.V_s[v_stage, :, :], tiles.acc_o, transpose_B=True,
                     policy=T.GemmWarpPolicy.FullRow)
    else:
        T.wgmma_gemm(tiles.P, tiles.V_s[v_stage, :, :], tiles.acc_o, policy=T.GemmWarpPolicy.FullRow)


@T.macro
def peeled_key_loop(tb, p, tiles, barriers, it: T.Ref, qb, k_start, k_end, n_kb, tiling, probabilities,
                    score_step=None):
    """The consumers' rotated loop over one tile's key blocks, peeled: the first QKᵀ and softmax before
    the loop, the last P·V after it (shared by the dense, the packed, the flex and the FP8 persistent forwards).

    ``score_step(S, step)``: what happens to the raw scores of the loop's ``step``-th key block before the
    softmax (flex: its modifiers); None: ``mask_scores`` of key block ``k_start + step``. ``probabilities``: a
    ``ProbabilitySteps``, the softmax and P (``online_probabilities``, or chapter 12's FP8 steps)."""
    # The first key block: scores and softmax only.
    stage = it % tiling.num_stages
    T.mbarrier_wait_parity(barriers.k_full[stage], (it // tiling.num_stages) & 1)
    if tiling.pingpong:
        wait_for_turn(tiling.block_M // 64)
    T.wgmma_gemm(tiles.Q_s, tiles.K_s[stage, :, :], tiles.S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                 clear_accum=True)
    if tiling.pingpong:
        pass_turn(tiling.block_M // 64)
    T.wait_wgmma(0)
    T.mbarrier_arrive(barriers.k_empty[stage])
    if score_step is None:
        mask_scores(tb, p, tiles.S, qb, T.max(T.min(k_start, n_kb - 1), 0), tiling.block_M, tiling.block_N)
    else:
        score_step(tiles.S, 0)
    probabilities.softmax(tiles, T.max(T.min(k_start, n_kb - 1), 0))
    probabilities.store_p(tiles.S, tiles.P)
    # Each step: QKᵀ of block j and P·V of block j - 1 in flight, then softmax of block j (ptxas waits for the
    # P·V before its exponentials: chapter 07, section 3).
    for j in T.serial(1, T.max(k_end - k_start, 1)):
        k_stage, v_stage = (it + 1) % tiling.num_stages, it % tiling.num_stages
        T.mbarrier_wait_parity(barriers.k_full[k_stage], ((it + 1) // tiling.num_stages) & 1)
        if tiling.pingpong:
            wait_for_turn(tiling.block_M // 64)
        T.wgmma_gemm(tiles.Q_s, tiles.K_s[k_stage, :, :], tiles.S, transpose_B=True,
                     policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
        T.mbarrier_wait_parity(barriers.v_full[v_stage], (it // tiling.num_stages) & 1)
        values_by_v(tiles, v_stage, probabilities)
        if tiling.pingpong:
            pass_turn(tiling.block_M // 64)
        T.wait_wgmma(1)  # the scores are ready; P·V may still be running
        T.mbarrier_arrive(barriers.k_empty[k_stage])
        if score_step is None:
            mask_scores(tb, p, tiles.S, qb, k_start + j, tiling.block_M, tiling.block_N)
        else:
            score_step(tiles.S, j)
        probabilities.softmax(tiles, k_start + j)
        T.wait_wgmma(0)
        T.mbarrier_arrive(barriers.v_empty[v_stage])
        for i, d in T.Parallel(tiling.block_M, p.dim):
            tiles.acc_o[i, d] *= tiles.alpha[i]
        probabilities.store_p(tiles.S, tiles.P)
        it = it + 1
    T.mbarrier_arrive(barriers.q_empty[0])  # the producer may load the next tile's Q
    # The last key block: P·V only.
    v_stage = it % tiling.num_stages
    T.mbarrier_wait_parity(barriers.v_full[v_stage], (it // tiling.num_stages) & 1)
    values_by_v(tiles, v_stage, probabilities)
    T.wait_wgmma(0)
    T.mbarrier_arrive(barriers.v_empty[v_stage])
    it = it + 1


class PersistentTiling(NamedTuple):
    """The persistent kernel's tiling and launch.

    ``block_M`` query rows per tile, one consumer warpgroup per 64; ``threads`` counts the consumer threads,
    so ``threads = 2 * block_M`` (a producer warpgroup is added); ``block_N`` keys per step through
    ``num_stages`` stages; ``pingpong``: the consumer warpgroups take turns issuing their matmuls;
    ``num_ctas``: how many persistent blocks to launch (one per SM). ``blocks_per_sm`` of 2 or 3 (one consumer
    warpgroup only) asks for that many resident blocks per SM: the launch fits 65536 registers shared among
    them (128 a thread for two), and the producer hands all but 24 of its own to the consumers (232 for two).
    """

    block_M: int = 128
    block_N: int = 128
    num_stages: int = 2
    threads: int = 256
    pingpong: bool = False
    num_ctas: int = H100_SMS
    blocks_per_sm: int = 1


class PersistentPieces(NamedTuple):
    """The steps chapter 07's ablation swaps (``kernels/versions``); the defaults are the shipped kernel.

    ``order(p, index, block_M)`` -> (batch, head, query block) of a tile (``tile_order``: the causal triangle
    folded); ``exp2`` and ``row_sums`` are ``online_softmax``'s exponential and its fold of the row sums into
    the denominator (``row_sums``: a ``RowSums`` of ``kernels.versions``, with tiles of its own, zeroed per
    tile and finished before the epilogue). None is the shipped step.

    ``modifiers``: chapter 11's FlexAttention on this kernel (``flash_flex_persistent.ListedKeySteps``): each tile
    walks the key blocks a block mask lists (``key_range``, ``key_loads``), its scores go through the score_mod
    and the mask_mod (``score_step``), the kernel takes the block mask's inputs (``launch``), and ``tile_walk`` says
    which tiles each persistent block takes (``order`` over ``tile_index``, or an order the block mask gives);
    None: the dense kernel's key ranges, masks and walk.
    """

    order: object = tile_order
    exp2: object = None
    row_sums: object = None
    modifiers: object = None


SHIPPED_PIECES = PersistentPieces()
SHIPPED_TILING = PersistentTiling()  # two consumer warpgroups of 64 query rows, 128 keys per step, 2 stages


def flash_fwd_hopper_persistent_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None, dtype="float16",
    tiling=SHIPPED_TILING, pieces=SHIPPED_PIECES,
):
    """Return a ``@T.prim_func`` computing O and LSE; the problem's parameters as in ``flash_fwd_hopper_kernel``,
    its ``tiling`` a ``PersistentTiling`` and its swapped steps a ``PersistentPieces``."""
    block_M, block_N, num_stages, threads, pingpong, num_ctas, blocks_per_sm = tiling
    order, exp2, row_sums, modifiers = pieces
    if threads != 2 * block_M or block_M % 64:
        raise ValueError(f"the persistent kernel runs one consumer warpgroup per 64 query rows: block_M must be "
                         f"a multiple of 64 and threads = 2 * block_M; got block_M={block_M}, threads={threads}")
    if blocks_per_sm not in (1, 2, 3) or (blocks_per_sm > 1 and block_M != 64):
        raise ValueError(f"several blocks per SM fit only one consumer warpgroup (block_M = 64), two or three of "
                         f"them; got block_M={block_M}, blocks_per_sm={blocks_per_sm}")
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    consumers = block_M // 64
    n_kb = p.blocks(seq_k, block_N)
    total = tile_count(p, batch, block_M)
    num_ctas = launched_blocks(num_ctas * blocks_per_sm, total)
    launch_regs = 65536 // (blocks_per_sm * (threads + 128)) // 8 * 8
    consumer_regs = 2 * launch_regs - 24 if blocks_per_sm > 1 else 240 if consumers == 2 else 160
    add_row_sums = None if row_sums is None else row_sums.add
    tiling = LoopTiling(block_M, block_N, num_stages, pingpong)

    if modifiers is None:
        def block_tile_count(block_mask, cta):
            return tiles_per_block(total, num_ctas, cta)

        def block_tile(block_mask, cta, w):
            return order(p, tile_index(num_ctas, cta, w), block_M)

        def key_range(block_mask, bz, by, qb):
            return key_block_range(p, qb, block_M, block_N)

        def key_loads(K, V, K_s, V_s, k_full, v_full, block_mask, bz, by, kv_head, qb):
            return (partial(load_dense_keys, K, K_s, k_full, bz, kv_head, block_N),
                    partial(load_dense_values, V, V_s, v_full, bz, kv_head, block_N))

        def score_step(block_mask, bz, by, qb):
            return None
    else:
        key_range, key_loads, score_step = modifiers.key_range, modifiers.key_loads, modifiers.score_step
        block_tile_count, block_tile = modifiers.tile_walk(p, order, total, num_ctas, block_M)

    @T.macro
    def walk_tiles(Q, K, V, Sinks, Output, LSE, cta, block_mask):
        """What one persistent block does; ``block_mask``: the modifiers' inputs (None: the dense kernel's)."""
        if blocks_per_sm > 1:
            T.annotate_min_blocks_per_sm(blocks_per_sm)
        Q_s = T.alloc_shared([block_M, dim], dtype)
        K_s = T.alloc_shared([num_stages, block_N, dim], dtype)
        V_s = T.alloc_shared([num_stages, block_N, dim], dtype)
        O_s = T.alloc_shared([block_M, dim], dtype)
        S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_fragments(  # noqa: E741
            tb, block_M, block_N, dim, dtype)
        l_part = row_sums.tiles(block_M) if row_sums is not None else None
        q_full, barriers = stage_barriers(threads, num_stages)
        k_full, v_full = barriers.k_full, barriers.v_full
        it = T.alloc_var("int32", init=0)  # key blocks passed so far, over all tiles of this block
        tiles = ConsumerTiles(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l)

        if T.get_thread_binding() < 128:
            # region: producer
            produce_tiles(p, Q, Q_s, q_full, barriers, it, block_tile_count(block_mask, cta),
                          partial(block_tile, block_mask, cta), partial(key_range, block_mask),
                          partial(key_loads, K, V, K_s, V_s, k_full, v_full, block_mask), block_M, n_kb, num_stages)
            # endregion
        else:
            T.set_max_nreg(consumer_regs, 1)
            if pingpong:
                first_turn(consumers)
            for w in T.serial(block_tile_count(block_mask, cta)):
                bz, by, qb = block_tile(block_mask, cta, w)
                k_start, k_end = key_range(block_mask, bz, by, qb)
                T.fill(acc_o, 0)
                T.fill(l, 0)
                if row_sums is not None:
                    row_sums.start(l_part)
                init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
                T.mbarrier_wait_parity(q_full[0], w & 1)

                # region: peeled loop
                peeled_key_loop(tb, p, tiles, barriers, it, qb, k_start, k_end, n_kb, tiling,
                                online_probabilities(tb, p, tiling, SoftmaxPieces(exp2, add_row_sums, l_part)),
                                score_step(block_mask, bz, by, qb))
                # endregion
                if row_sums is not None:
                    row_sums.finish(l_part, l)

                T.tma_store_wait()
                forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim,
                                 has_sinks, wait_for_store=False)
            T.tma_store_wait()  # the last O store must have read shared memory before the block exits

    if modifiers is not None:
        return modifiers.launch(walk_tiles, num_ctas, threads + 128)

    @T.prim_func
    def flash_fwd_hopper_persistent(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], ACCUM),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], ACCUM),
    ):
        with T.Kernel(num_ctas, threads=threads + 128) as cta:
            walk_tiles(Q, K, V, Sinks, Output, LSE, cta, None)

    return flash_fwd_hopper_persistent
