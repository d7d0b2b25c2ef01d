"""Checkers for the exercises of chapter 01 (naive attention)."""

import math

import torch

from ..core.reference import attention_reference
from .common import ExerciseIncomplete, ExerciseWrong, check_exercise

__all__ = ["check_max_seq_len", "check_causal_attention"]


def _returns_something(name, fn, args):
    """Raise a clear message when ``fn`` returns None (a forgotten ``return``)."""
    try:
        got = fn(*args)
    except NotImplementedError:
        raise ExerciseIncomplete(f"{name}: not written yet — replace the `raise NotImplementedError` "
                                 "line with your code and run the cell again.") from None
    except Exception:  # check_exercise reports the exception itself
        return
    if got is None:
        raise ExerciseWrong(f"{name}: your function returned None. Did you forget the `return`?")


# --- Exercise 1: the longest sequence whose score matrix fits -----------------------------------

def _max_seq_len(batch, heads, bytes_per_el, capacity_bytes):
    # batch·heads·S²·bytes <= capacity  <=>  S² <= capacity // (batch·heads·bytes), S² being an integer
    return torch.tensor(math.isqrt(int(capacity_bytes) // (batch * heads * bytes_per_el)))


_SEQ_CASES = [
    (4, 16, 2, 80 * 10**9),           # the chapter's shape, fp16, an 80 GB card
    (1, 1, 4, 10**6),                 # a tiny fp32 case
    (2, 8, 2, 2 * 8 * 2 * 1000**2),   # exactly S = 1000 fits
    (2, 8, 2, 2 * 8 * 2 * 1000**2 - 1),  # one byte short: S = 999
    (8, 32, 4, 40 * 10**9),
]


def check_max_seq_len(fn):
    """Check ``fn(batch, heads, bytes_per_el, capacity_bytes)`` against the exact integer answer."""
    _returns_something("max_seq_len", fn, _SEQ_CASES[0])
    hint = ("The answer is the largest integer S with batch·heads·S²·bytes_per_el <= capacity_bytes. "
            "Divide the capacity by the bytes of one score per (batch, head) and take the integer "
            "square root, rounding down (math.isqrt avoids float rounding at exact squares).")
    try:
        exact, short = float(fn(*_SEQ_CASES[2])), float(fn(*_SEQ_CASES[3]))  # S = 1000 fits; then 999
        if exact != int(exact) or short != int(short):
            hint = "S is a number of positions: return a whole number, rounded down. " + hint
        elif exact == 1001:
            hint = ("You round up: on case 2 you return 1001, but exactly S = 1000 fits. "
                    "Round down. " + hint)
    except Exception:  # check_exercise reports the exception itself
        pass
    check_exercise("max_seq_len", fn, _max_seq_len, _SEQ_CASES, atol=0, rtol=0, hint=hint)


# --- Exercise 2: causal attention by hand ----------------------------------------------------------

def _attention_cases():
    g = torch.Generator().manual_seed(1)
    shapes = [(1, 1, 5, 4), (2, 3, 17, 8), (1, 2, 64, 16)]
    return [tuple(torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3)) for shape in shapes]


def _reference_causal(q, k, v):
    return attention_reference(q, k, v, causal=True)


def _common_mistakes(q, k, v):
    """Outputs of plausible wrong answers, to name the mistake when the learner's output matches one."""
    s = q.shape[2]
    scale = 1 / math.sqrt(q.shape[-1])
    lower = torch.ones(s, s, dtype=torch.bool).tril()
    scores = q @ k.transpose(-2, -1) * scale
    probs = torch.softmax(scores, dim=-1)
    return {
        "The output equals attention without any mask: query i must not see keys j > i. "
        "Fill those scores with -inf before the softmax.": attention_reference(q, k, v),
        "The output looks like causal attention without the 1/sqrt(D) scale: multiply Q Kᵀ by "
        "1/sqrt(head_dim) before masking.": attention_reference(q, k, v, causal=True, sm_scale=1.0),
        "The mask points the wrong way: keep the lower triangle (key j <= query i), e.g. "
        "torch.ones(S, S, dtype=torch.bool).tril(), and mask where it is False.":
            torch.softmax(scores.masked_fill(lower.T.logical_not(), float("-inf")), dim=-1) @ v,
        "Masked scores were set to 0, not -inf: exp(0) = 1 still gives those keys weight. "
        "Use float('-inf').": torch.softmax(scores.masked_fill(~lower, 0.0), dim=-1) @ v,
        "The mask was applied after the softmax, so the visible weights no longer sum to 1. "
        "Mask the scores, then take the softmax.": probs.masked_fill(~lower, 0.0) @ v,
    }


def check_causal_attention(fn):
    """Check ``fn(q, k, v)`` (float64, [B, H, S, D]) against the causal float64 reference."""
    cases = _attention_cases()
    _returns_something("causal attention", fn, cases[0])
    hint = ("Compute scores = Q Kᵀ / sqrt(D), set the scores of keys j > i to -inf with masked_fill, "
            "take the softmax over the keys (last dim), then multiply by V.")
    try:
        got = torch.as_tensor(fn(*cases[1])).double()
        for message, wrong in _common_mistakes(*cases[1]).items():
            if got.shape == wrong.shape and torch.allclose(got, wrong, atol=1e-9, rtol=1e-9):
                hint = message
                break
    except Exception:  # check_exercise reports the exception itself
        pass
    check_exercise("causal attention", fn, _reference_causal, cases, atol=1e-9, rtol=1e-9, hint=hint)


HINTS = {
    "a": ["The matrix holds batch · heads · S² entries of bytes_per_el bytes each. Solve batch · heads · S² · "
          "bytes_per_el ≤ capacity_bytes for the largest whole S.",
          "Stay in integers so that the edge is exact: // divides and rounds down, math.isqrt is the exact integer "
          "square root (a float sqrt can land one off for large numbers)."],
    "b": ["Four steps: the scaled scores, a mask hiding every key after its query, the softmax over the keys, the "
          "product with V. A hidden key must get probability 0, so its score becomes −∞ before the softmax.",
          "torch.tril builds a lower-triangular mask (what each query may see); Tensor.masked_fill writes −∞ where "
          "a key is hidden; torch.softmax along the key dimension; @ for the two products."],
}
