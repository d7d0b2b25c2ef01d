"""The correctness gate: random problems over the public API, each judged against float64.

Every kernel change passes it before it lands (on the GPU in the same run as its timing)::

    python -m course_utils.check --fuzz                   # this machine's tier (CPU: small; GPU: full)
    python -m course_utils.check --fuzz --seed 7 --problems 300 --seconds 120 --workers 8
    python -m course_utils.check --fuzz --plant window_off_by_one    # the gate on a planted bug: it must fail
    python -m course_utils.check --fuzz --replay '{"api": "dense", ...}'  # one problem again, from its line

A problem is drawn from the classes that index arithmetic gets wrong: S_q ≠ S_k both ways (S_q ≪ S_k
too), lengths one off a tile, windows from 1 to past the keys, sinks of −∞ or large logits, GQA and MQA,
rows whose scores are all very large, batches, packed lengths of 0 and 1, caches from empty to full; and the FP8
forward (chapter 12: the C backend's emulated FP8 on the CPU, FP8 wgmma on Hopper) against the float64 emulation
of its own FP8 roundings and the FP8 bound.
Kernels compile per *shape* (lengths of packed and cached problems are read at run time), so a run
draws a few shapes and several problems on each: new values, sinks, lengths and hidden-key contents.

What is judged, for each problem:
- outputs, LSE and every gradient against float64 by FlashAttention's criterion (``checks``), which
  also rejects a NaN or inf where the float64 result is finite;
- exact properties: keys no query sees get dK = dV = 0; rows that see no key get O = 0, LSE = −∞ (or
  the sink's logit) and dQ = 0; a NaN, inf or any value in a key no query sees changes nothing; a
  finite change to a key leaves the rows that cannot see it bitwise unchanged; the forward (and, with
  ``deterministic=True``, the backward) is bitwise equal from run to run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import random
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch

from ..core.reference import visibility_mask
from .checks import ERROR_SLACK, CheckFailed, check_attention_error, check_close
from .validation import (
    decode_references,
    references,
    varlen_references,
)

__all__ = ["Problem", "draw_problems", "run_problem", "run_gate", "PLANTS", "plant", "main"]

APIS = ("dense", "varlen", "decode", "flex", "fp8")
FLEX_MODIFIERS = ("causal", "soft_cap", "alibi", "document", "prefix_lm", "window_globals", "soft_cap+causal")


@dataclass(frozen=True)
class Problem:
    """One random problem: its compiled shape (the fields before ``seed``) and what varies at run time."""

    api: str
    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    dim: int
    dtype: str
    causal: bool = False
    window: int | None = None
    sinks: bool = False
    sm_scale: float | None = None
    deterministic: bool = False
    page_size: int | None = None  # decode: a paged cache
    modifier: str | None = None  # flex
    seed: int = 0
    sink_kind: str = "normal"  # normal, -inf, large, mixed
    score_scale: float = 1.0  # > 1: rows whose scores are all very large (or, with a shift, very negative)
    lengths_q: tuple = ()  # varlen: per-sequence lengths; decode: cache lengths in lengths_k
    lengths_k: tuple = ()

    def shape_key(self):
        """What a compile depends on: problems that share it share kernels."""
        fields = dataclasses.fields(self)
        return tuple(getattr(self, f.name) for f in fields[:fields.index(next(f for f in fields if f.name == "seed"))])

    def line(self):
        """A one-line reproducer."""
        return f"python -m course_utils.check --fuzz --replay '{json.dumps(dataclasses.asdict(self))}'"

    @staticmethod
    def parse(text):
        data = json.loads(text)
        data["lengths_q"], data["lengths_k"] = tuple(data.get("lengths_q", ())), tuple(data.get("lengths_k", ()))
        return Problem(**data)


# region: drawing problems
def _tile_lengths(rng, tile, longest):
    """A length from the classes that bite: 1, tile − 1, tile, tile + 1, a multiple ± 1, anything up to ``longest``."""
    choices = [1, 2, tile - 1, tile, tile + 1, 2 * tile - 1, 2 * tile + 1, rng.randint(1, longest)]
    return min(rng.choice(choices), longest)


def _dense_shape(rng, gpu):
    tile, longest = (128, 1100) if gpu else (16, 70)
    dims = (64, 128) if gpu else (16, 32)
    dtype = rng.choice(("float16", "bfloat16")) if gpu else "float32"
    heads_kv = rng.choice((1, 2)) if gpu else rng.choice((1, 2))
    heads = heads_kv * rng.choice((1, 2, 4))
    kind = rng.choice(("equal", "q_short", "q_much_shorter", "q_long", "any"))
    seq_k = _tile_lengths(rng, tile, longest)
    seq_q = {"equal": seq_k, "q_short": max(1, seq_k - rng.randint(1, tile)), "q_much_shorter": rng.randint(1, 3),
             "q_long": seq_k + rng.randint(1, tile + 1), "any": _tile_lengths(rng, tile, longest)}[kind]
    mask = rng.choice(("none", "causal", "window", "window"))
    window = None
    if mask == "window":
        window = rng.choice((1, 2, tile - 1, tile, tile + 1, rng.randint(1, seq_k + 3), seq_k, seq_k + 5))
    sm_scale = rng.choice((None, None, 0.5 / math.sqrt(64)))
    return dict(batch=rng.choice((1, 2)), heads=heads, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
                dim=rng.choice(dims), dtype=dtype, causal=mask != "none", window=window,
                sinks=rng.random() < 0.4, sm_scale=sm_scale)


def _runtime_draws(rng, shape, count):
    """``count`` problems on one shape: the values, sinks and lengths vary, the compiled kernels do not."""
    for _ in range(count):
        extra = dict(seed=rng.randrange(2**31), sink_kind=rng.choice(("normal", "normal", "-inf", "large", "mixed")),
                     score_scale=rng.choice((1.0, 1.0, 1.0, 12.0)))
        yield extra


def _lengths(rng, tile, longest, count):
    return tuple(rng.choice((0, 1, tile - 1, tile, tile + 1, rng.randint(0, longest))) for _ in range(count))


# Problems drawn on each compiled shape. Packed and cached problems draw new lengths for each problem, so
# they get more of them: their kernels read the lengths at run time.
PER_SHAPE = {"dense": 16, "flex": 16, "varlen": 40, "decode": 40, "fp8": 16}
# A GPU compile costs more, a problem less.
GPU_PER_SHAPE = {"dense": 24, "flex": 16, "varlen": 50, "decode": 50, "fp8": 24}


def draw_problems(seed, count, *, gpu, apis=APIS, per_shape=None):
    """``count`` problems from ``seed``, spread over ``apis``; problems share each compiled shape
    (``per_shape``, default ``PER_SHAPE``)."""
    rng = random.Random(seed)
    tile, longest = (128, 700) if gpu else (16, 50)
    problems = []
    while len(problems) < count:
        api = rng.choice(apis)
        base = _dense_shape(rng, gpu)
        if api == "dense":
            base["deterministic"] = gpu and rng.random() < 0.25
        elif api == "varlen":
            base.update(batch=1, seq_q=0, seq_k=0)
        elif api == "decode":
            base.update(batch=rng.choice((1, 2, 3)), seq_q=rng.choice((1, 1, 2, 4)), seq_k=0,
                        page_size=rng.choice((None, 16 if not gpu else 64)))
            base["heads"] = base["heads_kv"] * rng.choice((1, 4, 8))
        elif api == "flex":
            base.update(modifier=rng.choice(FLEX_MODIFIERS), sinks=False, window=None, causal=False,
                        heads_kv=base["heads_kv"], seq_q=base["seq_k"])
        elif api == "fp8":  # no windows or sinks; the inputs it quantises; Q and K rotated or not
            base.update(window=None, sinks=False, dtype=rng.choice(("float32", "float16", "bfloat16")),
                        modifier=rng.choice((None, "hadamard")))
        each = per_shape or (GPU_PER_SHAPE if gpu else PER_SHAPE)[api]
        for extra in _runtime_draws(rng, base, min(each, count - len(problems))):
            if api == "varlen":
                n = rng.randint(1, 4)
                lq = _lengths(rng, tile, longest, n)
                lq = lq[:-1] + (lq[-1] or 1,)  # at least one query and one key in the batch (else a clear error)
                lk = tuple(rng.choice((n, n, n + rng.randint(1, tile), max(0, n - 3), rng.randint(0, longest)))
                           for n in lq)
                extra.update(lengths_q=lq, lengths_k=lk[:-1] + (lk[-1] or 1,))
            elif api == "decode":
                capacity = longest
                extra.update(lengths_k=tuple(rng.choice((0, base["seq_q"], 1, capacity, rng.randint(0, capacity)))
                                             for _ in range(base["batch"])), lengths_q=(capacity,))
            problems.append(Problem(api=api, **base, **extra))
    return problems
# endregion


# region: inputs
def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _tensor(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _sinks(gen, pr, device):
    if not pr.sinks:
        return None
    s = torch.randn(pr.heads, generator=gen)
    if pr.sink_kind == "-inf":
        s[:] = float("-inf")
    elif pr.sink_kind == "large":
        s = s + 20.0
    elif pr.sink_kind == "mixed":
        s[::2] = float("-inf")
        s[1::3] = 25.0
    return s.to(device)
# endregion


class _Failures:
    """The failures of one problem, each a short line."""

    def __init__(self):
        self.lines = []

    @contextlib.contextmanager
    def judging(self, what):
        try:
            yield
        except CheckFailed as failure:
            self.lines.append(f"{what}: {str(failure).removeprefix('✗ ')}")

    def require(self, condition, message):
        if not bool(condition):
            self.lines.append(message)


def _same(a, b):
    """Bitwise equal, NaN equal to NaN."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return (a.shape == b.shape and torch.equal(nan_a, nan_b)
            and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)))


# region: dense
def _dense_call(pr, q, k, v, sinks, d_out):
    from ..api.attention import flash_attention

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = flash_attention(*leaves, causal=pr.causal, sm_scale=pr.sm_scale, window_size=pr.window, sinks=sink_leaf,
                               return_lse=True, deterministic=pr.deterministic)
    out.backward(d_out)
    grads = [t.grad for t in leaves] + ([] if sink_leaf is None else [sink_leaf.grad])
    return out.detach(), lse.detach(), grads


def _dense_inputs(pr):
    """q, k, v and dO of a problem in the [B, H, S, D] layout (dense and flex), and the generator they came from."""
    device, dtype = _device(), getattr(torch, pr.dtype)
    gen = torch.Generator().manual_seed(pr.seed)
    q = _tensor(gen, (pr.batch, pr.heads, pr.seq_q, pr.dim), dtype, device, pr.score_scale)
    k = _tensor(gen, (pr.batch, pr.heads_kv, pr.seq_k, pr.dim), dtype, device)
    v = _tensor(gen, (pr.batch, pr.heads_kv, pr.seq_k, pr.dim), dtype, device)
    return q, k, v, _tensor(gen, q.shape, dtype, device), gen


def _run_dense(pr, f):
    q, k, v, d_out, gen = _dense_inputs(pr)
    device, dtype = q.device, q.dtype
    sinks = _sinks(gen, pr, device)
    kw = dict(causal=pr.causal, window_size=pr.window, sinks=sinks, sm_scale=pr.sm_scale)
    out, lse, grads = _dense_call(pr, q, k, v, sinks, d_out)
    refs = dict(references(q, k, v, d_out=d_out, rounded_out_delta=True, **kw),
                exponent=exponent_bound(q, k, pr.sm_scale))
    own = None if sinks is None else dsinks_from_outputs(sinks, out, lse, d_out)
    _judge_all(f, out, lse, grads, refs, dtype, dsinks_own=own)
    _exact_dense_properties(pr, f, q, k, v, sinks, d_out, out, lse, grads)


def _exact_dense_properties(pr, f, q, k, v, sinks, d_out, out, lse, grads):
    seen = visibility_mask(pr.seq_q, pr.seq_k, causal=pr.causal, window_size=pr.window, device=q.device)
    unseen_keys, blind_rows = ~seen.any(0), ~seen.any(1)
    dq, dk, dv = grads[:3]
    if unseen_keys.any():
        f.require((dk[:, :, unseen_keys] == 0).all() and (dv[:, :, unseen_keys] == 0).all(),
                  f"dK/dV of the {int(unseen_keys.sum())} keys no query sees are not 0 "
                  f"(max |dK| {float(dk[:, :, unseen_keys].abs().max()):.3g})")
    if blind_rows.any():
        empty_lse = (torch.full((pr.heads,), float("-inf"), device=q.device) if sinks is None
                     else sinks.float())[None, :, None].expand(pr.batch, -1, int(blind_rows.sum()))
        f.require((out[:, :, blind_rows] == 0).all() and (dq[:, :, blind_rows] == 0).all(),
                  "rows that see no key: O or dQ is not 0")
        blind_lse = lse[:, :, blind_rows]
        f.require(torch.equal(torch.isinf(blind_lse), torch.isinf(empty_lse))
                  and torch.allclose(blind_lse, empty_lse, rtol=1e-6, atol=0, equal_nan=False),
                  "rows that see no key: LSE is not -inf (or the sink's logit)")
    again = _dense_call(pr, q, k, v, sinks, d_out)
    f.require(_same(out, again[0]) and _same(lse, again[1]), "the forward differs between two runs on the same inputs")
    if pr.deterministic or q.device.type == "cpu":
        f.require(all(_same(a, b) for a, b in zip(grads, again[2])),
                  "deterministic gradients differ between two runs on the same inputs")
    if unseen_keys.any():  # anything in a key no query sees changes nothing
        k2, v2 = k.clone(), v.clone()
        k2[:, :, unseen_keys], v2[:, :, unseen_keys] = float("nan"), float("inf")
        hidden = _dense_call(pr, q, k2, v2, sinks, d_out)
        if pr.deterministic or q.device.type == "cpu":
            same_grads = all(_same(a, b) for a, b in zip(grads, hidden[2]))
        else:  # dQ's atomics add in any order: finite where they were, and exactly 0 for the hidden keys
            same_grads = all(torch.isfinite(g[torch.isfinite(r)]).all() for g, r in zip(hidden[2], grads)) \
                and (hidden[2][1][:, :, unseen_keys] == 0).all() and (hidden[2][2][:, :, unseen_keys] == 0).all()
        f.require(_same(out, hidden[0]) and _same(lse, hidden[1]) and same_grads,
                  "NaN/inf in keys no query sees changed the result")
    rows_blind_to_last = ~seen[:, -1]
    if rows_blind_to_last.any():  # a finite change to the last key: the rows that cannot see it are unchanged
        k3, v3 = k.clone(), v.clone()
        k3[:, :, -1] = k3[:, :, -1] * 3 + 5
        v3[:, :, -1] = -v3[:, :, -1] * 7
        changed = _dense_call(pr, q, k3, v3, sinks, d_out)
        f.require(_same(out[:, :, rows_blind_to_last], changed[0][:, :, rows_blind_to_last])
                  and _same(lse[:, :, rows_blind_to_last], changed[1][:, :, rows_blind_to_last]),
                  "changing a key changed rows that cannot see it")
# endregion


# region: varlen
def _cu(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _run_varlen(pr, f):
    from ..api.varlen_api import flash_attention_varlen

    device, dtype = _device(), getattr(torch, pr.dtype)
    gen = torch.Generator().manual_seed(pr.seed)
    total_q, total_k = sum(pr.lengths_q), sum(pr.lengths_k)
    q = _tensor(gen, (total_q, pr.heads, pr.dim), dtype, device, pr.score_scale)
    k = _tensor(gen, (total_k, pr.heads_kv, pr.dim), dtype, device)
    v = _tensor(gen, (total_k, pr.heads_kv, pr.dim), dtype, device)
    d_out = _tensor(gen, q.shape, dtype, device)
    sinks = _sinks(gen, pr, device)
    cq, ck = _cu(pr.lengths_q, device), _cu(pr.lengths_k, device)
    kw = dict(causal=pr.causal, window_size=pr.window, sinks=sinks, sm_scale=pr.sm_scale)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = flash_attention_varlen(*leaves, cq, ck, max(pr.lengths_q, default=0), max(pr.lengths_k, default=0),
                                      return_lse=True, **{**kw, "sinks": sink_leaf})
    refs = dict(varlen_references(q, k, v, cq, ck, d_out=d_out, rounded_out_delta=True, **kw),
                exponent=exponent_bound(q, k, pr.sm_scale))
    out.backward(d_out)
    grads = [t.grad for t in leaves] + ([] if sink_leaf is None else [sink_leaf.grad])
    own = None if sinks is None else dsinks_from_outputs(sinks, out.detach(), lse.detach(), d_out)
    _judge_all(f, out.detach(), lse.detach(), grads, refs, dtype, dsinks_own=own)
    starts_k = ck.tolist()
    for b, (lq, lk) in enumerate(zip(pr.lengths_q, pr.lengths_k)):
        if lk == 0 or grads[1] is None:
            continue
        seen = visibility_mask(lq, lk, causal=pr.causal, window_size=pr.window, device=device)
        unseen = ~seen.any(0)
        keys = slice(starts_k[b], starts_k[b] + lk)
        if unseen.any():
            f.require((grads[1][keys][unseen] == 0).all() and (grads[2][keys][unseen] == 0).all(),
                      f"sequence {b}: dK/dV of the keys no query sees are not 0")


def rounding_slack(ref, dtype):
    """FlashAttention's tests' absolute slack: twice the largest rounding error of the reference's values
    near 0.3 in the kernel's dtype, ``2 · max|(ref + 0.3 − 0.3) − ref|`` (hopper/test_flash_attn.py). It
    matters where PyTorch's low-precision error is 0 or tiny (a row that sees one key, a gradient whose
    exact value is 0), and it is far below any planted bug's error."""
    r = ref.detach().to(dtype)
    return 2 * float(((r + 0.3) - 0.3 - r).abs().max()) if r.numel() else 0.0


def exponent_bound(q, k, sm_scale=None):
    """An upper bound on the exponents ``|score · sm_scale · log2 e|`` a kernel forms (Cauchy–Schwarz: the largest
    query norm times the largest key norm). A FlashAttention kernel folds the scale into exp2, so P carries a
    rounding of about 2⁻²⁴ times its exponent: at 12× the usual scores (the gate's ``score_scale``) that is above
    float32's usual tolerance, where PyTorch's softmax, subtracting the max before it scales, is far more exact."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else abs(float(sm_scale))
    norms = [float(t.detach().double().norm(dim=-1).max()) if t.numel() else 0.0 for t in (q, k)]
    return norms[0] * norms[1] * scale * math.log2(math.e)


def _judge(name, actual, ref, low, dtype, exponent=0.0):
    """FlashAttention's criterion (3× the error of PyTorch in the kernel's precision, plus its tests' rounding
    slack); a float32 result also passes within float32's tolerance, its absolute part scaled by the result's
    largest magnitude and by the rounding of P's largest exponent (``exponent_bound``). A gradient sums terms of
    either sign: where they cancel, an element is small but carries the rounding of its large terms (the backward
    recomputes P from the LSE, which rounds relative to the score, and scores reach 12× their usual size here), so a
    tolerance relative to each element would fail correct float32 arithmetic; a wrong term moves the result by a
    share of its size, far beyond this."""
    if actual is None:
        raise CheckFailed(f"{name}: no gradient was returned")
    finite = ref[torch.isfinite(ref)]
    if dtype == torch.float32:
        scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
        atol = max(1e-5, 4 * 2.0 ** -24 * exponent) * scale
        try:
            return check_close(actual, ref, name, dtype=torch.float32, atol=atol, quiet=True)
        except CheckFailed:
            pass
    return check_attention_error(actual, ref, low, name, quiet=True,
                                 slack=max(ERROR_SLACK, rounding_slack(finite, dtype)))


def _judge_forward(out, lse, refs, dtype):
    _judge("O", out, refs["out"], refs["out_low"], dtype, refs.get("exponent", 0.0))
    check_close(lse, refs["lse"], "LSE", dtype=torch.float32, quiet=True)


def _baseline(ref, lows):
    """Of the low-precision results given, the one farther from ``ref``: PyTorch's in the kernel's dtype, and
    the float64 gradient with FlashAttention's one rounding of Δ (``references(..., rounded_out_delta=True)``)."""
    lows = [low for low in lows if low is not None and torch.isfinite(low).all()]
    if not lows:
        return None
    return max(lows, key=lambda low: float((low.double() - ref).abs().nan_to_num(0).max()))


def dsinks_from_outputs(sinks, out, lse, d_out):
    """dsinks in float64 from a kernel's own O and LSE: -Σ_rows exp(sink_h - LSE) · rowsum(dO ∘ O), over every row
    of head h. O and the LSE are judged on their own; given them, this is the gradient every FlashAttention-style
    backward computes (Δ from its rounded O), summed without rounding. ``out``/``d_out`` [B, H, S, D] with ``lse``
    [B, H, S], or packed: [T, H, D] with ``lse`` [H, T]."""
    delta = (d_out.double() * out.double()).sum(-1)
    packed = out.dim() == 3
    if packed:
        delta = delta.transpose(0, 1)
    logits = sinks.double()[:, None] if packed else sinks.double()[None, :, None]
    terms = torch.exp(logits - lse.double()) * delta
    terms = torch.where(delta == 0, torch.zeros_like(terms), terms)  # a row that sees nothing (and no sink): Δ = 0
    return -terms.sum(1 if packed else (0, 2))


def _judge_all(f, out, lse, grads, refs, dtype, dsinks_own=None):
    """O and the LSE, then every gradient (dQ, dK, dV, and dsinks when the sinks are a leaf).

    dsinks sums one term per row over every row of a head, so its rounding error grows with the rows; its
    baseline also includes ``dsinks_own`` (``dsinks_from_outputs``): the error of that sum taken from the
    kernel's own, already judged, O and LSE."""
    with f.judging("forward"):
        _judge_forward(out, lse, refs, dtype)
    delta_refs = refs.get("grads_delta", [None] * 4)
    for name, g, ref, low, low_delta in zip(("dQ", "dK", "dV", "dsinks"), grads, refs.get("grads", ()),
                                            refs.get("grads_low", ()), delta_refs):
        lows = (low, low_delta, dsinks_own if name == "dsinks" else None)
        with f.judging("backward"):
            _judge(name, g, ref, _baseline(ref, lows) if dtype != torch.float32 else low, dtype,
                   refs.get("exponent", 0.0))
# endregion


# region: decode
def _run_decode(pr, f):
    from ..api.varlen_api import flash_decode

    device, dtype = _device(), getattr(torch, pr.dtype)
    gen = torch.Generator().manual_seed(pr.seed)
    capacity = pr.lengths_q[0]
    lengths = [max(n, pr.seq_q) if n else 0 for n in pr.lengths_k]  # the new tokens are in the cache
    q = _tensor(gen, (pr.batch, pr.seq_q, pr.heads, pr.dim), dtype, device, pr.score_scale)
    table = None
    if pr.page_size is None:
        k_cache = _tensor(gen, (pr.batch, capacity, pr.heads_kv, pr.dim), dtype, device)
        v_cache = _tensor(gen, (pr.batch, capacity, pr.heads_kv, pr.dim), dtype, device)
    else:
        pages_each = -(-capacity // pr.page_size)
        num_pages = pr.batch * pages_each + 1
        k_cache = _tensor(gen, (num_pages, pr.page_size, pr.heads_kv, pr.dim), dtype, device)
        v_cache = _tensor(gen, (num_pages, pr.page_size, pr.heads_kv, pr.dim), dtype, device)
        order = torch.randperm(num_pages, generator=gen)[:pr.batch * pages_each]
        table = order.view(pr.batch, pages_each).to(torch.int32).to(device)
    sinks = _sinks(gen, pr, device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    kw = dict(causal=pr.causal, window_size=pr.window, sinks=sinks, sm_scale=pr.sm_scale)
    with torch.no_grad():
        out, lse = flash_decode(q, k_cache, v_cache, seqlens, block_table=table, return_lse=True, **kw)
    refs = dict(decode_references(q, k_cache, v_cache, seqlens.cpu(),
                                  block_table=None if table is None else table.cpu(), **kw),
                exponent=exponent_bound(q, k_cache, pr.sm_scale))
    with f.judging("forward"):
        _judge_forward(out, lse, refs, dtype)
    if any(n < capacity for n in lengths):  # anything past a sequence's length changes nothing
        k2, v2 = k_cache.clone(), v_cache.clone()
        for b, n in enumerate(lengths):
            if pr.page_size is None:
                k2[b, n:], v2[b, n:] = float("nan"), float("inf")
        with torch.no_grad():
            out2, lse2 = flash_decode(q, k2, v2, seqlens, block_table=table, return_lse=True, **kw)
        f.require(_same(out, out2) and _same(lse, lse2), "NaN/inf past a sequence's cache length changed the result")
# endregion


# region: flex
def _flex_modifiers(pr, device):
    from ..api import flex

    name = pr.modifier
    if name == "causal":
        return None, flex.causal_mask
    if name == "soft_cap":
        return flex.soft_cap(20.0), None
    if name == "soft_cap+causal":
        return flex.soft_cap(30.0), flex.causal_mask
    if name == "alibi":
        return flex.alibi(flex.alibi_slopes(pr.heads).to(device)), flex.causal_mask
    if name == "document":  # the long document first: rows that shrink, which flex's sorted tile order serves
        cut = max(1, pr.seq_k // 3)
        return None, flex.document_mask(flex.document_ids([pr.seq_k - cut, cut], device=device))
    if name == "prefix_lm":
        return None, flex.prefix_lm(max(1, pr.seq_k // 4))
    if name == "window_globals":
        return None, flex.window_with_globals(max(1, pr.seq_k // 5), 2)
    raise ValueError(f"unknown flex modifier {name!r}")


def _run_flex(pr, f):
    from ..api.flex import flex_attention
    from .flex_reference import flex_references

    q, k, v, d_out, _ = _dense_inputs(pr)
    dtype = q.dtype
    score_mod, mask_mod = _flex_modifiers(pr, q.device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, score_mod=score_mod, mask_mod=mask_mod, sm_scale=pr.sm_scale, return_lse=True)
    out.backward(d_out)
    refs = dict(flex_references(q, k, v, d_out=d_out, score_mod=score_mod, mask_mod=mask_mod, sm_scale=pr.sm_scale,
                                rounded_out_delta=True), exponent=exponent_bound(q, k, pr.sm_scale))
    _judge_all(f, out.detach(), lse.detach(), [t.grad for t in leaves], refs, dtype)
# endregion


# region: fp8
def _run_fp8(pr, f):
    """The FP8 forward (chapter 12): equal to the float64 emulation of the same FP8 roundings (to float32's rounding
    and the output dtype's), that emulation within the FP8 bound of exact attention, and bitwise the same twice."""
    from ..api.fp8 import emulate_fp8_forward, flash_attention_fp8, fp8_error_bound, quantise_inputs, within_ties
    from ..core.reference import attention_reference

    device, dtype, gen = _device(), getattr(torch, pr.dtype), torch.Generator().manual_seed(pr.seed)
    q = _tensor(gen, (pr.batch, pr.heads, pr.seq_q, pr.dim), dtype, device, pr.score_scale)
    k, v = (_tensor(gen, (pr.batch, pr.heads_kv, pr.seq_k, pr.dim), dtype, device) for _ in range(2))
    options = dict(causal=pr.causal, sm_scale=pr.sm_scale)
    hadamard = pr.modifier == "hadamard"
    out, lse = flash_attention_fp8(q, k, v, hadamard=hadamard, return_lse=True, **options)
    (q8, k8, v8), descales = quantise_inputs(q, k, v, hadamard)
    emulated, emulated_lse, slack, lse_slack = emulate_fp8_forward(q8, k8, v8, descales, return_slack=True,
                                                                   **options)
    with f.judging("O against the FP8 emulation"):
        check_close(out, within_ties(out, emulated, slack), "O", atol=1e-4, rtol=1e-3 + torch.finfo(dtype).eps,
                    quiet=True)
    with f.judging("LSE against the FP8 emulation"):
        check_close(lse, within_ties(lse, emulated_lse, lse_slack), "LSE", atol=1e-5, rtol=1e-5, quiet=True)
    error = (emulated - attention_reference(q.double(), k.double(), v.double(), **options)).abs().amax(-1)
    f.require((error <= fp8_error_bound(q, k, v, hadamard=hadamard, **options)).all(),
              f"the FP8 emulation is beyond the FP8 bound of exact attention (error {float(error.max()):.3g})")
    again = flash_attention_fp8(q, k, v, hadamard=hadamard, **options)
    f.require(_same(out, again), "the FP8 forward differs from run to run")
# endregion


_RUNNERS = {"dense": _run_dense, "varlen": _run_varlen, "decode": _run_decode, "flex": _run_flex, "fp8": _run_fp8}


def run_problem(pr):
    """The failures of one problem (an empty list when it passes); an exception is a failure too."""
    f = _Failures()
    try:
        _RUNNERS[pr.api](pr, f)
    except Exception as error:  # a crash, or an error on valid input, fails the problem
        f.lines.append(f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                       + ("" if isinstance(error, (ValueError, CheckFailed)) else
                          f" [{traceback.extract_tb(error.__traceback__)[-1].name}]"))
    return f.lines


# region: planted bugs
def _patch_everywhere(name, replacement):
    """Replace function ``name`` in every course_utils.kernels module that imported it; returns an undo list."""
    undo = []
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("course_utils.kernels") and getattr(module, name, None) is not None:
            undo.append((module, name, getattr(module, name)))
            setattr(module, name, replacement)
    return undo


def _plant_window_off_by_one():
    import tilelang.language as T

    from ..kernels import flash_pieces as fp

    original = fp.visible

    def visible(p, q_pos, k_pos, *, guard_q=False):
        cond = original(dataclasses.replace(p, window_size=None), q_pos, k_pos, guard_q=guard_q)
        if p.window_size is not None:
            cond = T.And(cond, k_pos >= q_pos + p.past - p.window_size)  # one key too many
        return cond
    return _patch_everywhere("visible", visible)


def _plant_skip_ragged_key_block():
    import tilelang.language as T

    from ..kernels import flash_pieces as fp

    original = fp.key_range_of_queries

    def key_range_of_queries(p, first_q, end_q, block_N):
        start, end = original(p, first_q, end_q, block_N)
        return start, T.min(end, p.seq_k // block_N)  # the ragged last key block is never visited
    return _patch_everywhere("key_range_of_queries", key_range_of_queries)


def _plant_no_unseen_key_fix():
    from ..api import attention
    from ..kernels import flash_bwd_hopper as fbh

    def query_steps(p, kb, block_M, block_N):  # the range as it was: empty for keys no query sees
        q_start, q_end = fbh.query_block_range(p, kb, block_M, block_N)
        return (0, q_end - q_start, q_start) if p.window_size == 1 else (q_start, q_end, 0)
    undo = _patch_everywhere("query_steps", query_steps)
    undo.append((attention, "unseen_leading_keys", attention.unseen_leading_keys))
    attention.unseen_leading_keys = lambda *args: 0
    return undo


def _plant_unwritten_output():
    from ..kernels import tiles

    original = tiles.attention_launcher

    def attention_launcher(kernel):
        launch = original(kernel)

        def unwritten(*args):
            out, lse = launch(*args)
            out[..., -1:, :] = 1e4  # the last query row never stored: whatever the buffer held
            return out, lse
        return unwritten
    from ..api import attention
    undo = [(attention, "attention_launcher", attention.attention_launcher)]
    attention.attention_launcher = attention_launcher
    return undo


def _plant_scaled_gradient(which):
    """attention_backward with one of its results (0 dQ, 1 dK, 2 dV, 3 dsinks) 10% off: the smallest planted bug
    a check must catch."""
    from ..api import attention

    original = attention.attention_backward

    def attention_backward(*args, **kwargs):
        grads = list(original(*args, **kwargs))
        if grads[which] is not None:
            grads[which] = grads[which] * 0.9
        return tuple(grads)
    undo = [(attention, "attention_backward", original)]
    attention.attention_backward = attention_backward
    return undo


def _plant_fp8_p_unrounded():
    return _patch_everywhere("round_to_e4m3", lambda x: x)  # P reaches P V in float32: FP8 in name only


PLANTS = {"window_off_by_one": _plant_window_off_by_one, "skip_ragged_key_block": _plant_skip_ragged_key_block,
          "no_unseen_key_fix": _plant_no_unseen_key_fix, "unwritten_output": _plant_unwritten_output,
          "scaled_dk": functools.partial(_plant_scaled_gradient, 1),
          "scaled_dsinks": functools.partial(_plant_scaled_gradient, 3),
          "fp8_p_unrounded": _plant_fp8_p_unrounded}


@contextlib.contextmanager
def plant(name):
    """Run the gate with a planted bug (``PLANTS``); kernels compiled inside are built with it."""
    if name is None:
        yield
        return
    undo = PLANTS[name]()
    _forget_compiled_kernels()
    try:
        yield
    finally:
        for module, attr, value in undo:
            setattr(module, attr, value)
        _forget_compiled_kernels()


def _forget_compiled_kernels():
    """Drop the front doors' kernel and plan caches, so that the next call builds its kernels again."""
    from ..api import attention, compiled, decode_api, flex, fp8, varlen_api

    for module in (compiled, attention, varlen_api, decode_api, flex, fp8):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()
    attention._PLANS.clear()
    decode_api._PLANS.clear()
# endregion


# region: the gate
def _run_group(args):
    """One shape's problems in a worker, stopping at the deadline: [(problem, failures, seconds)]."""
    problems, deadline, plant_name = args
    results = []
    with plant(plant_name):
        for pr in problems:
            if time.time() > deadline:
                break
            start = time.time()
            results.append((pr, run_problem(pr), time.time() - start))
    return results


def _describe(pr):
    lengths = f" lengths {pr.lengths_q}/{pr.lengths_k}" if pr.lengths_q else ""
    return (f"{pr.api} B={pr.batch} H={pr.heads}/{pr.heads_kv} S={pr.seq_q}/{pr.seq_k} D={pr.dim} {pr.dtype} "
            f"causal={pr.causal} window={pr.window} sinks={pr.sinks and pr.sink_kind} {pr.modifier or ''}{lengths}")


def _groups_done(groups, deadline, workers, plant_name, progress):
    """Each shape's results as its group finishes (in worker processes when ``workers`` > 1). Groups still
    running a minute past the deadline are dropped: a compile in flight must not hold the gate."""
    if workers <= 1:
        for group in groups:
            yield _run_group((group, deadline, plant_name))
        return
    import multiprocessing
    from concurrent.futures import TimeoutError as FutureTimeout
    from concurrent.futures import as_completed

    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    futures = [pool.submit(_run_group, (group, deadline, plant_name)) for group in groups]
    try:
        for future in as_completed(futures, timeout=max(1.0, deadline + 60 - time.time())):
            yield future.result()
    except FutureTimeout:
        progress(f"  (groups still compiling {60} s past the deadline were dropped)")
    finally:
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def run_gate(problems, *, seconds, workers=1, plant_name=None, out=print, progress=None):
    """Run ``problems`` (starting none after ``seconds``), print a table per API and each failure's reproducer;
    returns (problems run, failures). ``progress`` gets a line per finished shape (default: none)."""
    progress = progress or (lambda line: None)
    deadline = time.time() + seconds
    by_shape = {}
    for pr in problems:
        by_shape.setdefault(pr.shape_key(), []).append(pr)
    start = time.time()
    results = []
    for group_results in _groups_done(list(by_shape.values()), deadline, workers, plant_name, progress):
        results.extend(group_results)
        bad = sum(bool(f) for _, f, _ in group_results)
        if group_results:
            progress(f"  {time.time() - start:5.0f} s  {_describe(group_results[0][0])}: "
                     f"{len(group_results)} problems, {bad} failed")
    wall = time.time() - start
    rows = {}
    for pr, failures, seconds_taken in results:
        row = rows.setdefault(pr.api, {"problems": 0, "failed": 0, "seconds": 0.0, "shapes": set()})
        row["problems"] += 1
        row["failed"] += bool(failures)
        row["seconds"] += seconds_taken
        row["shapes"].add(pr.shape_key())
    out(f"{'API':<8} {'problems':>8} {'shapes':>6} {'failed':>6} {'seconds':>8}")
    for api, row in sorted(rows.items()):
        out(f"{api:<8} {row['problems']:>8} {len(row['shapes']):>6} {row['failed']:>6} {row['seconds']:>8.1f}")
    failed = [(pr, failures) for pr, failures, _ in results if failures]
    out(f"{len(results)} problems ({len(problems) - len(results)} not reached) in {wall:.0f} s on {workers} "
        f"worker(s), {len(failed)} failed" + (f", planted bug: {plant_name}" if plant_name else ""))
    for pr, failures in failed[:200]:
        out(f"✗ {_describe(pr)}: {failures[0]}")
        out(f"  {pr.line()}")
    return len(results), len(failed)


def default_tier(gpu):
    """(problems, seconds, workers): the GPU tier's 1500 problems in at most 8 minutes (on an H100 with 16 CPU
    cores: 199 s), the CPU tier's 200 in about 3."""
    if gpu:
        return 1500, 420, min(10, os.cpu_count() or 1)
    return 200, 300, 1  # 65-99 s on two idle cores; the deadline leaves room for a slower or busier machine


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m course_utils.check --fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=None, help="default: a new one each run, printed")
    parser.add_argument("--problems", type=int)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--workers", type=int)
    parser.add_argument("--apis", default=",".join(APIS))
    parser.add_argument("--plant", choices=sorted(PLANTS), help="plant a bug: the gate must then fail")
    parser.add_argument("--replay", help="one problem, from the JSON of a failure's reproducer line")
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.replay:
        pr = Problem.parse(args.replay)
        with plant(args.plant):
            failures = run_problem(pr)
        print("\n".join(failures) or "passed")
        return 1 if failures else 0
    problems, seconds, workers = default_tier(gpu)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    problems = draw_problems(seed, args.problems or problems, gpu=gpu, apis=tuple(args.apis.split(",")))
    print(f"fuzz gate: seed {seed}, device {torch.cuda.get_device_name() if gpu else 'cpu'}, torch {torch.__version__}")
    run, failed = run_gate(problems, seconds=args.seconds or seconds, workers=args.workers or workers,
                           plant_name=args.plant, progress=lambda line: print(line, flush=True))
    return 1 if failed or run == 0 else 0
# endregion
