"""Checkers for chapter 10 (ring attention): the zigzag split's chunk pairs, the bytes on the ring, and
one ring step written by the learner (the LSE merge of a partial result), checked on its own against the
float64 merge and then in place of the course's merge inside ``ring_forward`` (a 2-rank ring in one process).

The merge has no tiles: what it can get wrong is which of the two LSEs is the larger and how large they are. Its
rows are drawn from ``shapes.draw_merge_rows`` with two parts (the running result, the partial): one row per class
of ``shapes.merge_row_classes`` (either part empty or both, either LSE more than 88 above the other, equal LSEs,
both past 88, both below −104), each of two heads with its own values; the ring's heads are
``shapes.attention_inputs``' kinds (plain, every score of a row very negative, large).
"""

import contextlib
import math

import torch

from .common import ExerciseFailed, ExerciseWrong, check_exercise, not_written
from .kernels import describe_rows, same_outputs
from .shapes import attention_inputs, draw_merge_rows

__all__ = ["check_zigzag_pairs", "check_ring_bytes", "check_merge_partial", "HINTS"]

HINTS = {
    "a": ["Rank r holds chunks r and 2·world − 1 − r. Query chunk a sees all of key chunk b when a comes "
          "after b, the causal triangle when a == b, and nothing when a comes before b.",
          "A small helper chunks(r) returning the two chunk numbers, then a dict comprehension over "
          "a in chunks(rank), b in chunks(source)."],
    "b": ["Only K and V travel in the forward, with H_kv heads. The backward also sends the running dK "
          "and dV sums, which stay in float32 (4 bytes) on the way.",
          "Count the elements of one shard from its shape (batch, seq_local, heads_kv, dim), multiply by "
          "bytes_per_element (or by 4 for a float32 sum), and add up the shards that leave a rank in one step "
          "of each pass; return the two totals as a pair."],
    "c": ["The new LSE is log(e^{LSE} + e^{LSE_b}); each part keeps the share e^{LSE_part − LSE_new} of "
          "the new denominator. Compute it without overflowing (subtract the larger LSE) and without "
          "NaN when both parts saw no key (LSE = −∞ on both sides: the result is O = 0, LSE = −∞).",
          "Three calls do the work: torch.logaddexp (log(e^a + e^b) without overflow, and −∞ when both are −∞), "
          "torch.where (to swap a −∞ you are about to subtract for something harmless) and broadcasting "
          "a (…, S) weight over a (…, S, D) output with [..., None]. Try your merge by hand on one row where "
          "both LSEs are −∞ before running the checker."],
}

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


# --- Exercise (c): one ring step, the LSE merge of a partial result ---------------------------------

def _merge_reference(out, lse, out_b, lse_b):
    """Float64 merge of two attention results over disjoint keys (O = 0, LSE = −∞ where neither saw a key)."""
    total = torch.logaddexp(lse.double(), lse_b.double())
    shift = torch.where(total == -math.inf, 0.0, total)
    return (torch.exp(lse.double() - shift)[..., None] * out.double()
            + torch.exp(lse_b.double() - shift)[..., None] * out_b.double()), total


# Chapter 10's names for the classes of ``shapes.merge_row_classes`` with two parts: the running result, the partial.
_ROW_NAMES = {"no part saw the row": "both empty", "the first part saw no key": "nothing seen yet",
              "the last part saw no key": "an empty partial", "a tie for the largest LSE": "equal LSEs",
              "every LSE past 88": "both LSEs > 88", "every LSE below −104": "both LSEs < −104",
              "the largest LSE first, more than 88 above the rest": "the running LSE 88+ above",
              "the largest LSE last, more than 88 above the rest": "the partial's LSE 88+ above",
              "ordinary": "ordinary"}


def _merge_inputs():
    """Running state and partial [1, 2, R, 4] in float32, one row per class of ``shapes.merge_row_classes`` for
    two parts (the running result first, the partial second), then ordinary rows; each head draws its own
    values. Returns the inputs and the rows' names."""
    g = torch.Generator().manual_seed(10)
    heads = [draw_merge_rows(2, seed=seed) for seed in (10, 11)]
    labels = heads[0][1]
    lse, lse_b = (torch.stack([rows[:, part] for rows, _ in heads])[None] for part in (0, 1))
    out, out_b = (torch.randn(1, 2, len(labels), 4, generator=g) for _ in range(2))
    out[lse == -math.inf] = 0
    out_b[lse_b == -math.inf] = 0
    return (out, lse, out_b, lse_b), [_ROW_NAMES[label] for label in labels]


def _merge_models(out, lse, out_b, lse_b):
    """The learner's (O, LSE) as the usual mistakes compute them, in float32."""
    total = torch.logaddexp(lse, lse_b)
    shift = torch.where(total == -math.inf, 0.0, total)

    def merged(new_lse, shift, weights_swapped=False, exp=torch.exp):
        w, w_b = exp(lse - shift)[..., None], exp(lse_b - shift)[..., None]
        if weights_swapped:
            w, w_b = w_b, w
        return {"O": w * out + w_b * out_b, "LSE": new_lse}

    def guarded(new_lse):
        return merged(new_lse, torch.where(new_lse == -math.inf, 0.0, new_lse))

    naive = torch.log(torch.exp(lse) + torch.exp(lse_b))
    total2 = torch.log2(torch.exp2(lse) + torch.exp2(lse_b))
    floor = torch.maximum(lse, lse_b).clamp(min=0)
    floored = floor + torch.log(torch.exp(lse - floor) + torch.exp(lse_b - floor))
    around = [torch.where(a == -math.inf, b, a + torch.log1p(torch.exp(b - a)))
              for a, b in ((lse, lse_b), (lse_b, lse))]
    return [
        ("the partial is averaged with the running result: the two parts weigh e^{LSE_part − LSE_new}, by how "
         "much of the denominator each holds, not ½ each.",
         {"O": (out + out_b) / 2, "LSE": total}),
        ("O is right but the LSE returned is the old one: return the merged log(e^{LSE} + e^{LSE_b}), or the "
         "next step weighs this one wrongly.", merged(lse, shift)),
        ("the LSE returned is the larger of the two, not log(e^{LSE} + e^{LSE_b}).",
         merged(torch.maximum(lse, lse_b), shift)),
        ("e^{LSE} is taken without subtracting the larger LSE first: it overflows float32 past 88 (LSE = 100 "
         "here). torch.logaddexp does the subtraction for you.", merged(naive, naive)),
        ("no guard for a row neither part saw: the new LSE is −∞ and e^{−∞ − (−∞)} = NaN. Shift by 0 there "
         "(O = 0, LSE = −∞).", merged(total, total)),
        ("the weights are swapped: the running result weighs e^{LSE − LSE_new} (its own LSE), the partial "
         "e^{LSE_b − LSE_new}.", merged(total, shift, weights_swapped=True)),
        ("the LSEs are natural logarithms: use exp and log (or logaddexp), not exp2 and log2.",
         merged(total2, torch.where(total2 == -math.inf, 0.0, total2), exp=torch.exp2)),
        ("the larger LSE is floored at 0 (a clamp(min=0) or max(…, 0) as the guard against −∞): when both LSEs are "
         "below −104, e^{LSE − 0} is 0 in float32 and the row comes out as one that saw no key. Guard the −∞ with "
         "torch.where, or let torch.logaddexp subtract the larger LSE.", guarded(floored)),
        *((f"log(e^{{LSE}} + e^{{LSE_b}}) is taken around {which} LSE ({a} + log(1 + e^{{{b} − {a}}})), not around "
           f"the larger: e^{{{b} − {a}}} overflows float32 once {b} is more than 88 above {a}. Subtract the larger "
           "of the two (torch.logaddexp does).", guarded(value))
          for which, a, b, value in (("the running", "LSE", "LSE_b", around[0]),
                                     ("the partial's", "LSE_b", "LSE", around[1]))),
    ]


@contextlib.contextmanager
def _learner_code(name, where=""):
    """What the learner's merge raises, as the checker's verdict: a placeholder, or an error ``where`` it ran."""
    try:
        yield
    except NotImplementedError as exc:
        raise not_written(name, exc) from None
    except ExerciseFailed:
        raise
    except Exception as exc:
        raise ExerciseWrong(f"✗ {name}{where}: your function raised {type(exc).__name__}: {exc}") from None


def _call(name, fn, *args):
    with _learner_code(name):
        got = fn(*(a.clone() for a in args))
    if not (isinstance(got, tuple | list) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise ExerciseWrong(f"✗ {name}: return the pair (O, LSE) of tensors; got {type(got).__name__}")
    out, lse = got
    if out.shape != args[0].shape or lse.shape != args[1].shape:
        raise ExerciseWrong(f"✗ {name}: O has shape {tuple(out.shape)} and LSE {tuple(lse.shape)}; expected "
                            f"{tuple(args[0].shape)} and {tuple(args[1].shape)}")
    return {"O": out, "LSE": lse}


def _bad_rows(got, expected):
    for what in ("O", "LSE"):
        have, want = got[what].double(), expected[what]
        finite = torch.isfinite(want)
        bad = (torch.isnan(have) | (~finite & (have != want))
               | (finite & ~torch.isclose(have, want, atol=1e-4, rtol=1e-4)))
        if bad.any():
            nan = " (NaN)" if torch.isnan(have[bad]).any() else ""
            return f"{what} is wrong{nan} in {describe_rows(bad, 'row')}"
    return None


class _Received:
    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


class _LapComm:
    """Rank ``rank`` of a ring run inside this process: ``start`` hands over the K/V shard that the previous rank
    holds at the next step (copied into the lap's receive buffers), which is what ``RingComm`` receives over gloo
    or NCCL. The merge under test runs on the same data either way, without starting processes."""

    def __init__(self, rank, world, shards):
        self.rank, self.world, self.shards, self.step = rank, world, shards, 0

    def start(self, tensors, tag=0, into=None):
        self.step += 1
        received = list(into) if into is not None else [torch.empty_like(t) for t in tensors]
        for buffer, shard in zip(received, self.shards[(self.rank - self.step) % self.world]):
            buffer.copy_(shard)
        return _Received(received)


@contextlib.contextmanager
def _merging_with(ring, merge, calls):
    """``ring_forward`` folds each step's partial result in with ``merge`` (given copies of the rows it merges)
    instead of the course's ``_merge_into``; ``calls`` counts the merges."""
    original = getattr(ring, "_merge_into", None)
    if original is None:  # the ring changed: checking it without the learner's merge would prove nothing
        raise RuntimeError("course_utils.api.ring has no _merge_into any more: update ch10.check_merge_partial")

    def merge_into(out, lse, out_b, lse_b, rows):
        calls.append(rows)
        new_out, new_lse = merge(out[:, :, rows].float().clone(), lse[:, :, rows].clone(), out_b.float().clone(),
                                 lse_b.clone())
        out[:, :, rows] = new_out.to(out.dtype)
        lse[:, :, rows] = new_lse

    ring._merge_into = merge_into
    try:
        yield
    finally:
        ring._merge_into = original


_RING_HEADS = ("plain", "very negative", "large", "plain")


def check_merge_partial(merge_partial):
    """``merge_partial(out, lse, out_b, lse_b) -> (out, lse)``: the running result of one ring step merged
    with the partial result of the step (float32 [B, H, S, D] and [B, H, S]). Checked on rows chosen to
    expose the usual mistakes against the float64 merge, then in place of the course's merge inside
    ``ring_forward``: both ranks of a 2-rank ring, run in this process, against the float64 attention reference.
    (Section 4 runs the ring itself on gloo processes; here the shards are handed over in memory, as starting
    two processes costs half a minute on a laptop and the merge sees the same data.)"""
    from ..api import ring
    from ..checking.checks import CheckFailed
    from ..checking.validation import check_forward

    name = "merge_partial"
    args, row_names = _merge_inputs()
    got = _call(name, merge_partial, *args)
    out, lse = _merge_reference(*args)
    symptom = _bad_rows(got, {"O": out, "LSE": lse})
    if symptom:
        cause = next((message for message, model in _merge_models(*args) if same_outputs(got, model)), None)
        advice = f"Likely cause: {cause}" if cause else ("Hint: LSE_new = log(e^{LSE} + e^{LSE_b}); O_new = "
                                                         "e^{LSE − LSE_new} · O + e^{LSE_b − LSE_new} · O_b.")
        rows = ", ".join(f"{i} {row}" for i, row in enumerate(row_names))
        raise ExerciseWrong(f"✗ {name}, rows chosen to break it ({rows}): {symptom}. {advice}")
    batch, heads, heads_kv, seq, dim, world = 2, 4, 2, 64, 16, 2  # section 4's shapes: the same compiled kernel
    # Heads of shapes.attention_inputs' kinds: plain, every score of a row very negative (LSE about −170), large
    # (logits ×4), plain. (A head of scores about +700 loses more than float32's tolerance in the forward itself;
    # the rows above cover LSEs past 88.)
    q, k, v = attention_inputs(batch, heads, seq, seq, dim, seed=11, heads_kv=heads_kv, kinds=_RING_HEADS)
    # Non-causal and contiguous: one kernel shape for every step (the rows above cover the masked cases).
    shards = [[ring.shard_sequence(x, world, r, "contiguous").contiguous() for x in (q, k, v)] for r in range(world)]
    calls, per_rank = [], []
    with _learner_code(name, " in the ring"), _merging_with(ring, merge_partial, calls):
        for rank in range(world):
            comm = _LapComm(rank, world, [kv for _, *kv in shards])
            per_rank.append(ring.ring_forward(*shards[rank], comm, causal=False, layout="contiguous"))
    if not calls:
        raise RuntimeError("ring_forward never called the merge: update ch10.check_merge_partial")
    ring_out = ring.unshard_sequence([o for o, _ in per_rank], "contiguous")
    ring_lse = ring.unshard_sequence([lse for _, lse in per_rank], "contiguous")
    try:
        check_forward(q, k, v, ring_out, ring_lse, quiet=True)
    except CheckFailed as exc:
        raise ExerciseWrong(f"✗ {name} in the ring (2 ranks, {len(calls)} merges): {str(exc).splitlines()[0]}") \
            from None
    print(f"✓ {name}: right on rows that saw nothing, empty partials, either LSE 88 above the other, LSEs past 88 and "
          f"below −104, and inside ring_forward: a 2-rank ring ({len(calls)} merges by your function; heads "
          f"{', '.join(_RING_HEADS)}) matches the float64 reference in O and LSE")
