"""The FP8 forward's producer step on the GPU (chapter 12): quantise Q and K per tile, and V transposed, in one pass.

In PyTorch the producer step is a chain of elementwise kernels (upcast, pad, |x|, block max, divide, cast,
transpose, pad), each reading and writing the whole tensor: at S = 4k it took longer than the attention kernel
itself. These two kernels read each input once and write its e4m3 values once:

- ``quantise_rows_kernel``: one block per ``block`` rows of one (batch, head); the block's largest magnitude
  gives its descale (largest / 448, and 1 for a block of zeros), every value is divided by it and rounded to
  e4m3. A block holding a NaN or an infinity gets an infinite descale, so the caller's check of the descales refuses it.
- ``quantise_transposed_kernel``: V with the per-(batch, head) descale it is given, written key-major
  ([B, H, D, S_k padded]), the layout FP8 ``wgmma`` reads, its keys in ``wgmma_key_slot`` order within each group
  of 16 (the order of P's columns in the kernel's registers); padded keys are 0.

They are compiled without fast math: the divisions are IEEE's, and e4m3 conversion rounds to nearest even, so the
values and descales equal those of ``api.fp8.quantise_blocks`` and ``quantise_tensor`` on the CPU bit for bit
(PyTorch on a GPU divides by a scalar through its reciprocal, which can differ in the last bit).
"""

import tilelang.language as T

from .flash_fwd_fp8 import E4M3_MAX, FP8_DTYPE, WGMMA_KEY_GROUP, wgmma_key_slot

__all__ = ["quantise_rows_kernel", "quantise_transposed_kernel"]


def quantise_rows_kernel(batch, heads, seq, dim, *, block=128, dtype="bfloat16", threads=256):
    """``(X [B, H, S, D]) -> (values [B, H, S, D] e4m3, descale [B, H, ⌈S/block⌉] float32)``."""
    blocks = -(-seq // block)

    @T.prim_func
    def quantise_rows(
        X: T.Tensor([batch, heads, seq, dim], dtype),
        Values: T.Tensor([batch, heads, seq, dim], FP8_DTYPE),
        Descale: T.Tensor([batch, heads, blocks], "float32"),
    ):
        with T.Kernel(blocks, heads, batch, threads=threads) as (bx, by, bz):
            x_in = T.alloc_fragment([block, dim], dtype)
            x = T.alloc_fragment([block, dim], "float32")
            not_finite = T.alloc_fragment([block, dim], "float32")
            row_max = T.alloc_fragment([block], "float32")
            row_not_finite = T.alloc_fragment([block], "float32")
            tile_max = T.alloc_fragment([1], "float32")
            tile_not_finite = T.alloc_fragment([1], "float32")
            descale = T.alloc_local([1], "float32")
            T.copy(X[bz, by, bx * block:(bx + 1) * block, :], x_in)  # one copy: 16-byte loads
            for i, d in T.Parallel(block, dim):
                x[i, d] = T.if_then_else(bx * block + i < seq, T.cast(x_in[i, d], "float32"), 0)
                # Counted apart: the max below would skip a NaN (and TVM folds x - x to 0, so no NaN arithmetic).
                not_finite[i, d] = T.if_then_else(T.isfinite(x[i, d]), T.float32(0), T.float32(1))
            T.reduce_absmax(x, row_max, dim=1)
            T.reduce_sum(not_finite, row_not_finite, dim=1)
            T.reduce_max(row_max, tile_max, dim=0)
            T.reduce_sum(row_not_finite, tile_not_finite, dim=0)
            descale[0] = T.if_then_else(tile_max[0] == 0, T.float32(1), tile_max[0] / T.float32(E4M3_MAX))
            if tile_not_finite[0] > 0:
                descale[0] = T.infinity("float32")
            Descale[bz, by, bx] = descale[0]
            for i, d in T.Parallel(block, dim):
                if bx * block + i < seq:
                    Values[bz, by, bx * block + i, d] = T.cast(x[i, d] / descale[0], FP8_DTYPE)

    return quantise_rows


def quantise_transposed_kernel(batch, heads, seq, dim, padded_seq, *, block=128, dtype="bfloat16", threads=256):
    """``(X [B, H, S, D], descale [B, H] float32) -> values [B, H, D, padded_seq] e4m3``, keys ≥ S zero, key j at
    ``wgmma_key_slot(j)``."""
    assert block % WGMMA_KEY_GROUP == 0 and padded_seq % WGMMA_KEY_GROUP == 0, "the slots permute groups of 16 keys"
    blocks = -(-padded_seq // block)

    @T.prim_func
    def quantise_transposed(
        X: T.Tensor([batch, heads, seq, dim], dtype),
        Descale: T.Tensor([batch, heads], "float32"),
        Values: T.Tensor([batch, heads, dim, padded_seq], FP8_DTYPE),
    ):
        with T.Kernel(blocks, heads, batch, threads=threads) as (bx, by, bz):
            x_in = T.alloc_fragment([block, dim], dtype)
            # A row of dim + 2 16-bit values (an odd number of 4-byte words): the transposed reads hit 32 banks.
            x_s = T.alloc_shared([block, dim + 2], dtype)
            values_s = T.alloc_shared([dim, block], FP8_DTYPE)
            T.copy(X[bz, by, bx * block:(bx + 1) * block, :], x_in)  # one copy: 16-byte loads
            for i, d in T.Parallel(block, dim):
                x_s[i, d] = T.if_then_else(bx * block + i < seq, x_in[i, d], T.cast(0, dtype))
            for d, i in T.Parallel(dim, block):
                values_s[d, wgmma_key_slot(i)] = T.cast(T.cast(x_s[i, d], "float32") / Descale[bz, by], FP8_DTYPE)
            T.copy(values_s, Values[bz, by, :, bx * block:(bx + 1) * block])  # whole rows of keys: 16-byte stores

    return quantise_transposed
