"""Ring attention (chapter 10): attention over one sequence split across the ranks of a process group.

Context parallelism splits the *sequence* of a long-context model across devices: rank r of a
group of ``world`` ranks holds S_local = S / world tokens of Q, K and V. Its queries must still see
every (visible) key, so the K/V shards travel around a ring. At step s, rank r holds the K/V shard
of rank r − s (mod world); it runs the single-device kernel on it with ``return_lse`` and merges the
partial result into its running one with the log-sum-exp (``softmax.merge_attention``, chapter 02).
While it computes, the next shard is already in flight. After ``world`` steps every query has seen
every key, and no device ever held more than two K/V shards.

The backward makes the same lap. The kernel of chapter 05 rebuilds P from the *merged* O and LSE of
each row, so each step gives that block's exact share of dQ (kept at home) and of the dK/dV of the
shard it holds. Those dK/dV sums travel with the K/V they belong to; after a full lap they are back
on the rank that owns the shard.

Causal attention makes the work uneven: with the contiguous split, rank 0's queries see only its own
keys while the last rank's see everyone's. The zigzag split cuts the sequence into 2·world chunks
and gives rank r chunks r and 2·world − 1 − r, an early one and a late one, so every rank computes
the same amount at every step (``step_blocks``).

Communication is torch.distributed's point-to-point ops (``batch_isend_irecv``): gloo between CPU
processes, NCCL between GPUs. NCCL runs them on its own CUDA stream, so they overlap the kernels of
the compute stream; gloo runs them on its own threads.

Credits: Liu, Zaharia and Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
Context" (2023); Brandon et al., "Striped Attention" (2023) on causal load imbalance; the two-chunk
("zigzag") split as in zhuzilin/ring-flash-attention and Llama 3's context parallelism (Meta, "The
Llama 3 Herd of Models", 2024). Our code is written from those descriptions.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..kernels.softmax import merge_attention
from .attention import attention_backward, backward_kernels, forward_kernel
from .inputs import check_attention_inputs, sink_logits

__all__ = ["LAYOUTS", "ring_attention", "shard_sequence", "unshard_sequence", "shard_zigzag", "unshard_zigzag",
           "sequence_positions", "Block", "step_blocks", "step_work", "kernel_shapes", "compile_ring_kernels",
           "RingComm", "NoComm", "ring_forward", "ring_backward",
           "RingCase", "run_ring_attention", "BAD_INPUTS"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")


# --- Splitting a sequence across ranks ---------------------------------------------------------

def _split(x, parts, dim):
    if x.shape[dim] % parts:
        raise ValueError(f"a sequence of length {x.shape[dim]} does not split into {parts} equal chunks")
    return x.split(x.shape[dim] // parts, dim=dim)


def shard_zigzag(x, world, rank, *, dim=2):
    """Rank ``rank``'s zigzag shard of ``x``: chunks ``rank`` and ``2·world − 1 − rank`` of 2·world."""
    # region: zigzag
    chunks = _split(x, 2 * world, dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)
    # endregion


def unshard_zigzag(shards, *, dim=2):
    """The sequence back from every rank's zigzag shard (a list in rank order)."""
    halves = [_split(shard, 2, dim) for shard in shards]
    early = [first for first, _ in halves]
    late = [second for _, second in reversed(halves)]
    return torch.cat(early + late, dim=dim)


def shard_sequence(x, world, rank, layout="contiguous", *, dim=2):
    """Rank ``rank``'s shard of ``x`` [B, H, S, D] (split along ``dim``) in ``layout``."""
    _check_layout(layout)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}); got {rank}")
    return _split(x, world, dim)[rank] if layout == "contiguous" else shard_zigzag(x, world, rank, dim=dim)


def unshard_sequence(shards, layout="contiguous", *, dim=2):
    """The sequence back from every rank's shard (a list in rank order)."""
    _check_layout(layout)
    return torch.cat(list(shards), dim=dim) if layout == "contiguous" else unshard_zigzag(shards, dim=dim)


def sequence_positions(world, rank, seq_local, layout="contiguous"):
    """The global positions of rank ``rank``'s ``seq_local`` tokens, in its local order."""
    return shard_sequence(torch.arange(world * seq_local), world, rank, layout, dim=0)


# --- Which blocks a rank computes at each step -------------------------------------------------

class Block(NamedTuple):
    """One kernel call of a ring step: local query rows ``q`` against rows ``k`` of the K/V shard held."""

    q: slice
    k: slice
    causal: bool


_ALL = slice(0, None)


def step_blocks(rank, source, world, seq_local, *, causal, layout="contiguous"):
    """The kernel calls rank ``rank`` makes while it holds rank ``source``'s K/V shard.

    Empty list: none of those keys is visible to its queries (the step is skipped). ``causal`` in a
    block means the usual (bottom-right aligned) causal triangle.
    """
    # region: blocks
    if not causal:
        return [Block(_ALL, _ALL, False)]
    if source == rank:
        # Its own shard: local order is global order, in either layout, so the usual triangle.
        return [Block(_ALL, _ALL, True)]
    if layout == "contiguous":
        return [Block(_ALL, _ALL, False)] if source < rank else []
    half = seq_local // 2  # zigzag: local rows [0, half) are chunk `rank`, the rest chunk 2·world − 1 − rank
    if source < rank:
        # Both query chunks come after the source's early chunk, and before its late one.
        return [Block(_ALL, slice(0, half), False)]
    # Only our late chunk comes after the source's chunks, and it comes after both.
    return [Block(slice(half, None), _ALL, False)]
    # endregion


def step_work(world, *, causal, layout="contiguous"):
    """Work of each rank (rows) at each step (columns) of the lap, in S_local × S_local blocks (the
    FLOP convention: a causal triangle counts half)."""
    seq_local = 2  # any even length: the blocks are whole shards or halves
    work = torch.zeros(world, world)
    for rank in range(world):
        for step in range(world):
            source = (rank - step) % world
            for b in step_blocks(rank, source, world, seq_local, causal=causal, layout=layout):
                rows, cols = len(range(seq_local)[b.q]), len(range(seq_local)[b.k])
                work[rank, step] += rows * cols / seq_local ** 2 * (0.5 if b.causal else 1.0)
    return work


def kernel_shapes(world, seq_local, *, causal, layout="contiguous"):
    """The distinct (query rows, key rows, causal) of the kernel calls of every rank at every step."""
    rows = range(seq_local)
    return sorted({(len(rows[b.q]), len(rows[b.k]), b.causal) for rank in range(world) for source in range(world)
                   for b in step_blocks(rank, source, world, seq_local, causal=causal, layout=layout)})


def compile_ring_kernels(q, k, world, *, causal=False, sm_scale=None, layout="contiguous"):
    """Compile (or load from TileLang's disk cache) the forward and backward kernels ``ring_attention``
    runs, on any rank, for shards shaped like ``q`` and ``k``."""
    for rows_q, rows_k, block_causal in kernel_shapes(world, q.shape[2], causal=causal, layout=layout):
        q_b = q.new_empty(q.shape[0], q.shape[1], rows_q, q.shape[3])
        k_b = k.new_empty(k.shape[0], k.shape[1], rows_k, k.shape[3])
        forward_kernel(q_b, k_b, causal=block_causal, sm_scale=sm_scale)
        backward_kernels(q_b, k_b, causal=block_causal, sm_scale=sm_scale)


# --- Passing shards around the ring ------------------------------------------------------------

class _Transfer:
    """Tensors in flight: ``wait()`` returns them once they have arrived (and ours have left)."""

    def __init__(self, works, received):
        self.works, self.received = works, received

    def wait(self):
        for work in self.works:
            work.wait()
        return self.received


class _Arrived:
    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


class RingComm:
    """One step around the ring of ``group``: send to the next rank, receive from the previous one."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        # P2POp wants global ranks.
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def start(self, tensors, tag=0):
        """Start sending ``tensors`` on and receiving the previous rank's into new buffers; returns
        at once. ``.wait()`` on the result gives the received tensors."""
        # region: exchange
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in received]
        return _Transfer(dist.batch_isend_irecv(ops), received)
        # endregion


class NoComm:
    """A ring that does not communicate: every "received" shard is the one sent. Runs the same
    kernels as ``RingComm`` would (for measuring the compute alone), with wrong results."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def start(self, tensors, tag=0):
        return _Arrived(list(tensors))


# --- The forward and backward laps -------------------------------------------------------------

def _rows(t, rows):
    return t[:, :, rows].contiguous()


def _accumulator(shape, device, compute, fill=0.0):
    """A float32 running sum starting at ``fill``; left uninitialised when nothing will be computed
    (``compute=False`` times the transfers alone, so it launches no other kernel)."""
    if not compute:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return torch.full(shape, fill, dtype=torch.float32, device=device)


def _finished(t, dtype, compute):
    """A float32 sum cast to ``dtype`` (with ``compute=False``, a buffer of that dtype, no cast)."""
    return t.to(dtype) if compute else torch.empty(t.shape, dtype=dtype, device=t.device)


def ring_forward(q, k, v, comm, *, causal=False, sm_scale=None, layout="contiguous", compute=True):
    """This rank's shard of O (input dtype) and its LSE (float32) after one lap of the ring.

    ``comm``: a ``RingComm`` (or ``NoComm``). ``compute=False`` passes the shards around without
    computing anything, not even the float32 accumulators' fills and casts (for measuring the
    communication alone; the results are garbage).
    """
    heads, seq_local = q.shape[1], q.shape[2]
    no_sinks = sink_logits(None, heads, q.device)
    out = _accumulator(q.shape, q.device, compute)
    lse = _accumulator(q.shape[:3], q.device, compute, float("-inf"))
    kv = (k, v)
    # region: forward lap
    for step in range(comm.world):
        source = (comm.rank - step) % comm.world  # whose K/V shard we hold
        in_flight = comm.start(kv) if step + 1 < comm.world else None  # the next shard travels meanwhile
        blocks = step_blocks(comm.rank, source, comm.world, seq_local, causal=causal, layout=layout)
        for block in blocks if compute else ():
            q_b, k_b, v_b = _rows(q, block.q), _rows(kv[0], block.k), _rows(kv[1], block.k)
            kernel = forward_kernel(q_b, k_b, causal=block.causal, sm_scale=sm_scale)
            out_b, lse_b = kernel(q_b, k_b, v_b, no_sinks)
            rows = (slice(None), slice(None), block.q)
            out[rows], lse[rows] = merge_attention(out[rows], lse[rows], out_b, lse_b)
        if in_flight is not None:
            kv = in_flight.wait()
    # endregion
    return _finished(out, q.dtype, compute), lse


def ring_backward(q, k, v, out, lse, d_out, comm, *, causal=False, sm_scale=None, layout="contiguous",
                  compute=True):
    """dQ, dK, dV of this rank's shards, from the merged ``out`` and ``lse`` of ``ring_forward``.

    ``compute=False`` makes the same transfers without computing anything (garbage results).
    """
    seq_local = q.shape[2]
    dq = _accumulator(q.shape, q.device, compute)
    kv, dkv_in_flight = (k, v), None
    # region: backward lap
    for step in range(comm.world):
        source = (comm.rank - step) % comm.world
        kv_in_flight = comm.start(kv) if step + 1 < comm.world else None
        # This step's share of the source's dK and dV, in float32 (the sums travel and grow).
        dk, dv = (_accumulator(k.shape, k.device, compute) for _ in range(2))
        blocks = step_blocks(comm.rank, source, comm.world, seq_local, causal=causal, layout=layout)
        for block in blocks if compute else ():
            q_b, out_b, d_out_b, lse_b = (_rows(t, block.q) for t in (q, out, d_out, lse))
            k_b, v_b = _rows(kv[0], block.k), _rows(kv[1], block.k)
            dq_b, dk_b, dv_b, _ = attention_backward(q_b, k_b, v_b, out_b, lse_b, d_out_b, causal=block.causal,
                                                     sm_scale=sm_scale)
            dq[:, :, block.q] += dq_b
            dk[:, :, block.k] += dk_b
            dv[:, :, block.k] += dv_b
        if dkv_in_flight is not None:
            dk_before, dv_before = dkv_in_flight.wait()  # what the ranks before us added for this source
            if compute:
                dk += dk_before
                dv += dv_before
        if step + 1 == comm.world:  # the sums are complete: they go home in the output dtype (fewer bytes)
            dk, dv = _finished(dk, k.dtype, compute), _finished(dv, v.dtype, compute)
        dkv_in_flight = comm.start((dk, dv), tag=1)  # the sums follow the K/V they belong to
        if kv_in_flight is not None:
            kv = kv_in_flight.wait()
    dk, dv = dkv_in_flight.wait()  # after a full lap, our own shard's dK and dV are home
    # endregion
    return _finished(dq, q.dtype, compute), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal, sm_scale, layout):
        options = dict(causal=causal, sm_scale=sm_scale, layout=layout)
        out, lse = ring_forward(q, k, v, comm, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.options = comm, options
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, d_out.contiguous(), ctx.comm, **ctx.options)
        return dq, dk, dv, None, None, None, None


# --- The public function and its input checks --------------------------------------------------

def _local_problem(q, k, v, *, sm_scale, layout):
    """What is wrong with this rank's own inputs (a ValueError/TypeError), or None."""
    try:
        check_attention_inputs("ring_attention", q, k, v, sm_scale=sm_scale)
        _check_layout(layout)
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"the K/V shard must be as long as the query shard (one sequence, split once); "
                             f"got S_local {q.shape[2]} for q and {k.shape[2]} for k, v")
        if layout == "zigzag" and q.shape[2] % 2:
            raise ValueError(f"layout='zigzag' needs an even S_local (two equal chunks per rank); got {q.shape[2]}")
    except (ValueError, TypeError) as exc:
        return exc
    return None


def _signature(q, k, causal, sm_scale, layout, problem):
    if problem is not None:
        return {"error": f"{type(problem).__name__}: {problem}"}
    return {"error": None, "q shape [B, H, S_local, D]": tuple(q.shape), "k/v shape": tuple(k.shape),
            "dtype": str(q.dtype).replace("torch.", ""), "causal": bool(causal), "sm_scale": sm_scale,
            "layout": layout}


def _check_inputs(q, k, v, *, causal, sm_scale, group, layout):
    """Check every rank's inputs, together: every rank raises the same error, or none does."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ring_attention runs on the ranks of a torch.distributed process group: call "
                         "torch.distributed.init_process_group first (or use flash_attention on one device)")
    comm = RingComm(group)
    if comm.world < 2:
        raise ValueError(f"ring_attention needs a group of at least 2 ranks; this group has {comm.world}. "
                         "On one device, call flash_attention.")
    problem = _local_problem(q, k, v, sm_scale=sm_scale, layout=layout)
    everyone = [None] * comm.world
    dist.all_gather_object(everyone, _signature(q, k, causal, sm_scale, layout, problem), group=comm.group)
    if problem is not None:
        raise problem
    for rank, signature in enumerate(everyone):
        if signature["error"]:
            raise ValueError(f"ring_attention: rank {rank} of the group passed bad input ({signature['error']})")
    for key in everyone[0]:
        values = [signature[key] for signature in everyone]
        if any(value != values[0] for value in values):
            listed = ", ".join(f"rank {r}: {value}" for r, value in enumerate(values))
            raise ValueError(f"ring_attention: every rank must pass shards of one sequence with the same "
                             f"{key}; got {listed}")
    return comm


def ring_attention(q, k, v, *, causal=False, sm_scale=None, group=None, layout="contiguous"):
    """Attention over one sequence split across the ranks of ``group`` (default: the whole world).

    Every rank passes its shard q [B, H, S_local, D], k, v [B, H_kv, S_local, D] (GQA: H a multiple
    of H_kv) of one sequence of length world · S_local, split in ``layout``: "contiguous" (rank r
    holds tokens [r·S_local, (r+1)·S_local)) or "zigzag" (rank r holds chunks r and 2·world − 1 − r
    of 2·world; ``shard_sequence`` makes both). Returns this rank's shard of O. Differentiable
    (once): the backward passes dK/dV around the ring as the forward passes K/V. Every rank must
    call it, with shards of the same shape, dtype and options, or every rank gets a ValueError.
    """
    comm = _check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, group=group, layout=layout)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, bool(causal), sm_scale,
                                layout)


# --- Checking on CPU processes (gloo) ----------------------------------------------------------

class RingCase(NamedTuple):
    """One global problem for ``run_ring_attention``: tensors of the whole sequence, and the options.

    ``ranks``: the global ranks of the process group that runs it (None: all of them).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    d_out: torch.Tensor
    causal: bool = False
    layout: str = "contiguous"
    sm_scale: float | None = None
    ranks: tuple | None = None


def _groups(cases):
    """The process group of each case (new_group is collective: every rank makes them all, in order)."""
    made = {}
    for case in cases:
        if case.ranks is not None and case.ranks not in made:
            made[case.ranks] = dist.new_group(list(case.ranks))
    return [made.get(case.ranks) for case in cases]


def _run_cases(cases):
    """On every rank: take this rank's shards of each case, run ring_attention and its backward;
    returns (rank in the case's group, its shards of O, dQ, dK, dV) for each case (None for a case
    whose group this rank is not in)."""
    results = []
    for case, group in zip(cases, _groups(cases)):
        if case.ranks is not None and dist.get_rank() not in case.ranks:
            results.append(None)
            continue
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        q, k, v, d_out = (shard_sequence(t, world, rank, case.layout) for t in case[:4])
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*leaves, causal=case.causal, sm_scale=case.sm_scale, layout=case.layout, group=group)
        results.append((rank, (out.detach(), *torch.autograd.grad(out, leaves, d_out))))
    return results


def _bad_calls(rank, world, dtype):
    """Each bad input, as the call every rank makes (some ranks differ on purpose)."""
    def shard(seq=32, heads_kv=2, dtypes=(dtype,) * 3, dims=4):
        q, k, v = (torch.randn((1, 4 if i == 0 else heads_kv, seq, 16)[4 - dims:], dtype=t)
                   for i, t in enumerate(dtypes))
        return q, k, v

    rank_dtype = dtype if rank == 0 else torch.float16
    return {
        "lengths differ across ranks": lambda: ring_attention(*shard(seq=32 if rank == 0 else 48)),
        "dtypes differ across ranks": lambda: ring_attention(*shard(dtypes=(rank_dtype,) * 3)),
        "causal on some ranks only": lambda: ring_attention(*shard(), causal=rank == 0),
        "a group of one": lambda: ring_attention(*shard(), group=_own_group(rank, world)),
        "q, k, v dtypes differ": lambda: ring_attention(*shard(dtypes=(dtype, torch.float16, dtype))),
        "bad shape on rank 1 only": lambda: ring_attention(*shard(dims=3 if rank == 1 else 4)),
        "K/V shard shorter than Q's": lambda: ring_attention(shard()[0], *shard(seq=16)[1:]),
        "zigzag with an odd S_local": lambda: ring_attention(*shard(seq=31), layout="zigzag"),
        "unknown layout": lambda: ring_attention(*shard(), layout="striped"),
    }


_OWN_GROUPS = {}


def _own_group(rank, world):
    # new_group is collective: every rank creates every one-rank group, in the same order.
    if not _OWN_GROUPS:
        _OWN_GROUPS.update({r: dist.new_group([r]) for r in range(world)})
    return _OWN_GROUPS[rank]


BAD_INPUTS = tuple(_bad_calls(0, 2, torch.float32))


def _run_bad_inputs():
    """On every rank: make each bad call; returns {name: "ExceptionType: message"} (or "no error")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    for name, call in _bad_calls(rank, world, torch.float32).items():
        try:
            call()
            errors[name] = "no error"
        except Exception as exc:  # noqa: BLE001 (reported, and checked by the caller)
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


def _worker(cases, bad_inputs):
    # Rank 0 compiles the kernels first; the others then load them from TileLang's disk cache
    # instead of all compiling the same kernels at once.
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        for case in cases:
            size = world if case.ranks is None else len(case.ranks)
            q, k = (shard_sequence(t, size, 0, case.layout) for t in case[:2])
            compile_ring_kernels(q, k, size, causal=case.causal, sm_scale=case.sm_scale, layout=case.layout)
    dist.barrier()
    return _run_cases(cases), (_run_bad_inputs() if bad_inputs else None)


def run_ring_attention(cases, world=2, *, bad_inputs=False):
    """Run each ``RingCase`` on ``world`` CPU processes (gloo), in one go.

    Every rank (of the case's ``ranks``, if given) takes its shards of the case's global tensors,
    runs ``ring_attention`` and its backward, and returns its shards of O, dQ, dK, dV; they are
    put back in sequence order here.
    Returns ``[(out, (dq, dk, dv)) for each case]`` and, with ``bad_inputs``, each rank's error
    for each bad call of ``BAD_INPUTS`` (a list of dicts in rank order, else None).
    """
    from .gloo import run_on_ranks

    per_rank = run_on_ranks(_worker, world, list(cases), bad_inputs)
    results = []
    for index, case in enumerate(cases):
        members = range(world) if case.ranks is None else case.ranks
        # (rank in the group, shards) from each member, put in group order
        shards = [result for _, result in sorted(per_rank[rank][0][index] for rank in members)]
        out, dq, dk, dv = (unshard_sequence([s[i] for s in shards], case.layout) for i in range(4))
        results.append((out, (dq, dk, dv)))
    return results, ([errors for _, errors in per_rank] if bad_inputs else None)
