"""The input checks every front door shares, written once: ``flash_attention``, ``flash_attention_varlen``,
``flash_decode`` and ``ring_attention`` raise the same ``ValueError`` for the same mistake.

Each front door checks its own layout (4-D dense tensors, packed rows, a cache) and then calls
``check_attention_inputs``; the kernels' ``Sinks`` argument is made by ``sink_logits`` for all of them.
"""

from __future__ import annotations

import functools
import math

import torch

from ..core.reference import check_qkv_agree, check_window_and_sinks, validate_attention_inputs

__all__ = ["SUPPORTED", "LAYOUTS", "check_attention_inputs", "check_supported", "check_sm_scale", "sink_logits",
           "sink_probability", "PlanCache", "PLAN_SCALAR_TYPES"]

# What the kernels accept, per device type. The CPU path is for learning and testing at small sizes.
SUPPORTED = {
    "cuda": {"dtypes": (torch.float16, torch.bfloat16), "head_dims": (64, 128)},
    "cpu": {"dtypes": (torch.float32, torch.float16), "head_dims": (16, 32, 64, 128)},
}
# Where the heads are in q for each front door's layout: dense [B, H, S, D], packed [total, H, D],
# decode [B, S_new, H, D].
LAYOUTS = {"dense": 1, "packed": 1, "decode": 2}


def check_supported(q, fn="flash_attention"):
    """Raise ``ValueError`` unless ``fn``'s kernels run on q's device type, dtype and head dim."""
    device_type = q.device.type
    if device_type not in SUPPORTED:
        raise ValueError(f"{fn} runs on CUDA or the CPU; got device {q.device}")
    support = SUPPORTED[device_type]
    if q.dtype not in support["dtypes"]:
        names = ", ".join(str(d) for d in support["dtypes"])
        raise ValueError(f"on {device_type}, {fn} supports dtypes {names}; got {q.dtype}")
    if q.shape[-1] not in support["head_dims"]:
        raise ValueError(f"on {device_type}, head_dim must be one of {support['head_dims']}; got {q.shape[-1]}")


def check_sm_scale(sm_scale):
    """Raise ``ValueError`` unless ``sm_scale`` is None (1/√D) or a positive finite number."""
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                             or not math.isfinite(sm_scale) or sm_scale <= 0):
        raise ValueError(f"sm_scale must be a positive finite number (the kernels fold it into exp2); got {sm_scale!r}")


def check_attention_inputs(fn, q, k, v, *, layout="dense", window_size=None, sinks=None, sm_scale=None):
    """The checks every front door shares, after its own layout checks: q, k, v agree (dtype, device,
    k/v shape), head dims match, GQA head counts, what the kernels support here, window, sinks, scale.

    ``layout``: "dense" (q [B, H, S, D]; also checks the 4-D shapes, batch and empty sizes), "packed"
    (q [total, H, D]) or "decode" (q [B, S_new, H, D]).
    """
    if layout == "dense":
        validate_attention_inputs(q, k, v, window_size=window_size, sinks=sinks)
        check_supported(q, fn)
    else:
        check_qkv_agree(q, k, v)
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f"head dims differ: q has {q.shape[-1]}, k/v have {k.shape[-1]}")
        hq, hkv = q.shape[LAYOUTS[layout]], k.shape[-2]
        if hq == 0 or hkv == 0 or hq % hkv:
            raise ValueError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv}) for GQA")
        check_supported(q, fn)
        check_window_and_sinks(window_size, sinks, hq, q.device)
    check_sm_scale(sm_scale)


# What a per-signature plan key may hold by value (with its type): anything else makes the key None.
PLAN_SCALAR_TYPES = frozenset((type(None), bool, int, float))


class PlanCache(dict):
    """Plans kept per host-known signature of a front door's arguments (its ``_plan_key``), at most ``max_size``
    (then all are dropped): one lookup replaces the checks and choices that depend only on that signature."""

    def __init__(self, max_size):
        super().__init__()
        self.max_size = max_size

    def plan(self, key, make, *args):
        """The plan kept for ``key``, or ``make(*args)``, kept unless ``key`` is None (a signature the key cannot
        describe). ``make`` raises on a bad input, so nothing is ever kept for one."""
        plan = None if key is None else self.get(key)
        if plan is None:
            plan = make(*args)
            if key is not None:
                if len(self) >= self.max_size:
                    self.clear()
                self[key] = plan
        return plan


@functools.lru_cache(maxsize=16)
def _no_sinks(heads, device):
    """Sink logits of -inf for every head (cached: one fewer allocation and kernel launch per call)."""
    return torch.full((heads,), float("-inf"), device=device)


def sink_probability(sink, lse):
    """P_sink = exp(sink − LSE), and 0 where the sink's logit is −∞: a row that saw no key and has no sink
    has LSE −∞ too, and exp(−∞ − (−∞)) would be NaN (the float64 reference gives 0 there)."""
    return torch.where(sink == float("-inf"), 0.0, torch.exp(sink - lse))


def sink_logits(sinks, heads, device):
    """The kernels' ``Sinks`` argument: float32 logits [H], or -inf for every head when there are none.

    "No sink" is a sink of logit -inf: its exp() is 0, so one kernel signature serves both.
    """
    return sinks.detach().float().contiguous() if sinks is not None else _no_sinks(heads, device)


def check_tensor_dims(name, t, dims, layout):
    """A tensor with ``dims`` dimensions; ``layout`` names them in the error (the packed and decoding front doors)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have shape {layout}; got {tuple(t.shape)}")


def check_index_tensor(name, t, shape, device):
    """An int32 index tensor of the given shape on ``device`` (FlashAttention's convention)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype int32; got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32; got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (with q); got {t.device}")


def wants_index_check(check_indices, *tensors):
    """``check_indices=None``: check where the index tensors are on the host already (free); on the GPU the
    check would wait for it (a sync per call), so it runs only when asked for."""
    if check_indices is None:
        return all(t.device.type == "cpu" for t in tensors if t is not None)
    if not isinstance(check_indices, bool):
        raise ValueError(f"check_indices must be True, False or None; got {check_indices!r}")
    return check_indices
