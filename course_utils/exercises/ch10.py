"""Checkers for chapter 10 (ring attention): the zigzag split's chunk pairs, and the bytes on the ring."""

import torch

from .common import ExerciseWrong, check_exercise, not_written

__all__ = ["check_zigzag_pairs", "check_ring_bytes"]

_KINDS = ("full", "diagonal", "empty")


# --- Exercise 1: which chunk pairs a rank computes with the zigzag split -------------------------

def _zigzag_pairs(rank, source, world):
    """{(query chunk, key chunk): kind} for rank ``rank``'s chunks against rank ``source``'s."""
    def chunks(r):
        return (r, 2 * world - 1 - r)

    return {(a, b): "full" if a > b else "diagonal" if a == b else "empty"
            for a in chunks(rank) for b in chunks(source)}


def _cases():
    return [(rank, source, world) for world in (2, 3, 4) for rank in range(world) for source in range(world)]


def _as_dict(got, name):
    if got is None:
        raise ExerciseWrong(f"{name}: your function returned None. Did you forget the `return`?")
    if not isinstance(got, dict):
        raise ExerciseWrong(f"{name}: return a dict {{(query chunk, key chunk): kind}}; got a {type(got).__name__}")
    bad = [kind for kind in got.values() if kind not in _KINDS]
    if bad:
        raise ExerciseWrong(f"{name}: every kind must be one of {_KINDS}; got {bad[0]!r}")
    return {tuple(int(i) for i in pair): kind for pair, kind in got.items()}


def check_zigzag_pairs(fn):
    """``fn(rank, source, world)`` -> {(query chunk, key chunk): "full" | "diagonal" | "empty"} for the
    four pairs of rank ``rank``'s two chunks with rank ``source``'s, chunks numbered 0 … 2·world − 1."""
    name = "zigzag_pairs"
    for rank, source, world in _cases():
        try:
            got = fn(rank, source, world)
        except NotImplementedError as exc:
            raise not_written(name, exc) from None
        got = _as_dict(got, name)
        expected = _zigzag_pairs(rank, source, world)
        case = f"rank {rank}, source {source}, world {world}"
        if set(got) != set(expected):
            hint = ("Rank r holds chunks r and 2·world − 1 − r (2·world chunks, numbered from 0)."
                    if any(2 * world - rank in pair for pair in got) else
                    "List the pairs (a, b) for a in the rank's two chunks and b in the source's two chunks.")
            raise ExerciseWrong(f"{name} ({case}): expected the pairs {sorted(expected)}, got {sorted(got)}. {hint}")
        wrong = {pair: kind for pair, kind in got.items() if kind != expected[pair]}
        if wrong:
            pair, kind = next(iter(wrong.items()))
            flipped = all(got[p] == {"full": "empty", "empty": "full"}.get(k, k) for p, k in expected.items())
            hint = ("Full and empty are swapped: query chunk a sees key chunk b entirely when a comes *after* b."
                    if flipped else "Query chunk a sees all of key chunk b when a > b, the causal triangle when "
                    "a == b, and nothing when a < b.")
            raise ExerciseWrong(f"{name} ({case}): pair {pair} is {expected[pair]!r}, you said {kind!r}. {hint}")
    print(f"✓ {name}: correct for every (rank, source) with 2, 3 and 4 ranks")


# --- Exercise 2: the bytes each rank sends per ring step -------------------------------------------

def _ring_bytes(batch, heads, heads_kv, seq_local, dim, bytes_per_element):
    shard = batch * heads_kv * seq_local * dim
    return torch.tensor([2 * shard * bytes_per_element, 2 * shard * (bytes_per_element + 4)], dtype=torch.float64)


_BYTES_CASES = [(1, 16, 16, 32768, 128, 2), (2, 64, 8, 4096, 64, 2), (1, 8, 1, 1000, 128, 4)]


def check_ring_bytes(fn):
    """``fn(batch, heads, heads_kv, seq_local, dim, bytes_per_element)`` -> (forward, backward): the
    bytes one rank sends to the next at one step of the forward lap and of the backward lap."""
    name = "ring_bytes"
    hint = None
    try:
        got = [float(x) for x in fn(*_BYTES_CASES[1])]
        batch, heads, heads_kv, seq_local, dim, nbytes = _BYTES_CASES[1]
        shard = batch * heads_kv * seq_local * dim
        if got[0] == 2 * batch * heads * seq_local * dim * nbytes:
            hint = "Only K and V travel, and they have H_kv heads (GQA), not H."
        elif got[0] == shard * nbytes:
            hint = "Both K and V travel: two shards per step."
        elif got[1] == 2 * got[0] or got[1] == 4 * shard * nbytes:
            hint = ("The backward sends K, V in the input dtype and the running dK, dV sums in float32 "
                    "(4 bytes), so that the sums are not rounded at every hop.")
    except Exception:  # noqa: BLE001 (check_exercise reports it)
        pass
    def learner(*args):
        got = fn(*args)
        return None if got is None else torch.as_tensor([float(x) for x in got], dtype=torch.float64)

    check_exercise(name, learner, _ring_bytes, _BYTES_CASES, atol=0, rtol=0, hint=hint)
