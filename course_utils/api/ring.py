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

``ring_harness`` runs and checks it on gloo processes; ``measure.ring_memory`` measures what a lap holds.

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

from ..kernels.softmax import safe_shift
from .attention import backward_kernels, forward_kernel
from .inputs import check_attention_inputs, sink_logits

__all__ = ["LAYOUTS", "ring_attention", "shard_sequence", "unshard_sequence", "shard_zigzag", "unshard_zigzag",
           "sequence_positions", "Block", "step_blocks", "step_work", "kernel_shapes", "compile_ring_kernels",
           "RingComm", "NoComm", "ring_forward", "ring_backward", "head_pieces",
           "default_backward_chunks", "LONG_SHARD", "backward_lap", "pair_backward_lap", "travelling_backward_lap",
           "host_group"]

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


def compile_ring_kernels(q, k, world, *, causal=False, sm_scale=None, layout="contiguous", backward_chunks=None):
    """Compile (or load from TileLang's disk cache) the forward and backward kernels ``ring_attention``
    runs, on any rank, for shards shaped like ``q`` and ``k``."""
    chunks = _backward_chunks(backward_chunks, k)
    for rows_q, rows_k, block_causal in kernel_shapes(world, q.shape[2], causal=causal, layout=layout):
        q_b = q.new_empty(q.shape[0], q.shape[1], rows_q, q.shape[3])
        k_b = k.new_empty(k.shape[0], k.shape[1], rows_k, k.shape[3])
        forward_kernel(q_b, k_b, causal=block_causal, sm_scale=sm_scale)
        if chunks > 1:  # the backward's laps run on pieces of the heads (head_pieces)
            rows_q_piece, rows_kv_piece = head_pieces(1, q.shape[1], k.shape[1], chunks)[0]
            q_b, k_b = q_b[rows_q_piece], k_b[rows_kv_piece]
        backward_kernels(q_b, k_b, causal=block_causal, sm_scale=sm_scale)
        if rows_q < q.shape[2]:  # the backward's per-head calls (_per_head)
            backward_kernels(q_b[:1, :1], k_b[:1, :1], causal=block_causal, sm_scale=sm_scale)


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

    def start(self, tensors, tag=0, into=None):
        """Start sending ``tensors`` on and receiving the previous rank's into ``into`` (buffers shaped
        like them, reused by the laps; new ones if None); returns at once. ``.wait()`` on the result
        gives the received tensors (once ours have left too, so their buffers may then be reused)."""
        received = list(into) if into is not None else [torch.empty_like(t) for t in tensors]
        return self.exchange(tensors, received, tag)

    def exchange(self, send, receive, tag=0):
        """Start sending ``send`` to the next rank and receiving the previous rank's tensors into
        ``receive`` (either may be empty: the two ranks must agree on what travels)."""
        # region: exchange
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in receive]
        return _Transfer(dist.batch_isend_irecv(ops) if ops else [], list(receive))
        # endregion


class NoComm:
    """A ring that does not communicate: the "received" shards are the receive buffers as they are
    (new ones, as ``RingComm`` makes, when none are given). Runs the same kernels on the same buffers
    as ``RingComm`` would (for measuring the compute alone, and the memory search), with wrong results."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def start(self, tensors, tag=0, into=None):
        return _Arrived(list(into) if into is not None else [torch.empty_like(t) for t in tensors])

    def exchange(self, send, receive, tag=0):
        return _Arrived(list(receive))


# --- The forward and backward laps -------------------------------------------------------------
#
# Memory (docs/ring_memory.md has the accounting): besides its inputs and outputs a rank holds one
# K/V receive buffer (two for world > 2, reused in turn), the running O in the input dtype (merged in
# float32 a few heads at a time), one float32 dQ accumulator that the backward kernel adds into
# directly, and two dK/dV buffers: on a ring of two, in the input dtype, our own step-0 dK/dV and
# the buffer the kernel writes at step 1 (the other rank's part arrives after it, into a new buffer
# once dQ's float32 sum is gone); on longer rings, in float32, the sum arriving and the buffer the
# kernel writes, which becomes the next receive buffer. On long shards ring_backward runs the lap
# once per group of heads, so those buffers are a group's.

MERGE_PIECES = 8  # the forward merges O in float32 in this many pieces (of whole heads): ≤ 1/8 of a shard


def _rows(t, rows):
    return t[:, :, rows].contiguous()


def _empty_like_all(tensors):
    return [torch.empty_like(t) for t in tensors]


def _merge_into(out, lse, out_b, lse_b, rows):
    """Fold a block's (out_b, lse_b) into rows ``rows`` of the running (out, lse), in place: the
    log-sum-exp merge of ``softmax.merge_attention``, in float32, a few heads at a time (so no float32
    copy of a whole shard exists); ``out`` stays in its own dtype."""
    lse_rows = lse[:, :, rows]
    total = torch.logaddexp(lse_rows, lse_b)
    shift = safe_shift(total)
    w_old, w_new = torch.exp(lse_rows - shift), torch.exp(lse_b - shift)
    lse[:, :, rows] = total
    batch, heads, _, dim = out.shape
    flat_out = out.view(batch * heads, out.shape[2], dim)[:, rows]
    flat_b = out_b.reshape(batch * heads, -1, dim)
    w_old, w_new = w_old.reshape(batch * heads, -1, 1), w_new.reshape(batch * heads, -1, 1)
    step = max(1, -(-batch * heads // MERGE_PIECES))
    for i in range(0, batch * heads, step):
        piece = slice(i, i + step)
        merged = flat_out[piece].float() * w_old[piece]
        merged += flat_b[piece].float() * w_new[piece]
        flat_out[piece] = merged


def ring_forward(q, k, v, comm, *, causal=False, sm_scale=None, layout="contiguous", compute=True):
    """This rank's shard of O (input dtype) and its LSE (float32) after one lap of the ring.

    ``comm``: a ``RingComm`` (or ``NoComm``). ``compute=False`` passes the shards around without
    computing anything (for measuring the communication alone; the results are garbage).
    """
    heads, seq_local = q.shape[1], q.shape[2]
    no_sinks = sink_logits(None, heads, q.device)
    out = lse = None
    kv, spare = (k, v), None  # the K/V shard held, and the buffers free to receive the next one into
    # region: forward lap
    for step in range(comm.world):
        source = (comm.rank - step) % comm.world  # whose K/V shard we hold
        in_flight = None
        if step + 1 < comm.world:  # the next shard travels meanwhile, into a buffer of an earlier lap step
            spare = spare or _empty_like_all(kv)
            in_flight = comm.start(kv, into=spare)
        blocks = step_blocks(comm.rank, source, comm.world, seq_local, causal=causal, layout=layout)
        for block in blocks if compute else ():
            q_b, k_b, v_b = _rows(q, block.q), _rows(kv[0], block.k), _rows(kv[1], block.k)
            kernel = forward_kernel(q_b, k_b, causal=block.causal, sm_scale=sm_scale)
            out_b, lse_b = kernel(q_b, k_b, v_b, no_sinks)
            if out is None:  # the first step (our own shard, every row): its result is the running one
                out, lse = out_b, lse_b
            else:
                _merge_into(out, lse, out_b, lse_b, block.q)
            del out_b, lse_b, q_b, k_b, v_b
        if in_flight is not None:
            held, kv = kv, in_flight.wait()
            spare = None if held[0] is k else held  # the shard just used receives the one after next
    # endregion
    if out is None:  # compute=False
        out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return out, lse


def _per_head(block, q, k):
    """Whether the backward runs a block of some query rows as one kernel call per (batch, head):
    every tensor of such a call is a contiguous view (no copy of Q's or dO's rows, no float32 dQ of
    the block). GQA: each head's dK/dV (input dtype) is summed over its group in float32."""
    return block.q != _ALL


def _block_backward(kernels, q, k_b, v_b, d_out, lse, delta, dq_acc, block, dkv_into):
    """One block's dQ (added into the float32 ``dq_acc``) and its dK, dV (returned, in the input dtype;
    written into ``dkv_into`` when given and shaped like ``k_b``). ``kernels``: the block's, or for a
    ``_per_head`` block those of one (batch, head) of it."""
    mha = kernels.postprocess_dkv is None
    if mha or _per_head(block, q, k_b):  # dK, dV in the input dtype
        fits = dkv_into is not None and dkv_into[0].shape == k_b.shape
        dk_b, dv_b = dkv_into if fits else _empty_like_all((k_b, v_b))
    if _per_head(block, q, k_b):
        group = q.shape[1] // k_b.shape[1]
        if group > 1:  # one head's dK, dV, and their float32 sums over its group (one K/V head each)
            head_dkv = _empty_like_all((k_b[:1, :1], v_b[:1, :1]))
            sums = [torch.empty(k_b[:1, :1].shape, dtype=torch.float32, device=k_b.device) for _ in range(2)]
        for b in range(q.shape[0]):
            for h_kv in range(k_b.shape[1]):
                kv_one = (slice(b, b + 1), slice(h_kv, h_kv + 1))
                for h in range(h_kv * group, (h_kv + 1) * group):
                    one, rows = (slice(b, b + 1), slice(h, h + 1)), block.q
                    out_dkv = (dk_b[kv_one], dv_b[kv_one]) if group == 1 else head_dkv
                    kernels.main(q[one + (rows,)], k_b[kv_one], v_b[kv_one], d_out[one + (rows,)], lse[one + (rows,)],
                                 delta[one + (rows,)], dq_acc[one + (rows,)], *out_dkv)
                    if group > 1:
                        for total, part in zip(sums, head_dkv):
                            total.copy_(part) if h == h_kv * group else total.add_(part)
                if group > 1:
                    dk_b[kv_one].copy_(sums[0])
                    dv_b[kv_one].copy_(sums[1])
        return dk_b, dv_b
    if block.q == _ALL:
        q_b, d_out_b, lse_b, delta_b, dq_b = q, d_out, lse, delta, dq_acc
    else:  # rows of a [B, H, S, D] tensor are not contiguous: copies of the block's rows (GQA)
        q_b, d_out_b, lse_b, delta_b = (_rows(t, block.q) for t in (q, d_out, lse, delta))
        dq_b = torch.zeros(q_b.shape, dtype=torch.float32, device=q.device)
    if mha:
        kernels.main(q_b, k_b, v_b, d_out_b, lse_b, delta_b, dq_b, dk_b, dv_b)
    else:  # GQA: the kernel sums the heads of a group into float32 (a K/V shard's size), then casts
        dk_b, dv_b = (torch.zeros(k_b.shape, dtype=torch.float32, device=k_b.device) for _ in range(2))
        kernels.main(q_b, k_b, v_b, d_out_b, lse_b, delta_b, dq_b, dk_b, dv_b)
        dk_b, dv_b = kernels.postprocess_dkv(dk_b), kernels.postprocess_dkv(dv_b)
    if dq_b is not dq_acc:
        dq_acc[:, :, block.q] += dq_b
    return dk_b, dv_b


def _block_kernels(q, k_b, block, sm_scale):
    """The compiled backward a block runs (for a ``_per_head`` block: one (batch, head)'s)."""
    q_b = q[:, :, block.q]
    if _per_head(block, q, k_b):
        q_b, k_b = q_b[:1, :1], k_b[:1, :1]
    return backward_kernels(q_b, k_b, causal=block.causal, sm_scale=sm_scale)


def _carve(buffers, like):
    """Two tensors shaped like ``like`` in each of ``buffers`` (views of its first elements)."""
    n = like.numel()
    return [[buf.view(-1)[i * n:(i + 1) * n].view(like.shape) for i in range(2)] for buf in buffers]


# The backward runs in pieces of the heads by default from this shard length on: there the 2-H200 records measured
# it as fast as one lap within their spread (0.98-1.07 of one lap's speed over two runs) and much leaner (0.49 of
# one GPU's peak instead of 0.65 with 16 K/V heads); shorter shards keep one lap (fewer, larger kernel calls; their
# memory is small anyway). docs/ring_memory.md; commits 40923a8, b90086b.
LONG_SHARD = 32768
MAX_BACKWARD_CHUNKS = 8


def default_backward_chunks(heads_kv, seq_local):
    """``ring_attention``'s ``backward_chunks`` when none is given: 1 below ``LONG_SHARD`` tokens a shard, else
    the largest divisor of H_kv up to ``MAX_BACKWARD_CHUNKS``."""
    if seq_local < LONG_SHARD:
        return 1
    return max(c for c in range(1, MAX_BACKWARD_CHUNKS + 1) if heads_kv % c == 0)


def _backward_chunks(chunks, k):
    """``chunks``, or the default for K/V shards shaped like ``k`` when it is None."""
    return default_backward_chunks(k.shape[1], k.shape[2]) if chunks is None else chunks


def head_pieces(batch, heads, heads_kv, chunks):
    """The pieces of a backward run in ``chunks`` laps per batch element: (batch, query heads, K/V heads)
    index pairs, each a contiguous view of a [B, H, S, D] tensor (one batch element, consecutive heads;
    GQA: whole groups of query heads with their K/V heads)."""
    per, group = heads_kv // chunks, heads // heads_kv
    return [((slice(b, b + 1), slice(i * per * group, (i + 1) * per * group)),
             (slice(b, b + 1), slice(i * per, (i + 1) * per)))
            for b in range(batch) for i in range(chunks)]


def ring_backward(q, k, v, out, lse, d_out, comm, *, causal=False, sm_scale=None, layout="contiguous",
                  compute=True, chunks=None):
    """dQ, dK, dV of this rank's shards, from the merged ``out`` and ``lse`` of ``ring_forward``.

    ``chunks`` > 1 runs the lap once per piece of ``head_pieces`` (every batch element, ``chunks`` groups
    of K/V heads): each lap's buffers (the K/V shard received, the dK/dV sums in flight, the float32 dQ
    sum) are that piece's, so the peak holds a ``chunks``-th of them; a piece's dK/dV travel home while
    the next piece computes. None: ``default_backward_chunks``. ``compute=False`` makes the same
    transfers without computing anything (garbage results).
    """
    options = dict(causal=causal, sm_scale=sm_scale, layout=layout, compute=compute)
    chunks = _backward_chunks(chunks, k)
    if chunks == 1:
        dq, home = backward_lap(q, k, v, out, lse, d_out, comm, **options)
        dk, dv = home.wait()
        return dq, dk, dv
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    # region: pieces
    landing = None  # the previous piece's dK/dV, still on their way home into their rows of dK, dV
    for rows_q, rows_kv in head_pieces(q.shape[0], q.shape[1], k.shape[1], chunks):
        dq_piece, home = backward_lap(q[rows_q], k[rows_kv], v[rows_kv], out[rows_q], lse[rows_q], d_out[rows_q],
                                      comm, into=(dk[rows_kv], dv[rows_kv]), **options)
        dq[rows_q].copy_(dq_piece)
        del dq_piece
        if landing is not None:  # waited for only now: the transfer ran under this piece's kernels
            landing.wait()
        landing = home
    landing.wait()
    # endregion
    return dq, dk, dv


def backward_lap(q, k, v, out, lse, d_out, comm, *, causal, sm_scale, layout, compute, into=None):
    """One lap of the backward over whole shards (or pieces of them): this rank's dQ, and the transfer
    that brings its dK/dV home (``.wait()`` gives them; in ``into``, a pair shaped like ``k`` and ``v``,
    when given)."""
    own = backward_kernels(q, k, causal=causal, sm_scale=sm_scale)  # step 0's block: every row, every key
    if own.dq is not None:
        raise ValueError("ring_backward runs the atomic backward kernels (BackwardKernels.dq must be None)")
    lap = pair_backward_lap if comm.world == 2 else travelling_backward_lap
    return lap(q, k, v, out, lse, d_out, own, comm, causal=causal, sm_scale=sm_scale, layout=layout,
               compute=compute, into=into)


def _dq_sum_and_delta(own, q, out, d_out, compute):
    """One float32 dQ sum that every block's kernel adds into (no per-call accumulator and cast), and
    Δ = rowsum(O ∘ dO), once for the lap."""
    if not compute:
        return None, None
    return torch.zeros(q.shape, dtype=torch.float32, device=q.device), own.preprocess(out, d_out)


def _dq(own, dq_acc, q):
    return own.postprocess_dq(dq_acc) if dq_acc is not None else torch.empty_like(q)


def _step_backward(kernels, q, kv, d_out, lse, delta, dq_acc, block, free, sm_scale):
    """One block's backward at a step: dQ into ``dq_acc``; returns its dK, dV (the block's key rows, input
    dtype). ``kernels``: step 0's (None: the block's own). ``free``: a pair of idle buffers shaped like
    the K/V shard (or None), used when they are in its dtype (a travelling lap's float32 sums are, for
    float32 inputs only); a block of at most half the keys keeps its copy of those K/V rows and its
    dK/dV in them (no other buffer), a block of every key writes its dK/dV there."""
    seq_local = q.shape[2]
    into = free if free is not None and free[0].dtype == kv[0].dtype else None
    if block.k != _ALL and into is not None and 2 * len(range(seq_local)[block.k]) <= seq_local:
        (k_b, dk_into), (v_b, dv_into) = _carve(free, kv[0][:, :, block.k])
        k_b.copy_(kv[0][:, :, block.k])
        v_b.copy_(kv[1][:, :, block.k])
        into = (dk_into, dv_into)
    else:
        k_b, v_b = _rows(kv[0], block.k), _rows(kv[1], block.k)
    kernels = kernels if kernels is not None else _block_kernels(q, k_b, block, sm_scale)
    return _block_backward(kernels, q, k_b, v_b, d_out, lse, delta, dq_acc, block, into)


class _Home:
    """Our dK/dV: step 0's part here, the other rank's part in flight; ``wait()`` adds it in and returns them."""

    def __init__(self, transfer, mine, rows, sent):
        self.transfer, self.mine, self.rows, self.sent = transfer, mine, rows, sent

    def wait(self):
        if self.transfer is not None:  # the first wait adds the other rank's part; later ones only return
            received = self.transfer.wait()
            if self.rows is not None:
                for total, part in zip(self.mine, received):
                    total[:, :, self.rows] += part
            self.transfer = self.sent = None  # ours have left: their buffers may go
        return self.mine


def _second_step_block(rank, seq_local, *, causal, layout):
    """The one block ``rank`` computes at the second step of a ring of two (None: it computes none)."""
    blocks = step_blocks(rank, 1 - rank, 2, seq_local, causal=causal, layout=layout)
    assert len(blocks) <= 1, "a ring of two has at most one block at its second step"
    return blocks[0] if blocks else None


def pair_backward_lap(q, k, v, out, lse, d_out, own, comm, *, causal, sm_scale, layout, compute, into):
    """The backward lap on a ring of two. Our own shard's dK/dV (step 0) stay here; the other rank's part
    of them comes back after its step 1 and is added. So step 1 waits for nothing but the K/V shard
    (sent under step 0), and one dK/dV transfer a lap, of only the key rows a block touched, replaces
    the two of a travelling sum. Every element is still one rounded sum of two kernel outputs."""
    seq_local, peer = q.shape[2], 1 - comm.rank
    dq_acc, delta = _dq_sum_and_delta(own, q, out, d_out, compute)
    # region: pair lap
    kv_in_flight = comm.start((k, v))
    mine = into
    for block in step_blocks(comm.rank, comm.rank, 2, seq_local, causal=causal, layout=layout) if compute else ():
        parts = _block_backward(own, q, k, v, d_out, lse, delta, dq_acc, block, mine)
        if mine is None:
            mine = parts
        elif parts[0] is not mine[0]:  # GQA's kernel sums into float32 buffers of its own
            for total, part in zip(mine, parts):
                total.copy_(part)
    mine = mine if mine is not None else _empty_like_all((k, v))
    kv = kv_in_flight.wait()
    scratch = _empty_like_all((k, v))  # step 1's dK/dV (or, for half the keys, their K/V copy and dK/dV)
    block = _second_step_block(comm.rank, seq_local, causal=causal, layout=layout)
    sent = []
    if block is not None:
        if compute:
            sent = list(_step_backward(None, q, kv, d_out, lse, delta, dq_acc, block, scratch, sm_scale))
        else:
            sent = [t[:, :, block.k].contiguous() for t in scratch]
    del scratch, kv, kv_in_flight, delta
    dq = _dq(own, dq_acc, q)  # before the exchange's buffer is made: dQ's float32 sum is gone by then
    del dq_acc
    theirs = _second_step_block(peer, seq_local, causal=causal, layout=layout)  # the rows of ours it touched
    rows = None if theirs is None else theirs.k
    receive = [] if rows is None else [torch.empty_like(m[:, :, rows]) for m in mine]
    return dq, _Home(comm.exchange(sent, receive, tag=1), mine, rows, sent)
    # endregion


def travelling_backward_lap(q, k, v, out, lse, d_out, own, comm, *, causal, sm_scale, layout, compute, into):
    """The backward lap on a ring of more than two: a shard's dK/dV sum travels with it, every rank it
    visits adds its part, and after a full lap the sum arrives home."""
    seq_local = q.shape[2]
    dq_acc, delta = _dq_sum_and_delta(own, q, out, d_out, compute)
    # The sums travel in float32 on rings of more than two: there every addition rounds again in the
    # input dtype, which broke the FlashAttention criterion for dK at 8 ranks (bfloat16, causal;
    # docs/ring_memory.md); they travel in the input dtype only on their last hop home.
    sum_dtype = torch.promote_types(k.dtype, torch.float32)
    kv, kv_spare = (k, v), None
    dkv_in_flight = dkv_sent = None
    free = None  # dK/dV buffers the kernel may write into / we may receive into: the sum we sent last step
    # region: backward lap
    for step in range(comm.world):
        source = (comm.rank - step) % comm.world
        last = step + 1 == comm.world
        kv_in_flight = None
        if not last:
            kv_spare = kv_spare or _empty_like_all(kv)
            kv_in_flight = comm.start(kv, into=kv_spare)
        arrived = None
        if dkv_in_flight is not None:
            # The dK/dV sum for this source from the ranks before us; ours has left, so its buffers
            # are free for this step's kernel. (Waiting here, before the kernel, keeps two dK/dV
            # buffers instead of three; the transfer is the previous step's.)
            arrived, free = dkv_in_flight.wait(), dkv_sent
        if free is None:
            free = [torch.empty(k.shape, dtype=sum_dtype, device=k.device) for _ in range(2)]
        blocks = step_blocks(comm.rank, source, comm.world, seq_local, causal=causal, layout=layout)
        total = arrived if arrived is not None else free
        for block in blocks if compute else ():
            dk_b, dv_b = _step_backward(own if step == 0 else None, q, kv, d_out, lse, delta, dq_acc, block, free,
                                        sm_scale)
            if arrived is None:  # step 0: our own shard's block, every key: the sum starts as its dK/dV
                total = [dk_b.to(sum_dtype), dv_b.to(sum_dtype)]
            else:
                arrived[0][:, :, block.k] += dk_b
                arrived[1][:, :, block.k] += dv_b
            del dk_b, dv_b
        if last:  # complete: the sums go home in the input dtype
            total = [t.to(k.dtype) for t in total]
        # Send the sum on (it follows the K/V it belongs to); receive into the free buffers if they fit.
        fits = total[0] is not free[0] and free[0].dtype == total[0].dtype
        receive_into = free if fits else [torch.empty_like(t) for t in total]
        dkv_in_flight, dkv_sent, free = comm.start(total, tag=1, into=receive_into), total, None
        if kv_in_flight is not None:
            held, kv = kv, kv_in_flight.wait()
            kv_spare = None if held[0] is k else held
    del kv, kv_spare, free, dkv_sent
    # endregion
    return _dq(own, dq_acc, q), _Landing(dkv_in_flight, into)


class _Landing:
    """A travelling sum's last hop home; ``wait()`` returns it (copied into ``into`` when given)."""

    def __init__(self, transfer, into):
        self.transfer, self.into = transfer, into

    def wait(self):
        arrived = self.transfer.wait()
        if self.into is None:
            return arrived
        for total, part in zip(self.into, arrived):
            total.copy_(part)
        return self.into


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal, sm_scale, layout, backward_chunks=None):
        options = dict(causal=causal, sm_scale=sm_scale, layout=layout)
        out, lse = ring_forward(q, k, v, comm, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.options, ctx.chunks = comm, options, backward_chunks
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, out, lse, d_out.contiguous(), ctx.comm, chunks=ctx.chunks, **ctx.options)
        return dq, dk, dv, None, None, None, None, None


# --- The public function and its input checks --------------------------------------------------

def _check_backward_chunks(chunks, heads_kv):
    if chunks is None:
        return
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"backward_chunks must be None or an int (laps of the backward per batch element); got "
                        f"{type(chunks).__name__}")
    if chunks < 1 or heads_kv % chunks:
        raise ValueError(f"backward_chunks must be a divisor of the K/V heads ({heads_kv}): each lap takes as many "
                         f"whole K/V heads; got {chunks}")


def _local_problem(q, k, v, *, sm_scale, layout, backward_chunks=None):
    """What is wrong with this rank's own inputs (a ValueError/TypeError), or None."""
    try:
        check_attention_inputs("ring_attention", q, k, v, sm_scale=sm_scale)
        _check_layout(layout)
        _check_backward_chunks(backward_chunks, k.shape[1])
        if k.shape[2] != q.shape[2]:
            raise ValueError(f"the K/V shard must be as long as the query shard (one sequence, split once); "
                             f"got S_local {q.shape[2]} for q and {k.shape[2]} for k, v")
        if layout == "zigzag" and q.shape[2] % 2:
            raise ValueError(f"layout='zigzag' needs an even S_local (two equal chunks per rank); got {q.shape[2]}")
    except (ValueError, TypeError) as exc:
        return exc
    return None


def _signature(q, k, causal, sm_scale, layout, problem, backward_chunks=None):
    if problem is not None:
        return {"error": f"{type(problem).__name__}: {problem}"}
    return {"error": None, "q shape [B, H, S_local, D]": tuple(q.shape), "k/v shape": tuple(k.shape),
            "dtype": str(q.dtype).replace("torch.", ""), "causal": bool(causal), "sm_scale": sm_scale,
            "layout": layout, "backward_chunks": _backward_chunks(backward_chunks, k)}


_HOST_GROUPS = {}


def host_group(group):
    """A gloo process group with the ranks of ``group`` (``group`` itself if it is gloo), made once per group.

    ``ring_attention`` checks that every rank passed the same kind of input with ``all_gather_object``; over
    NCCL that moves the pickled descriptions through the GPUs and waits for them (the host stops until the
    GPU has finished all the work queued before), every call. Over gloo the check stays on the host, and the
    GPU keeps running the queued kernels meanwhile. Only the group's ranks take part in making it.
    """
    if dist.get_backend(group) == "gloo":
        return group
    if group not in _HOST_GROUPS:
        _HOST_GROUPS[group] = _gloo_twin(group)
    return _HOST_GROUPS[group]


def _gloo_twin(group):
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)


def _check_inputs(q, k, v, *, causal, sm_scale, group, layout, backward_chunks=None):
    """Check every rank's inputs, together: every rank raises the same error, or none does."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ring_attention runs on the ranks of a torch.distributed process group: call "
                         "torch.distributed.init_process_group first (or use flash_attention on one device)")
    comm = RingComm(group)
    if comm.world < 2:
        raise ValueError(f"ring_attention needs a group of at least 2 ranks; this group has {comm.world}. "
                         "On one device, call flash_attention.")
    problem = _local_problem(q, k, v, sm_scale=sm_scale, layout=layout, backward_chunks=backward_chunks)
    everyone = [None] * comm.world
    dist.all_gather_object(everyone, _signature(q, k, causal, sm_scale, layout, problem, backward_chunks),
                           group=host_group(comm.group))
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


def ring_attention(q, k, v, *, causal=False, sm_scale=None, group=None, layout="contiguous", backward_chunks=None):
    """Attention over one sequence split across the ranks of ``group`` (default: the whole world).

    Every rank passes its shard q [B, H, S_local, D], k, v [B, H_kv, S_local, D] (GQA: H a multiple
    of H_kv) of one sequence of length world · S_local, split in ``layout``: "contiguous" (rank r
    holds tokens [r·S_local, (r+1)·S_local)) or "zigzag" (rank r holds chunks r and 2·world − 1 − r
    of 2·world; ``shard_sequence`` makes both). Returns this rank's shard of O. Differentiable
    (once): the backward passes dK/dV around the ring as the forward passes K/V. Every rank must
    call it, with shards of the same shape, dtype and options, or every rank gets a ValueError.

    ``backward_chunks``: the backward runs its lap this many times per batch element, on groups of
    K/V heads (a divisor of H_kv), so the buffers of the lap (K/V received, dK/dV sums, the float32
    dQ sum) are that much smaller at the peak: the lever for fitting longer sequences with as many
    K/V heads as query heads (docs/ring_memory.md). Same results; more, smaller kernel calls.
    None (the default): ``default_backward_chunks`` (8 pieces for shards of 32k tokens and more).
    """
    comm = _check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, group=group, layout=layout,
                         backward_chunks=backward_chunks)
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), comm, bool(causal), sm_scale,
                                layout, backward_chunks)


def _allocations(fn):
    """Run ``fn`` under torch's CPU memory profiler; returns (its result, the byte sizes of the
    allocations it made, in order, and the peak of the bytes it held at once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    sizes, held, peak = [], 0, 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() != "[memory]" or event.device_type() != torch.autograd.DeviceType.CPU:
            continue
        nbytes = event.nbytes()
        if nbytes > 0:
            sizes.append(nbytes)
        held += nbytes
        peak = max(peak, held)
    return result, sizes, peak
