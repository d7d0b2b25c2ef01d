"""Checkers for the exercises of chapter 04 (pipelining, swizzled layouts and tuning).

The kernel exercise (c) is checked three ways: the learner's pipelined GEMM loop runs on TileLang's C
backend against the float64 product, on shapes drawn by ``shapes.draw_gemm_shapes`` (three different block
sizes, each of M, N, K ragged), and a wrong product is matched against models of a size counted with the wrong
block; it is lowered for sm_80 (no GPU needed) and the generated code
and TileLang's inferred layouts say how many buffers each tile got, whether the copies are
asynchronous (cp.async) and how many wavefronts an ``ldmatrix`` needs in each shared tile (the bank
model of ``course_utils.pictures.banks``); and it must lower for sm_90a too, where wgmma accepts only swizzled
operand tiles.
"""

import contextlib
import io
import re

import torch

from ..pictures import banks, layouts
from .common import ExerciseWrong, check_exercise
from .kernels import KernelCase, Suspect, build, check_kernel, same_outputs
from .late_tools import c_lowering, surfacing_warnings
from .shapes import draw_gemm_shapes

__all__ = ["check_bank_of", "check_swizzle", "check_pipelined_gemm", "HINTS"]

HINTS = {
    "a": ["Successive 4-byte words go to successive banks, and there are 32 of them.",
          "Python's // (integer division) tells which 4-byte word a byte is in; % wraps a count around a cycle "
          "of the length you give it."],
    "b": ["Keep each 16-byte chunk (8 fp16) whole and in its row's 128-byte line, but move chunk c of row r "
          "to position c XOR (r mod 8).",
          "Python's ^ is XOR. Build the offset from four parts: the 8-row group (512 elements each), the row in "
          "it (64 each), the chunk's position after the XOR (8 each), and the element's place in its chunk."],
    "c": ["Two buffers per tile let the copy of tile ko + 1 run while the gemm reads tile ko; a swizzled shared "
          "layout lets ldmatrix read 8 rows of a 16-byte column without bank conflicts. Layouts exist only "
          "on the GPU (tb.on_gpu).",
          "T.annotate_layout takes a dict from each shared tile to its layout (make_swizzled_layout(tile)), only "
          "when tb.on_gpu; T.Pipelined(number of K tiles, num_stages=...) is the K loop whose copies run ahead; in "
          "it, T.copy each operand's tile at column ko · block_K, then T.gemm with transpose_B=True (C = A Bᵀ)."],
}


# --- Exercise (a): which bank serves a byte address ---------------------------------------------------

_ADDRESS_CASES = [(0,), (3,), (4,), (127,), (128,), (132,), (256 + 20,), (16384 + 64 * 4 + 2,), (4095,)]


def check_bank_of(fn):
    """Check ``fn(byte_address) -> bank`` against 32 banks of 4 bytes."""
    hint = ("Successive 4-byte words go to successive banks, and there are 32 of them: "
            "divide the byte address by 4 (rounding down), then take the remainder modulo 32.")
    check_exercise("bank_of", lambda a: torch.tensor(int(fn(a))), lambda a: torch.tensor(banks.bank_of(a)),
                   _ADDRESS_CASES, atol=0, rtol=0, hint=hint)


# --- Exercise (b): the 128-byte XOR swizzle, written by hand -----------------------------------------

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


# --- Exercise (c): a pipelined, swizzled GEMM loop, in TileLang --------------------------------------

_GPU_SHAPE = (256, 256, 1024)  # M, N, K of the lowered kernel: 16 K tiles of 64


def _gemm_model(a, b, shape, *, a_rows="M", b_rows="N", a_cols="K", b_cols="K", count="K", floor=False,
                swapped=False):
    """C = A Bᵀ in float64 as the learner's K loop computes it, tile by tile, with one bug: the block size that
    steps A's rows, B's rows, A's or B's K columns, or counts the K tiles (``"M"``, ``"N"``, ``"K"``); the K
    tiles counted rounding down (``floor``); or the block indices bx and by swapped. A tile read past the end of
    A or B holds zeros, as TileLang's guarded copy leaves it."""
    block = {"M": shape.block_M, "N": shape.block_N, "K": shape.block_K}
    M, N, K = shape.M, shape.N, shape.K

    def tile(x, row, col, rows, cols):
        out = torch.zeros(rows, cols, dtype=torch.float64)
        part = x[max(row, 0):row + rows, max(col, 0):col + cols].double()
        out[:part.shape[0], :part.shape[1]] = part
        return out

    c = torch.zeros(M, N, dtype=torch.float64)
    tiles = K // block[count] if floor else -(-K // block[count])
    for by in range(-(-M // shape.block_M)):
        for bx in range(-(-N // shape.block_N)):
            ra, rb = (bx, by) if swapped else (by, bx)
            acc = torch.zeros(shape.block_M, shape.block_N, dtype=torch.float64)
            for ko in range(tiles):
                acc += tile(a, ra * block[a_rows], ko * block[a_cols], shape.block_M, shape.block_K) \
                    @ tile(b, rb * block[b_rows], ko * block[b_cols], shape.block_N, shape.block_K).T
            out = c[by * shape.block_M:(by + 1) * shape.block_M, bx * shape.block_N:(bx + 1) * shape.block_N]
            out[:] = acc[:out.shape[0], :out.shape[1]]
    return c


def _gemm_cases():
    """The drawn shapes (``shapes.draw_gemm_shapes``): three different block sizes, block_M < and > block_N, each
    of M, N and K ragged and past one block, and block_K the smallest once (equal 64 × 64 × 64 tiles hid a size
    counted with the wrong block)."""
    cases = []
    for index, shape in enumerate(draw_gemm_shapes(seed=4)):
        g = torch.Generator().manual_seed(40 + index)
        a, b = torch.randn(shape.M, shape.K, generator=g), torch.randn(shape.N, shape.K, generator=g)
        cases.append(KernelCase(f"{shape.label()} (float32, C backend)", (shape.M, shape.N, shape.K),
                                dict(block_M=shape.block_M, block_N=shape.block_N, block_K=shape.block_K,
                                     dtype="float32"), [2], lambda kernel, a=a, b=b: {"C": kernel(a, b)},
                                {"C": a.double() @ b.double().T}, data=dict(a=a, b=b, shape=shape)))
    return cases


def _gemm_suspect(message, **bug):
    def test(case, got, kernel):
        return same_outputs(got, {"C": _gemm_model(case.data["a"], case.data["b"], case.data["shape"], **bug)})
    return Suspect(message, test)


_OWN = "Count each tile with its own block size (equal tiles hide the slip)."
_GEMM_SUSPECTS = [
    _gemm_suspect(f"A's rows are counted with block_N: row block by starts at by · block_M. {_OWN}", a_rows="N"),
    _gemm_suspect(f"A's rows are counted with block_K: row block by starts at by · block_M. {_OWN}", a_rows="K"),
    _gemm_suspect(f"B's rows are counted with block_M: column block bx of C reads B from bx · block_N. {_OWN}",
                  b_rows="M"),
    _gemm_suspect(f"B's rows are counted with block_K: column block bx of C reads B from bx · block_N. {_OWN}",
                  b_rows="K"),
    *(_gemm_suspect(f"{operand}'s K columns are stepped with block_{size}: tile ko starts at column ko · block_K. "
                    f"{_OWN}", **{f"{operand.lower()}_cols": size}) for operand in "AB" for size in "MN"),
    *(_gemm_suspect(f"the K loop counts its tiles in block_{size}: T.ceildiv(K, block_K) tiles of block_K. {_OWN}",
                    count=size) for size in "MN"),
    _gemm_suspect("the K loop rounds its tile count down (K // block_K): the last, partial K tile is never added. "
                  "Use T.ceildiv(K, block_K).", floor=True),
    _gemm_suspect("bx and by are swapped: by walks the row blocks of C (and of A), bx its column blocks (and B's "
                  "rows).", swapped=True),
]


def _buffers(layout):
    offsets = layouts.layout_offsets(layout)
    return offsets if offsets.ndim == 3 else offsets[None]


def _lower(name, factory, arch):
    prim_func = build(name, factory, *_GPU_SHAPE, target="cuda")
    try:
        return layouts.lower_with_layouts(prim_func, arch)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = next((line for line in lines if "layout" in line.lower()), lines[-1] if lines else type(exc).__name__)
        raise ExerciseWrong(f"✗ {name}: your kernel does not lower for {arch}: {why[:200]}") from None


def check_pipelined_gemm(factory):
    """Run the learner's ``pipelined_gemm(M, N, K, ..., target=...)`` on the C backend, then lower it for
    sm_80 and sm_90a and read the stages, the copies and the bank conflicts from the generated code."""
    surfacing_warnings(lambda: _check_pipelined_gemm(factory), c_lowering(factory, 96, 80, 160, dtype="float32"))


def _check_pipelined_gemm(factory):
    name = "pipelined GEMM loop"
    with contextlib.redirect_stdout(io.StringIO()):  # one ✓ at the end, after the GPU checks too
        check_kernel(name, factory, _gemm_cases, suspects=_GEMM_SUSPECTS,
                     hint="Hint: copy row block by of A and column block bx of B at column ko · block_K, and "
                          "multiply with transpose_B=True (C = A Bᵀ).")
    ampere = _lower(name, factory, "sm_80")
    if "cp_async" not in ampere.source:
        raise ExerciseWrong(f"✗ {name}: the sm_80 code has no cp.async: every copy is a plain load and store "
                            "that the gemm waits for. Make the K loop a T.Pipelined(..., num_stages=2): only a "
                            "pipelined loop gets asynchronous copies.")
    tiles = {buf: _buffers(ampere.layouts[buf]) for buf in ("A_s", "B_s") if buf in ampere.layouts}
    stages = {buf: offsets.shape[0] for buf, offsets in tiles.items()}
    waits = sorted({int(n) for n in re.findall(r"cp_async_wait<(\d+)>", ampere.source)})
    if set(stages.values()) != {2}:
        count = max(stages.values())
        why = ("cp_async_wait<0> right after each copy is issued: the loop waits for the tile it is about to use, "
               "so nothing is in flight while the gemm runs" if count == 1 else
               f"{count} buffers per tile cost {ampere.shared_bytes // 1024} KB of shared memory; the chapter's "
               "model and the H100 sweep show a copy is hidden once one tile is in flight behind the gemm")
        raise ExerciseWrong(f"✗ {name}: {count} buffer(s) per shared tile (num_stages={count}): {why}. "
                            "Use num_stages=2.")
    report = []
    for buf, offsets in tiles.items():
        table = banks.conflict_table({"yours": offsets[0]}, banks.warp_access_patterns(offsets.shape[-1]))
        ldmatrix = next(row for row in table if row["pattern"].startswith("ldmatrix"))
        if ldmatrix["yours"] > ldmatrix["ideal"]:
            raise ExerciseWrong(f"✗ {name}: in {buf}, one ldmatrix.x4 needs {ldmatrix['yours']} wavefronts instead "
                                f"of {ldmatrix['ideal']} ({ldmatrix['yours'] // ldmatrix['ideal']}-way bank "
                                f"conflicts): its rows are {offsets.shape[-1] * 2} bytes, a multiple of 128, so a "
                                "row-major column of 8 rows sits in one group of 4 banks. Annotate it with "
                                "make_swizzled_layout.")
        report.append(f"{buf} {ldmatrix['yours']}")
    _lower(name, factory, "sm_90a")
    print(f"✓ {name}: right on the C backend (drawn shapes: M, N, K ragged, three different block sizes); "
          f"sm_80: 2 buffers per tile (cp_async_wait<{max(waits)}>), {ampere.shared_bytes // 1024} KB shared; "
          f"wavefronts per ldmatrix.x4: {', '.join(report)} (ideal {ldmatrix['ideal']}); lowers for sm_90a too")
