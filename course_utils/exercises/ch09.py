"""Checkers for chapter 09 (packed variable-length batches and decoding with a KV cache).

Each checker runs the learner's function through ``check_exercise``; when the answer is wrong it
compares it with the usual mistakes (a missing leading 0, lengths instead of prefix sums, the sink
left out, the sink given a value row, weights that do not share one maximum) and says which one it
looks like.
"""

import torch

from ..kernels.softmax import merge_attention_states
from .common import ExerciseWrong, check_exercise, with_diagnosis

__all__ = ["check_pack", "check_merge_with_sink"]


# --- Exercise (a): pack a padded batch ---------------------------------------------------------------

def _pack_cases():
    g = torch.Generator().manual_seed(9)
    cases = []
    for lengths in ([3, 1, 4], [5, 0, 2, 5], [1]):
        padded = torch.randn(len(lengths), max(lengths), 2, 4, generator=g, dtype=torch.float64)
        cases.append((padded, torch.tensor(lengths)))
    return cases


def _reference_pack(padded, lengths):
    packed = torch.cat([padded[b, :n] for b, n in enumerate(lengths.tolist())])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return packed, cu


def check_pack(pack):
    """``pack(padded [B, S_max, H, D], lengths [B]) -> (packed [total, H, D], cu_seqlens int32 [B + 1])``."""
    cases = _pack_cases()

    def part(index):
        return lambda *args: pack(*args)[index]

    def run():
        check_exercise("pack (packed tokens)", part(0), lambda *a: _reference_pack(*a)[0], cases)
        check_exercise("pack (cu_seqlens)", part(1), lambda *a: _reference_pack(*a)[1], cases, atol=0, rtol=0)
        for args in cases:
            if pack(*args)[1].dtype != torch.int32:
                raise ExerciseWrong("pack: cu_seqlens must be int32, as flash_attention_varlen requires "
                                    "(.to(torch.int32)).")

    padded, lengths = cases[1]
    with_diagnosis(run, [
        ("cu_seqlens starts with 0: sequence b occupies rows cu_seqlens[b] … cu_seqlens[b+1] − 1, so it has B + 1 "
         "entries.", lambda: pack(padded, lengths)[1].tolist() == torch.cumsum(lengths, 0).tolist()),
        ("cu_seqlens holds prefix sums of the lengths, not the lengths themselves.",
         lambda: pack(padded, lengths)[1].tolist()[1:] == lengths.tolist()),
        ("keep only the first lengths[b] tokens of each row: the rest is padding.",
         lambda: pack(padded, lengths)[0].shape[0] == padded.shape[0] * padded.shape[1]),
    ])


# --- Exercise (b): merge split-KV partial states, with a sink -------------------------------------

def _merge_cases():
    g = torch.Generator().manual_seed(10)
    cases = []
    for splits, rows, dim, empty in ((2, 3, 4, False), (5, 4, 8, True), (1, 2, 4, False)):
        o = torch.randn(splits, rows, dim, generator=g, dtype=torch.float64)
        lse = torch.randn(splits, rows, generator=g, dtype=torch.float64) * 5
        if empty:  # a split that saw no key for these rows
            lse[1, :2] = float("-inf")
            o[1, :2] = 0
        sink = torch.randn(rows, generator=g, dtype=torch.float64)
        cases.append((o, lse, sink))
    return cases


def _reference_merge(o, lse, sink):
    o_all = torch.cat([o, torch.zeros_like(o[:1])])
    lse_all = torch.cat([lse, sink[None]])
    return merge_attention_states(o_all, lse_all, dim=0)


def check_merge_with_sink(merge):
    """``merge(o [splits, rows, D], lse [splits, rows], sink [rows]) -> (O [rows, D], LSE [rows])``."""
    cases = _merge_cases()
    o, lse, sink = cases[0]

    def run():
        check_exercise("merge_with_sink (O)", lambda *a: merge(*a)[0], lambda *a: _reference_merge(*a)[0], cases)
        check_exercise("merge_with_sink (LSE)", lambda *a: merge(*a)[1], lambda *a: _reference_merge(*a)[1], cases)

    without_sink = merge_attention_states(o, lse, dim=0)
    with_diagnosis(run, [
        ("the sink is missing: it is one more state, with LSE = its logit and O = 0 (it has no value row).",
         lambda: torch.allclose(merge(o, lse, sink)[0], without_sink[0])),
        ("the sink's state has O = 0, not O = 1: it joins the denominator but adds nothing to the output.",
         lambda: torch.allclose(merge(o, lse, sink)[0],
                                merge_attention_states(torch.cat([o, torch.ones_like(o[:1])]),
                                                       torch.cat([lse, sink[None]]), dim=0)[0])),
        ("each state's weight is e^{LSE_s − LSE} with the LSE over all states (sink included), not a plain "
         "average of the O_s.", lambda: torch.allclose(merge(o, lse, sink)[0], o.mean(dim=0))),
    ])
