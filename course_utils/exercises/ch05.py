"""Checkers for chapter 05 (the backward pass): the key-block-major backward and a dQ pass without atomics.

Both exercises work on one (batch, head): q [S_q, D], k and v [S_k, D], the forward's natural-log
LSE [S_q], Δ = rowsum(dO ∘ O) [S_q] and d_out [S_q, D], all float64, no mask. The expected
gradients come from ``torch.autograd`` through ``attention_reference``. When an answer is wrong,
the checker compares it with the usual mistakes (a missing or doubled scale, a forgotten Δ) and
says which one it looks like.
"""

import math

import torch

from ..reference import attention_reference
from .common import ExerciseWrong, check_exercise

__all__ = ["backward_cases", "check_blockwise_backward", "check_dq_query_major"]

_NAMES = ("dq", "dk", "dv")


def backward_cases():
    """Test cases (q, k, v, lse, delta, d_out, scale, block_M, block_N): ragged blocks, S_q ≠ S_k,
    blocks larger than the sequence, and a large scale (where exp(S) alone would overflow)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for s_q, s_k, dim, scale, block_M, block_N in ((32, 32, 16, None, 8, 16), (20, 36, 8, None, 8, 16),
                                                   (12, 40, 8, 0.3, 16, 16), (24, 24, 4, 40.0, 5, 7)):
        q, k, v, d_out = (torch.randn(n, dim, generator=g, dtype=torch.float64) for n in (s_q, s_k, s_k, s_q))
        scale = 1 / math.sqrt(dim) if scale is None else scale
        lse = torch.logsumexp(scale * q @ k.T, dim=-1)
        out = torch.exp(scale * q @ k.T - lse[:, None]) @ v
        delta = (d_out * out).sum(-1)
        cases.append((q, k, v, lse, delta, d_out, scale, block_M, block_N))
    return cases


def _expected(q, k, v, lse, delta, d_out, scale, block_M, block_N):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention_reference(*(t[None, None] for t in leaves), sm_scale=scale)[0, 0]
    return torch.autograd.grad(out, leaves, d_out)


def _close(a, b):
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-7, atol=1e-9))


def _diagnose(name, got, case):
    """A sentence naming the likely mistake in gradient ``name`` (got is the learner's tensor)."""
    q, k, v, lse, delta, d_out, scale, block_M, block_N = case
    expected = dict(zip(_NAMES, _expected(*case)))[name]
    got = torch.as_tensor(got, dtype=torch.float64)
    if got.shape != expected.shape:
        return ""
    if name in ("dq", "dk") and _close(got * scale, expected):
        return f"{name} is missing the factor scale: S = scale · Q Kᵀ, so {name} = scale · (…)."
    if name in ("dq", "dk") and _close(got, expected * scale):
        return f"{name} has the factor scale twice: apply it once, to dS or to the product."
    p = torch.exp(scale * q @ k.T - lse[:, None])
    ds_no_delta = p * (d_out @ v.T)
    if name == "dq" and _close(got, scale * ds_no_delta @ k) or name == "dk" and _close(got, scale * ds_no_delta.T @ q):
        return "dS needs Δ: dS = P ∘ (dP − Δ), with Δ of each query row broadcast along the keys."
    return {"dq": "dQ[query rows] += scale · dS_block K_block (dS_block is dSᵀ transposed): every key block "
                  "adds its share to the rows of every query block it sees.",
            "dk": "dK[keys] += scale · dSᵀ Q_block, with dSᵀ = Pᵀ ∘ (dPᵀ − Δ) and Δ indexed by query.",
            "dv": "dV[keys] += Pᵀ dO_block, with Pᵀ = exp(scale · K_block Q_blockᵀ − LSE[queries])."}[name]


def check_blockwise_backward(fn):
    """``fn(q, k, v, lse, delta, d_out, scale, block_M, block_N) -> (dq, dk, dv)``, key blocks outside."""
    cases = backward_cases()
    for index, name in enumerate(_NAMES):
        try:
            check_exercise(f"blockwise_backward → {name}", lambda *a, i=index: fn(*a)[i],
                           lambda *a, i=index: _expected(*a)[i], cases, atol=1e-9, rtol=1e-7)
        except ExerciseWrong as exc:
            hints = [_diagnose(name, fn(*case)[index], case) for case in cases]
            raise ExerciseWrong(f"{str(exc).rstrip()} {next((h for h in hints if h), '')}") from None


def check_dq_query_major(fn):
    """``fn(q, k, v, lse, delta, d_out, scale, block_M, block_N) -> dq``, query blocks outside."""
    cases = backward_cases()
    try:
        check_exercise("dq_query_major", fn, lambda *a: _expected(*a)[0], cases, atol=1e-9, rtol=1e-7)
    except ExerciseWrong as exc:
        hints = [_diagnose("dq", fn(*case), case) for case in cases]
        raise ExerciseWrong(f"{str(exc).rstrip()} {next((h for h in hints if h), '')}") from None
