"""Checkers for chapter 06 (GQA, sliding windows and attention sinks).

Each checker runs the learner's function through ``check_exercise``; when the answer is wrong it
compares it with the usual mistakes (a sink dropped before the softmax, a scaled sink logit, a
sign error, a window off by one, …) and says which one it looks like. The kernel checker runs the
learner's TileLang forward (window range and sink) on the C backend and names its bug.
"""

import math

import torch

from ..core.reference import attention_reference, visibility_mask
from ..kernels.flash_pieces import LOG2E
from .common import check_exercise, with_diagnosis
from .kernels import KernelCase, Suspect, check_kernel, same_outputs
from .shapes import HEAD_KINDS, attention_inputs, draw_shapes

__all__ = ["check_sink_attention", "check_dsinks", "check_visible_pairs", "check_gpt_oss_forward",
           "check_my_gpt_oss_forward"]


def _close(a, b, tol=1e-9):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tol, atol=tol, equal_nan=True))


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
    with_diagnosis(lambda: check_exercise(
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
    with_diagnosis(lambda: check_exercise(
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
    with_diagnosis(lambda: check_exercise(
        "visible_pairs", learner, _pairs, _PAIR_CASES, atol=0, rtol=0, hint=hint), mistakes)


# --- Exercise (d): the window's key-block range and the sink, in the TileLang forward -----------------

def _gpt_oss_case(label, heads, heads_kv, seq_q, seq_k, dim, window, sinks, *, block_M, block_N, seed, poison,
                  inputs=None):
    """Inputs, the float64 reference, and (``poison``) K/V with NaN in every key block that no query can
    see, so that a loop that visits such a block shows it (a visited key's P is 0, but 0 · NaN is NaN).
    ``inputs(q, k, v)``: Q, K, V made from the random ones (default: those)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq_q, dim, generator=g)
    k, v = (torch.randn(1, heads_kv, seq_k, dim, generator=g) for _ in range(2))
    if inputs is not None:
        q, k, v = inputs(q, k, v)
    sinks = torch.tensor(sinks, dtype=torch.float32)
    out, lse = attention_reference(q.double(), k.double(), v.double(), window_size=window, sinks=sinks.double(),
                                   return_lse=True)
    first_seen = int(visibility_mask(seq_q, seq_k, window_size=window).any(0).nonzero()[0])
    dead = first_seen // block_N * block_N if poison else 0  # keys of the blocks no query sees
    k_run, v_run = k.clone(), v.clone()
    k_run[:, :, :dead], v_run[:, :, :dead] = float("nan"), float("nan")

    def run(kernel, clean=False):
        o, l = kernel(q, k if clean else k_run, v if clean else v_run, sinks)
        return {"O": o, "LSE": l}

    kwargs = dict(window=window, block_M=block_M, block_N=block_N)
    return KernelCase(label, (1, heads, heads_kv, seq_q, seq_k, dim), kwargs, [4, 5], run,
                      {"O": out, "LSE": lse.double()}, data=dict(q=q, k=k, v=v, sinks=sinks, **kwargs),
                      rows="query row")


_WINDOW = 5
_SINKS = [1.5, float("-inf"), 3.0, float("-inf")]  # the extreme heads without a sink, which would hide their scores


def _drawn_gpt_oss_cases(seed=61):
    """Shapes drawn by ``shapes.draw_shapes`` for a window of 5: the window's first key block and the causal stop
    at every residue modulo block_N, block_M < and > block_N, rows that see no key, keys no query sees (NaN in
    their blocks), ragged S; 4 query heads on 2 K/V heads of the kinds of ``shapes.HEAD_KINDS`` (plain with a
    sink, every score very negative, large logits with a sink, every score very large)."""
    cases = []
    for i, shape in enumerate(draw_shapes("keys", window=_WINDOW, seed=seed, edges=False)):
        def inputs(q, k, v, shape=shape, i=i):
            return attention_inputs(1, 4, shape.seq_q, shape.seq_k, q.shape[-1], seed=seed + i, kinds=HEAD_KINDS,
                                    heads_kv=2)
        cases.append(_gpt_oss_case(f"{shape.label()}, 4 query heads on 2 K/V heads: 0 plain with a sink, 1 every "
                                   "score very negative, 2 large logits with a sink, 3 every score very large",
                                   4, 2, shape.seq_q, shape.seq_k, 16, _WINDOW, _SINKS, block_M=shape.block_M,
                                   block_N=shape.block_N, seed=seed + i, poison=True, inputs=inputs))
    return cases


def _gpt_oss_cases():
    """The drawn window shapes (``_drawn_gpt_oss_cases``): their heads without a sink (z = −∞) and with one cover
    rows that see no key both ways."""
    return _drawn_gpt_oss_cases()


def _dominant_sink_inputs(q, k, v):
    """Every key near 10·u (u the unit diagonal), head 0's queries small and random (scaled scores of a few
    units), head 1's queries near −c·u with scaled scores near −200: a sink of 100 in head 0 and of −100 in
    head 1 exceeds every score of its row by about 100."""
    dim = q.shape[-1]
    u = torch.ones(dim) / math.sqrt(dim)
    k = 10 * u + 0.1 * k
    q = q.clone()
    q[:, 0] *= 0.3
    q[:, 1] = -20 * math.sqrt(dim) * u + 0.3 * q[:, 1]
    return q, k, v


def _large_sink_case():
    """Sinks of ±100, each about 100 above every score of its row, at D = 128: e^100 is past float32's
    largest value (about e^88.7), so any exponential taken relative to anything below the sink overflows."""
    return _gpt_oss_case("sinks of 100 (head 0, scores of a few units) and −100 (head 1, scores near −200), "
                         "window 5, S=24, D=128, 16×8 tiles", 2, 1, 24, 24, 128, 5, [100.0, -100.0],
                         block_M=16, block_N=8, seed=64, poison=False, inputs=_dominant_sink_inputs)


def _my_gpt_oss_cases():
    """(d)'s cases, then the large sinks: a kernel that starts its running max below the sink passes the
    others (its sink term e^(z − m) stays small there) and overflows here."""
    return _gpt_oss_cases() + [_large_sink_case()]


def _model(data, sink, lse_sink, first_block=None, last_block=None, gqa_tiled=False, wider=0):
    """O and LSE of windowed attention with a per-row sink logit ``sink`` [1, H, S_q] (None: no sink), the
    LSE with ``lse_sink`` in its place, and keys before block ``first_block(qb)`` of each query block dropped."""
    q, k, v = (data[n].double() for n in ("q", "k", "v"))
    group = q.shape[1] // k.shape[1]
    if gqa_tiled:  # query head h on K/V head h % heads_kv
        k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
    else:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seq_q, seq_k = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    visible = visibility_mask(seq_q, seq_k, window_size=data["window"] + wider)
    if first_block is not None:
        starts = torch.tensor([first_block(i // data["block_M"]) * data["block_N"] for i in range(seq_q)])
        visible = visible & (torch.arange(seq_k)[None, :] >= starts[:, None])
    if last_block is not None:
        stops = torch.tensor([last_block(i // data["block_M"]) * data["block_N"] for i in range(seq_q)])
        visible = visible & (torch.arange(seq_k)[None, :] < stops[:, None])
    scores = scores.masked_fill(~visible, -math.inf)

    def lse_with(z):
        return torch.logsumexp(scores, dim=-1) if z is None else torch.logaddexp(torch.logsumexp(scores, dim=-1), z)

    out = torch.nan_to_num(torch.exp(scores - lse_with(sink)[..., None])) @ v
    return {"O": out, "LSE": lse_with(lse_sink)}


def _sinks(data):
    return data["sinks"].double()[None, :, None].expand(1, -1, data["q"].shape[2])


def _like(sink=None, lse_sink=None, first_block=None, last_block=None, **bugs):
    """A suspect's test: the learner's outputs equal ``_model``'s (each argument a function of the case data)."""
    def test(case, got, kernel):
        d = case.data
        model = _model(d, sink and sink(d), lse_sink and lse_sink(d), first_block and first_block(d),
                       last_block and last_block(d), **bugs)
        return same_outputs(got, model)
    return test


def _visits_dead_blocks(case, got, kernel):
    """NaN where the reference is finite, and the same kernel is right once the NaN keys are made finite."""
    if not torch.isnan(got["O"]).any():
        return False
    clean = case.run(kernel, clean=True)["O"].double()
    return bool(torch.allclose(clean, case.expected["O"], atol=1e-4, rtol=1e-3))


def _unshifted_sink(from_sink):
    """The sink term added as exp2(z·log2 e), not exp2(z·log2 e − shift): relative to the shift, a logit of
    z + scale·m, with m the row's running max of the raw scores, started at the sink's (``from_sink``, as in
    exercise (d)'s skeleton) or at −∞ (a learner's own kernel of (e))."""
    def logit(data):
        q = data["q"].double()
        k = data["k"].double().repeat_interleave(q.shape[1] // data["k"].shape[1], 1)
        visible = visibility_mask(q.shape[2], k.shape[2], window_size=data["window"])
        m = (q @ k.transpose(-1, -2)).masked_fill(~visible, -math.inf).amax(-1)
        if from_sink:
            m = torch.maximum(m, _sinks(data) * math.sqrt(q.shape[-1]))
        return _sinks(data) + m / math.sqrt(q.shape[-1])
    return logit


def _start(from_last_row=False, round_up=False):
    """first_block(data) -> (qb -> the first key block a mistaken range visits)."""
    def first_block(data):
        past = data["k"].shape[2] - data["q"].shape[2]
        bm, bn, w = data["block_M"], data["block_N"], data["window"]

        def start(qb):
            first_key = qb * bm + (bm - 1 if from_last_row else 0) + past - w + 1
            return max(0, -(-first_key // bn) if round_up else first_key // bn)
        return start
    return first_block


def _stop_minus_one(data):
    """qb -> the stop of a causal range computed as ⌈((qb+1)·block_M + past − 1) / block_N⌉."""
    past = data["k"].shape[2] - data["q"].shape[2]
    bm, bn = data["block_M"], data["block_N"]
    return lambda qb: max(0, -(-((qb + 1) * bm + past - 1) // bn))


def _unguarded_sink_test(case, got, kernel):
    """Rows that see no key are wrong and not finite (LSE = +∞ from exp2(sink·log2 e + ∞) when m starts at −∞,
    NaN from −∞ + ∞ in a head without a sink); every row that sees a key is right."""
    no_key = ~visibility_mask(case.data["q"].shape[2], case.data["k"].shape[2],
                              window_size=case.data["window"]).any(-1)
    if not no_key.any():
        return False
    lse, want = got["LSE"].double(), case.expected["LSE"].double()
    blind, blind_want = lse[..., no_key], want[..., no_key]
    broken = ~torch.isfinite(blind) & ~(blind == blind_want)
    seen = ~no_key
    return bool(broken.any()) and bool((broken | (blind == blind_want)).all()) and bool(torch.allclose(
        lse[..., seen], want[..., seen], atol=1e-3, rtol=1e-3))


def _sink_overflows(start):
    """A kernel whose running max starts at ``start(data)`` (scaled-score units, [1, H, S_q]) instead of at the
    sink, and is otherwise right: its sink term exp2(sink·log2 e − shift) overflows float32 to +∞ (ℓ and the LSE
    +∞, O 0) in every row where the sink exceeds the row's max (started at ``start``; 0 while −∞, the guard)
    by more than log(2¹²⁸) ≈ 88.7, and every other row is right. Rows within a unit of that edge may go either
    way; at least one row must overflow."""
    def test(case, got, kernel):
        d = case.data
        q = d["q"].double()
        k = d["k"].double().repeat_interleave(q.shape[1] // d["k"].shape[1], 1)
        visible = visibility_mask(q.shape[2], k.shape[2], window_size=d["window"])
        scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
        m = torch.maximum(scores.amax(-1), start(d))
        gap = _sinks(d) - torch.where(m == -math.inf, 0.0, m)
        edge = 128 / LOG2E
        over, under = gap > edge + 1, gap < edge - 1
        if not over.any():
            return False
        lse, want = got["LSE"].double(), case.expected["LSE"].double()
        o_right = torch.isclose(got["O"].double(), case.expected["O"].double(), atol=1e-4, rtol=1e-3).all(-1)
        lse_right = torch.isclose(lse, want, atol=1e-3, rtol=1e-3) | (lse == want)
        return bool((lse[over] == math.inf).all() and o_right[over | under].all() and lse_right[under].all())
    return test


def _from_minus_inf(data):
    return torch.full_like(_sinks(data), -math.inf)


def _scaled_sinks(data):
    return _sinks(data) / math.sqrt(data["q"].shape[-1])


def _sinks_over_log2e(data):
    return _sinks(data) / LOG2E


_GPT_OSS_SUSPECTS = [
    Suspect("your loop visits key blocks that no row of the query block can see (this test fills the keys "
            "no query sees with NaN): start at the block of the first row's first key, "
            "(qb·block_M + past − W + 1) // block_N, not earlier.", _visits_dead_blocks),
    Suspect("the sink is missing: add its term to ℓ, l[i] += exp2(sink·log2 e − shift[i]), before the "
            "division and the LSE.", _like()),
    Suspect("the sink is left out of the LSE: add its term to ℓ before computing the LSE (the backward "
            "recomputes P from this LSE, and P_sink = exp(z − LSE)).", _like(sink=_sinks)),
    Suspect("the sink logit was multiplied by the softmax scale: it is already a logit, on the footing of the "
            "scaled scores, so its exp2 argument is sink·log2(e) − shift.", _like(_scaled_sinks, _scaled_sinks)),
    Suspect("the sink's exp2 lacks log2(e): e^z = exp2(z·log2 e), so add exp2(sink·log2 e − shift).",
            _like(_sinks_over_log2e, _sinks_over_log2e)),
    Suspect("the sink's term uses the unguarded shift: in a row that has seen no key, m = −∞ (in a head without "
            "a sink, or in a kernel that starts m at −∞), so exp2(sink·log2 e − m·scale_log2) is NaN or +∞. Use the "
            "guarded shift (0 while m = −∞): the row's O is then 0 and its LSE is the sink.", _unguarded_sink_test),
    Suspect("the running max starts at −∞: with a sink logit of 100 over scores of a few units (or of −100 over "
            "scores near −200), the sink's term exp2(sink·log2 e − shift) is about e^100, past float32's largest "
            "value (about e^88.7), so ℓ and the LSE become +∞. Start m at the sink's logit in raw score units, "
            "m[i] = Sinks[h]·√D, as exercise (d)'s skeleton does: every exponential, the sink's included, is then "
            "at most 1.", _sink_overflows(_from_minus_inf)),
    Suspect("the running max starts at the sink's logit in the wrong units: m holds raw scores (Q·Kᵀ, before the "
            "1/√D that scale_log2 applies), so the sink's logit z enters it as z·√D. Started at z itself, the sink's "
            "term is e^(z − z/√D): about e^91 for z = 100 at D = 128, past float32's largest value (about e^88.7).",
            _sink_overflows(lambda data: _sinks(data) / math.sqrt(data["q"].shape[-1]))),
    Suspect("the causal stop loses the key block that holds the last row's diagonal key when that key is the "
            "first of a block: the last row sees keys up to (qb+1)·block_M − 1 + past, so stop = "
            "⌈((qb+1)·block_M + past) / block_N⌉.", _like(_sinks, _sinks, last_block=_stop_minus_one)),
    Suspect("query head h must read K/V head h // group (consecutive query heads share a K/V head), not "
            "h % heads_kv.", _like(_sinks, _sinks, gqa_tiled=True)),
    Suspect("the window's mask lets one key too many through: query q sees keys k with q + past − W < k, "
            "i.e. k > q + past − window (you used >=).", _like(_sinks, _sinks, first_block=_start(), wider=1)),
    Suspect("the sink term is not shifted: ℓ holds exp2(x·scale_log2 − shift), so the sink adds "
            "exp2(sink·log2 e − shift), not exp2(sink·log2 e).", _like(_unshifted_sink(True), _unshifted_sink(True))),
    Suspect("the sink term is not shifted: ℓ holds exp2(x·scale_log2 − shift), so the sink adds "
            "exp2(sink·log2 e − shift), not exp2(sink·log2 e).", _like(_unshifted_sink(False), _unshifted_sink(False))),
    Suspect("the window's first key block is computed from the query block's last row; its first row needs "
            "earlier keys. Start at the block of the first row's first key, (qb·block_M + past − W + 1) // block_N.",
            _like(_sinks, _sinks, _start(from_last_row=True))),
    Suspect("the first key block is rounded up (ceildiv): the block holding the first key of the window is only "
            "partly inside it, and it must be visited. Round down: // block_N.",
            _like(_sinks, _sinks, _start(round_up=True))),
]


def gpt_oss_gpu_config():
    return (1, 2, 1, 64, 64, 32), dict(window=24, block_M=32, block_N=32)


def check_gpt_oss_forward(factory, name="gpt-oss forward", learner=("window_block_range", "sink_epilogue"),
                          cases=_gpt_oss_cases, summary=""):
    """Check ``factory(batch, heads, heads_kv, seq_q, seq_k, dim, *, window, block_M, block_N, target)``
    (a prim_func (Q, K, V, Sinks) -> O, LSE) on the C backend, then lowered for sm_90a and sm_80."""
    check_kernel(
        name, factory, cases, suspects=_GPT_OSS_SUSPECTS, gpu=gpt_oss_gpu_config(),
        learner=learner,
        hint="The first key block holds the first key of the block's first row, (qb·block_M + past − W + 1); the "
             "sink adds exp2(sink·log2 e − shift) to ℓ before the division and the LSE.",
        summary="the window's first key block and the causal stop at every residue of the tile, block_M ≶ block_N, "
                "GQA, sinks, rows that see no key, keys no query sees, scores all very negative or very large"
                + summary)


def check_my_gpt_oss_forward(factory):
    """Exercise (e): the learner's own chapter-03 forward with GQA, the window and sinks added, on (d)'s cases and
    sinks of ±100 that dominate their rows (the learner writes the running max's start, which (d) gives)."""
    check_gpt_oss_forward(factory, name="your gpt-oss forward", learner=("my_softmax_step",),
                          cases=_my_gpt_oss_cases, summary=", sinks of ±100")


HINTS = {
    "a": ["The sink is one more logit in every row's softmax, with no value row: it takes probability mass "
          "away from the keys. Add it as a column, softmax, then drop that column.",
          "Index sinks with None to add dimensions and Tensor.expand it to one score column, [B, H, S_q, 1]; "
          "torch.cat(..., dim=-1) appends it; torch.softmax over the last dim; slicing [..., :-1] drops the sink's "
          "column before the product with V."],
    "b": ["The sink's logit z_h enters every row's denominator; its gradient is the sink's probability "
          "times the row's −Δ, summed over batch and rows.",
          "An elementwise product of the two [B, H, S] tensors, reduced with Tensor.sum over a tuple of dims (batch "
          "and query) so that the head dimension stays; mind the sign of section 3's formula."],
    "c": ["Row i sees min(i + 1, W) keys. Split the rows into those before the window is full and those after.",
          "Python's sum over a generator of min(...) is enough. For a closed form, split at the row where the window "
          "is full: before it the counts 1, 2, 3, … add up to a triangular number, after it every row counts the "
          "same."],
    "d": ["start: the block holding the first key the block's FIRST row can see (its window reaches furthest "
          "back), rounded down, never below 0. Epilogue: the sink adds exp(sink − shift) to ℓ in the same "
          "base-2 units, before the LSE and the division.",
          "start: T.max keeps it at block 0 or later, and // on TileLang expressions rounds down. Epilogue: the "
          "sink's logit is in natural-log units and ℓ in powers of 2, so T.exp2 takes the logit times LOG2E, minus "
          "the guarded shift[i] as the scores had; add it to l[i] before the LSE line. No softmax scale on the sink."],
    "e": ["Four changes to your chapter-03 kernel: K/V head h // (heads / heads_kv); the running max starts at the "
          "sink's logit (in raw score units, as in (d)'s skeleton), not at −∞, so that e^(sink − m) cannot overflow; "
          "the key loop starts at the block of the first row's first key and the mask also hides keys "
          "k <= q + past − window; the epilogue adds the sink's term exp(sink − shift) to ℓ (guarded shift) before "
          "the LSE and the division.",
          "Four places in your chapter-03 kernel: the K/V head in the two T.copy (integer division by the group "
          "size); the running max's start, a tb.parallel loop instead of T.fill (the units are those of (d)'s "
          "skeleton: m holds raw scores); T.Pipelined(start, stop, num_stages=1) with (d)'s start; T.And adds the "
          "window's condition to the mask; the epilogue's sink term as in (d)."],
}
