"""Reference attention: the slow, obviously-correct definition every kernel is checked against.

Layout is [batch, heads, seq, head_dim], the same as ``torch.nn.functional.scaled_dot_product_attention``.
The math is done in float64 by default so that the reference's own rounding error is far below
any kernel's.

Masking conventions (the same as FlashAttention-2 and gpt-oss):
- causal: query ``i`` sees key ``j`` iff ``j <= i + (S_k - S_q)`` (bottom-right aligned; for
  self-attention, S_q == S_k, this is the usual lower triangle);
- sliding window ``W``: additionally ``j > i + (S_k - S_q) - W``, so a query sees the last ``W``
  keys including its own position;
- sinks: one logit per query head that joins the softmax denominator but has no value row.
A row that sees no key at all (possible only with unusual S_q > S_k shapes) gets output 0 and
LSE -inf rather than NaN. NaN in an input the row sees comes out as NaN, as in PyTorch's SDPA;
a key the row cannot see has no influence, whatever its value.

The kernels keep that promise for a finite key, and for any key that no query sees (``flash_attention``
never reads those). A NaN or inf in a key that some rows see can also reach the other rows of its tile
through the matrix products (0 · NaN is NaN), as in PyTorch's SDPA and FlashAttention.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_reference", "rounded_out_delta_grads", "visibility_mask", "validate_attention_inputs",
           "check_qkv_agree", "check_window_and_sinks", "head_chunks"]


def check_qkv_agree(q, k, v):
    """Raise ``ValueError`` unless q, k, v share a dtype and a device and k and v have one shape
    (every layout: the 4-D tensors here, the packed and cached ones of chapter 09)."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")


def check_window_and_sinks(window_size, sinks, heads, device):
    """Raise ``ValueError`` unless ``window_size`` is None or a positive int and ``sinks`` is None or
    a floating-point tensor [heads] on ``device``."""
    if window_size is not None and (not isinstance(window_size, int) or isinstance(window_size, bool)
                                    or window_size < 1):
        raise ValueError(f"window_size must be a positive int or None; got {window_size!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (heads,):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a tensor of shape [{heads}] (one logit per query head); got {shape}")
        if not sinks.is_floating_point():
            raise ValueError(f"sinks must be a floating-point tensor; got {sinks.dtype}")
        if sinks.device != device:
            raise ValueError(f"sinks must be on {device}; got {sinks.device}")


def validate_attention_inputs(q, k, v, *, window_size=None, sinks=None):
    """Raise ``ValueError`` with a readable message for any input the course's kernels reject."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape [batch, heads, seq, head_dim]; got {tuple(t.shape)}")
    check_qkv_agree(q, k, v)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head dims differ: q has {q.shape[3]}, k/v have {k.shape[3]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hq == 0 or hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) for GQA")
    if min(q.shape[0], q.shape[2], k.shape[2], q.shape[3]) == 0:
        raise ValueError(f"batch, sequence lengths and head_dim must be positive; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    check_window_and_sinks(window_size, sinks, hq, q.device)


def visibility_mask(seq_q, seq_k, *, causal=False, window_size=None, device=None):
    """Boolean [seq_q, seq_k] mask: True where query i may attend to key j."""
    i = torch.arange(seq_q, device=device)[:, None] + (seq_k - seq_q)
    j = torch.arange(seq_k, device=device)[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if causal or window_size is not None:
        visible &= j <= i
    if window_size is not None:
        visible &= j > i - window_size
    return visible


def attention_reference(
    q,
    k,
    v,
    *,
    causal=False,
    window_size=None,
    sinks=None,
    sm_scale=None,
    return_lse=False,
    compute_dtype=torch.float64,
):
    """softmax(Q Kᵀ · scale + mask [, sink]) V, computed naively in ``compute_dtype``.

    Returns O in ``q.dtype`` (and, with ``return_lse``, the natural-log log-sum-exp of each row's
    scaled scores, sink included, as float32 of shape [B, H, S_q]). A sliding window implies
    causal masking, as in gpt-oss.

    With a 16-bit ``compute_dtype`` this is the *low-precision* PyTorch reference that
    FlashAttention's tests measure kernels against: the matrix products run in that dtype (their
    results rounded to it), the softmax in float32, and the probabilities are rounded to the dtype
    before P·V, as in every FlashAttention kernel. Differentiable: its gradients are computed in
    the same precisions.
    """
    validate_attention_inputs(q, k, v, window_size=window_size, sinks=sinks)
    group = q.shape[1] // k.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    softmax_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=1)
    vc = vc.repeat_interleave(group, dim=1)

    scores = torch.einsum("bhqd,bhkd->bhqk", qc, kc).to(softmax_dtype) * scale
    visible = visibility_mask(q.shape[2], k.shape[2], causal=causal, window_size=window_size, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    row_max = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(softmax_dtype)[None, :, None, None]
        row_max = torch.maximum(row_max, sink)
    # A row with nothing visible has max -inf; shifting by 0 keeps exp() at 0 instead of NaN.
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    probs = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    out = torch.einsum("bhqk,bhkd->bhqd", probs.to(compute_dtype), vc).to(q.dtype)
    if not return_lse:
        return out
    lse = (row_max + torch.log(denom)).squeeze(-1)
    return out, lse.to(torch.float32)


# Float64 score matrices of at most this many elements per chunk of heads (2 GiB).
_CHUNK_ELEMENTS = 2 ** 28

def head_chunks(q, k):
    """(batch, query-head slice, kv-head slice) chunks covering every head, whole GQA groups at a time."""
    batch, heads, seq_q = q.shape[:3]
    group = heads // k.shape[1]
    per_head = seq_q * k.shape[2]
    groups_per_chunk = max(1, _CHUNK_ELEMENTS // (per_head * group))
    for b in range(batch):
        for g0 in range(0, k.shape[1], groups_per_chunk):
            g1 = min(k.shape[1], g0 + groups_per_chunk)
            yield b, slice(g0 * group, g1 * group), slice(g0, g1)


def rounded_out_delta_grads(out, lse, wrt, d_out, dtype, allow_unused=False):
    """The float64 gradients with FlashAttention's one rounding: Δ = rowsum(dO ∘ O) from O rounded to ``dtype``.

    ``out`` and ``lse`` are a float64 reference's outputs (their graph kept), ``wrt`` its leaves. With Δ off by
    ε, dS = P ∘ (dP − Δ − ε) is the gradient whose LSE gets −ε (∂LSE_i/∂S_ij = P_ij), so autograd computes it.
    """
    eps = (d_out * (out.detach().to(dtype).double() - out.detach())).sum(-1)
    return torch.autograd.grad((out, lse), wrt, (d_out, -eps.to(lse.dtype)), allow_unused=allow_unused)
