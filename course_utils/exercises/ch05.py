"""Checkers for chapter 05 (the backward pass): the key-block-major backward and a dQ pass without atomics,
and one step of the main kernel written in TileLang (run on the C backend, its bug named by ``kernels``).

Both exercises work on one (batch, head): q [S_q, D], k and v [S_k, D], the forward's natural-log
LSE [S_q], Δ = rowsum(dO ∘ O) [S_q] and d_out [S_q, D], all float64, no mask. The expected
gradients come from ``torch.autograd`` through ``attention_reference``. When an answer is wrong,
the checker compares it with the usual mistakes (a missing or doubled scale, a forgotten Δ) and
says which one it looks like.
"""

import math

import torch

from ..core.reference import attention_reference, visibility_mask
from ..kernels.flash_pieces import LOG2E
from .common import ExerciseWrong, check_exercise
from .kernels import KernelCase, Suspect, check_kernel, same_outputs

__all__ = ["backward_cases", "check_blockwise_backward", "check_dq_query_major", "check_flash_backward"]

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


# --- Exercise (c): one step of the main kernel, in TileLang -----------------------------------------

def _backward_case(label, batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, seed, logit_scale=(1.0,)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=g)
    q *= torch.tensor(logit_scale + (1.0,) * (heads - len(logit_scale)))[None, :, None, None]
    k, v = (torch.randn(batch, heads, seq_k, dim, generator=g) for _ in range(2))
    d_out = torch.randn(batch, heads, seq_q, dim, generator=g)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_reference(*leaves, causal=causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, leaves, d_out.double())
    delta = (d_out.double() * out.detach()).sum(-1)
    lse32, delta32 = lse.float(), delta.float()

    def run(kernel):
        dq_acc = torch.zeros_like(q)
        dk_got, dv_got = kernel(q, k, v, d_out, lse32, delta32, dq_acc)
        return {"dV": dv_got, "dK": dk_got, "dQ": dq_acc}

    kwargs = dict(causal=causal, block_M=block_M, block_N=block_N)
    data = dict(q=q, k=k, v=v, d_out=d_out, lse=lse32, delta=delta32, **kwargs)
    return KernelCase(label, (batch, heads, seq_q, seq_k, dim), kwargs, [7, 8], run,
                      {"dV": dv, "dK": dk, "dQ": dq}, data=data, rows="row")


def _backward_cases():
    """Causal with S_q = 24 < S_k = 40 (bottom-right diagonal, past = 16), head 1 with larger logits; then
    non-causal self-attention with S = 20, not a multiple of the 16 × 16 tiles."""
    return [
        _backward_case("causal, S_q=24 < S_k=40, 16×16 tiles", 1, 2, 24, 40, 16, causal=True, block_M=16, block_N=16,
                       seed=51, logit_scale=(1.0, 3.0)),
        _backward_case("non-causal, S=20 (ragged), 16×16 tiles", 1, 1, 20, 20, 16, causal=False, block_M=16,
                       block_N=16, seed=52),
    ]


def _model_backward(data, bugs=()):
    """The gradients of the exercise's kernel with some known bugs, in float64 (no tiling needed)."""
    q, k, v, d_out = (data[n].double() for n in ("q", "k", "v", "d_out"))
    lse, delta = data["lse"].double(), data["delta"].double()
    scale = 1 / math.sqrt(q.shape[-1])
    seq_q, seq_k = q.shape[2], k.shape[2]
    visible = visibility_mask(seq_q, seq_k, causal=data["causal"] and "no mask" not in bugs)
    if data["causal"] and "no mask" in bugs:  # every pair of the tiles the causal walk visits counts
        first_qb = ((torch.arange(seq_k) // data["block_N"]) * data["block_N"] - (seq_k - seq_q)) // data["block_M"]
        visible = (torch.arange(seq_q) // data["block_M"])[:, None] >= first_qb.clamp(min=0)[None, :]
    lse_log2 = lse if "lse base 2" in bugs else lse * LOG2E
    p = torch.exp2(q @ k.transpose(-1, -2) * scale * LOG2E - lse_log2[..., None]).masked_fill(~visible, 0)
    dp = d_out @ v.transpose(-1, -2)
    ds = p * dp if "no delta" in bugs else p * (dp - delta[..., None])
    dk = ds.transpose(-1, -2) @ q * (1 if "dk unscaled" in bugs else scale)
    dq = ds @ k * (1 if "dq unscaled" in bugs else scale)
    return {"dV": p.transpose(-1, -2) @ d_out, "dK": dk, "dQ": dq}


def _like(*bugs):
    return lambda case, got, kernel: same_outputs(got, _model_backward(case.data, bugs))


_BACKWARD_SUSPECTS = [
    Suspect("Δ is missing from dS: dS = P ∘ (dP − Δ), with Δ = rowsum(dO ∘ O) of each query (delta[i]).",
            _like("no delta")),
    Suspect("dK is missing the softmax scale: S = scale·Q Kᵀ, so dK = scale·dSᵀ Q. Multiply dk by sm_scale "
            "once, after the walk (finish).", _like("dk unscaled")),
    Suspect("dQ is missing the softmax scale: dQ = scale·dS K. Scale this tile's dq before it is added.",
            _like("dq unscaled")),
    Suspect("P is recomputed as if the LSE were in base 2. It is a natural log: exp(S·scale − LSE) = "
            "exp2(S·scale_log2 − LSE·log2 e).", _like("lse base 2")),
    Suspect("the recomputed P ignores the causal mask: in the tiles on the diagonal, a key after a query's "
            "position must get P = 0 (select with visible(q, k)).", _like("no mask")),
]


def check_flash_backward(factory):
    """Check ``factory(batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, target)`` (a prim_func
    (Q, K, V, dO, LSE, Δ, dQ) -> dK, dV that adds into dQ) on the C backend against autograd in float64."""
    check_kernel(
        "flash backward", factory, _backward_cases, suspects=_BACKWARD_SUSPECTS,
        hint="Check each product against section 3.2: Pᵀ = exp2(Sᵀ·scale_log2 − LSE·log2 e) masked, dV += Pᵀ dO, "
             "dSᵀ = Pᵀ ∘ (dPᵀ − Δ), dK += dSᵀ Q (scaled once at the end), dQ tile = scale · dS K.",
        summary="causal with S_q < S_k, non-causal with a ragged tail")
