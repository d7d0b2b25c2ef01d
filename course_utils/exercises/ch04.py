"""Checkers for the exercises of chapter 04 (pipelining, swizzled layouts and tuning)."""

import torch

from ..pictures import banks, layouts
from .common import ExerciseWrong, check_exercise

__all__ = ["check_bank_of", "check_swizzle"]


# --- Exercise 1: which bank serves a byte address ---------------------------------------------------

_ADDRESS_CASES = [(0,), (3,), (4,), (127,), (128,), (132,), (256 + 20,), (16384 + 64 * 4 + 2,), (4095,)]


def check_bank_of(fn):
    """Check ``fn(byte_address) -> bank`` against 32 banks of 4 bytes."""
    hint = ("Successive 4-byte words go to successive banks, and there are 32 of them: "
            "divide the byte address by 4 (rounding down), then take the remainder modulo 32.")
    check_exercise("bank_of", lambda a: torch.tensor(int(fn(a))), lambda a: torch.tensor(banks.bank_of(a)),
                   _ADDRESS_CASES, atol=0, rtol=0, hint=hint)


# --- Exercise 2: the 128-byte XOR swizzle, written by hand -----------------------------------------

def _tilelang_swizzle_offsets(rows, cols):
    from tilelang.layout import make_swizzled_layout

    return layouts.layout_offsets(make_swizzled_layout(layouts.shared_tile((rows, cols), "float16")))


def check_swizzle(fn, rows=64, cols=64):
    """Check ``fn(i, j) -> element offset`` for a [rows x 64] fp16 tile against TileLang's swizzled layout.

    Then count the wavefronts of one ldmatrix phase (rows 0-7, one 16-byte chunk) in the learner's layout.
    """
    def learner(r, c):
        return torch.tensor([[int(fn(i, j)) for j in range(c)] for i in range(r)])

    def reference(r, c):
        return torch.from_numpy(_tilelang_swizzle_offsets(r, c))

    hint = ("Keep the row-major position of 16-byte chunks inside each 8-row group, but XOR the chunk "
            "index (j // 8) with the row inside the group (i % 8); the element's position in its chunk "
            "(j % 8) does not change. One row is 64 elements, a group of 8 rows 512.")
    check_exercise("swizzled_offset", learner, reference, [(rows, cols), (16, 64)], atol=0, rtol=0, hint=hint)
    offsets = learner(rows, cols).numpy()
    if sorted(offsets.ravel().tolist()) != list(range(rows * cols)):
        raise ExerciseWrong("swizzled_offset: two elements share an offset")
    for chunk in range(cols // 8):
        addrs = [int(offsets[i, chunk * 8]) * 2 for i in range(8)]
        if banks.wavefronts(addrs, 16) != 1:
            raise ExerciseWrong(f"swizzled_offset: an ldmatrix phase on chunk {chunk} still conflicts")
    print("  and every ldmatrix phase (8 rows x 16 B) of your layout takes 1 wavefront.")
