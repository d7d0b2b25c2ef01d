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
from .common import ExerciseWrong, check_exercise, quiet_builder
from .kernels import KernelCase, Suspect, check_kernel, same_outputs
from .shapes import HEAD_KINDS, attention_inputs, draw_lengths, draw_shapes

__all__ = ["backward_cases", "check_blockwise_backward", "check_dq_query_major", "check_flash_backward",
           "check_my_delta", "check_my_dkdv", "check_my_dq", "check_my_flash_attention", "compiled"]

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

def _backward_case(label, batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, seed, logit_scale=(1.0,),
                   kinds=None):
    if kinds is not None:  # heads of the kinds of shapes.attention_inputs
        q, k, v = attention_inputs(batch, heads, seq_q, seq_k, dim, seed=seed, kinds=kinds)
        d_out = torch.randn(batch, heads, seq_q, dim, generator=torch.Generator().manual_seed(seed + 1))
    else:
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


_HEADS = "head 0 plain, 1 every score very negative, 2 large logits, 3 every score very large"


def _drawn(make, walk, seed, **extra):
    """One case per shape of ``shapes.draw_shapes(walk)``, four heads of the kinds of ``shapes.HEAD_KINDS``."""
    return [make(f"{shape.label()}, {_HEADS}", 1, len(HEAD_KINDS), shape.seq_q, shape.seq_k, 16,
                 causal=shape.causal, block_M=shape.block_M, block_N=shape.block_N, seed=seed + i, kinds=HEAD_KINDS,
                 **extra)
            for i, shape in enumerate(draw_shapes(walk, seed=seed))]


def _backward_cases():
    """Drawn by ``shapes.draw_shapes`` for a key block walking query blocks: the causal start
    ⌊(kb·block_N − past) / block_M⌋ at every residue modulo block_M, block_N < and > block_M, rows that see
    no key, ragged S, a non-causal shape below one block, one row and one key."""
    return _drawn(_backward_case, "queries", 51)


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
    if data["causal"]:  # a wrong bound of the causal walk drops the pairs of the blocks it does not visit
        visible = visible & _walked(seq_q, seq_k, data["block_M"], data["block_N"], bugs)
    lse_log2 = lse if "lse base 2" in bugs else lse * LOG2E
    p = torch.exp2(q @ k.transpose(-1, -2) * scale * LOG2E - lse_log2[..., None]).masked_fill(~visible, 0)
    dp = d_out @ v.transpose(-1, -2)
    ds = p * dp if "no delta" in bugs else p * (dp - delta[..., None])
    dk = ds.transpose(-1, -2) @ q * (1 if "dk unscaled" in bugs else scale)
    dq = ds @ k * (1 if "dq unscaled" in bugs else scale)
    return {"dV": p.transpose(-1, -2) @ d_out, "dK": dk, "dQ": dq}


def _causal_start(kb, block_M, block_N, past, bugs=()):
    """The first query block that sees key block kb, ⌊(kb·block_N − past) / block_M⌋ (at least 0), or a known
    wrong version of it."""
    first_query = kb * block_N - past
    if "start rounded up" in bugs:
        return max(0, -(-first_query // block_M))
    if "start over block_N" in bugs:
        return max(0, first_query // block_N)
    if "start without offset" in bugs:
        return max(0, kb * block_N // block_M)
    return max(0, first_query // block_M)


def _walked(seq_q, seq_k, block_M, block_N, bugs):
    """[S_q, S_k]: the (query, key) pairs in the blocks a causal walk with ``bugs`` in its bounds visits."""
    from .ch03 import _causal_stop

    past = seq_k - seq_q
    qb, kb = torch.arange(seq_q) // block_M, torch.arange(seq_k) // block_N
    start = torch.tensor([_causal_start(int(b), block_M, block_N, past, bugs) for b in kb])
    stop = torch.tensor([_causal_stop(int(b), block_M, block_N, past, bugs) for b in qb])
    return (qb[:, None] >= start[None, :]) & (kb[None, :] < stop[:, None])


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
        summary="the causal start at every residue of block_M, block_N ≶ block_M, rows that see no key, ragged S, "
                "scores all very negative or very large", gpu=backward_gpu_config(),
        learner=("backward_step_macros",))



# --- The capstone: Δ, dK/dV and dQ kernels, and the learner's autograd op -------------------------

def backward_gpu_config(causal=True):
    """Small enough to lower in seconds (the checkers lower every kernel for sm_90a and sm_80)."""
    return (1, 1, 64, 64, 32), dict(causal=causal, block_M=32, block_N=32)


def _delta_case():
    g = torch.Generator().manual_seed(53)
    o, d_out = torch.randn(1, 2, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g)
    expected = {"Δ": (o.double() * d_out.double()).sum(-1)}

    def run(kernel):
        return {"Δ": kernel(o, d_out)}

    return KernelCase("Δ, S=24 (a ragged second block of 16 rows), 2 heads", (1, 2, 24, 16), dict(block_M=16), [2],
                      run, expected, data=dict(o=o, d_out=d_out))


def check_my_delta(factory):
    """``factory(batch, heads, seq, dim, *, block_M, target)``: a prim_func O, dO -> Δ = rowsum(dO ∘ O)."""
    suspects = [Suspect("Δ sums dO ∘ dO or O ∘ O: multiply the two tiles elementwise, o[i, d] *= do[i, d].",
                        lambda case, got, kernel: same_outputs(got, {"Δ": (case.data["o"].double() ** 2).sum(-1)})
                        or same_outputs(got, {"Δ": (case.data["d_out"].double() ** 2).sum(-1)}))]
    check_kernel("your Δ kernel", factory, [_delta_case()], suspects=suspects,
                 hint="Copy the block of O and dO rows, multiply elementwise, T.reduce_sum over dim=1, copy Δ out.",
                 gpu=((1, 1, 64, 32), dict(block_M=32)))


def _grads_case(label, batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, seed, outputs, logit_scale=(1.0,),
                kinds=None):
    case = _backward_case(label, batch, heads, seq_q, seq_k, dim, causal=causal, block_M=block_M, block_N=block_N,
                          seed=seed, logit_scale=logit_scale, kinds=kinds)
    d = case.data
    expected = {name: case.expected[name] for name in outputs}

    def run(kernel):
        got = kernel(d["q"], d["k"], d["v"], d["d_out"], d["lse"], d["delta"])
        got = got if isinstance(got, (list, tuple)) else [got]
        return dict(zip(outputs, got))

    return KernelCase(label, case.args, case.kwargs, list(range(6, 6 + len(outputs))), run, expected, data=d,
                      rows="row")


def _grads_cases(outputs):
    """Drawn by ``shapes.draw_shapes``: for dK/dV a key block walking query blocks (the causal start at every
    residue modulo block_M), for dQ a query block walking key blocks (the causal stop at every residue modulo
    block_N); block sizes both ways, rows that see no key, ragged S, one row and one key, extreme scores."""
    return _drawn(_grads_case, "queries" if "dK" in outputs else "keys", 51, outputs=outputs)


def _like_only(outputs, *bugs):
    return lambda case, got, kernel: same_outputs(got, {k: v for k, v in _model_backward(case.data, bugs).items()
                                                        if k in outputs})


# The bounds of the causal walk: wrong only at residues or block sizes a fixed list of cases may never draw.
_START_SUSPECTS = [
    (("start without offset",), "the causal walk starts without the offset S_k − S_q: the first query that sees key "
     "kb·block_N is kb·block_N − past, so start at (kb * block_N - past) // block_M (at least 0)."),
    (("start rounded up",), "the causal walk starts one query block late when the key block's first key is first seen "
     "inside a query block: the start is rounded up. The first query that sees key kb·block_N is kb·block_N − past, "
     "and its block is (kb * block_N - past) // block_M, rounded down."),
    (("start over block_N",), "the causal walk starts at a query block counted in key blocks: (kb·block_N − past) is "
     "a query index, so divide it by block_M, not block_N (the two differ here)."),
]
_STOP_SUSPECTS = [
    (("stop one short at a block edge",), "the causal stop is one key block short when the last row's diagonal key "
     "is the first key of a block: the stop is T.ceildiv((qb + 1) * block_M + past, block_N), with no − 1."),
    (("stop rounded down",), "the causal stop is rounded down: use T.ceildiv((qb + 1) * block_M + past, block_N)."),
    (("stop split",), "the causal stop adds the query block's key blocks and the offset's separately: "
     "⌈(a + past)/block_N⌉ is not a/block_N + ⌈past/block_N⌉ when block_M is not a multiple of block_N. One "
     "ceiling division: T.ceildiv((qb + 1) * block_M + past, block_N)."),
]


def _suspects(outputs):
    bounds = _START_SUSPECTS if "dK" in outputs else _STOP_SUSPECTS
    return [Suspect(s.message, _like_only(outputs, *bugs)) for s, bugs in zip(
        _BACKWARD_SUSPECTS, (("no delta",), ("dk unscaled",), ("dq unscaled",), ("lse base 2",), ("no mask",)))
        if not (bugs == ("no mask",) and "dQ" in outputs)] + \
        [Suspect(message, _like_only(outputs, *bugs)) for bugs, message in bounds]


def check_my_dkdv(factory):
    """``factory(batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, target)``: a prim_func
    (Q, K, V, dO, LSE, Δ) -> dK, dV."""
    check_kernel("your dK/dV kernel", factory, lambda: _grads_cases(("dK", "dV")), suspects=_suspects(("dK", "dV")),
                 hint="Per query block: Pᵀ = exp2(Sᵀ·scale_log2 − LSE·log2 e) where visible (0 elsewhere), "
                      "dV += Pᵀ dO, dSᵀ = Pᵀ ∘ (dPᵀ − Δ), dK += dSᵀ Q; dK times the scale once at the end; the "
                      "causal walk starts at the first query block that sees the key block.",
                 summary="the causal start at every residue of block_M, block_N ≶ block_M, rows that see no key, "
                         "ragged S, one row and one key, scores all very negative or very large",
                 gpu=backward_gpu_config())


def check_my_dq(factory):
    """``factory(batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, target)``: a prim_func
    (Q, K, V, dO, LSE, Δ) -> dQ."""
    check_kernel("your dQ kernel", factory, lambda: _grads_cases(("dQ",)), suspects=_suspects(("dQ",)),
                 hint="Per key block up to the causal stop: P = exp2(S·scale_log2 − LSE·log2 e) where visible, "
                      "dP = dO Vᵀ, dS = P ∘ (dP − Δ), dq += dS K; dq times the scale once, then one store.",
                 summary="the causal stop at every residue of block_N, block_M ≶ block_N, rows that see no key, "
                         "ragged S, one row and one key, scores all very negative or very large",
                 gpu=backward_gpu_config())


_COMPILED = {}
# The tiles the learner's kernels get on a GPU (the timing cell after exercise (g)), where the call leaves them to
# the factory's CPU-sized defaults: chapter 03's timing cell times the forward with the same 64 × 64 float32 tiles.
GPU_TILES = dict(block_M=64, block_N=64)


def _compile(factory, shape, out_idx, options, device):
    import inspect

    from ..kernels.tiles import compile_kernel
    from .kernels import build, compile_c

    if device == "cuda":
        accepted = inspect.signature(factory).parameters
        options = {**{k: v for k, v in GPU_TILES.items() if k in accepted}, **options}
    key = (factory, shape, tuple(sorted(options.items())), tuple(out_idx), device)
    if key not in _COMPILED:
        name = getattr(factory, "__name__", "kernel")
        if device == "cuda":
            _COMPILED[key] = compile_kernel(build(name, factory, *shape, **options, target="cuda"),
                                            out_idx=list(out_idx), target="cuda")
        else:
            _COMPILED[key] = compile_c(name, build(name, factory, *shape, **options, target="c"), list(out_idx))
    return _COMPILED[key]


def compiled(factory, *shape, out_idx, **options):
    """The learner's kernel ``factory(*shape, **options, target=...)``, compiled once per shape, options and
    device (and per version of the factory) when it is first called: for the C backend on CPU tensors (the
    checkers), for CUDA on GPU tensors (the timing cell after exercise (g)), there with ``GPU_TILES`` for the
    tile sizes the call does not give."""
    def run(*tensors):
        device = "cuda" if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors) else "c"
        return _compile(factory, shape, tuple(out_idx), options, device)(*tensors)
    return run


def _default_tiles(factory, fallback=(16, 16)):
    """(block_M, block_N) that ``factory`` uses when the call gives none (the capstone's kernels are called so)."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return fallback
    pick = [params[n].default if n in params and isinstance(params[n].default, int) else f
            for n, f in zip(("block_M", "block_N"), fallback)]
    return tuple(pick)


def _autograd_cases(fn=None):
    """(label, batch, heads, seq_q, seq_k, dim, causal, seed, kinds): lengths drawn by ``shapes.draw_lengths`` for
    the tiles each of the learner's kernels uses by default (the autograd op calls them without tiles): the
    forward's causal stop, dQ's stop and dK/dV's start at residues 0, 1 and tile − 1, rows that see no key, ragged
    S, then a non-causal shape below one block; four heads of the kinds of ``shapes.HEAD_KINDS``."""
    found = fn.__globals__ if fn is not None and hasattr(fn, "__globals__") else {}
    forward_tiles = _default_tiles(found["my_flash_forward"], (32, 8)) if "my_flash_forward" in found else (32, 8)
    dq_tiles = _default_tiles(found["my_dq"]) if "my_dq" in found else (16, 16)
    dkdv_tiles = _default_tiles(found["my_dkdv"]) if "my_dkdv" in found else (16, 16)
    specs = [(forward_tiles, ("keys",)), (dq_tiles, ("keys",)), (dkdv_tiles, ("queries",))]
    lengths = draw_lengths(specs, max_seq=2 * max(max(t) for t, _ in specs) + 16)
    lengths.append((dkdv_tiles[0] - 1, 2 * dkdv_tiles[1] + 1))
    return [(f"{'causal' if i < len(lengths) - 1 else 'non-causal'}, S_q={sq}, S_k={sk}, {_HEADS}", 1,
             len(HEAD_KINDS), sq, sk, 16, i < len(lengths) - 1, 61 + i, HEAD_KINDS)
            for i, (sq, sk) in enumerate(lengths)]


# The learner's kernels the autograd op calls, by the names chapter 05 gives them, and how to re-check each alone.
_KERNELS = (("my_flash_forward", "your forward (03 d)"), ("my_delta", "your Δ kernel (d)"),
            ("my_dkdv", "your dK/dV kernel (e)"), ("my_dq", "your dQ kernel (f)"))


def _kernel_case(name, factory, label, batch, heads, seq_q, seq_k, dim, causal, seed, kinds):
    """A ``KernelCase`` re-checking the learner's kernel ``name`` alone on one of the capstone's shapes, at the
    tiles it uses by default."""
    from .ch03 import _forward_case

    block_M, block_N = _default_tiles(factory, (32, 8) if name == "my_flash_forward" else (16, 16))
    if name == "my_flash_forward":
        return _forward_case(label, batch, heads, seq_q, seq_k, dim, causal=causal, block_M=block_M,
                             block_N=block_N, seed=seed, kinds=kinds)
    case = _backward_case(label, batch, heads, seq_q, seq_k, dim, causal=causal, block_M=block_M, block_N=block_N,
                          seed=seed, kinds=kinds)
    if name == "my_delta":
        o = attention_reference(*(case.data[n].double() for n in ("q", "k", "v")), causal=causal).float()
        d_out = case.data["d_out"]

        def run(kernel):
            return {"Δ": kernel(o, d_out)}

        return KernelCase(label, (batch, heads, seq_q, dim), dict(block_M=block_M), [2], run,
                          {"Δ": (o.double() * d_out.double()).sum(-1)}, data=dict(o=o, d_out=d_out))
    outputs = ("dK", "dV") if name == "my_dkdv" else ("dQ",)
    return _grads_case(label, batch, heads, seq_q, seq_k, dim, causal=causal, block_M=block_M, block_N=block_N,
                       seed=seed, outputs=outputs, kinds=kinds)


def _wrong_kernel(fn, case, others=()):
    """'<which kernel>: <its checker's diagnosis>' for the first of the learner's kernels that is wrong alone on
    the capstone's failing ``case``, or None when each is right there (then the wiring is wrong). The wrong one is
    checked on ``others`` too where two of its known mistakes explain the failing case alike."""
    import contextlib
    import io

    from .ch03 import _FULL_FORWARD_SUSPECTS

    suspects = {"my_flash_forward": _FULL_FORWARD_SUSPECTS, "my_dkdv": _suspects(("dK", "dV")),
                "my_dq": _suspects(("dQ",))}
    for name, title in _KERNELS:
        factory = fn.__globals__.get(name)
        if factory is None:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                check_kernel(title, factory, [_kernel_case(name, factory, *case)], suspects=suspects.get(name, ()))
        except ExerciseWrong:
            def cases(name=name, factory=factory):
                return [_kernel_case(name, factory, *c) for c in (case, *others)]
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    check_kernel(title, factory, cases, suspects=suspects.get(name, ()))
            except ExerciseWrong as exc:
                return f"`{name}` is wrong on this shape alone: {str(exc).removeprefix('✗ ')}"
    return None


def check_my_flash_attention(fn):
    """``fn(q, k, v, causal)`` -> O, differentiable through the learner's own ``torch.autograd.Function``:
    O and the gradients of Q, K, V against float64 autograd of the reference."""
    from torch.autograd.function import BackwardCFunction

    from .common import ExerciseIncomplete, not_written, stale_definition

    stale = stale_definition("your flash_attention", fn)
    if stale is not None:
        raise stale
    cases = _autograd_cases(fn)
    for case in cases:
        label, batch, heads, seq_q, seq_k, dim, causal, seed, kinds = case
        q, k, v = attention_inputs(batch, heads, seq_q, seq_k, dim, seed=seed, kinds=kinds)
        d_out = torch.randn(batch, heads, seq_q, dim, generator=torch.Generator().manual_seed(seed + 1))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            with quiet_builder():
                out = fn(*leaves, causal)
                if not isinstance(out, torch.Tensor):
                    raise ExerciseWrong(f"✗ your flash_attention, {label}: returned a {type(out).__name__}, not O")
                if not isinstance(out.grad_fn, BackwardCFunction):
                    raise ExerciseWrong(f"✗ your flash_attention, {label}: O was not made by a torch.autograd."
                                        f"Function (its grad_fn is {type(out.grad_fn).__name__}): call "
                                        "MyFlashAttention.apply.")
                out.backward(d_out)
        except NotImplementedError as exc:
            raise not_written("your flash_attention", exc) from None
        except (ExerciseWrong, ExerciseIncomplete):
            raise
        except Exception as exc:
            from .help import needed_first

            if needed_first(exc) is not None:
                raise ExerciseIncomplete(f"your flash_attention: {needed_first(exc)}") from None
            raise ExerciseWrong(f"✗ your flash_attention, {label}: raised {type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from None
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*ref_leaves, causal=causal)
        ref_grads = torch.autograd.grad(ref, ref_leaves, d_out.double())
        got = {"O": out.detach(), "dQ": leaves[0].grad, "dK": leaves[1].grad, "dV": leaves[2].grad}
        want = {"O": ref.detach(), "dQ": ref_grads[0], "dK": ref_grads[1], "dV": ref_grads[2]}
        for name, value in got.items():
            if value is None:
                raise ExerciseWrong(f"✗ your flash_attention, {label}: {name} is None — backward must return "
                                    "dq, dk, dv (and None for causal).")
            if value.shape != want[name].shape:
                raise ExerciseWrong(f"✗ your flash_attention, {label}: {name} has shape {tuple(value.shape)}, "
                                    f"expected {tuple(want[name].shape)}.")
        wrong = [n for n in got if not torch.allclose(got[n].double(), want[n], atol=2e-4, rtol=1e-3)]
        if wrong:
            culprit = _wrong_kernel(fn, case, [c for c in cases if c is not case]) \
                if hasattr(fn, "__globals__") else None
            err = max(float((got[n].double() - want[n]).abs().nan_to_num(float("inf")).max()) for n in wrong)
            where = "the forward" if "O" in wrong else "the backward"
            swapped = [a for a, b in (("dK", "dV"), ("dV", "dK")) if a in wrong
                       and torch.allclose(got[a].double(), want[b], atol=2e-4, rtol=1e-3)]
            extra = f" ({swapped[0]} holds the other gradient: return dq, dk, dv in that order)" if swapped else ""
            if culprit is not None and not swapped:
                raise ExerciseWrong(f"✗ your flash_attention, {label}: {', '.join(wrong)} wrong (off by up to "
                                    f"{err:.3g}); re-checked alone, {culprit}")
            raise ExerciseWrong(f"✗ your flash_attention, {label}: {', '.join(wrong)} wrong (off by up to {err:.3g}) "
                                f"— look at {where}{extra}. Each of your kernels is right alone on this shape, so "
                                "look at how they are wired: what forward saves, the order of the outputs, d_out made "
                                "contiguous.")
    print(f"✓ your flash_attention: O, dQ, dK and dV match float64 autograd on {len(cases)} cases "
          "(the causal bounds at residues 0, 1 and tile − 1 of your tiles, rows that see no key, ragged S, non-causal, "
          "scores all very negative or very large)")


HINTS = {
    "a": ["Rebuild the tile's probabilities from the LSE (no running max needed), then the four products "
          "of the backward: dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − Δ), dK += scale·dSᵀ Q and this key "
          "block's share of dQ, scale·dS K.",
          "Python slices pick the rows of a key block and of a query block; torch.exp of the scaled scores minus the "
          "LSE (broadcast along the key axis) rebuilds the probabilities without a max; @ and .T give the products "
          "(keys as rows: Pᵀ and dPᵀ are [keys, queries]); += adds each block's share into dk, dv and dq."],
    "b": ["Swap the loops: outer over query blocks, inner over key blocks, dQ of the query block kept in a "
          "local accumulator and written once. Only P and dP are needed again, not dV or dK.",
          "(a)'s products with queries as rows: the LSE and Δ broadcast over the keys (index them with [:, None]); "
          "one torch.zeros accumulator per query block, filled over the key blocks and written into dq once."],
    "c": ["Keys as rows: Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ·c − LSE·log2 e) where visible (0 elsewhere), dPᵀ = V dOᵀ, "
          "dV += Pᵀ dO, dSᵀ = Pᵀ ∘ (dPᵀ − Δ), dK += dSᵀ Q, dq = scale · dS K; finish scales dK once.",
          "T.gemm(A, B, C, transpose_B=True) computes C += A Bᵀ (transpose_A for Aᵀ B), T.clear resets C first; "
          "T.if_then_else(visible(...), value, 0) inside tb.parallel masks by selection; T.exp2 with the LSE times "
          "LOG2E; a probability tile goes through a shared tile (T.copy) before it is a T.gemm operand."],
    "d": ["Each thread block owns a block of query rows: copy its rows of O and dO, multiply elementwise, sum "
          "each row, store.",
          "T.copy for the slices of O and dO (and for Δ's slice at the end), tb.parallel(block_M, dim) for the "
          "elementwise product, T.reduce_sum along dim=1 for the row sums."],
    "e": ["Exercise (c)'s skeleton and step without dQ: K and V of the key block stay, the query blocks from the "
          "first that can see them stream past; per block Pᵀ from the LSE (masked), dV += Pᵀ dO, dSᵀ = Pᵀ ∘ (dPᵀ − Δ), "
          "dK += dSᵀ Q; dK scaled once at the end.",
          "The causal start is the first query block whose last row reaches the key block's first key (mind past = "
          "S_k − S_q): integer division by block_M, kept at 0 or above with T.max; T.Pipelined(start, stop, "
          "num_stages=1) walks the query blocks. Sᵀ is a T.gemm with transpose_B; Pᵀ goes through a shared tile "
          "(T.copy) before it feeds dV's T.gemm."],
    "f": ["The forward's loop structure (query block per thread block, key blocks up to the causal stop) with "
          "exercise (b)'s body: P and dP recomputed, dS = P ∘ (dP − Δ), dq += dS K, scaled and stored once.",
          "Two T.gemm with transpose_B give S and dP; dS is formed elementwise with T.if_then_else (0 where a pair is"
          " hidden) into a shared tile, since it is the operand of the T.gemm that accumulates dq; the scale and the "
          "store come once, after the loop."],
    "g": ["forward: run your forward kernel, save Q, K, V, O and the LSE (ctx.save_for_backward) and causal "
          "(ctx.causal). backward: Δ from O and dO, then dK/dV, then dQ; return one gradient per input of "
          "forward (None for causal).",
          "compiled(factory, *shape, out_idx=[...], **options) returns a kernel to call on the tensors; out_idx lists"
          " the positions, among the prim_func's parameters, of the outputs it returns (the parameters after the "
          "inputs). ctx.save_for_backward and ctx.saved_tensors keep tensors, a plain ctx attribute keeps causal; "
          "backward returns one gradient per argument of forward."],
}
