"""The pieces every attention kernel of the course is built from, each written once.

A kernel factory starts from a ``Prelude`` (the constants of its problem), asks ``visible``
which (query, key) pairs count, walks ``key_block_range`` (forward) or ``query_block_range``
(backward), and the forward kernels end with ``forward_epilogue``. The forward kernels also
share their tiles (``forward_tiles``) and the online-softmax update of one score tile
(``online_softmax``), the way Triton's tutorial factors ``_attn_fwd_inner`` out of its kernel.

Everything here is evaluated while a factory builds its ``@T.prim_func``: the Python functions
return TileLang expressions, and the ``@T.macro`` pieces are inlined where they are called, so
a kernel built from pieces generates the same CUDA as one written out in full.
"""

import dataclasses
import math
from dataclasses import dataclass

import tilelang.language as T

__all__ = ["LOG2E", "ACCUM", "NEG_INF", "Prelude", "prelude", "with_lengths", "visible", "block_needs_mask",
           "key_block_range", "key_range_of_queries", "query_block_range", "mask_scores", "init_running_max",
           "forward_tiles", "online_softmax", "normalise_rows", "natural_lse", "forward_epilogue", "store_dkv",
           "zero_rows_past_end", "consumer_barrier"]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · LOG2E)
ACCUM = "float32"
NEG_INF = -T.infinity(ACCUM)


@dataclass(frozen=True)
class Prelude:
    """The constants an attention kernel derives from its problem before touching a tile.

    ``seq_q`` and ``seq_k`` are Python ints for kernels compiled for one shape, or run-time
    lengths (TIR expressions, e.g. read from ``cu_seqlens``) in a per-sequence prelude made with
    ``with_lengths`` inside a kernel; every piece below accepts either.
    """

    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    dim: int
    sm_scale: float
    causal: bool
    window_size: "int | None"

    @property
    def group(self):
        """Query heads per K/V head (grouped-query attention; 1 for plain multi-head attention)."""
        return self.heads // self.heads_kv

    @property
    def scale_log2(self):
        """sm_scale · log2(e): a raw score times this goes straight into exp2."""
        return self.sm_scale * LOG2E

    @property
    def past(self):
        """S_k − S_q: how far the causal diagonal is shifted (aligned bottom-right)."""
        return self.seq_k - self.seq_q

    @property
    def masked(self):
        """Whether some pairs are hidden besides the ragged end: causal, or a sliding window."""
        return self.causal or self.window_size is not None

    @staticmethod
    def blocks(seq, block):
        """How many blocks of ``block`` rows cover ``seq`` rows (the last one may be partial)."""
        return (seq + block - 1) // block


def prelude(heads, seq_q, seq_k, dim, *, heads_kv=None, causal=False, window_size=None, sm_scale=None):
    """The ``Prelude`` of one problem: defaults filled in (K/V heads = query heads, scale 1/√D)."""
    return Prelude(heads=heads, heads_kv=heads if heads_kv is None else heads_kv, seq_q=seq_q, seq_k=seq_k,
                   dim=dim, sm_scale=1.0 / math.sqrt(dim) if sm_scale is None else sm_scale,
                   causal=bool(causal), window_size=window_size)


def with_lengths(p, seq_q, seq_k):
    """The per-sequence prelude: ``p`` with the lengths of one sequence, known only at run time.

    Called inside a kernel whose sequences are packed (varlen) or cached (decoding): ``seq_q`` and
    ``seq_k`` are expressions such as ``cu_seqlens[b + 1] - cu_seqlens[b]``. The causal diagonal
    (``past``), the block counts and every range below then follow each sequence's own lengths.
    """
    return dataclasses.replace(p, seq_q=seq_q, seq_k=seq_k)


def visible(p, q_pos, k_pos, *, guard_q=False):
    """Whether key position ``k_pos`` counts for query position ``q_pos`` (both absolute).

    Keys past the end never count; causal hides keys after the (bottom-right aligned) diagonal;
    a window of W also hides keys W or more positions behind it. ``guard_q`` adds the query's
    own bound, for kernels whose rows may run past the end of the queries (the backward).
    """
    cond = k_pos < p.seq_k
    if guard_q:
        cond = T.And(q_pos < p.seq_q, cond)
    if p.masked:
        cond = T.And(cond, k_pos <= q_pos + p.past)
    if p.window_size is not None:
        cond = T.And(cond, k_pos > q_pos + p.past - p.window_size)
    return cond


def block_needs_mask(p, qb, kb, block_M, block_N):
    """Whether any pair of the tile (query block ``qb``, key block ``kb``) is hidden.

    The same for every thread of the block, so branching on it costs nothing: only the tiles on a
    boundary (the ragged end, the diagonal, the window's edge) pay for the mask.
    """
    cond = (kb + 1) * block_N > p.seq_k
    if p.masked:
        cond = T.Or(cond, (kb + 1) * block_N - 1 > qb * block_M + p.past)
    if p.window_size is not None:
        cond = T.Or(cond, kb * block_N <= (qb + 1) * block_M - 1 + p.past - p.window_size)
    return cond


def key_block_range(p, qb, block_M, block_N):
    """The key blocks ``[start, end)`` that query block ``qb`` must visit (forward).

    Causal stops after the block holding the last row's diagonal key; a window starts at the block
    holding the first row's oldest visible key. Everything outside is skipped: no load, no math.
    """
    return key_range_of_queries(p, qb * block_M, (qb + 1) * block_M, block_N)


def key_range_of_queries(p, first_q, end_q, block_N):
    """The key blocks ``[start, end)`` that query positions ``first_q … end_q − 1`` must visit.

    ``key_block_range`` for any set of consecutive queries: a decoding tile packs the query heads
    of a group, so its rows are not one query each. (``end`` may fall below ``start`` when no
    query sees a key: the loop then runs no iteration.)
    """
    end = p.blocks(p.seq_k, block_N)
    if p.masked:
        end = T.min(end, T.ceildiv(end_q + p.past, block_N))
    start = 0
    if p.window_size is not None:
        start = T.max(0, (first_q + p.past - p.window_size + 1) // block_N)
    return start, end


def query_block_range(p, kb, block_M, block_N):
    """The query blocks ``[start, end)`` that can see key block ``kb`` (backward).

    Causal skips the query blocks above the diagonal; a window also skips those more than
    ``window_size − 1`` positions below it.
    """
    start = 0
    if p.masked:
        start = T.max(0, (kb * block_N - p.past) // block_M)
    end = p.blocks(p.seq_q, block_M)
    if p.window_size is not None:
        end = T.min(end, T.ceildiv((kb + 1) * block_N - p.past + p.window_size - 1, block_M))
    return start, end


@T.macro
def mask_scores(tb, p, S, qb, kb, block_M, block_N):
    """Set the hidden pairs of score tile (qb, kb) to -inf, after the QKᵀ product.

    Masking by selection, not by adding -inf to the scores: a hidden key's score then has no influence,
    even if the key holds an inf or a NaN (its value row still meets P = 0 in P·V, and 0 · NaN is NaN).
    Tiles inside the visible region skip the pass.
    """
    if block_needs_mask(p, qb, kb, block_M, block_N):
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.if_then_else(visible(p, qb * block_M + i, kb * block_N + j), S[i, j], NEG_INF)


@T.macro
def init_running_max(tb, p, m, Sinks, by, block_M, has_sinks):
    """Start the running max at -inf, or at the sink's logit (in raw score units) when there is one.

    A sink is a key with a logit and no value row; counting it in the max from the start keeps every
    exponential at most 1, however large the sink or however small the scores.
    """
    if has_sinks:
        for i in tb.parallel(block_M):
            m[i] = Sinks[by] * (1.0 / p.sm_scale)
    else:
        T.fill(m, NEG_INF)


@T.macro
def forward_tiles(tb, block_M, block_N, dim, dtype):
    """The tiles of a forward kernel: Q, K, V, O in shared memory; scores and statistics in registers."""
    Q_s = tb.shared([block_M, dim], dtype)
    K_s = tb.shared([block_N, dim], dtype)
    V_s = tb.shared([block_N, dim], dtype)
    O_s = tb.shared([block_M, dim], dtype)
    S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_fragments(tb, block_M, block_N, dim, dtype)  # noqa: E741
    return Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l


@T.macro
def forward_fragments(tb, block_M, block_N, dim, dtype):
    """A forward's registers: the score tile and its 16-bit copy, the output accumulator, the row statistics
    (the kernels with stage buffers of their own allocate their shared tiles themselves)."""
    S = tb.fragment([block_M, block_N], ACCUM)  # scores, then probabilities
    P = tb.fragment([block_M, block_N], dtype)  # probabilities rounded for the PV gemm
    acc_o = tb.fragment([block_M, dim], ACCUM)
    m = tb.fragment([block_M], ACCUM)  # running row max of the raw scores
    m_prev = tb.fragment([block_M], ACCUM)
    shift = tb.fragment([block_M], ACCUM)  # m · scale_log2, or 0 for a row that saw nothing yet
    alpha = tb.fragment([block_M], ACCUM)  # rescale factor of the old accumulators
    row_sum = tb.fragment([block_M], ACCUM)
    l = tb.fragment([block_M], ACCUM)  # running softmax denominator  # noqa: E741
    return S, P, acc_o, m, m_prev, shift, alpha, row_sum, l


@T.macro
def online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, scale_log2, new_max=None, exp2=None,
                   add_row_sums=None, row_parts=None):
    """Fold one tile of raw scores ``S`` into the running max ``m`` and denominator ``l``.

    Leaves the unnormalised probabilities in ``S`` and the factor ``alpha`` by which the caller
    must rescale its output accumulator (the old terms were exponentiated against a smaller max).

    The ablation versions (``kernels/versions``) swap three of its steps; None is the shipped step.
    ``new_max(tb, S, m, m_prev, row_sum, block_M, scale_log2)`` sets ``m`` from the tile (shipped:
    max(m_prev, the tile's row max)); ``exp2(x, column)`` is the exponential of score column ``column``
    (shipped: ``T.exp2``); ``add_row_sums(tb, S, alpha, row_parts, l, block_M, block_N)`` folds the
    tile's row sums into the denominator, keeping partial sums in the version's own tiles ``row_parts``
    (shipped: reduce across the row's threads into ``row_sum``, then into ``l``).
    """
    T.copy(m, m_prev)
    if new_max is None:
        T.reduce_max(S, m, dim=1, clear=False)  # m = max(m_prev, this block's row max)
    else:
        new_max(tb, S, m, m_prev, row_sum, block_M, scale_log2)
    for i in tb.parallel(block_M):
        # A row whose keys so far were all masked has m = -inf; -inf - -inf would be NaN.
        shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] * scale_log2)
        alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
    if exp2 is None:
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])
    else:
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = exp2(S[i, j] * scale_log2 - shift[i], j)
    if add_row_sums is None:
        T.reduce_sum(S, row_sum, dim=1)
        for i in tb.parallel(block_M):
            l[i] = l[i] * alpha[i] + row_sum[i]
    else:
        add_row_sums(tb, S, alpha, row_parts, l, block_M, block_N)


def natural_lse(l_i, shift_i):
    """The natural-log LSE of a row from its denominator and shift (exp2 units); -inf if it saw nothing."""
    return T.if_then_else(l_i == 0, NEG_INF, (shift_i + T.log2(l_i)) / LOG2E)


@T.macro
def normalise_rows(tb, p, acc_o, l, m, shift, Sinks, by, block_M, dim, has_sinks):
    """Add the sink of head ``by`` to the denominators, divide the accumulator by them once, and leave
    in ``shift`` what ``natural_lse`` needs. A row that saw nothing (``l == 0``) gets 0."""
    # The shift is recomputed: a query block that sees no key never ran the loop.
    for i in tb.parallel(block_M):
        shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] * p.scale_log2)
    # region: sink
    if has_sinks:
        for i in tb.parallel(block_M):
            l[i] += T.exp2(Sinks[by] * LOG2E - shift[i])  # the sink's term (≤ 1: m includes it); no value row
    # endregion
    # region: normalise
    # Only a row that saw nothing has l = 0; a NaN the row saw stays NaN, as in PyTorch.
    for i, j in tb.parallel(block_M, dim):
        acc_o[i, j] = T.if_then_else(l[i] == 0, 0, acc_o[i, j] / l[i])
    # endregion


@T.macro
def forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim, has_sinks,
                     wait_for_store=True):
    """Add the sink, normalise once, store O through shared memory and write the natural-log LSE.

    ``wait_for_store=False`` (CUDA only) leaves the TMA store of O in flight: a persistent kernel
    overlaps it with its next tile and calls ``T.tma_store_wait()`` before it writes ``O_s`` again.
    """
    normalise_rows(tb, p, acc_o, l, m, shift, Sinks, by, block_M, dim, has_sinks)
    # region: store
    T.copy(acc_o, O_s)
    if wait_for_store:
        T.copy(O_s, Output[bz, by, qb * block_M:(qb + 1) * block_M, :])
    else:
        T.tma_copy(O_s, Output[bz, by, qb * block_M:(qb + 1) * block_M, :])
    # endregion
    # region: lse
    for i in tb.parallel(block_M):
        if qb * block_M + i < p.seq_q:
            LSE[bz, by, qb * block_M + i] = natural_lse(l[i], shift[i])
    # endregion


@T.macro
def store_dkv(tb, p, dk, dv, dK, dV, block, block_N, dim, owned=None):
    """Scale dK and store the rows of dK and dV of ``block`` = (batch, K/V head, key block).

    Chapter 05's and chapter 08's backwards and the flex one. Where one block owns these rows (``owned``;
    None: without GQA), a plain copy. Otherwise the query heads of a group add into one K/V head: float32
    accumulators, zero on entry, and only the rows before the keys' end. (``block`` is one tuple: a macro
    renames a loop variable passed as an argument of its own, and the CPU's C names its loops after them.)
    """
    for j, d in tb.parallel(block_N, dim):
        dk[j, d] *= p.sm_scale
    if p.group == 1 if owned is None else owned:
        T.copy(dv, dV[block[0], block[1], block[2] * block_N:(block[2] + 1) * block_N, :])
        T.copy(dk, dK[block[0], block[1], block[2] * block_N:(block[2] + 1) * block_N, :])
    else:
        for j, d in tb.parallel(block_N, dim):
            if block[2] * block_N + j < p.seq_k:
                T.atomic_add(dV[block[0], block[1], block[2] * block_N + j, d], dv[j, d])
                T.atomic_add(dK[block[0], block[1], block[2] * block_N + j, d], dk[j, d])


@T.macro
def consumer_barrier(barrier_id):
    """The 256 consumer threads meet; the shared memory each wrote becomes visible to the tensor cores
    and the copy engine (the proxy fence comes first, in every writing thread). A plain extern call:
    warp specialisation would move a ``T.sync_threads`` into the producer's branch (chapter 07)."""
    T.fence_proxy_async()
    T.call_extern("handle", "tl::__sync_thread_partial", barrier_id, 256)


@T.macro
def zero_rows_past_end(tb, tile, first_row, length, rows, cols=None, barrier_id=None):
    """Zero the rows of a loaded tile that lie past its sequence's end (only a tile that runs past it).

    ``tile`` holds rows ``first_row …`` of a sequence of ``length`` rows (``cols`` columns, or a vector).
    Masking the scores gives a key past the end P = 0, but P·V still multiplies 0 by its value row,
    and 0 · NaN = NaN: the rows past a sequence's end (another sequence's tokens when sequences are
    packed, never-written slots of a KV cache) must not reach its result, whatever they hold.
    ``barrier_id``: in a kernel that places its own barriers, the consumers meet on it after zeroing
    (``consumer_barrier``), on this tile only.
    """
    if first_row + rows > length:
        # Written as a read of the tile: TileLang's warp specialisation waits for a tile's load before
        # the first *read* of it, and would let a plain store run before the data has arrived.
        if cols is None:
            for i in tb.parallel(rows):
                tile[i] = T.if_then_else(first_row + i < length, tile[i], 0)
        else:
            for i, j in tb.parallel(rows, cols):
                tile[i, j] = T.if_then_else(first_row + i < length, tile[i, j], 0)
        if tb.on_gpu and barrier_id is not None:
            consumer_barrier(barrier_id)
        elif tb.on_gpu:
            T.fence_proxy_async()  # order these stores before the copy engine's next write to the buffer
