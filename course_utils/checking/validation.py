"""Validating attention kernels on whole tensors, and planting bugs to show the checks catch them.

``check_forward`` and ``check_backward`` compare a kernel's O, LSE and gradients with the float64
reference on every batch entry and head, judging 16-bit results the way FlashAttention's tests do
(``checks.check_attention_error``) and float32 LSEs with float32's tolerance. The references are
computed a few heads at a time, so this works at the sizes the records are measured at.

``forward_bugs`` and ``backward_bugs`` make wrong results of the kinds a kernel really gets wrong
(a wrong head or batch index, an LSE off by 1%, dV scaled by 0.9, Δ dropped); ``show_bugs_caught``
runs the same checks on each and passes only if every one of them fails.
"""

import torch

from ..api.inputs import sink_probability
from ..core.labels import FA4, NAIVE, PEERS
from ..core.reference import attention_reference, head_chunks, rounded_out_delta_grads
from .checks import (
    ERROR_FACTOR,
    ERROR_SLACK,
    CheckFailed,
    check_attention_error,
    check_close,
    expect_failure,
    tolerance_for,
)

__all__ = ["references", "check_forward", "check_backward", "forward_bugs", "backward_bugs", "show_bugs_caught",
           "backward_without_delta", "check_stored_errors", "stored_bounds", "varlen_references", "decode_references",
           "cached_keys"]



def references(q, k, v, *, d_out=None, causal=False, window_size=None, sinks=None, sm_scale=None,
               rounded_out_delta=False):
    """The float64 reference and the low-precision (input dtype) PyTorch reference, on every head.

    Returns a dict with ``out``, ``lse`` (float64 reference), ``out_low`` (low precision) and, with
    ``d_out``, the gradients ``dq, dk, dv[, dsinks]`` of both (keys ``grads`` and ``grads_low``).
    The low-precision gradients come from autograd through the low-precision reference, except
    dsinks, which FlashAttention-style backwards compute from the rounded O (see below).

    ``rounded_out_delta`` (16-bit inputs, with ``d_out``) adds ``grads_delta``: the float64 gradients with
    one rounding, the one every FlashAttention backward makes, Δ = rowsum(dO ∘ O) from O in the input dtype.
    With Δ off by ε, dS = P ∘ (dP − Δ − ε) is the gradient whose LSE gets −ε, so autograd computes it. The
    cancellation in dP − Δ makes this error large where a row's probabilities are nearly one-hot (rows that
    see one or two keys, very large scores); PyTorch's autograd, which keeps P, never makes it.
    """
    kw = dict(causal=causal, window_size=window_size, sm_scale=sm_scale)
    want_grads = d_out is not None
    result = {"out": torch.empty_like(q, dtype=torch.float64), "lse": q.new_empty(q.shape[:3], dtype=torch.float32),
              "out_low": torch.empty_like(q)}
    if want_grads:
        for key in ("grads", "grads_low"):
            dtype = torch.float64 if key == "grads" else q.dtype
            grads = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v)]
            if sinks is not None:
                grads.append(torch.zeros(sinks.shape, dtype=torch.float64, device=sinks.device))
            result[key] = grads
    rounded_out_delta = rounded_out_delta and want_grads and _sixteen_bit(q)
    if rounded_out_delta:
        result["grads_delta"] = [torch.zeros_like(g) for g in result["grads"]]
    for b, hq, hkv in head_chunks(q, k):
        for key, dtype in (("", torch.float64), ("_low", q.dtype)):
            leaves = [t[b:b + 1, h].detach().to(dtype).requires_grad_(want_grads)
                      for t, h in ((q, hq), (k, hkv), (v, hkv))]
            sink = None if sinks is None else sinks[hq].detach().double().requires_grad_(want_grads and not key)
            with torch.enable_grad():
                out, lse = attention_reference(*leaves, sinks=sink, compute_dtype=dtype, return_lse=True, **kw)
                if not key:
                    result["lse"][b:b + 1, hq] = lse
                result["out" + key][b:b + 1, hq] = out.detach()
                if not want_grads:
                    continue
                wrt = leaves + ([sink] if sink is not None and not key else [])
                d_chunk = d_out[b:b + 1, hq].to(out.dtype)
                grads = torch.autograd.grad(out, wrt, d_chunk, retain_graph=rounded_out_delta and not key)
                if rounded_out_delta and not key:
                    delta_grads = rounded_out_delta_grads(out, lse, wrt, d_chunk, q.dtype)
                    for index, (h, g) in enumerate(zip((hq, hkv, hkv), delta_grads)):
                        result["grads_delta"][index][b:b + 1, h] = g
                    if sink is not None:
                        result["grads_delta"][3][hq] += delta_grads[3].to(torch.float64)
                target = result["grads" + key]
                for index, (h, g) in enumerate(zip((hq, hkv, hkv), grads)):
                    target[index][b:b + 1, h] = g
                if sink is not None and not key:
                    target[3][hq] += grads[3].to(target[3].dtype)
                elif sink is not None:
                    # In low precision, dsinks is what every implementation computes from its rounded O
                    # (FlashAttention's Δ): -Σ_i exp(z - LSE_i) · rowsum(dO ∘ O)_i, in float32.
                    delta = (d_out[b:b + 1, hq].float() * out.detach().float()).sum(-1)
                    p_sink = sink_probability(sink.detach().float()[None, :, None], lse.detach())
                    target[3][hq] += -(p_sink * delta).sum(dim=(0, 2)).double()
    return result


def _label(name, what):
    return f"{what} {name}".rstrip()


def check_forward(q, k, v, out, lse=None, *, name="", causal=False, window_size=None, sinks=None, sm_scale=None,
                  refs=None, quiet=False):
    """Check O (and the LSE) of every head against the float64 reference; returns the errors.

    16-bit O: the FlashAttention criterion (``check_attention_error``); float32 O and every LSE:
    float32's tolerance. Pass ``refs`` (from ``references``) to reuse references across checks.
    Returns {quantity: {"err": ..., "allowed": ...}}, what records store.
    """
    refs = refs or references(q, k, v, causal=causal, window_size=window_size, sinks=sinks, sm_scale=sm_scale)
    low = refs["out_low"] if _sixteen_bit(q) else None
    errors = {"O": _check(out, refs["out"], low, _label(name, "O"), quiet)}
    if lse is not None:
        errors["LSE"] = _check(lse, refs["lse"], None, _label(name, "LSE"), quiet)
    return errors


def check_backward(q, k, v, d_out, grads, *, name="", causal=False, window_size=None, sinks=None, sm_scale=None,
                   refs=None, quiet=False):
    """Check dQ, dK, dV (and dsinks) of every head against the float64 reference; returns the errors.

    ``grads`` may stop after dV when the sinks are not a leaf.
    """
    refs = refs or references(q, k, v, d_out=d_out, causal=causal, window_size=window_size, sinks=sinks,
                              sm_scale=sm_scale)
    errors = {}
    for what, g, ref, low in zip(("dQ", "dK", "dV", "dsinks"), grads, refs["grads"], refs["grads_low"]):
        if g is None:
            raise CheckFailed(f"✗ {_label(name, what)}: no gradient was returned")
        errors[what] = _check(g, ref, low if _sixteen_bit(q) else None, _label(name, what), quiet)
    return errors


def _sixteen_bit(q):
    return q.dtype in (torch.float16, torch.bfloat16)


def _check(actual, reference, low_precision, name, quiet):
    """One quantity: by the FlashAttention criterion when a low-precision reference is given (16-bit
    inputs; dsinks too, although it is float32), else by float32's tolerance (float32 problems, and
    every LSE). Returns {"err": max error, "allowed": the bound it was held to}."""
    if low_precision is not None:
        err, base = check_attention_error(actual, reference, low_precision, name, quiet=quiet)
        return {"err": err, "allowed": ERROR_FACTOR * base + ERROR_SLACK}
    tol = tolerance_for(torch.float32)
    err = check_close(actual, reference, name, dtype=torch.float32, quiet=quiet)
    return {"err": err, "allowed": tol.atol + tol.rtol * float(reference.detach().abs().nan_to_num(0).max())}


def stored_bounds(errors):
    """(quantity, error, bound) for each quantity of a row's stored errors.

    Records store {"err", "allowed"} per quantity. The first records of 2026-11-23 stored the error
    and, for 16-bit results, the low-precision reference's error as "<quantity>_low": their bound
    is the criterion itself; a float32 quantity without a stored bound (the LSE) is held to
    float32's tolerance at magnitude 1, stricter than the check it passed for any LSE ≥ 1.
    """
    tol = tolerance_for(torch.float32)
    for quantity, value in errors.items():
        if isinstance(value, dict):
            yield quantity, value["err"], value["allowed"]
        elif quantity + "_low" in errors:
            yield quantity, value, ERROR_FACTOR * errors[quantity + "_low"] + ERROR_SLACK
        elif not quantity.endswith("_low"):
            yield quantity, value, tol.atol + tol.rtol


def check_stored_errors(rows, what="record", *, unchecked=PEERS + (FA4, NAIVE), legacy_tolerance=None):
    """Check that every measured row of a record (but the ``unchecked`` implementations: the peers,
    whose correctness is not ours to prove) was validated, and within its bound.

    Records store, for each checked quantity, its error against the float64 reference and the bound
    it was held to when measured. A row without them was never checked, and fails here. With
    ``legacy_tolerance``, a record measured before whole-tensor validation (each row checked on one
    (batch, head) with that fixed tolerance, stored as ``max_abs_err``) passes with a warning that
    says so; it must be re-measured.
    """
    ours = [r for r in rows if r.get("impl") not in unchecked and not r.get("error")]
    if not ours:
        raise CheckFailed(f"✗ {what}: no measured rows to check")
    if legacy_tolerance is not None and all("errors" not in r and "max_abs_err" in r for r in ours):
        worst = max(r["max_abs_err"] for r in ours)
        if worst > legacy_tolerance:
            raise CheckFailed(f"✗ {what}: a legacy row's error {worst:.1e} exceeds its tolerance "
                              f"{legacy_tolerance:.0e}")
        print(f"⚠ {what} was measured before whole-tensor validation: each of its {len(ours)} rows of ours was "
              f"checked on one (batch, head) only, with a fixed tolerance of {legacy_tolerance:.0e} (worst error "
              f"{worst:.1e}). Re-measure it on a GPU: python -m course_utils.measure.benchmarks <record name>")
        return
    missing = [r for r in ours if not r.get("errors")]
    if missing:
        raise CheckFailed(f"✗ {what}: {len(missing)} of {len(ours)} rows of ours carry no validation errors")
    worst = max(((err / allowed, q, err) for r in ours for q, err, allowed in stored_bounds(r["errors"])),
                key=lambda t: t[0])
    if worst[0] > 1:
        raise CheckFailed(f"✗ {what}: {worst[1]} error {worst[2]:.2e} exceeds its bound")
    print(f"✓ {what}: all {len(ours)} measured rows were checked on every head; the worst used "
          f"{worst[0]:.0%} of its allowed error ({worst[1]})")


def _roll(t, dim):
    """``t`` with its entries along ``dim`` shifted by one: what reading the wrong head or batch gives."""
    return t.roll(1, dims=dim) if t.shape[dim] > 1 else None


def forward_bugs(out, lse):
    """Wrong (O, LSE) pairs a kernel could produce, by label: indexing bugs and an LSE off by 1%."""
    bugs = {"O from the wrong head": (_roll(out, 1), lse), "O from the wrong batch entry": (_roll(out, 0), lse),
            "LSE off by 1%": (out, lse * 1.01)}
    return {label: pair for label, pair in bugs.items() if pair[0] is not None}


def backward_bugs(grads, *, grads_without_delta=None):
    """Wrong gradients a kernel could produce, by label (each a full (dQ, dK, dV[, dsinks]) tuple).

    ``grads_without_delta``: the gradients the same kernel gives when Δ is dropped from
    dS = P ∘ (dP − Δ) (see ``course_utils.api.attention.backward_kernels``).
    """
    dq, dk, dv = grads[:3]
    rest = tuple(grads[3:])
    bugs = {"dV × 0.9": (dq, dk, dv * 0.9) + rest, "dK × 0.9": (dq, dk * 0.9, dv) + rest,
            "dQ from the wrong head": (_roll(dq, 1), dk, dv) + rest}
    if rest and rest[0] is not None:
        bugs["dsinks × 0.9"] = (dq, dk, dv, rest[0] * 0.9)
    if grads_without_delta is not None:
        bugs["Δ dropped"] = tuple(grads_without_delta)
    return {label: g for label, g in bugs.items() if g[0] is not None}


def backward_without_delta(q, k, v, out, lse, d_out, *, causal=False, window_size=None, sinks=None, sm_scale=None,
                           config=None):
    """The gradients the course's backward kernels give when Δ is dropped (a planted bug)."""
    from ..api.attention import backward_kernels

    kernels = backward_kernels(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale, config=config)
    delta = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    gqa = kernels.postprocess_dkv is not None
    dk, dv = ((torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)) if gqa
              else (torch.empty_like(k), torch.empty_like(v)))
    kernels.main(q, k, v, d_out.contiguous(), lse, delta, dq_acc, dk, dv)
    grads = (kernels.postprocess_dq(dq_acc),) + ((kernels.postprocess_dkv(dk), kernels.postprocess_dkv(dv)) if gqa
                                                 else (dk, dv))
    return grads + ((torch.zeros_like(sinks, dtype=torch.float32),) if sinks is not None else ())


def show_bugs_caught(check, bugs):
    """Run ``check(*bug)`` on every planted bug; each must fail (printed), or this raises."""
    for label, bug in bugs.items():
        expect_failure(label, lambda bug=bug: check(*bug))


# Packed (varlen) and cached (decoding) layouts: the same float64 and low-precision references, one
# sequence at a time, laid out like the kernel's outputs so check_forward / check_backward apply as they are.

def _empty_keys_row(sinks, heads):
    """LSE of rows that see no key: the sink's logit, or -inf without one (their O is 0)."""
    return (sinks.detach().double().cpu() if sinks is not None else torch.full((heads,), float("-inf"),
                                                                              dtype=torch.float64))


def varlen_references(q, k, v, cu_seqlens_q, cu_seqlens_k, *, d_out=None, causal=False, window_size=None,
                      sinks=None, sm_scale=None, rounded_out_delta=False):
    """``references`` for a packed batch (q [total_q, H, D], k/v [total_k, H_kv, D]): every sequence on
    its own, packed back (O [total_q, H, D], LSE [H, total_q], gradients like q, k, v and sinks)."""
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    heads = q.shape[1]
    result = {"out": torch.zeros(q.shape, dtype=torch.float64, device=q.device), "out_low": torch.zeros_like(q),
              "lse": torch.empty(heads, q.shape[0], dtype=torch.float32, device=q.device)}
    want_grads = d_out is not None
    kinds = ("grads", "grads_low") + (("grads_delta",) if rounded_out_delta and _sixteen_bit(q) else ())
    if want_grads:
        for key in kinds:
            dtype = q.dtype if key == "grads_low" else torch.float64
            result[key] = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v)]
            if sinks is not None:
                result[key].append(torch.zeros(sinks.shape, dtype=torch.float64, device=sinks.device))

    def as_bhsd(t, part):  # [n, H, D] rows of one sequence -> [1, H, n, D]
        return t[part].transpose(0, 1)[None]

    for b in range(len(bq) - 1):
        rows, keys = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        if bq[b + 1] == bq[b]:
            continue
        if bk[b + 1] == bk[b]:  # no key at all: O = 0 and no gradient; the LSE is the sink's
            result["lse"][:, rows] = _empty_keys_row(sinks, heads).float().to(q.device)[:, None]
            continue
        r = references(as_bhsd(q, rows), as_bhsd(k, keys), as_bhsd(v, keys), causal=causal, window_size=window_size,
                       sinks=sinks, sm_scale=sm_scale, d_out=None if d_out is None else as_bhsd(d_out, rows),
                       rounded_out_delta=rounded_out_delta)
        result["out"][rows] = r["out"][0].transpose(0, 1)
        result["out_low"][rows] = r["out_low"][0].transpose(0, 1)
        result["lse"][:, rows] = r["lse"][0]
        for key in kinds if want_grads else ():
            for index, part in enumerate((rows, keys, keys)):
                result[key][index][part] = r[key][index][0].transpose(0, 1).to(result[key][index].dtype)
            if sinks is not None:
                result[key][3] += r[key][3].to(torch.float64)
    return result


def cached_keys(cache, cache_seqlens, block_table, b):
    """The keys (or values) of sequence ``b`` of a contiguous or paged cache, in order: [1, H_kv, L, D]."""
    length = int(cache_seqlens[b])
    if block_table is None:
        rows = cache[b, :length]
    else:
        page_size = cache.shape[1]
        pages = block_table[b, :(length + page_size - 1) // page_size].long()
        rows = cache[pages].flatten(0, 1)[:length]
    return rows.transpose(0, 1)[None]


def decode_references(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=False, window_size=None,
                      sinks=None, sm_scale=None):
    """``references`` for one decoding step (q [B, S_new, H, D]): O [B, S_new, H, D] and LSE [B, H, S_new],
    each sequence against its own ``cache_seqlens[b]`` keys (the new tokens last, causal aligned bottom-right)."""
    heads = q.shape[2]
    result = {"out": torch.zeros(q.shape, dtype=torch.float64, device=q.device), "out_low": torch.zeros_like(q),
              "lse": torch.empty(q.shape[0], heads, q.shape[1], dtype=torch.float32, device=q.device)}
    lengths = cache_seqlens.cpu()
    for b in range(q.shape[0]):
        if int(lengths[b]) == 0:
            result["lse"][b] = _empty_keys_row(sinks, heads).float().to(q.device)[:, None]
            continue
        keys, values = (cached_keys(c, lengths, block_table, b) for c in (k_cache, v_cache))
        r = references(q[b:b + 1].transpose(1, 2), keys, values, causal=causal, window_size=window_size, sinks=sinks,
                       sm_scale=sm_scale)
        result["out"][b] = r["out"][0].transpose(0, 1)
        result["out_low"][b] = r["out_low"][0].transpose(0, 1)
        result["lse"][b] = r["lse"][0]
    return result
