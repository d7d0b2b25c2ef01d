"""The float64 reference of chapter 11's flex attention: the modifiers evaluated on whole score and mask matrices.

``flex_reference`` computes softmax(mask(score_mod(Q Kᵀ · scale))) V naively, calling the same ``score_mod`` and
``mask_mod`` the kernels compile on torch tensors of indices (``api.flex.index_grids``); ``flex_references`` makes
from it what ``validation.check_forward`` and ``check_backward`` take, every head. The kernels are ``api.flex``'s.
"""

from __future__ import annotations

import math

import torch

from ..api.flex import index_grids, reference_mask
from ..core.reference import head_chunks, rounded_out_delta_grads
from ..kernels.flex_trace import float64_reads, name_of

__all__ = ["flex_reference", "flex_references"]


def flex_reference(q, k, v, *, score_mod=None, mask_mod=None, sm_scale=None, compute_dtype=torch.float64,
                   batch_ids=None, head_ids=None):
    """softmax(mask(score_mod(Q Kᵀ · scale))) V computed naively in ``compute_dtype``; returns (O, LSE).

    O has q's dtype; LSE is float32, natural log. A row that sees no key gets O = 0 and LSE = −∞.
    ``batch_ids`` / ``head_ids``: the b and h the modifiers see when q is a slice of a larger
    problem. With a 16-bit ``compute_dtype`` this is the low-precision reference of
    ``course_utils.core.reference.attention_reference`` (products in 16 bits, softmax in float32).
    """
    group = q.shape[1] // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
    b, h, q_idx, kv_idx = index_grids(range(q.shape[0]) if batch_ids is None else batch_ids,
                                       range(q.shape[1]) if head_ids is None else head_ids,
                                       q.shape[2], k.shape[2], q.device)
    scores = torch.einsum("bhqd,bhkd->bhqk", qc, kc).to(softmax_dtype) * scale
    if score_mod is not None:
        with float64_reads(compute_dtype == torch.float64):
            scores = score_mod(scores, b, h, q_idx, kv_idx)
        if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
            raise TypeError(f"score_mod `{name_of(score_mod)}` must return a floating-point tensor on tensor inputs")
        scores = scores.to(softmax_dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask_mod is not None:
        visible = reference_mask(mask_mod, b, h, q_idx, kv_idx)
        scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhqk,bhkd->bhqd", probs.to(compute_dtype), vc).to(q.dtype)
    return out, (row_max + torch.log(denom)).squeeze(-1).to(torch.float32)


def flex_references(q, k, v, *, d_out=None, score_mod=None, mask_mod=None, sm_scale=None, rounded_out_delta=False):
    """``validation.references`` for modifiers: float64 and low-precision O, LSE (and gradients), every head.

    The result plugs into ``check_forward(..., refs=...)`` and ``check_backward(..., refs=...)``.
    Computed one batch entry and one K/V head group at a time, with the b and h the modifiers see.
    ``rounded_out_delta``: also ``grads_delta``, as ``validation.references`` makes it.
    """
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, sm_scale=sm_scale)
    want = d_out is not None
    rounded_out_delta = rounded_out_delta and want and q.dtype in (torch.float16, torch.bfloat16)
    result = {"out": torch.empty_like(q, dtype=torch.float64), "lse": q.new_empty(q.shape[:3], dtype=torch.float32),
              "out_low": torch.empty_like(q)}
    if want:
        for key, dtype in (("grads", torch.float64), ("grads_low", q.dtype)) + (
                (("grads_delta", torch.float64),) if rounded_out_delta else ()):
            result[key] = [torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (q, k, v)]
    for b, hq, hkv in head_chunks(q, k):
        heads = range(q.shape[1])[hq]
        for suffix, dtype in (("", torch.float64), ("_low", q.dtype)):
            leaves = [t[b:b + 1, hh].detach().to(dtype).requires_grad_(want) for t, hh in ((q, hq), (k, hkv), (v, hkv))]
            with torch.enable_grad():
                out, lse = flex_reference(*leaves, compute_dtype=dtype, batch_ids=[b], head_ids=list(heads), **kw)
                result["out" + suffix][b:b + 1, hq] = out.detach()
                if not suffix:
                    result["lse"][b:b + 1, hq] = lse
                if want:
                    d_chunk = d_out[b:b + 1, hq].to(out.dtype)
                    delta_too = rounded_out_delta and not suffix
                    grads = torch.autograd.grad(out, leaves, d_chunk, allow_unused=True, retain_graph=delta_too)
                    for index, (hh, g) in enumerate(zip((hq, hkv, hkv), grads)):
                        if g is not None:
                            result["grads" + suffix][index][b:b + 1, hh] = g
                    if delta_too:
                        grads = rounded_out_delta_grads(out, lse, leaves, d_chunk, q.dtype, allow_unused=True)
                        for index, (hh, g) in enumerate(zip((hq, hkv, hkv), grads)):
                            if g is not None:
                                result["grads_delta"][index][b:b + 1, hh] = g
    return result
