"""``flash_attention``: the course's kernels behind one PyTorch-style function.

Kernels are compiled once per (shapes, dtype, variant, tiling, target) and cached, so calling
this in a loop costs one compilation.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .flash_fwd import flash_fwd_kernel
from .reference import validate_attention_inputs
from .tiles import compile_kernel

__all__ = ["flash_attention", "ForwardConfig", "default_forward_config", "SUPPORTED"]

# What the kernels accept, per device type. The CPU path is for learning and testing at small sizes.
SUPPORTED = {
    "cuda": {"dtypes": (torch.float16, torch.bfloat16), "head_dims": (64, 128)},
    "cpu": {"dtypes": (torch.float32, torch.float16), "head_dims": (16, 32, 64, 128)},
}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


class ForwardConfig(NamedTuple):
    """Tiling of the forward kernel."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int
    overlap_softmax: bool = False


def default_forward_config(device_type, dim):
    """The tiling used when none is given: small tiles on the CPU, the tuned one on the GPU."""
    if device_type == "cpu":
        return ForwardConfig(16, 16, 1, 1)
    # Best of the chapter 04 sweep on the H100 (figures/ch04_forward_sweep_h100.json), causal and not.
    return ForwardConfig(128, 128, 1, 256)


@functools.lru_cache(maxsize=None)
def _compiled_forward(batch, heads, heads_kv, seq_q, seq_k, dim, dtype_name, causal, window_size,
                      has_sinks, sm_scale, config, target):
    func = flash_fwd_kernel(
        batch, heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
        has_sinks=has_sinks, sm_scale=sm_scale, dtype=dtype_name, target=target, **config._asdict())
    return compile_kernel(func, out_idx=[4, 5], target=target, dtype=dtype_name)


def _check_supported(q):
    device_type = q.device.type
    if device_type not in SUPPORTED:
        raise ValueError(f"flash_attention runs on CUDA or the CPU; got device {q.device}")
    support = SUPPORTED[device_type]
    if q.dtype not in support["dtypes"]:
        names = ", ".join(str(d) for d in support["dtypes"])
        raise ValueError(f"on {device_type}, flash_attention supports dtypes {names}; got {q.dtype}")
    if q.shape[-1] not in support["head_dims"]:
        raise ValueError(f"on {device_type}, head_dim must be one of {support['head_dims']}; got {q.shape[-1]}")


def flash_attention(q, k, v, causal=False, sm_scale=None, *, window_size=None, sinks=None,
                    return_lse=False, config=None):
    """Attention with the course's TileLang FlashAttention kernel.

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (GQA). ``window_size``
    W lets a query see its last W keys (implies causal); ``sinks`` is a float tensor [H] of
    per-head sink logits (gpt-oss). Returns O (and the natural-log LSE [B, H, S_q] in float32 with
    ``return_lse``). Masking conventions are those of ``course_utils.reference``.
    """
    validate_attention_inputs(q, k, v, window_size=window_size, sinks=sinks)
    _check_supported(q)
    device_type = q.device.type
    dim = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    config = ForwardConfig(*config) if config is not None else default_forward_config(device_type, dim)
    target = "cuda" if device_type == "cuda" else "c"
    kernel = _compiled_forward(
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], dim, _DTYPE_NAMES[q.dtype],
        bool(causal or window_size is not None), window_size, sinks is not None, sm_scale, config, target)
    # "No sink" is a sink of logit -inf: its exp() is 0, so one kernel signature serves both.
    sink_logits = (sinks.detach().float().contiguous() if sinks is not None
                   else torch.full((q.shape[1],), float("-inf"), device=q.device))
    out, lse = kernel(q.contiguous(), k.contiguous(), v.contiguous(), sink_logits)
    return (out, lse) if return_lse else out
