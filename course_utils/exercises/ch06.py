"""Checkers for chapter 06 (GQA, sliding windows and attention sinks).

Each checker runs the learner's function through ``check_exercise``; when the answer is wrong it
compares it with the usual mistakes (a sink dropped before the softmax, a scaled sink logit, a
sign error, a window off by one, …) and says which one it looks like.
"""

import math

import torch

from ..reference import attention_reference, visibility_mask
from .common import ExerciseWrong, check_exercise

__all__ = ["check_sink_attention", "check_dsinks", "check_visible_pairs"]


def _close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True))


def _with_diagnosis(name, run, mistakes):
    """Run ``run()``; on a wrong answer, add the first mistake whose output the learner's matches."""
    try:
        run()
    except ExerciseWrong as exc:
        for message, matches in mistakes:
            try:
                if matches():
                    raise ExerciseWrong(f"{str(exc).rstrip()} Likely cause: {message}") from None
            except ExerciseWrong:
                raise
            except Exception:  # a diagnosis that cannot run says nothing
                continue
        raise


# --- Exercise (a): attention with a sink, gpt-oss style ---------------------------------------------

def _sink_cases():
    g = torch.Generator().manual_seed(6)
    cases = []
    for (b, h, s_q, s_k, d), sink_scale in (((1, 1, 5, 5, 4), 1.0), ((2, 3, 17, 23, 8), 2.0), ((1, 4, 9, 9, 16), 6.0)):
        q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (s_q, s_k, s_k))
        cases.append((q, k, v, torch.randn(h, generator=g, dtype=torch.float64) * sink_scale))
    return cases


def _reference_sink_attention(q, k, v, sinks):
    return attention_reference(q, k, v, sinks=sinks)


def check_sink_attention(fn):
    """``fn(q, k, v, sinks)``: non-causal attention (q, k, v [B, H, S, D] float64) with one sink
    logit per head (``sinks`` [H]) in the softmax denominator."""
    cases = _sink_cases()
    q, k, v, sinks = cases[1]

    def got():
        return torch.as_tensor(fn(q, k, v, sinks)).double()

    scale = 1 / math.sqrt(q.shape[-1])
    mistakes = [
        ("the output equals attention without a sink. Keep the sink column in the softmax and drop it "
         "only afterwards; renormalising the remaining weights undoes the sink.",
         lambda: _close(got(), attention_reference(q, k, v))),
        ("the sink logit was multiplied by the softmax scale 1/sqrt(D). It is a learned logit on the "
         "same footing as the already scaled scores Q·Kᵀ/sqrt(D): concatenate it unscaled.",
         lambda: _close(got(), attention_reference(q, k, v, sinks=sinks * scale))),
        ("the sink went in as exp(sink) instead of as a logit: concatenate the raw logit and let the "
         "softmax exponentiate it.",
         lambda: _close(got(), attention_reference(q, k, v, sinks=torch.exp(sinks)))),
    ]
    hint = ("Compute the scaled scores [B, H, S_q, S_k], append sinks[h] as one more column "
            "(expand it to [B, H, S_q, 1] and torch.cat on the last dim), take the softmax, drop the "
            "last column, multiply by V.")
    _with_diagnosis("sink_attention", lambda: check_exercise(
        "sink_attention", fn, _reference_sink_attention, cases, atol=1e-9, rtol=1e-9, hint=hint), mistakes)


# --- Exercise (b): the gradient of the sink logits -------------------------------------------------

def _dsinks_cases():
    g = torch.Generator().manual_seed(7)
    cases = []
    for b, h, s in ((1, 1, 6), (2, 4, 33), (3, 8, 10)):
        p_sink = torch.rand(b, h, s, generator=g, dtype=torch.float64)
        cases.append((p_sink, torch.randn(b, h, s, generator=g, dtype=torch.float64)))
    return cases


def _reference_dsinks(p_sink, delta):
    return -(p_sink * delta).sum(dim=(0, 2))


def check_dsinks(fn):
    """``fn(p_sink, delta) -> dsinks [H]`` from P_sink and Δ, both [B, H, S]."""
    cases = _dsinks_cases()
    p_sink, delta = cases[1]

    def got():
        return torch.as_tensor(fn(p_sink, delta)).double()

    mistakes = [
        ("the sign is flipped: raising the sink logit takes probability away from every key, so "
         "dsinks_h = −Σ_{b,i} P_sink·Δ.", lambda: _close(got(), -_reference_dsinks(p_sink, delta))),
        ("P_sink·(1 − P_sink) is the softmax's own derivative, but the chain through O gives P_sink·Δ: "
         "dO·O already collects the keys' share.",
         lambda: _close(got(), -(p_sink * (1 - p_sink) * delta).sum(dim=(0, 2)))),
    ]
    hint = "dsinks[h] = −Σ over batch b and query i of p_sink[b, h, i] · delta[b, h, i]."
    _with_diagnosis("dsinks", lambda: check_exercise(
        "dsinks", fn, _reference_dsinks, cases, atol=1e-10, rtol=1e-10, hint=hint), mistakes)


# --- Exercise (c): how many (query, key) pairs a window leaves ---------------------------------------

_PAIR_CASES = [(10, 1), (10, 3), (16, 16), (7, 20), (4096, 128), (4096, 4096), (1000, 999), (1, 5)]


def _pairs(seq, window):
    return torch.tensor(int(visibility_mask(seq, seq, window_size=window).sum()))


def check_visible_pairs(fn):
    """``fn(seq, window)``: the number of visible (query, key) pairs of self-attention with a
    sliding window (a query sees its last ``window`` keys, itself included)."""
    def learner(seq, window):
        return torch.tensor(int(fn(seq, window)))

    def band(seq, width):  # pairs with i - width < j <= i, as visibility_mask counts them
        return sum(min(i + 1, width) for i in range(seq))

    seq, window = 10, 3
    mistakes = [
        ("off by one: the window includes the query itself, so query i sees keys i − W + 1 … i "
         "(W keys), not i − W … i.", lambda: int(fn(seq, window)) == band(seq, window + 1)),
        ("off by one: query i sees W keys, i − W + 1 … i, itself included (you counted W − 1).",
         lambda: int(fn(seq, window)) == band(seq, window - 1)),
        ("the first W − 1 queries have fewer than W keys before them: query i sees min(i + 1, W) keys.",
         lambda: int(fn(seq, window)) == seq * window),
        ("a sliding window is also causal: keys after the query are never visible.",
         lambda: int(fn(seq, window)) == sum(min(seq, i + window) - max(0, i - window + 1) for i in range(seq))),
    ]
    hint = "Query i sees min(i + 1, W) keys; add that up over i = 0 … S − 1 (or find the closed form)."
    _with_diagnosis("visible_pairs", lambda: check_exercise(
        "visible_pairs", learner, _pairs, _PAIR_CASES, atol=0, rtol=0, hint=hint), mistakes)
