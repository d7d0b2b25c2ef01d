"""The memory of ring attention's lap on CPU processes, against the accounting of docs/ring_memory.md.

``lap_memory`` measures, on every rank of a gloo group, what ``ring_forward`` and ``ring_backward`` allocate
above their inputs (torch's CPU memory profiler); ``lap_memory_model`` is the accounting; ``check_lap_memory``
holds one against the other (``tests/test_ring_attention.py``).
"""

from __future__ import annotations

import math

import torch

from ..api.gloo import run_on_ranks
from ..api.ring import MERGE_PIECES, RingComm, _allocations, compile_ring_kernels, ring_backward, ring_forward

__all__ = ["lap_memory", "lap_memory_model", "check_lap_memory"]


def _memory_worker(shapes, dtype, causal, layout):
    """On every rank (CPU, gloo): the allocations of ring_forward and of ring_backward, measured apart
    (the inputs and the forward's results are made outside the measured windows)."""
    comm = RingComm()
    g = torch.Generator().manual_seed(comm.rank)
    q, k, v, d_out = (torch.randn(shape, generator=g).to(dtype) for shape in shapes)
    compile_ring_kernels(q, k, comm.world, causal=causal, layout=layout)
    options = dict(causal=causal, layout=layout)
    ring_forward(q, k, v, comm, **options)  # warm: TileLang's and the allocator's first-call costs
    (out, lse), forward_sizes, forward_peak = _allocations(lambda: ring_forward(q, k, v, comm, **options))
    ring_backward(q, k, v, out, lse, d_out, comm, **options)
    _, backward_sizes, backward_peak = _allocations(
        lambda: ring_backward(q, k, v, out, lse, d_out, comm, **options))
    return dict(forward=dict(sizes=forward_sizes, peak=forward_peak),
                backward=dict(sizes=backward_sizes, peak=backward_peak))


def lap_memory(q_shape, kv_shape, world=2, *, dtype=torch.float16, causal=False, layout="contiguous"):
    """Measured on ``world`` CPU processes (gloo): per rank, {"forward"|"backward": {"peak": the most
    bytes the lap held at once, above its inputs, "sizes": every allocation's bytes}} for shards of
    ``q_shape`` and ``kv_shape`` (q, dO and k, v)."""
    return run_on_ranks(_memory_worker, world, (q_shape, kv_shape, kv_shape, q_shape), dtype, causal, layout)


def lap_memory_model(q_shape, kv_shape, world=2, *, dtype=torch.float16):
    """The accounting of docs/ring_memory.md for a contiguous non-causal lap (every block whole):
    {"forward"|"backward": (bytes of the whole-shard buffers the lap holds at its peak, what small
    buffers may add: LSE-sized ones and the merge's float32 pieces)}, per rank, above the inputs."""
    size = torch.empty((), dtype=dtype).element_size()
    n_q, n_kv = math.prod(q_shape), math.prod(kv_shape)
    row = math.prod(q_shape[:3]) * 4  # one float32 per query row: LSE, Δ, the merge's weights
    kv_held = 2 * n_kv * size  # the receive buffer of K and V (one set on a ring of two)
    sums = 2 * 2 * n_kv * (size if world <= 2 else max(size, 4))  # two sets of dK/dV buffers
    piece = 4 * n_q // min(MERGE_PIECES, q_shape[0] * q_shape[1])  # one float32 piece of the merge
    return {"forward": (kv_held + 2 * n_q * size, 8 * row + 2 * piece),  # running O, this step's O
            "backward": (4 * n_q + kv_held + sums, 4 * row)}  # the float32 dQ sum


def check_lap_memory(measured, q_shape, kv_shape, world=2, *, dtype=torch.float16):
    """Raise AssertionError unless one rank's ``lap_memory`` result matches ``lap_memory_model``: each
    peak within [model, model + small buffers], and no float32 buffer of a whole Q shard other than
    the backward's dQ sum (none in the forward)."""
    model = lap_memory_model(q_shape, kv_shape, world, dtype=dtype)
    whole_f32 = 4 * math.prod(q_shape)
    for phase, (big, small) in model.items():
        peak = measured[phase]["peak"]
        if not big <= peak <= big + small:
            raise AssertionError(f"{phase}: peak {peak} bytes above the inputs; the accounting says {big} "
                                 f"(+ up to {small} in small buffers)")
        count = sum(n == whole_f32 for n in measured[phase]["sizes"])
        allowed = 1 if phase == "backward" and dtype != torch.float32 else 0
        if dtype != torch.float32 and count != allowed:
            raise AssertionError(f"{phase}: {count} float32 buffers of a whole Q shard ({whole_f32} bytes); "
                                 f"the accounting has {allowed}")
    return model
