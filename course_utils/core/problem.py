"""One description of an attention problem, built once at the API edge and read by everything after it.

``AttentionProblem`` is what a compiled kernel is specialised for: head counts and dim, dtype, target,
masking, sinks, the scale and, where the kernel is compiled for one shape, the shape. It is frozen and
hashable, so it is the key of the compile caches; ``kernel_options`` is the keyword list every kernel
factory takes (``heads_kv``, ``causal``, ``window_size``, ``sm_scale``, ``dtype``), and the kernels'
``Prelude`` (``flash_pieces.prelude``) is made from those. The front doors build it from their tensors:
``dense`` (``flash_attention``, ring attention's blocks), ``packed`` (``flash_attention_varlen``),
``decode`` (``flash_decode``) and ``flex`` (``flex_attention``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

__all__ = ["AttentionProblem", "DTYPE_NAMES", "target_of"]

DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def target_of(device):
    """The TileLang target for tensors on ``device``: "cuda" on a GPU, "c" (TileLang's C backend) otherwise."""
    return "cuda" if torch.device(device).type == "cuda" else "c"


@dataclass(frozen=True)
class AttentionProblem:
    """Everything a compiled kernel is specialised for (the key of the kernel caches).

    ``causal`` is True for causal attention and for a sliding window (a window implies causal).
    ``batch``, ``seq_q`` and ``seq_k`` are the shape of a dense problem; a packed (varlen) or cached
    (decode) problem reads its lengths at run time and leaves them None. ``seq_new`` and
    ``page_size`` are decoding's new tokens per sequence and cache page size (None: contiguous cache).
    ``mask_shape`` and ``mask_block`` are a flex problem's block mask: the shape of its tile states
    [B', H', query blocks, key blocks] and its tile (query rows, keys); its modifiers are not part of
    the problem (the compile cache keys them by their ``ModifierPlan``).
    """

    heads: int
    heads_kv: int
    dim: int
    dtype: str
    target: str
    sm_scale: float
    causal: bool = False
    window_size: int | None = None
    has_sinks: bool = False
    batch: int | None = None
    seq_q: int | None = None
    seq_k: int | None = None
    seq_new: int | None = None
    page_size: int | None = None
    mask_shape: tuple | None = None
    mask_block: tuple | None = None

    @staticmethod
    def _scale(dim, sm_scale):
        return 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)

    @classmethod
    def dense(cls, q, k, *, causal=False, window_size=None, has_sinks=False, sm_scale=None):
        """q [B, H, S_q, D], k [B, H_kv, S_k, D] (``flash_attention``; ring attention's blocks)."""
        return cls(heads=q.shape[1], heads_kv=k.shape[1], dim=q.shape[3], dtype=DTYPE_NAMES[q.dtype],
                   target=target_of(q.device), sm_scale=cls._scale(q.shape[3], sm_scale),
                   causal=bool(causal or window_size is not None), window_size=window_size,
                   has_sinks=bool(has_sinks), batch=q.shape[0], seq_q=q.shape[2], seq_k=k.shape[2])

    @classmethod
    def packed(cls, q, k, *, causal=False, window_size=None, sm_scale=None):
        """q [total_q, H, D], k [total_k, H_kv, D] (``flash_attention_varlen``: sinks are always an argument)."""
        return cls(heads=q.shape[1], heads_kv=k.shape[1], dim=q.shape[2], dtype=DTYPE_NAMES[q.dtype],
                   target=target_of(q.device), sm_scale=cls._scale(q.shape[2], sm_scale),
                   causal=bool(causal or window_size is not None), window_size=window_size)

    @classmethod
    def decode(cls, q, k_cache, *, page_size=None, causal=False, window_size=None, sm_scale=None):
        """q [B, S_new, H, D] against a cache [., ., H_kv, D] (``flash_decode``), paged if ``page_size``."""
        return cls(heads=q.shape[2], heads_kv=k_cache.shape[2], dim=q.shape[3], dtype=DTYPE_NAMES[q.dtype],
                   target=target_of(q.device), sm_scale=cls._scale(q.shape[3], sm_scale),
                   causal=bool(causal or window_size is not None), window_size=window_size,
                   seq_new=q.shape[1], page_size=page_size)

    @classmethod
    def flex(cls, q, k, block_mask, sm_scale=None):
        """q [B, H, S_q, D], k [B, H_kv, S_k, D] under ``block_mask`` (a ``BlockMask``: ``flex_attention``)."""
        return cls(heads=q.shape[1], heads_kv=k.shape[1], dim=q.shape[3], dtype=DTYPE_NAMES[q.dtype],
                   target=target_of(q.device), sm_scale=cls._scale(q.shape[3], sm_scale), batch=q.shape[0],
                   seq_q=q.shape[2], seq_k=k.shape[2], mask_shape=tuple(block_mask.state.shape),
                   mask_block=tuple(block_mask.block))

    @property
    def shape(self):
        """(batch, heads, seq_q, seq_k, dim): the leading arguments of the dense kernel factories."""
        return (self.batch, self.heads, self.seq_q, self.seq_k, self.dim)

    def kernel_options(self):
        """The keyword arguments every kernel factory takes for the problem's variant."""
        return dict(heads_kv=self.heads_kv, causal=self.causal, window_size=self.window_size, sm_scale=self.sm_scale,
                    dtype=self.dtype)

    def replace(self, **changes):
        """A copy with ``changes`` (e.g. ``has_sinks=False``: the backward does not depend on sinks)."""
        return dataclasses.replace(self, **changes)
