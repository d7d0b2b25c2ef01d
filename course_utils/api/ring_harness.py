"""Ring attention checked on CPU processes joined by gloo (chapter 10, the tests, ``python -m course_utils.check``).

``run_ring_attention(cases, world)`` runs each ``RingCase`` (the tensors of a whole sequence and the options) on
``world`` processes: every rank takes its shards, runs ``ring_attention`` and its backward, and the shards of O,
dQ, dK and dV are put back in sequence order. With ``bad_inputs`` every rank also makes each call of
``BAD_INPUTS``, where some ranks pass what the others do not, and reports the error it got.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .gloo import run_on_ranks
from .ring import compile_ring_kernels, ring_attention, shard_sequence, unshard_sequence

__all__ = ["RingCase", "run_ring_attention", "BAD_INPUTS"]


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
    backward_chunks: int | None = None


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
        out = ring_attention(*leaves, causal=case.causal, sm_scale=case.sm_scale, layout=case.layout, group=group,
                             backward_chunks=case.backward_chunks)
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
        "backward_chunks not dividing H_kv": lambda: ring_attention(*shard(), backward_chunks=3),
        "backward_chunks differ across ranks": lambda: ring_attention(*shard(), backward_chunks=1 + rank),
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
            compile_ring_kernels(q, k, size, causal=case.causal, sm_scale=case.sm_scale, layout=case.layout,
                                 backward_chunks=case.backward_chunks)
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
    per_rank = run_on_ranks(_worker, world, list(cases), bad_inputs)
    results = []
    for index, case in enumerate(cases):
        members = range(world) if case.ranks is None else case.ranks
        # (rank in the group, shards) from each member, put in group order
        shards = [result for _, result in sorted(per_rank[rank][0][index] for rank in members)]
        out, dq, dk, dv = (unshard_sequence([s[i] for s in shards], case.layout) for i in range(4))
        results.append((out, (dq, dk, dv)))
    return results, ([errors for _, errors in per_rank] if bad_inputs else None)
