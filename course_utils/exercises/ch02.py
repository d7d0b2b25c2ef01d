"""Checkers for chapter 02 (online softmax): merging softmax states, partial attention outputs, and
the online update written in TileLang.

The first two checkers run the learner's function through ``check_exercise``; when it is wrong they
compare the answer with the usual mistakes (no rescaling, an inverted factor, adding LSEs, …)
and say which one it looks like. The kernel checker runs the learner's TileLang kernel on the C
backend and names its bug with ``kernels.check_kernel``.
"""

import torch

from ..core.reference import attention_reference
from ..kernels.softmax import LOG2E, safe_shift
from .common import ExerciseWrong, check_exercise
from .kernels import KernelCase, Suspect, check_kernel, same_outputs

__all__ = ["check_merge_softmax_states", "check_combine_partial_attention", "check_online_softmax_kernel"]


def _stats(x):
    """(m, l) of each row of x, computed directly (not online)."""
    m = x.amax(dim=-1)
    return m, torch.exp(x - safe_shift(m)[..., None]).sum(dim=-1)


def _merge_cases():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 50, generator=g, dtype=torch.float64) * 3
    y = x.clone()
    y[:3, 30:] = float("-inf")  # the second part of three rows is fully masked: an empty state
    cases = []
    for rows, split in ((x, 20), (x * 1000, 33), (y, 30)):  # x * 1000: exp(m) alone would overflow
        cases.append((*_stats(rows[:, :split]), *_stats(rows[:, split:])))
    return cases, [x, x * 1000, y]


def _close(a, b):
    return a.shape == b.shape and bool(torch.allclose(a.double(), b.double(), rtol=1e-6, atol=1e-9, equal_nan=True))


def _diagnose_merge(merge, cases):
    for m_a, l_a, m_b, l_b in cases:
        m_got, l_got = (torch.as_tensor(t) for t in merge(m_a, l_a, m_b, l_b))
        m = torch.maximum(m_a, m_b)
        if not torch.isfinite(l_got).all():
            return ("l contains inf or NaN: keep every exponent ≤ 0 by subtracting the new maximum m, "
                    "i.e. use exp(m_a − m) and exp(m_b − m), never exp(m_a) on its own.")
        if not _close(m_got, m):
            return "m of the merged state is the larger of the two maxima: torch.maximum(m_a, m_b)."
        if _close(l_got, l_a + l_b):
            return ("You added l_a and l_b without rescaling. Each sum is relative to its own maximum; "
                    "multiply l_a by exp(m_a − m) and l_b by exp(m_b − m) before adding.")
        if _close(l_got, l_a * torch.exp(m - m_a) + l_b * torch.exp(m - m_b)):
            return "The rescale factor is exp(m_old − m_new), which is ≤ 1; you used its reciprocal."
    return "Merged l should be l_a·exp(m_a − m) + l_b·exp(m_b − m) with m = max(m_a, m_b)."


def check_merge_softmax_states(merge):
    """``merge(m_a, l_a, m_b, l_b) -> (m, l)``: the state of the union of two disjoint sets of scores."""
    cases, rows = _merge_cases()
    by_args = {id(c[0]): r for c, r in zip(cases, rows)}

    def learner(*args):
        return torch.stack([torch.as_tensor(t, dtype=torch.float64) for t in merge(*args)])

    def expected(*args):
        return torch.stack(_stats(by_args[id(args[0])]))

    try:
        check_exercise("merge_softmax_states", learner, expected, cases, rtol=1e-9, atol=1e-12)
    except ExerciseWrong as exc:
        raise ExerciseWrong(f"{str(exc).rstrip()} {_diagnose_merge(merge, cases)}") from None


def _attention_cases():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 24, 32, generator=g)
    k, v = torch.randn(1, 2, 100, 32, generator=g), torch.randn(1, 2, 100, 32, generator=g)
    cases, full = [], []
    for scale, split in ((1.0, 50), (1.0, 13), (30.0, 70)):  # scale 30: exp(lse) overflows float32
        part_a = attention_reference(q * scale, k[:, :, :split], v[:, :, :split], return_lse=True)
        part_b = attention_reference(q * scale, k[:, :, split:], v[:, :, split:], return_lse=True)
        cases.append((*part_a, *part_b))
        full.append(attention_reference(q * scale, k, v, return_lse=True))
    return cases, full


def _pack(o, lse):
    return torch.cat([torch.as_tensor(o).double().flatten(), torch.as_tensor(lse).double().flatten()])


def _diagnose_combine(combine, cases, full):
    for (o_a, lse_a, o_b, lse_b), (_, lse) in zip(cases, full):
        o_got, lse_got = (torch.as_tensor(t) for t in combine(o_a, lse_a, o_b, lse_b))
        if not (torch.isfinite(o_got).all() and torch.isfinite(lse_got).all()):
            return ("Your result has inf or NaN on large scores: exp(lse) overflows. Subtract the larger "
                    "LSE before exponentiating, or use torch.logaddexp.")
        if _close(lse_got, lse_a + lse_b):
            return ("LSEs of disjoint key sets combine as log(exp(lse_a) + exp(lse_b)) "
                    "(torch.logaddexp), not by adding them.")
        if _close(o_got, o_a + o_b) or _close(o_got, (o_a + o_b) / 2):
            return ("o_a and o_b are each divided by their own denominator exp(lse_a), exp(lse_b). Weight "
                    "each by its share of the total, exp(lse_a − lse) and exp(lse_b − lse).")
        if not torch.allclose(lse_got.double(), lse.double(), rtol=1e-5, atol=1e-5):
            return "The output o looks wrong because lse is: lse = torch.logaddexp(lse_a, lse_b)."
    return "Check the weights: o = o_a·exp(lse_a − lse) + o_b·exp(lse_b − lse)."


def check_combine_partial_attention(combine):
    """``combine(o_a, lse_a, o_b, lse_b) -> (o, lse)``: attention over keys A ∪ B from the two halves."""
    cases, full = _attention_cases()
    by_args = {id(c[0]): f for c, f in zip(cases, full)}

    def learner(*args):
        return _pack(*combine(*args))

    def expected(*args):
        return _pack(*by_args[id(args[0])])

    try:
        check_exercise("combine_partial_attention", learner, expected, cases, rtol=1e-5, atol=1e-5)
    except ExerciseWrong as exc:
        raise ExerciseWrong(f"{str(exc).rstrip()} {_diagnose_combine(combine, cases, full)}") from None


# --- Exercise (c): the online update inside a TileLang softmax kernel ------------------------------

_M, _N, _SCALE, _BLOCK_M, _BLOCK_N = 24, 64, 0.5, 8, 16


def _softmax_rows():
    """Rows, four of each kind: random; the first two blocks masked (−∞); the second block masked;
    large logits (scale·x beyond float32's exp range); a max that grows at every block."""
    g = torch.Generator().manual_seed(20)
    x = torch.randn(_M, _N, generator=g) * 4
    x[4:8, :2 * _BLOCK_N] = float("-inf")
    x[8:12, _BLOCK_N:2 * _BLOCK_N] = float("-inf")
    x[12:16] *= 60
    x[16:20] += 10 * torch.arange(_N // _BLOCK_N).repeat_interleave(_BLOCK_N)
    return x


def _simulate_online_softmax(x, bugs=()):
    """The exercise's kernel in float32 PyTorch, with some of the known bugs switched on. Float32 like
    the kernel, so that a bug that overflows there (a reset max on large logits) overflows here too."""
    c = _SCALE * LOG2E
    c_step = _SCALE if "no log2e" in bugs else c
    m = torch.full((x.shape[0],), float("-inf"), dtype=x.dtype)
    l = torch.zeros_like(m)
    for start in range(0, x.shape[1], _BLOCK_N):
        block = x[:, start:start + _BLOCK_N]
        m_prev = m
        m = block.amax(1) if "max reset" in bugs else torch.maximum(m_prev, block.amax(1))
        shift = m * c_step if "no guard" in bugs else torch.where(m == float("-inf"), 0.0, m * c_step)
        block_sum = torch.exp2(block * c_step - shift[:, None]).sum(1)
        l = l + block_sum if "no rescale" in bugs else l * torch.exp2(m_prev * c_step - shift) + block_sum
    y = torch.exp2(x * c - shift[:, None]) / l[:, None]
    return {"Y": y, "LSE": (shift + torch.log2(l)) / LOG2E}


def _online_softmax_cases():
    x = _softmax_rows()

    def run(kernel):
        y, lse = kernel(x)
        return {"Y": y, "LSE": lse}

    expected = {"Y": torch.softmax(_SCALE * x.double(), dim=-1), "LSE": torch.logsumexp(_SCALE * x.double(), dim=-1)}
    return [KernelCase(f"X [{_M}, {_N}], {_BLOCK_M}×{_BLOCK_N} tiles, scale {_SCALE}", (_M, _N),
                       dict(scale=_SCALE, block_M=_BLOCK_M, block_N=_BLOCK_N), [1, 2], run, expected, data=dict(x=x))]


def _like(*bugs):
    return lambda case, got, kernel: same_outputs(got, _simulate_online_softmax(case.data["x"], bugs))


_ONLINE_SOFTMAX_SUSPECTS = [
    Suspect("NaN in rows whose first blocks are all −∞: there m = −∞ and x·c − m·c is −∞ − (−∞). Keep the "
            "guard: shift = 0 while m is −∞, m·scale_log2 otherwise.", _like("no guard")),
    Suspect("the running max is reset at every block: T.reduce_max clears m unless clear=False. The rescale "
            "factor can then exceed 1 (and overflow on large logits), and after a fully masked block m = −∞ "
            "wipes the sum gathered so far. Write T.reduce_max(x, m, dim=1, clear=False).", _like("max reset")),
    Suspect("ℓ is not rescaled when the max grows: ℓ = ℓ·exp2(m_prev·scale_log2 − shift) + row_sum.",
            _like("no rescale")),
    Suspect("log2(e) is missing: exp2(x·scale) is 2^(scale·x), not e^(scale·x). Use scale_log2 = "
            "scale·log2(e) in the exponentials and in the shift.", _like("no log2e")),
]


def check_online_softmax_kernel(factory):
    """Check ``factory(M, N, *, scale, block_M, block_N, target)`` (a prim_func X -> Y, LSE) on the C backend."""
    check_kernel("online softmax kernel", factory, _online_softmax_cases, suspects=_ONLINE_SOFTMAX_SUSPECTS,
                 hint="Compare your update with section 7: clear=False, the shift guard, exp2 with scale_log2, "
                      "and ℓ rescaled by exp2(m_prev·scale_log2 − shift).",
                 summary="masked leading and middle blocks, large logits, a growing max",
                 gpu=((256, 128), dict(scale=_SCALE, block_M=8, block_N=64)))


HINTS = {
    "a": ["Both states must be expressed against the same maximum before they can be added: the larger of "
          "the two maxima. Each ℓ is a sum of exponentials relative to its own maximum.",
          "torch.maximum takes the larger of two tensors elementwise; torch.exp of a state's own maximum minus "
          "the common one is the factor its ℓ needs (at most 1, and 0, not NaN, for an empty side whose maximum is "
          "−∞ while the other's is finite)."],
    "b": ["exp(LSE_a) is block A's softmax denominator; the total is the sum of both. Each half's output "
          "is weighted by its share of the total denominator.",
          "torch.logaddexp adds two denominators given as their logarithms, without overflow; a half's share of "
          "the total is, in logarithms, a difference, and torch.exp turns it back into a weight; [..., None] "
          "broadcasts a [B, H, S] weight over D."],
    "c": ["For each block: remember the old max, fold the block's maxima into m, shift by m·c (but by 0 "
          "while m is still −∞), exponentiate the block, and rescale ℓ by exp2(m_prev·c − shift) before "
          "adding the block's row sums.",
          "T.copy saves a fragment (the old max); T.reduce_max folds a tile's rows into a row vector along dim=1, "
          "and clear=False keeps what the vector held; T.if_then_else(cond, a, b) selects (neg_inf is −∞); T.exp2 "
          "and T.reduce_sum give the tile's exponentials and their row sums; tb.parallel(block_M) loops over rows, "
          "tb.parallel(block_M, block_N) over the tile."],
}
