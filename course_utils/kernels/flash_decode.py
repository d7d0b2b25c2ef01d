"""Decoding against a KV cache (chapter 09): split-KV attention with GQA packing, contiguous or paged.

One decoding step brings ``S_new`` new query tokens per sequence (1 in plain generation) and
attends over a long cache of keys and values. Two kernels do it:

* ``flash_decode_kernel`` (the *split* kernel). One thread block owns one K/V head of one
  sequence (or, with ``kv_heads_per_block``, a few neighbouring ones) and one *split*, a contiguous
  range of the cache. Its query tile packs every query
  head that shares that K/V head (GQA packing: ``group · S_new`` rows), so each K/V tile is read
  from memory once for the whole group. It runs chapter 03's loop over its key blocks and writes
  a *partial* result: O normalised over its own keys, and their log-sum-exp.
* ``flash_decode_merge_kernel``. One thread block per (sequence, token, query head) combines the
  partial results with chapter 02's merge of softmax states: with LSE = log Σ_s exp(LSE_s),
  O = Σ_s exp(LSE_s − LSE) · O_s. A sink is one more partial state, with LSE_s = its logit and
  O_s = 0, so the split kernel never sees it.

The cache is either contiguous, ``[B, S_max, H_kv, D]``, or *paged* as in vLLM:
``[num_pages, page_size, H_kv, D]`` with a block table ``[B, max_pages]`` that lists the pages of
each sequence in order. A key tile of ``block_N`` keys then lies inside one page (``block_N``
divides ``page_size``), so a paged load is a contiguous load from a looked-up page.

Lengths come from ``cache_seqlens`` at run time, and the number of splits is the size of the
partial buffers, so one compiled kernel serves every batch size, cache size and split count.

    python -m course_utils.check flash_decode  # check against the reference (and time it, on a GPU)
"""

import functools
import math
from typing import NamedTuple

import tilelang
import tilelang.language as T
from tilelang.language.copy_op import EVICTION_POLICY_IDS

from .flash_pieces import (
    ACCUM,
    LOG2E,
    NEG_INF,
    key_range_of_queries,
    natural_lse,
    normalise_rows,
    online_softmax,
    prelude,
    visible,
    with_lengths,
    zero_rows_past_end,
)
from .tiles import TileBackend

__all__ = ["DecodeConfig", "DECODE_CONFIGS", "SPLIT_TILING", "decode_config", "decode_rows", "decode_row_tiles",
           "flash_decode_kernel", "flash_decode_merge_kernel", "choose_num_splits", "blocks_per_sm", "MAX_SPLITS",
           "ONE_SPLIT_TILES"]


class DecodeConfig(NamedTuple):
    """The split kernel's tiling and schedule.

    ``block_M`` packed query rows (None: fit them), ``block_N`` keys per tile, ``num_stages`` tiles
    in flight; on the GPU, ``warp_specialize`` lets TileLang dedicate a producer warpgroup to the TMA
    loads, and ``min_blocks`` > 0 asks the compiler to fit that many blocks on one SM (fewer
    registers per thread: more blocks, so more loads, in flight). ``kv_heads_per_block`` K/V heads
    share one block (see ``flash_decode_kernel``).
    """

    block_N: int
    num_stages: int
    threads: int
    block_M: "int | None" = None
    warp_specialize: bool = True
    min_blocks: int = 0
    kv_heads_per_block: "int | None" = 1  # None (decode_config): 128 // D, a K/V tile row of 128 values
    kv_eviction: "str | None" = None  # an L2 eviction hint for the K/V loads ("evict_first", ...); None: none

    def tiling(self):
        """The config's fields by name (``flash_decode_kernel`` takes the config itself as its ``tiling``)."""
        return self._asdict()

    def pass_configs(self):
        """TileLang pass options for compiling the split kernel with this config."""
        return {} if self.warp_specialize else {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


# The CPU runs one thread per block; on the GPU the rows are padded to a tensor-core tile (16) and the
# K/V tiles are streamed through shared memory a few stages ahead (decoding is a stream of loads).
# On the GPU: three stages of K/V in flight per block, and two blocks per SM (ptxas then keeps the
# registers under 128 per thread); TileLang's warp specialisation gives the TMA loads their own warpgroup.
# A block reads K/V rows of at least 128 values (256 bytes): at D = 64, two K/V heads per block
# (``kv_heads_per_block``). Measured at gpt-oss heads, D = 64, B = 64, 8k-128k keys (2026-11-26,
# docs/varlen_and_decoding.md): one head per block (128-byte pieces of each 1 KiB cache row) ran at 0.97-0.98 of cuDNN's
# speed (its time ÷ ours) on an H100 and 0.98-0.99 on an H200; two heads (256-byte pieces) at 0.99-1.00 and
# 1.00-1.01. At D = 128 (rows of 256 bytes already) two heads per block were 0-2% slower on the H100.
DECODE_CONFIGS = {"c": DecodeConfig(block_N=16, num_stages=1, threads=1),
                  "cuda": DecodeConfig(block_N=128, num_stages=3, threads=128, warp_specialize=True, min_blocks=2,
                                       kv_heads_per_block=None)}
MAX_SPLITS = 128
# A cache of at most this many key tiles is read by one kernel (no merge). Calls issued from Python are
# launch-bound there: on the H100 (gpt-oss heads, D = 64, tiles of 64 keys; figures/ch09_decode_splits_h100.json,
# docs/varlen_and_decoding.md) one kernel took 34-36 µs at 1k keys against 41-43 µs split (2026-11-26, 19:37 UTC),
# and in a later run, on a slower host, 51-54 µs against 68-79 at 1k and 59-69 against 59-88 at 2k; at 4k one
# kernel still won there (66-81 against 77-86), but its 64 tiles take about 58 µs of GPU time, more than the split
# path's 42 µs on the faster host; at 8k splitting wins by far (115 µs against 43-55).
# In a CUDA graph, where launches cost nothing, splitting pays sooner than this.
ONE_SPLIT_TILES = 32


def decode_rows(heads, heads_kv, seq_new):
    """Rows of one packed query tile: every query head of a K/V group, for every new token."""
    return heads // heads_kv * seq_new


def decode_row_tiles(rows, block_M, kv_heads_per_block=1):
    """Query tiles per block row of the grid: the packed ``rows`` in tiles of ``block_M``, or one tile holding
    every row of its heads when a block owns ``kv_heads_per_block`` > 1 K/V heads."""
    return 1 if kv_heads_per_block > 1 else (rows + block_M - 1) // block_M


@functools.lru_cache(maxsize=64)  # called at every decoding step: the answer depends on these ints only
def decode_config(target, heads, heads_kv, dim, seq_new, page_size=None, kv_heads_per_block=None):
    """The tiling ``flash_decode`` uses: the target's default, with ``block_M`` fitted to the packed
    rows and ``block_N`` shrunk, if needed, to divide the page size. ``kv_heads_per_block`` (None: the
    default's; the GPU's: 128 // D) is lowered, if needed, to a power of two dividing ``heads_kv`` whose
    rows fit one tile."""
    config = DECODE_CONFIGS[target]
    rows = decode_rows(heads, heads_kv, seq_new)
    hpb = config.kv_heads_per_block if kv_heads_per_block is None else kv_heads_per_block
    if hpb is None:
        hpb = max(1, 128 // dim)
    while hpb > 1 and (heads_kv % hpb or (target != "c" and hpb * rows > 64)):
        hpb //= 2
    block_M = hpb * rows if target == "c" else min(64, max(16, 1 << (hpb * rows - 1).bit_length()))
    width = hpb * dim
    if target == "c":
        block_N = config.block_N
    elif hpb == 1:
        block_N = config.block_N if dim <= 64 else config.block_N // 2  # same bytes per tile
    else:
        block_N = max(32, config.block_N * 64 // width)
    while page_size is not None and page_size % block_N:
        block_N //= 2
    return config._replace(block_M=block_M, block_N=block_N, kv_heads_per_block=hpb)


# The factory's default: one K/V head per block, its rows fitted (block_M None), 128 keys per tile, two stages.
SPLIT_TILING = DecodeConfig(block_N=128, num_stages=2, threads=128)


def flash_decode_kernel(heads, heads_kv, dim, seq_new, *, page_size=None, causal=False, window_size=None,
                        sm_scale=None, dtype="float16", target=None, tiling=SPLIT_TILING, single=False):
    """Return the split kernel: partial O and LSE of each (sequence, new token, query head, split).

    Tensors: Q [B, S_new, H, D]; K, V [B, S_max, H_kv, D], or with ``page_size`` the pages
    [num_pages, page_size, H_kv, D] and BlockTable [B, max_pages] (int32); CacheSeqlens [B] (int32,
    the new tokens included); outputs O_part [B, S_new, H, splits, D] and LSE_part [B, S_new, H,
    splits] in float32. New token ``s`` of sequence ``b`` sits at position
    ``cache_seqlens[b] − S_new + s`` (``causal``; a ``window_size`` implies causal).
    ``tiling``: a ``DecodeConfig`` (its tiling, ``warp_specialize``, ``min_blocks``, ``kv_heads_per_block`` and
    ``kv_eviction``; compile with its ``pass_configs``).

    ``single=True``: the one-split kernel, with no merge after it. Each block then owns a whole
    sequence's cache, starts its running max at its rows' sinks (Sinks [H], float32, -inf for none)
    and writes the final Output [B, S_new, H, D] (``dtype``) and LSE [B, H, S_new] itself: one launch
    per decoding step instead of two, which is what a small cache costs (a launch, not a read).

    ``kv_heads_per_block`` = c > 1: one block owns c neighbouring K/V heads. The cache [.., H_kv, D] is
    read as [.., H_kv / c, c·D] (the same bytes), so a key tile is one c·D-wide matrix whose rows are
    contiguous c·D·2-byte pieces of memory instead of D·2-byte ones. The query tile is block-diagonal:
    the rows of head slot j hold their queries in columns j·D … (j+1)·D − 1 and zeros elsewhere, so one
    Q·Kᵀ gives every row the scores of its own head only; P·V computes c·D columns per row, of which
    the row keeps its own head's D (the others, another head's values under this head's weights, are
    never stored). It trades c× the (idle) tensor-core work for wider loads. All rows of the c heads
    share one tile: ``block_M`` ≥ c · group · S_new.

    Indices are clamped, never trusted: a length is read as ``min(max(cache_seqlens[b], 0),
    capacity)`` and a page number as ``min(max(block_table[b, j], 0), num_pages − 1)``, so a bad index
    (which ``flash_decode`` checks only on request: it would need the host to read the indices) gives
    a wrong result for its sequence but never a read outside the cache.
    """
    block_N, num_stages, threads, block_M, warp_specialize, min_blocks, kv_heads_per_block, kv_eviction = tiling
    tb = TileBackend(target)
    p_model = prelude(heads, seq_new, 1, dim, heads_kv=heads_kv, causal=causal or window_size is not None,
                      window_size=window_size, sm_scale=sm_scale)
    rows = decode_rows(heads, heads_kv, seq_new)
    group = p_model.group
    hpb = kv_heads_per_block
    if isinstance(hpb, bool) or not isinstance(hpb, int) or hpb < 1 or heads_kv % hpb:
        raise ValueError(f"kv_heads_per_block must be a positive int dividing heads_kv ({heads_kv}); got {hpb!r}")
    block_M = hpb * rows if block_M is None else block_M
    if hpb > 1 and block_M < hpb * rows:
        raise ValueError(f"kv_heads_per_block={hpb} needs every row of its {hpb} heads in one tile: block_M "
                         f"({block_M}) must be at least {hpb} × {rows}")
    row_tiles = decode_row_tiles(rows, block_M, hpb)
    width = hpb * dim  # columns of a K/V tile: hpb heads side by side
    if page_size is not None and page_size % block_N:
        raise ValueError(f"block_N ({block_N}) must divide page_size ({page_size})")
    paged = page_size is not None

    batch, splits = T.dynamic("batch, num_splits")
    if paged:
        num_pages, max_pages = T.dynamic("num_pages, max_pages")
        cache_shape = [num_pages, page_size, heads_kv, dim]
        grouped_shape = [num_pages, page_size, heads_kv // hpb, width]
        capacity = max_pages * page_size
    else:
        seq_max = T.dynamic("seq_max")
        cache_shape = [batch, seq_max, heads_kv, dim]
        grouped_shape = [batch, seq_max, heads_kv // hpb, width]
        max_pages = 1
        capacity = seq_max

    # Row i of a tile (first row ``first_row`` of its head group; with hpb > 1, head slot i // rows).
    def row(i, first_row):  # its row within its head's group: new token row // group
        return first_row + i if hpb == 1 else i % rows

    def q_head(i, first_row, kv_head):  # its query head
        if hpb == 1:
            return kv_head * group + (first_row + i) % group
        return (kv_head + i // rows) * group + i % rows % group

    def sink_head(i, first_row, kv_head):  # the same, for padding rows too (they repeat the last row)
        if hpb == 1:
            return kv_head * group + T.min(first_row + i, rows - 1) % group
        return q_head(i, first_row, kv_head)

    def stored(i, first_row):  # a real row, not padding
        return first_row + i < rows if hpb == 1 else i < hpb * rows

    def own_column(d):  # column d of acc_o as a column of its head
        return d if hpb == 1 else d % dim

    def cache_head(kv_head):  # the (grouped) cache's head index of K/V head kv_head
        return kv_head if hpb == 1 else kv_head // hpb

    def grouped(cache):  # hpb > 1: the cache read as [.., H_kv / hpb, hpb·D] (the same bytes)
        return cache if hpb == 1 else T.reshape(cache, grouped_shape)

    def stored_column(i, d, first_row):  # column d of acc_o belongs to row i's own head, and the row is real
        return stored(i, first_row) if hpb == 1 else T.And(i < hpb * rows, d // dim == i // rows)

    hint = None if kv_eviction is None or not tb.on_gpu else {"eviction_policy": EVICTION_POLICY_IDS[kv_eviction]}

    @T.macro
    def load_tile(Cache, BlockTable, tile, b, kv_head, kb):
        # region: load a key tile
        if paged:  # the page holding keys kb·block_N …, looked up in the block table (inline: no let
            # binding, which warp specialisation would leave behind in the consumer's branch); a page
            # number outside the pool is clamped into it (never a read outside the cache)
            T.copy(Cache[T.max(T.min(BlockTable[b, kb * block_N // page_size], num_pages - 1), 0),
                         kb * block_N % page_size:kb * block_N % page_size + block_N, cache_head(kv_head), :], tile,
                   annotations=hint)
        else:
            T.copy(Cache[b, kb * block_N:(kb + 1) * block_N, cache_head(kv_head), :], tile, annotations=hint)
        # endregion

    @T.macro
    def decode_block(Q, K, V, BlockTable, CacheSeqlens, Sinks, Out, Lse, bx, split, b, num_splits):
        Q_s = tb.shared([block_M, width], dtype)
        K_s = tb.shared([block_N, width], dtype)
        V_s = tb.shared([block_N, width], dtype)
        S = tb.fragment([block_M, block_N], ACCUM)
        P_s = tb.shared([block_M, block_N], dtype)  # the few rows' P goes to every warp of the PV gemm
        acc_o = tb.fragment([block_M, width], ACCUM)
        m = tb.fragment([block_M], ACCUM)
        m_prev = tb.fragment([block_M], ACCUM)
        shift = tb.fragment([block_M], ACCUM)
        alpha = tb.fragment([block_M], ACCUM)
        row_sum = tb.fragment([block_M], ACCUM)
        l = tb.fragment([block_M], ACCUM)  # noqa: E741
        if tb.on_gpu and min_blocks:
            T.annotate_min_blocks_per_sm(min_blocks)
            if warp_specialize:
                T.no_set_max_nreg()  # the consumers must not claim the registers the other blocks need

        # region: packed query tile
        kv_head = bx // row_tiles if hpb == 1 else bx * hpb  # the block's (first) K/V head
        first_row = bx % row_tiles * block_M  # row r of the group: new token r // group, head r % group
        p = with_lengths(p_model, seq_new, T.max(T.min(CacheSeqlens[b], capacity), 0))  # clamped: see above
        if hpb == 1:
            for i, d in tb.parallel(block_M, dim):
                r = T.min(first_row + i, rows - 1)  # padding rows repeat the last row; never stored
                Q_s[i, d] = Q[b, r // group, kv_head * group + r % group, d]
        else:  # block-diagonal: row i (head slot i // rows) keeps its query in its slot's D columns only
            for i, c in tb.parallel(block_M, width):
                Q_s[i, c] = T.if_then_else(i // rows == c // dim, Q[b, i % rows // group, (kv_head + c // dim) * group
                                                                    + i % rows % group, c % dim], T.cast(0, dtype))
        # endregion

        # region: this split's key blocks
        last_row = T.min(first_row + block_M, rows) - 1
        start, end = key_range_of_queries(p, first_row // group, last_row // group + 1, block_N)
        blocks = T.max(end - start, 0)
        # Splits differ by at most one key block (truncdiv: every term is ≥ 0, so no sign fix-ups).
        split_start = start + T.truncdiv(split * blocks, num_splits)
        split_tiles = start + T.truncdiv((split + 1) * blocks, num_splits) - split_start
        # endregion
        T.fill(acc_o, 0)
        T.fill(l, 0)
        if single:  # the sink counts in the running max from the start (one sink per row: its query head)
            for i in tb.parallel(block_M):
                m[i] = Sinks[sink_head(i, first_row, kv_head)] * (1.0 / p.sm_scale)
        else:
            T.fill(m, NEG_INF)

        for t in T.Pipelined(split_tiles, num_stages=num_stages):
            kb = split_start + t
            load_tile(K, BlockTable, K_s, b, kv_head, kb)
            T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            for i, j in tb.parallel(block_M, block_N):  # every tile: a decoding tile is mostly boundary
                S[i, j] = T.if_then_else(visible(p, row(i, first_row) // group, kb * block_N + j), S[i, j], NEG_INF)
            online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
            T.copy(S, P_s)
            for i, d in tb.parallel(block_M, width):
                acc_o[i, d] *= alpha[i]
            load_tile(V, BlockTable, V_s, b, kv_head, kb)
            zero_rows_past_end(tb, V_s, kb * block_N, p.seq_k, block_N, width)  # never-written cache slots
            T.gemm(P_s, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

        if single:
            # region: final result
            for i in tb.parallel(block_M):  # add each row's sink (≤ 1 against m, which includes it)
                shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] * p.scale_log2)
                l[i] += T.exp2(Sinks[sink_head(i, first_row, kv_head)] * LOG2E - shift[i])
            for i, d in tb.parallel(block_M, width):
                acc_o[i, d] = T.if_then_else(l[i] == 0, 0, acc_o[i, d] / l[i])
            for i, d in tb.parallel(block_M, width):
                if stored_column(i, d, first_row):
                    Out[b, row(i, first_row) // group, q_head(i, first_row, kv_head), own_column(d)] = \
                        T.cast(acc_o[i, d], dtype)
            for i in tb.parallel(block_M):
                if stored(i, first_row):
                    Lse[b, q_head(i, first_row, kv_head), row(i, first_row) // group] = natural_lse(l[i], shift[i])
            # endregion
        else:
            # region: partial result
            normalise_rows(tb, p, acc_o, l, m, shift, None, 0, block_M, width, False)  # the sink joins in the merge
            for i, d in tb.parallel(block_M, width):  # row r: new token r // group, query head of the group r % group
                if stored_column(i, d, first_row):
                    Out[b, row(i, first_row) // group, q_head(i, first_row, kv_head), split, own_column(d)] = \
                        acc_o[i, d]
            for i in tb.parallel(block_M):
                if stored(i, first_row):
                    Lse[b, row(i, first_row) // group, q_head(i, first_row, kv_head), split] = \
                        natural_lse(l[i], shift[i])
            # endregion

    if single:
        @T.prim_func
        def flash_decode_single(
            Q: T.Tensor([batch, seq_new, heads, dim], dtype),
            K: T.Tensor(cache_shape, dtype),
            V: T.Tensor(cache_shape, dtype),
            BlockTable: T.Tensor([batch, max_pages], "int32"),
            CacheSeqlens: T.Tensor([batch], "int32"),
            Sinks: T.Tensor([heads], ACCUM),
            Output: T.Tensor([batch, seq_new, heads, dim], dtype),
            LSE: T.Tensor([batch, heads, seq_new], ACCUM),
        ):
            with tb.kernel(heads_kv // hpb * row_tiles, batch, threads=threads) as (bx, b):
                decode_block(Q, grouped(K), grouped(V), BlockTable, CacheSeqlens, Sinks, Output, LSE, bx, 0, b, 1)

        return flash_decode_single

    @T.prim_func
    def flash_decode_split(
        Q: T.Tensor([batch, seq_new, heads, dim], dtype),
        K: T.Tensor(cache_shape, dtype),
        V: T.Tensor(cache_shape, dtype),
        BlockTable: T.Tensor([batch, max_pages], "int32"),
        CacheSeqlens: T.Tensor([batch], "int32"),
        O_part: T.Tensor([batch, seq_new, heads, splits, dim], ACCUM),
        LSE_part: T.Tensor([batch, seq_new, heads, splits], ACCUM),
    ):
        # K/V head fastest: the blocks that run together read neighbouring slices of the same cache rows.
        with tb.kernel(heads_kv // hpb * row_tiles, splits, batch, threads=threads) as (bx, split, b):
            decode_block(Q, grouped(K), grouped(V), BlockTable, CacheSeqlens, None, O_part, LSE_part, bx, split, b,
                         splits)

    return flash_decode_split


def flash_decode_merge_kernel(heads, dim, seq_new, *, dtype="float16", threads=None, target=None):
    """Return the merge kernel: O [B, S_new, H, D] (``dtype``) and the natural-log LSE [B, H, S_new].

    Combines the partial states of every split, and the sink (logit ``Sinks[h]``; -inf for none):
    LSE = log(e^{sink} + Σ_s e^{LSE_s}), O = Σ_s e^{LSE_s − LSE} · O_s. A row that saw no key and has
    no sink gets O = 0 and LSE = -inf.
    """
    tb = TileBackend(target)
    threads = dim if threads is None else threads
    batch, splits = T.dynamic("batch, num_splits")

    @T.prim_func
    def flash_decode_merge(
        O_part: T.Tensor([batch, seq_new, heads, splits, dim], ACCUM),
        LSE_part: T.Tensor([batch, seq_new, heads, splits], ACCUM),
        Sinks: T.Tensor([heads], ACCUM),
        Output: T.Tensor([batch, seq_new, heads, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_new], ACCUM),
    ):
        with tb.kernel(heads, seq_new, batch, threads=threads) as (h, s, b):
            # Per-row scalars: every thread keeps its own copy (no communication needed).
            shift = T.alloc_local([1], ACCUM)  # max over the states, in exp2 units (0 while it is -inf)
            l = T.alloc_local([1], ACCUM)  # noqa: E741
            lse2 = T.alloc_local([1], ACCUM)
            weight = T.alloc_local([1], ACCUM)
            acc = tb.fragment([dim], ACCUM)

            # region: merge
            shift[0] = Sinks[h] * LOG2E
            for split in T.serial(splits):
                shift[0] = T.max(shift[0], LSE_part[b, s, h, split] * LOG2E)
            shift[0] = T.if_then_else(shift[0] == NEG_INF, 0, shift[0])
            l[0] = T.exp2(Sinks[h] * LOG2E - shift[0])  # the sink: a state with LSE = its logit and O = 0
            for split in T.serial(splits):
                l[0] += T.exp2(LSE_part[b, s, h, split] * LOG2E - shift[0])
            lse2[0] = shift[0] + T.log2(l[0])
            T.fill(acc, 0)
            for split in T.serial(splits):
                weight[0] = T.if_then_else(l[0] == 0, 0, T.exp2(LSE_part[b, s, h, split] * LOG2E - lse2[0]))
                for d in tb.parallel(dim):
                    acc[d] += weight[0] * O_part[b, s, h, split, d]
            # endregion
            for d in tb.parallel(dim):
                Output[b, s, h, d] = T.cast(acc[d], dtype)
            LSE[b, h, s] = natural_lse(l[0], shift[0])

    return flash_decode_merge


def blocks_per_sm(config, dim, dtype_bytes=2, smem_per_sm=228 * 1024):
    """How many split-kernel blocks fit on one SM by shared memory (Q tile + K/V stages)."""
    width = config.kv_heads_per_block * dim
    smem = (config.block_M * width + 2 * config.num_stages * config.block_N * width) * dtype_bytes
    return max(1, min(8, smem_per_sm // (smem + 1024)))


def choose_num_splits(batch, heads_kv, capacity, *, num_sms, config, row_tiles=1, max_splits=MAX_SPLITS,
                      min_blocks_per_split=None, one_split_tiles=ONE_SPLIT_TILES):
    """How many splits one decoding step uses, from (B, H_kv, cache capacity) and the GPU's SMs.

    Without splitting there are B·H_kv·row_tiles thread blocks (B·H_kv / ``kv_heads_per_block``). When there
    are as many as SMs already, splitting only adds merge work: 1 split, and one kernel (no merge launch).
    A cache of at most ``one_split_tiles`` key tiles is read by one kernel too: the merge's launch costs
    more than a block takes to stream that many tiles. Otherwise use as many splits as give every SM one
    block, but give every split at least ``min_blocks_per_split`` key tiles (default: ``num_stages + 1``,
    so its pipeline fills; a split shorter than that is a launch and a merge for a few loads).

    One block per SM, although two fit (``blocks_per_sm``): measured on the H100 (2026-11-26, gpt-oss
    heads, 32k and 128k keys, D 64 and 128, contiguous and paged; one K/V head per block), B = 8 read 1–3% faster
    with 2 splits (128 blocks) than with 4 (256, a full wave of two per SM), and B = 1 as fast with 16 splits as
    with 33;
    fewer splits also mean fewer partials for the merge to read.
    """
    if min_blocks_per_split is None:
        min_blocks_per_split = config.num_stages + 1
    blocks = batch * (heads_kv // config.kv_heads_per_block) * row_tiles
    key_blocks = math.ceil(capacity / config.block_N)
    if key_blocks <= one_split_tiles:
        return 1
    splits = num_sms // blocks
    return int(max(1, min(splits, max_splits, key_blocks // min_blocks_per_split)))
