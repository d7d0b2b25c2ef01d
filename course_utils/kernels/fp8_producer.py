"""The FP8 forward's producer step on the GPU (chapter 12): quantise Q and K per tile, and V transposed, in two passes.

In PyTorch the producer step is a chain of elementwise kernels (upcast, pad, |x|, block max, divide, cast,
transpose, pad), each reading and writing the whole tensor: at S = 4k it took longer than the attention kernel
itself. These two kernels read each input once (V twice: its descale needs the whole head before any value) and
write its e4m3 values once:

- ``quantise_inputs_kernel``: one launch, one block per ``block`` rows of one (batch, head) of Q, of K and of V.
  A Q or K block's largest magnitude gives its descale (largest / 448, and 1 for a block of zeros); every value is
  divided by it and rounded to e4m3. A V block only adds its largest magnitude to its head's, by an atomic max.
  A block holding a NaN or an infinity counts as infinitely large: its descale (or its head's) is infinite, so the
  caller's check of the descales refuses it.
- ``quantise_transposed_kernel``: V with its head's descale (from that largest magnitude), written key-major
  ([B, H, D, S_k padded]), the layout FP8 ``wgmma`` reads, its keys in ``wgmma_key_slot`` order within each group
  of 16 (the order of P's columns in the kernel's registers); padded keys are 0.

They are compiled without fast math: the divisions are IEEE's, and e4m3 conversion rounds to nearest even, so the
values and descales equal those of ``api.fp8.quantise_blocks`` and ``quantise_tensor`` on the CPU bit for bit
(PyTorch on a GPU divides by a scalar through its reciprocal, which can differ in the last bit).
"""

from dataclasses import dataclass

import tilelang.language as T

from .flash_fwd_fp8 import E4M3_MAX, FP8_DTYPE, WGMMA_KEY_GROUP, wgmma_key_slot

__all__ = ["quantise_inputs_kernel", "quantise_transposed_kernel"]


@dataclass
class _TileBuffers:
    """One block's buffers: a Q or K tile as loaded and in float32, its non-finite flags, and its reductions."""
    x_in: object
    x: object
    not_finite: object
    row_max: object
    row_not_finite: object
    tile_max: object
    tile_not_finite: object
    largest: object
    descale: object


def _tile_of(index, heads, blocks):
    """(batch, head, row block) of the ``index``-th tile of a tensor with ``heads`` heads of ``blocks`` blocks."""
    return index // (heads * blocks), index // blocks % heads, index % blocks


def _descale(largest):
    """largest / 448, and 1 for a block of zeros (any scale represents it): ``api.fp8._descale_of``'s rule."""
    return T.if_then_else(largest == 0, T.float32(1), largest / T.float32(E4M3_MAX))


def quantise_inputs_kernel(batch, heads, heads_kv, seq_q, seq_k, dim, *, block=128, dtype="bfloat16", v_dtype=None,
                           threads=256):
    """``(Q [B, H, S_q, D], K, V [B, H_kv, S_k, D], V_largest [B, H_kv] int32, zeroed) -> (Q's values e4m3,
    Q's descales [B, H, ⌈S_q/block⌉] float32, K's values, K's descales)``; V_largest gets each V head's largest
    magnitude as float32 bits (non-negative floats order as their bits do, so an integer atomic max is theirs).
    Q and K are in ``dtype``, V in ``v_dtype`` (default ``dtype``: they differ when Q and K were rotated in float32)."""
    v_dtype = v_dtype or dtype
    q_blocks, k_blocks = -(-seq_q // block), -(-seq_k // block)
    q_tiles, k_tiles = batch * heads * q_blocks, batch * heads_kv * k_blocks

    @T.macro
    def largest_magnitude(X, x_in, b, h, r, seq, tile):
        """The block's largest magnitude in ``tile.largest[0]``, infinite if it holds a NaN or an infinity; its
        values (zero past ``seq``) in ``tile.x``. ``x_in``: a fragment in ``X``'s dtype."""
        T.copy(X[b, h, r * block:(r + 1) * block, :], x_in)  # one copy: 16-byte loads
        for i, d in T.Parallel(block, dim):
            tile.x[i, d] = T.if_then_else(r * block + i < seq, T.cast(x_in[i, d], "float32"), 0)
            # Counted apart: the max below would skip a NaN (and TVM folds x - x to 0, so no NaN arithmetic).
            tile.not_finite[i, d] = T.if_then_else(T.isfinite(tile.x[i, d]), T.float32(0), T.float32(1))
        T.reduce_absmax(tile.x, tile.row_max, dim=1)
        T.reduce_sum(tile.not_finite, tile.row_not_finite, dim=1)
        T.reduce_max(tile.row_max, tile.tile_max, dim=0)
        T.reduce_sum(tile.row_not_finite, tile.tile_not_finite, dim=0)
        tile.largest[0] = T.if_then_else(tile.tile_not_finite[0] > 0, T.infinity("float32"), tile.tile_max[0])

    @T.macro
    def quantise(X, Values, Descale, b, h, r, seq, tile):
        largest_magnitude(X, tile.x_in, b, h, r, seq, tile)
        tile.descale[0] = _descale(tile.largest[0])
        Descale[b, h, r] = tile.descale[0]
        for i, d in T.Parallel(block, dim):
            if r * block + i < seq:
                Values[b, h, r * block + i, d] = T.cast(tile.x[i, d] / tile.descale[0], FP8_DTYPE)

    @T.prim_func
    def quantise_inputs(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, heads_kv, seq_k, dim], v_dtype),
        VLargest: T.Tensor([batch, heads_kv], "int32"),
        QValues: T.Tensor([batch, heads, seq_q, dim], FP8_DTYPE),
        QDescale: T.Tensor([batch, heads, q_blocks], "float32"),
        KValues: T.Tensor([batch, heads_kv, seq_k, dim], FP8_DTYPE),
        KDescale: T.Tensor([batch, heads_kv, k_blocks], "float32"),
    ):
        with T.Kernel(q_tiles + 2 * k_tiles, threads=threads) as bx:
            # Three resident blocks per SM (80 registers a thread, no spills): more loads in flight, 96 -> 81 us at
            # B·S = 16k, H = 16, D = 128 on an H200 (figures/fp8_producer_occupancy_h200.json; 4 spill, 512 threads
            # gain less, and V's kernel gains nothing from it).
            T.annotate_min_blocks_per_sm(3)
            tile = _TileBuffers(
                x_in=T.alloc_fragment([block, dim], dtype), x=T.alloc_fragment([block, dim], "float32"),
                not_finite=T.alloc_fragment([block, dim], "float32"), row_max=T.alloc_fragment([block], "float32"),
                row_not_finite=T.alloc_fragment([block], "float32"), tile_max=T.alloc_fragment([1], "float32"),
                tile_not_finite=T.alloc_fragment([1], "float32"), largest=T.alloc_local([1], "float32"),
                descale=T.alloc_local([1], "float32"))
            if bx < q_tiles:
                quantise(Q, QValues, QDescale, *_tile_of(bx, heads, q_blocks), seq_q, tile)
            elif bx < q_tiles + k_tiles:
                quantise(K, KValues, KDescale, *_tile_of(bx - q_tiles, heads_kv, k_blocks), seq_k, tile)
            else:
                b, h, r = _tile_of(bx - q_tiles - k_tiles, heads_kv, k_blocks)
                largest_magnitude(V, T.alloc_fragment([block, dim], v_dtype), b, h, r, seq_k, tile)
                if T.get_thread_binding() == 0:  # every thread holds the block's largest: one atomic a block
                    T.atomic_max(VLargest[b, h], T.reinterpret("int32", tile.largest[0]))

    return quantise_inputs


def quantise_transposed_kernel(batch, heads, seq, dim, padded_seq, *, block=128, dtype="bfloat16", threads=256):
    """``(X [B, H, S, D], largest [B, H] int32: float32 bits) -> (values [B, H, D, padded_seq] e4m3, descale [B, H]
    float32)``, keys ≥ S zero, key j at ``wgmma_key_slot(j)``."""
    assert block % WGMMA_KEY_GROUP == 0 and padded_seq % WGMMA_KEY_GROUP == 0, "the slots permute groups of 16 keys"
    blocks = -(-padded_seq // block)

    @T.prim_func
    def quantise_transposed(
        X: T.Tensor([batch, heads, seq, dim], dtype),
        Largest: T.Tensor([batch, heads], "int32"),
        Values: T.Tensor([batch, heads, dim, padded_seq], FP8_DTYPE),
        Descale: T.Tensor([batch, heads], "float32"),
    ):
        with T.Kernel(blocks, heads, batch, threads=threads) as (bx, by, bz):
            x_in = T.alloc_fragment([block, dim], dtype)
            # A row of dim + 2 16-bit values (an odd number of 4-byte words): the transposed reads hit 32 banks.
            x_s = T.alloc_shared([block, dim + 2], dtype)
            values_s = T.alloc_shared([dim, block], FP8_DTYPE)
            descale = T.alloc_local([1], "float32")
            descale[0] = _descale(T.reinterpret("float32", Largest[bz, by]))
            if bx == 0:
                Descale[bz, by] = descale[0]
            T.copy(X[bz, by, bx * block:(bx + 1) * block, :], x_in)  # one copy: 16-byte loads
            for i, d in T.Parallel(block, dim):
                x_s[i, d] = T.if_then_else(bx * block + i < seq, x_in[i, d], T.cast(0, dtype))
            for d, i in T.Parallel(dim, block):
                values_s[d, wgmma_key_slot(i)] = T.cast(T.cast(x_s[i, d], "float32") / descale[0], FP8_DTYPE)
            T.copy(values_s, Values[bz, by, :, bx * block:(bx + 1) * block])  # whole rows of keys: 16-byte stores

    return quantise_transposed
