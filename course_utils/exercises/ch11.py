"""Checkers for chapter 11 (FlexAttention: score and mask modifiers compiled into the kernels).

Each modifier exercise is checked twice: first on torch tensors, against the float64 definition on a
grid of scores and positions (fast, and it says which usual mistake the answer looks like), then
inside the kernels: ``flex_attention`` compiles the learner's function into the TileLang forward
and backward on the C backend, and O, LSE, dQ, dK, dV are checked against the float64 reference.
"""

import math

import torch

from ..api import flex
from ..checking.checks import CheckFailed
from ..checking.flex_reference import flex_references
from ..checking.validation import check_backward, check_forward
from .common import ExerciseWrong, check_exercise, not_written, with_diagnosis

__all__ = ["HINTS", "check_alibi", "check_document_mask", "check_skipped_fraction"]

HINTS = {
    "a": ["ALiBi adds to each score a penalty that grows linearly with the distance from the query back to the "
          "key, with one slope per head. With causal masking the key is never after the query, so the distance "
          "kv_idx − q_idx is ≤ 0 and the bias is ≤ 0.",
          "`slope` is the captured() handle made for you: index it with the head, h, like a tensor, and multiply "
          "it by the signed distance from the query to the key (which of q_idx, kv_idx comes first decides the "
          "sign). Only ordinary operators are needed: the score plus that bias."],
    "b": ["A query may see a key when both belong to the same document and the key is not in the query's future.",
          "Index the captured handle `doc` with a position to get its document, and compare two of them with ==; "
          "causality compares the two positions. Join two conditions with & (not `and`: a kernel value has no "
          "Python truth value)."],
    "c": ["A tile (query block qb, key block kb) is skipped when no pair in it is visible. With a causal document "
          "mask, a pair is visible when query and key share a document and the key is not later.",
          "Loop over the blocks; for each, ask whether some document has a query in the query block and a key in the "
          "key block that is not after it. The last key of a document inside the key block's range that is ≤ the "
          "last query of that document inside the query block's range is enough to decide."],
}


def _grid(seq_q, seq_k, heads, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, heads, seq_q, seq_k, generator=g, dtype=torch.float64) * 4
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.arange(heads).view(1, -1, 1, 1)
    return scores, b, h, torch.arange(seq_q).view(1, 1, -1, 1), torch.arange(seq_k).view(1, 1, 1, -1)


def _kernel_check(name, q, k, v, d_out, learner_mods, reference_mods):
    """The learner's modifiers compiled into the kernels, against the float64 reference of the right ones."""
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flex.flex_attention(*leaves, return_lse=True, **learner_mods)
        grads = torch.autograd.grad(out, leaves, d_out)
    except NotImplementedError as exc:
        raise not_written(name, exc) from None
    except TypeError as exc:
        raise ExerciseWrong(f"{name}: the kernel could not be built from your function: {exc}") from None
    refs = flex_references(q, k, v, d_out=d_out, **reference_mods)
    try:
        check_forward(q, k, v, out, lse, refs=refs, name=f"{name} in the kernel", quiet=True)
        check_backward(q, k, v, d_out, grads, refs=refs, name=f"{name} in the kernel", quiet=True)
    except CheckFailed as exc:
        raise ExerciseWrong(f"{name}: correct on tensors but not in the kernel: {exc}") from None
    print(f"✓ {name}: compiled into the TileLang forward and backward (C backend), O, LSE, dQ, dK, dV match the "
          f"float64 reference on every head")


def _inputs(batch, heads, heads_kv, seq, dim, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=g) * scale
    k, v = (torch.randn(batch, heads_kv, seq, dim, generator=g) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seq, dim, generator=g)


# --- Exercise (a): ALiBi as a score_mod ---------------------------------------------------------------

def check_alibi(make_alibi):
    """``make_alibi(slopes [H]) -> score_mod`` adding slope[h] · (kv_idx − q_idx) to each score."""
    name = "ALiBi score_mod"
    heads = 4
    slopes = flex.alibi_slopes(heads)
    try:
        mine = make_alibi(slopes)
    except NotImplementedError as exc:
        raise not_written(name, exc) from None
    right = flex.alibi(slopes)
    cases = [_grid(9, 9, heads, 0), _grid(7, 12, heads, 1)]

    def run():
        check_exercise(name, mine, right, cases, atol=1e-9, rtol=1e-9)

    scores, b, h, q_idx, kv_idx = cases[0]
    s = slopes.double().view(1, -1, 1, 1)
    models = {
        "the distance has the wrong sign: a key behind the query (kv_idx < q_idx) must get a negative bias, so "
        "write slope · (kv_idx − q_idx).": scores + s * (q_idx - kv_idx),
        "the score itself is missing: return score + the bias.": s * (kv_idx - q_idx) + 0 * scores,
        "ALiBi's bias is linear in the signed distance (kv_idx − q_idx), not its absolute value.":
            scores - s * (kv_idx - q_idx).abs(),
        "the slope belongs to the head: index the captured slopes with h.": scores + slopes.double()[0] * (kv_idx -
                                                                                                          q_idx),
        "each head has its own slope: multiply the distance by slope[h].": scores + (kv_idx - q_idx),
    }
    with_diagnosis(run, [(message, lambda m=model: _matches(mine, cases[0], m)) for message, model in models.items()])
    q, k, v, d_out = _inputs(1, heads, 2, 40, 16, 11)
    _kernel_check(name, q, k, v, d_out, dict(score_mod=mine, mask_mod=flex.causal_mask),
                  dict(score_mod=right, mask_mod=flex.causal_mask))


def _matches(fn, args, model):
    got = fn(*args)
    return isinstance(got, torch.Tensor) and torch.allclose(got.double().expand_as(model), model, atol=1e-9)


# --- Exercise (b): document masking as a mask_mod --------------------------------------------------------

def _mask_grid(doc_ids, fn):
    s = len(doc_ids)
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    out = fn(b, h, torch.arange(s).view(1, 1, -1, 1), torch.arange(s).view(1, 1, 1, -1))
    return out


def check_document_mask(make_document_mask):
    """``make_document_mask(doc_ids [S]) -> mask_mod``: same document, and the key not after the query."""
    name = "document mask_mod"
    packings = ([7, 20, 1, 17], [16, 16, 3], [45])
    ids = [flex.document_ids(p) for p in packings]
    try:
        mine = [make_document_mask(d) for d in ids]
    except NotImplementedError as exc:
        raise not_written(name, exc) from None
    right = [flex.document_mask(d) for d in ids]

    def run():
        for m, r, d in zip(mine, right, ids):
            try:
                got = _mask_grid(d, m)
            except NotImplementedError as exc:
                raise not_written(name, exc) from None
            except RuntimeError as exc:
                if "Boolean value of Tensor" in str(exc):
                    raise ExerciseWrong(f"{name}: Python's `and`, `or`, `not` and `if` need a single truth value; "
                                        "a mask_mod works on whole grids of positions (and, in the kernel, on "
                                        "expressions): join conditions with &, |, ~.") from None
                raise ExerciseWrong(f"{name}: your function raised RuntimeError: {exc}") from None
            except Exception as exc:
                raise ExerciseWrong(f"{name}: your function raised {type(exc).__name__}: {exc}") from None
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
                raise ExerciseWrong(f"{name}: a mask_mod returns booleans (a comparison); got "
                                    f"{getattr(got, 'dtype', type(got).__name__)}")
            expected = _mask_grid(d, r)
            got = got.expand_as(expected)
            if not torch.equal(got, expected):
                wrong = (got != expected).nonzero()[0].tolist()
                raise ExerciseWrong(f"{name}: with documents of lengths {d.bincount().tolist()}, query {wrong[2]} and "
                                    f"key {wrong[3]} should be {'visible' if expected[tuple(wrong)] else 'hidden'}.")
        print(f"✓ {name}: the right mask for all {len(ids)} packings (on tensors)")

    d = ids[0]
    grid = _mask_grid(d, right[0])
    same = (d[:, None] == d[None, :])[None, None]
    causal = torch.ones_like(grid) & (torch.arange(len(d))[:, None] >= torch.arange(len(d))[None, :])
    models = {
        "a query must not see later keys of its own document: add & (q_idx >= kv_idx).": same,
        "a query sees only keys of its own document: add & (doc[q_idx] == doc[kv_idx]).": causal,
        "a query sees its own position too: q_idx >= kv_idx, not >.": same & (torch.arange(len(d))[:, None] >
                                                                               torch.arange(len(d))[None, :]),
    }
    with_diagnosis(run, [(msg, lambda m=model: torch.equal(_mask_grid(d, mine[0]).expand_as(grid), m))
                         for msg, model in models.items()])
    q, k, v, d_out = _inputs(1, 2, 2, 45, 16, 12)
    _kernel_check(name, q, k, v, d_out, dict(mask_mod=mine[0]), dict(mask_mod=right[0]))


# --- Exercise (c): predict the share of skipped tiles ----------------------------------------------------

def check_skipped_fraction(skipped_fraction):
    """``skipped_fraction(lengths, block) -> float``: the share of block × block tiles a causal document mask
    over documents of ``lengths`` leaves empty (what ``create_block_mask(...).fraction_skipped()`` measures)."""
    cases = [([64, 64], 32), ([100, 28], 32), ([5, 120, 3], 16), ([256], 64), ([30, 30, 30, 30, 30], 16)]

    def reference(lengths, block):
        s = sum(lengths)
        bm = flex.create_block_mask(flex.document_mask(flex.document_ids(lengths)), None, None, s, s,
                                    block=(block, block))
        return torch.tensor(bm.fraction_skipped(), dtype=torch.float64)

    def learner(lengths, block):
        return torch.tensor(float(skipped_fraction(lengths, block)), dtype=torch.float64)

    def causal_only(lengths, block):
        n = math.ceil(sum(lengths) / block)
        return (n * (n - 1) / 2) / (n * n)

    def hidden_pairs(lengths, block):
        s = sum(lengths)
        return 1 - sum(n * (n + 1) // 2 for n in lengths) / (s * s)

    def run():
        check_exercise("skipped_fraction", learner, reference, cases, atol=1e-12, rtol=0)

    with_diagnosis(run, [
        ("that is causal masking alone: the documents leave more tiles empty (a tile below the diagonal whose "
         "queries and keys are in different documents).", lambda: abs(skipped_fraction(*cases[0]) -
                                                                      causal_only(*cases[0])) < 1e-12),
        ("count tiles, not pairs: a tile with a single visible pair is visited.",
         lambda: abs(skipped_fraction(*cases[1]) - hidden_pairs(*cases[1])) < 1e-12),
    ])
