"""What TileLang decides about layouts (chapter 04), read from TileLang itself, and its picture.

- **Shared tiles.** ``layout_offsets`` evaluates a TileLang ``Layout`` (e.g. ``make_swizzled_layout``
  or ``make_linear_layout`` of a ``shared_tile``) at every element, giving the element offset where
  the element is stored (``course_utils.pictures.banks`` counts the bank conflicts of such offsets).
- **Registers.** ``fragment_tables`` evaluates a TileLang ``Fragment`` into two tables: which thread
  holds each element, and in which of its registers; ``fragment_map`` draws them.
  ``lower_with_layouts`` lowers a kernel for a CUDA architecture and also returns the layouts
  TileLang's layout inference chose for every buffer, so the tables describe the real kernel;
  ``gemm_fragments`` builds the layouts of TileLang's tensor-core gemm directly.
"""

from __future__ import annotations

from typing import NamedTuple

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from . import plots  # noqa: F401  (importing it applies the course style)

__all__ = ["shared_tile", "layout_offsets", "fragment_tables", "Lowered", "lower_with_layouts", "gemm_fragments",
           "fragment_map", "key_order_map"]


# --------------------------------------------------------------------------- evaluating layouts


_BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "FloorDiv": np.floor_divide,
    "FloorMod": np.mod, "Min": np.minimum, "Max": np.maximum,
}
_CALLS = {
    "tirx.bitwise_xor": np.bitwise_xor, "tirx.bitwise_and": np.bitwise_and,
    "tirx.bitwise_or": np.bitwise_or, "tirx.shift_right": np.right_shift, "tirx.shift_left": np.left_shift,
}


def _evaluate(expr, env):
    """Evaluate an integer TIR expression on numpy arrays; ``env`` maps variable names to arrays."""
    from tvm import tirx

    if isinstance(expr, (int, np.integer)):
        return np.int64(expr)
    if isinstance(expr, tirx.IntImm):
        return np.int64(expr.value)
    if isinstance(expr, tirx.Var):
        return env[expr.name]
    kind = type(expr).__name__
    if kind in _BINARY:
        return _BINARY[kind](_evaluate(expr.a, env), _evaluate(expr.b, env))
    if isinstance(expr, tirx.Call) and expr.op.name in _CALLS:
        return _CALLS[expr.op.name](*(_evaluate(arg, env) for arg in expr.args))
    raise NotImplementedError(f"cannot evaluate {kind}: {expr}")


def _grid(layout, replica=0):
    """numpy index grids over a layout's input shape, by variable name (and the replica index)."""
    shape = [int(n) for n in layout.get_input_shape()]
    grids = np.meshgrid(*(np.arange(n, dtype=np.int64) for n in shape), indexing="ij")
    variables = list(layout.get_forward_vars())
    env = {var.name: grid for var, grid in zip(variables[-len(shape):], grids)}
    if len(variables) > len(shape):  # a replicated Fragment lists its replica variable first
        env[variables[0].name] = np.full(shape, replica, dtype=np.int64)
    return shape, env


def _spot_check(layout, table, method, replica=0):
    """Compare a few evaluated entries with TileLang's own ``map_forward_*`` (guards the evaluator)."""
    shape = table.shape
    for flat in np.linspace(0, table.size - 1, 7).astype(int):
        idx = [int(i) for i in np.unravel_index(flat, shape)]
        mapped = getattr(layout, method)(([replica] if int(getattr(layout, "replicate_size", 1)) > 1 else []) + idx)
        expected = [int(v) for v in mapped]
        if method == "map_forward_index":
            expected = int(np.ravel_multi_index(expected, [int(n) for n in layout.get_output_shape()]))
        else:
            expected = expected[0]
        if int(table[tuple(idx)]) != expected:
            raise AssertionError(f"layout evaluation disagrees with TileLang at {idx}: "
                                 f"{table[tuple(idx)]} vs {expected}")


def shared_tile(shape, dtype="float16"):
    """A shared-memory buffer declaration, to ask TileLang for the layouts it would give such a tile."""
    from tvm import tirx

    return tirx.decl_buffer(tuple(shape), dtype, scope="shared.dyn")


def layout_offsets(layout):
    """Element offset (row-major over the layout's output shape) of every element of the tile."""
    shape, env = _grid(layout)
    out_shape = [int(n) for n in layout.get_output_shape()]
    offset = np.zeros(shape, dtype=np.int64)
    for index, extent in zip(layout.index, out_shape):
        offset = offset * extent + _evaluate(index, env)
    _spot_check(layout, offset, "map_forward_index")
    return offset


def fragment_tables(fragment, replica=0):
    """(thread, register) tables of a register Fragment: who holds each element, and where.

    Thread numbers are relative to the fragment's thread range (on Hopper the consumer threads of
    a warp-specialised kernel start at 128). ``replica`` picks the copy for replicated fragments.
    """
    shape, env = _grid(fragment, replica)
    threads = np.broadcast_to(_evaluate(fragment.thread, env), shape).copy()
    (index,) = fragment.index
    registers = np.broadcast_to(_evaluate(index, env), shape).copy()
    _spot_check(fragment, threads, "map_forward_thread", replica)
    _spot_check(fragment, registers, "map_forward_index", replica)
    return threads, registers


# --------------------------------------------------------------------------- the real kernel's layouts


class Lowered(NamedTuple):
    """A kernel lowered for one CUDA architecture, with what layout inference decided."""

    source: str  # the CUDA C++ TileLang generates
    layouts: dict  # buffer name -> tilelang Layout (shared tiles) or Fragment (registers)
    shared_bytes: int  # dynamic shared memory per block


def lower_with_layouts(prim_func, arch):
    """Lower ``prim_func`` (built with target="cuda") for ``arch`` without a GPU; keep the inferred layouts.

    The layouts are read from the IR right after TileLang's ``LayoutInference`` pass.
    """
    import tilelang
    from tilelang import tvm
    from tvm import tirx

    layouts = {}

    @tvm.instrument.pass_instrument
    class _KeepLayouts:
        def run_after_pass(self, mod, info):
            if info.name != "tl.LayoutInference":
                return

            def visit(node):
                if isinstance(node, tirx.SBlock) and "layout_map" in node.annotations:
                    for buf, layout in node.annotations["layout_map"].items():
                        layouts[buf.name] = layout

            for func in mod.functions.values():
                if isinstance(func, tirx.PrimFunc):
                    tirx.stmt_functor.post_order_visit(func.body, visit)

    with tvm.transform.PassContext(instruments=[_KeepLayouts()]):
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            artifact = tilelang.lower(prim_func)
    shared = max((int(f.attrs["dyn_shared_memory_buf"]) for f in artifact.device_mod.functions.values()
                  if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs), default=0)
    return Lowered(artifact.kernel_source, layouts, shared)


def gemm_fragments(m, n, k, threads, *, transpose_b, hopper=False, a_dtype="float16", accum_dtype="float32"):
    """The register layouts TileLang's tensor-core gemm uses, built with its own emitters.

    Returns ``(warps, {"C": Fragment, "A": Fragment})`` for ``T.gemm(A, B, C)`` with A [m, k] and C
    [m, n] in registers, ``threads`` threads and the FullRow warp policy: "C" is the accumulator
    layout the gemm writes (``make_mma_store_layout``), "A" the layout it needs for a register A
    operand (``make_mma_load_layout``). ``hopper`` picks the wgmma emitter instead of mma.sync.
    """
    from tilelang.tileop.base import GemmWarpPolicy
    from tvm import tirx

    if hopper:
        from tilelang.cuda.intrinsics.macro.wgmma_macro_generator import TensorCoreIntrinEmitter
    else:
        from tilelang.cuda.intrinsics.macro.mma_macro_generator import TensorCoreIntrinEmitter

    m_warp, n_warp = GemmWarpPolicy.FullRow.compute_warp_partition(m, n, threads // 32)
    emitter = TensorCoreIntrinEmitter(
        a_dtype=a_dtype, b_dtype=a_dtype, accum_dtype=accum_dtype, a_transposed=False, b_transposed=transpose_b,
        block_row_warps=m_warp, block_col_warps=n_warp, warp_row_tiles=m // m_warp,
        warp_col_tiles=n // n_warp, chunk=k)
    c = tirx.decl_buffer((m, n), accum_dtype, scope="local.fragment", name="C")
    a = tirx.decl_buffer((m, k), a_dtype, scope="local.fragment", name="A")
    return (m_warp, n_warp), {"C": emitter.make_mma_store_layout(c), "A": emitter.make_mma_load_layout(a, "A")}


# --------------------------------------------------------------------------- picture


def fragment_map(ax, threads, registers=None, *, title=None, rows=None, cols=None, color_by="warp",
                 annotate=False):
    """Who holds each element of a register tile (tables from ``fragment_tables``).

    ``color_by``: "warp" (each warp's cells labelled with its number), "lane" (thread % 32) or
    "register" (the register index, with a colour bar). ``annotate`` writes 'lane / register' in
    every cell (for a zoomed-in corner). ``rows`` / ``cols`` are (start, stop) ranges to show.
    """
    threads = np.asarray(threads)
    rows = rows or (0, threads.shape[0])
    cols = cols or (0, threads.shape[1])
    t = threads[rows[0]:rows[1], cols[0]:cols[1]]
    regs = None if registers is None else np.asarray(registers)[rows[0]:rows[1], cols[0]:cols[1]]
    extent = (cols[0] - 0.5, cols[1] - 0.5, rows[1] - 0.5, rows[0] - 0.5)
    if color_by == "register":
        image = ax.imshow(regs, cmap="viridis", aspect="auto", interpolation="nearest", extent=extent)
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="register index")
    else:
        key = t // 32 if color_by == "warp" else t % 32
        n = int(key.max()) + 1
        base = plt.get_cmap("tab10" if n <= 10 else "tab20").colors
        cmap = ListedColormap([base[i % len(base)] for i in range(n)])
        ax.imshow(key, cmap=cmap, vmin=-0.5, vmax=n - 0.5, aspect="auto", interpolation="nearest", extent=extent)
        if color_by == "warp" and not annotate:
            for w in np.unique(key):
                ii, jj = np.nonzero(key == w)
                ax.text(cols[0] + jj.mean(), rows[0] + ii.mean(), f"warp {w}", ha="center", va="center",
                        fontsize=8, color="white")
    if annotate:
        for (i, j), thread in np.ndenumerate(t):
            text = f"{thread % 32}" + ("" if regs is None else f"\n{regs[i, j]}")
            ax.text(cols[0] + j, rows[0] + i, text, ha="center", va="center", fontsize=7, color="white",
                    linespacing=0.9)
    ax.grid(False)
    ax.set(title=title, xlabel="column j", ylabel="row i")


def key_order_map(ax, score_threads, p_threads, slots):
    """One row of a group of key columns, twice: the thread holding each score (the accumulator's layout, top) and
    each column of P (the register A operand's layout, bottom), coloured by lane within the quad (thread % 4);
    a line joins score column j to the P column ``slots[j]`` it is stored in."""
    score_threads, p_threads = np.asarray(score_threads), np.asarray(p_threads)
    colors = plt.get_cmap("tab10").colors
    for y, threads, name in ((1, score_threads, "S (scores)"), (0, p_threads, "P (A operand)")):
        for j, thread in enumerate(threads):
            ax.add_patch(plt.Rectangle((j - 0.45, y - 0.3), 0.9, 0.6, color=colors[int(thread) % 4]))
            ax.text(j, y, f"t{int(thread) % 4}", ha="center", va="center", fontsize=8, color="white")
        ax.text(-0.8, y, name, ha="right", va="center", fontsize=9)
    for j, slot in enumerate(slots):
        ax.plot([j, slot], [0.7, 0.3], color="0.35", lw=0.9)
    ax.set(xlim=(-5.5, len(slots) - 0.4), ylim=(-0.5, 1.5), xticks=range(len(slots)), yticks=[],
           xlabel="key column (within a group of 16)")
    ax.grid(False)
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
