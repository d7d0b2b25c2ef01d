"""Layouts made visible (chapter 04): shared-memory banks, register fragments, pipeline timelines.

Everything here is computed, not drawn by hand:

- **Shared memory.** ``layout_offsets`` evaluates a TileLang ``Layout`` (e.g. ``make_swizzled_layout``
  or ``make_linear_layout`` of a shared tile) at every element, giving the element offset where
  the element is stored. ``wavefronts`` then counts how many shared-memory wavefronts a warp's
  request needs under the usual model: 32 banks of 4 bytes, at most 128 bytes per wavefront, and
  a bank serves one 4-byte word per wavefront (threads reading the *same* word share it).
- **Registers.** ``fragment_tables`` evaluates a TileLang ``Fragment`` into two tables: which thread
  holds each element, and in which of its registers. ``lower_with_layouts`` lowers a kernel for a
  CUDA architecture and also returns the layouts TileLang's layout inference chose for every
  buffer, so the tables describe the real kernel.
- **Pipelines.** ``pipeline_schedule`` simulates the order of copies and compute that
  ``T.Pipelined(num_stages=...)`` generates for the FlashAttention loop, for a timeline picture.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import NamedTuple

import numpy as np

__all__ = [
    "BANKS", "BANK_BYTES", "WAVEFRONT_BYTES", "bank_of", "wavefronts", "ideal_wavefronts", "bank_hits",
    "shared_tile", "layout_offsets", "fragment_tables", "bank_groups", "warp_access_patterns",
    "conflict_table", "Lowered", "lower_with_layouts", "gemm_fragments", "loop_skeleton", "pipeline_schedule",
    "overlap_schedule", "block_timelines",
]

BANKS = 32  # shared memory banks
BANK_BYTES = 4  # each bank serves one 4-byte word per wavefront
WAVEFRONT_BYTES = BANKS * BANK_BYTES  # 128 bytes at most per wavefront


# --------------------------------------------------------------------------- banks


def bank_of(byte_address):
    """The bank (0..31) that serves a byte address (works on ints and numpy arrays)."""
    return (byte_address // BANK_BYTES) % BANKS


def _words(address, width):
    """The 4-byte words an access of ``width`` bytes at ``address`` touches."""
    return range(address // BANK_BYTES, (address + max(width, 1) - 1) // BANK_BYTES + 1)


def _phases(byte_addresses, width):
    """Split a warp's addresses into the groups the hardware serves together.

    Accesses of 16 bytes are served a quarter-warp (8 threads, 128 bytes) at a time, 8-byte ones a
    half-warp at a time, smaller ones the whole warp at once. (``ldmatrix`` reads its 8x8 matrices
    the same way: 8 row addresses of 16 bytes per phase.)
    """
    addrs = [int(a) for a in np.asarray(byte_addresses).ravel()]
    size = max(1, min(len(addrs), WAVEFRONT_BYTES // max(width, 4)))
    return [addrs[i:i + size] for i in range(0, len(addrs), size)]


def wavefronts(byte_addresses, width):
    """Wavefronts a warp-wide shared-memory request needs: per phase, the most distinct words in one bank."""
    total = 0
    for phase in _phases(byte_addresses, width):
        words = {w for a in phase for w in _words(a, width)}
        total += max(Counter(w % BANKS for w in words).values())
    return total


def ideal_wavefronts(byte_addresses, width):
    """The fewest wavefronts the same request could need: its distinct bytes / 128, per phase."""
    total = 0
    for phase in _phases(byte_addresses, width):
        words = {w for a in phase for w in _words(a, width)}
        total += math.ceil(len(words) * BANK_BYTES / WAVEFRONT_BYTES)
    return total


def bank_hits(byte_addresses, width):
    """For a picture of one phase: {bank: [(word, [threads reading it]), ...]} in thread order."""
    hits = defaultdict(dict)
    for thread, a in enumerate(int(x) for x in np.asarray(byte_addresses).ravel()):
        for w in _words(a, width):
            hits[w % BANKS].setdefault(w, []).append(thread)
    return {bank: list(words.items()) for bank, words in sorted(hits.items())}


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
            raise AssertionError(f"layout evaluation disagrees with TileLang at {idx}: {table[tuple(idx)]} vs {expected}")


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


def bank_groups(offsets, elem_bytes):
    """For each 16-byte chunk of a tile (rows x chunks): its group of 4 banks (0..7) in its 128-byte line."""
    per_chunk = 16 // elem_bytes
    first = offsets[:, ::per_chunk] * elem_bytes
    return (first % WAVEFRONT_BYTES) // 16


def warp_access_patterns(cols, elem_bytes=2):
    """Three warp-wide accesses to a [rows x cols] tile, as (cells (i, j) per thread, bytes per thread).

    - a copy into the tile (cp.async / vector stores): 32 threads x 16 bytes along the rows;
    - ``ldmatrix.x4`` of a 16x16 operand block: 4 phases of 8 row addresses x 16 bytes;
    - a warp reading one column: 32 rows x one element.
    """
    vec = 16 // elem_bytes
    per_row = cols // vec
    return {
        "copy in: 32 threads x 16 B along rows": ([(t // per_row, (t % per_row) * vec) for t in range(32)], 16),
        "ldmatrix.x4: 16 rows x 32 B (4 phases)": ([(t % 8 + 8 * ((t // 8) % 2), vec * (t // 16)) for t in range(32)], 16),
        "one column: 32 rows x 2 B": ([(t, 0) for t in range(32)], elem_bytes),
    }


def conflict_table(offsets_by_layout, patterns, elem_bytes=2):
    """Rows (pattern, ideal, wavefronts per layout...) for a set of access patterns and layouts."""
    rows = []
    for name, (cells, width) in patterns.items():
        row = dict(pattern=name)
        for layout_name, offsets in offsets_by_layout.items():
            addrs = [int(offsets[i, j]) * elem_bytes for i, j in cells]
            row.setdefault("ideal", ideal_wavefronts(addrs, width))  # the same for any layout
            row[layout_name] = wavefronts(addrs, width)
        rows.append(row)
    return rows


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


def loop_skeleton(source, loop_header, steps):
    """The statements of one loop of generated code that match ``steps``, in order.

    ``loop_header`` is a regex for the loop's first line (e.g. ``r"for \\(int kb = 0"``); ``steps``
    maps a label (``str.format``-ed with the regex's groups) to a regex. Consecutive equal labels
    are merged ("label ×n"). Returns a list of (first line number, label).
    """
    import re

    lines = source.splitlines()
    start = next(n for n, line in enumerate(lines) if re.search(loop_header, line))
    depth, out = 0, []
    for n in range(start, len(lines)):
        depth += lines[n].count("{") - lines[n].count("}")
        for label, pattern in steps.items():
            m = re.search(pattern, lines[n])
            if m:
                text = label.format(*(g or "" for g in m.groups()))
                if out and out[-1][1] == text:
                    out[-1][2] += 1
                else:
                    out.append([n + 1, text, 1])
                break
        if depth == 0 and n > start:
            break
    return [(n, text + (f" ×{k}" if k > 1 else "")) for n, text, k in out]


# --------------------------------------------------------------------------- pipeline timelines


def pipeline_schedule(num_stages, n_blocks, *, load, qk, softmax, pv):
    """Timeline of the FlashAttention loop as ``T.Pipelined(num_stages=...)`` orders it (a model).

    ``num_stages=0`` is a plain loop: load K, QK^T, softmax, load V, PV, one after the other.
    With ``num_stages=s`` (what TileLang generates for this loop, sm_80 and sm_90a alike) K and V
    each get ``s`` shared buffers; the first ``s`` tiles are loaded up front, and a buffer is
    refilled with the tile ``s`` iterations ahead as soon as the gemm reading it is done. Loads run
    asynchronously and take ``load`` time units each (latency-bound: several may be in flight).
    Returns ``(events, total)``, events as (lane, start, duration, label, slot) with lanes
    "load K", "load V" and "compute"; ``slot`` is the shared buffer a load fills (0 for compute).
    """
    events, t = [], 0.0
    if num_stages == 0:
        for k in range(n_blocks):
            for lane, label, dur in (("load K", f"K{k}", load), ("compute", "QK", qk), ("compute", "sm", softmax),
                                     ("load V", f"V{k}", load), ("compute", "PV", pv)):
                events.append((lane, t, dur, label, 0))
                t += dur
        return events, t
    ready = {}

    def issue(kind, k, at):
        if k < n_blocks:
            events.append((f"load {kind}", at, load, f"{kind}{k}", k % num_stages))
            ready[kind, k] = at + load

    for k in range(min(num_stages, n_blocks)):
        issue("K", k, 0.0)
        issue("V", k, 0.0)
    for k in range(n_blocks):
        t = max(t, ready["K", k])
        events.append(("compute", t, qk, "QK", 0))
        t += qk
        issue("K", k + num_stages, t)  # K buffer free again
        events.append(("compute", t, softmax, "sm", 0))
        t += softmax
        t = max(t, ready["V", k])
        events.append(("compute", t, pv, "PV", 0))
        t += pv
        issue("V", k + num_stages, t)  # V buffer free again
    return events, t


def overlap_schedule(n_blocks, *, qk, softmax, pv, overlap):
    """Timeline of one consumer warpgroup's loop over key blocks, copies assumed hidden (a model).

    Without ``overlap`` each block runs QKᵀ, softmax, P·V one after the other. With ``overlap``
    (chapter 07's rotated loop) iteration k issues QKᵀ of block k and P·V of block k-1 back to back
    on the tensor cores, waits only for QKᵀ, and computes the softmax of block k while P·V runs;
    the idle matmuls of the first and last iteration are labelled "(PV)" and "(QK)".
    Returns ``(events, total)``, events as (lane, start, duration, label, 0) with lanes
    "tensor cores" and "softmax".
    """
    events, t = [], 0.0
    if not overlap:
        for k in range(n_blocks):
            for lane, label, dur in (("tensor cores", f"QK{k}", qk), ("softmax", f"sm{k}", softmax),
                                     ("tensor cores", f"PV{k}", pv)):
                events.append((lane, t, dur, label, 0))
                t += dur
        return events, t
    for k in range(n_blocks + 1):
        events.append(("tensor cores", t, qk, f"QK{k}" if k < n_blocks else "(QK)", 0))
        events.append(("tensor cores", t + qk, pv, f"PV{k - 1}" if k > 0 else "(PV)", 0))
        end = t + qk + pv
        if k < n_blocks:
            events.append(("softmax", t + qk, softmax, f"sm{k}", 0))
            end = max(end, t + qk + softmax)
        t = end
    return events, t


def block_timelines(tiles_per_sm, cost, label=str):
    """Each SM runs its list of tiles back to back (a persistent block's static schedule).

    ``tiles_per_sm``: one list of tiles per SM; ``cost(tile)``: its duration; ``label(tile)``: its text.
    Returns ``(events, makespan)``, events as (lane "SM i", start, duration, label, 0).
    """
    events, ends = [], []
    for sm, tiles in enumerate(tiles_per_sm):
        t = 0.0
        for tile in tiles:
            events.append((f"SM {sm}", t, cost(tile), label(tile), 0))
            t += cost(tile)
        ends.append(t)
    return events, max(ends, default=0.0)

