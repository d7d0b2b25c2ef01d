"""``flash_attention_varlen`` and ``flash_decode``: chapter 09's kernels behind FlashAttention's conventions.

* ``flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``: a batch
  of sequences of different lengths, packed without padding (``q`` is ``[total_q, H, D]``; sequence
  ``b`` is rows ``cu_seqlens_q[b] … cu_seqlens_q[b+1] − 1``), each attended independently.
  Differentiable with respect to q, k, v and sinks. FlashAttention's ``flash_attn_varlen_func``.
* ``flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, ...)``: one decoding step
  against a KV cache, contiguous or paged. FlashAttention's ``flash_attn_with_kvcache``.

Every input is checked here, before anything is compiled or launched: a bad input gets a
``ValueError`` (or ``TypeError``) that says what is wrong. The index tensors (``cu_seqlens``,
``cache_seqlens``, ``block_table``) are read on the host for that, which waits for the GPU once per
call; ``flash_decode(..., check_indices=False)`` skips that read for a decoding loop whose indices are
already trusted (the kernels then read whatever the indices point at).
"""

import functools
import math

import torch

from .attention import SUPPORTED, _DTYPE_NAMES, _no_sinks
from .flash_decode import (choose_num_splits, decode_config, decode_rows, flash_decode_kernel,
                           flash_decode_merge_kernel)
from .tiles import compile_kernel

__all__ = ["flash_decode", "decode_kernels", "decode_num_splits"]

_CACHE_SIZE = 32


# ---------------------------------------------------------------------------------------------- checks

def _check_tensor(name, t, dims, layout):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have shape {layout}; got {tuple(t.shape)}")


def _check_index_tensor(name, t, shape, device):
    """An int32 index tensor of the given shape on ``device`` (FlashAttention's convention)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype int32; got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32; got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (with q); got {t.device}")


def _check_supported(fn, q):
    device_type = q.device.type
    if device_type not in SUPPORTED:
        raise ValueError(f"{fn} runs on CUDA or the CPU; got device {q.device}")
    support = SUPPORTED[device_type]
    if q.dtype not in support["dtypes"]:
        names = ", ".join(str(d) for d in support["dtypes"])
        raise ValueError(f"on {device_type}, {fn} supports dtypes {names}; got {q.dtype}")
    if q.shape[-1] not in support["head_dims"]:
        raise ValueError(f"on {device_type}, head_dim must be one of {support['head_dims']}; got {q.shape[-1]}")


def _check_common(fn, q, k, v, heads_dim, *, sinks, window_size, sm_scale):
    """Checks both functions share: dtypes, devices, head counts and dims, sinks, window, scale."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head dims differ: q has {q.shape[-1]}, k/v have {k.shape[-1]}")
    hq, hkv = q.shape[heads_dim], k.shape[-2]
    if hq == 0 or hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a positive multiple of key/value heads ({hkv}) for GQA")
    _check_supported(fn, q)
    if window_size is not None and (not isinstance(window_size, int) or isinstance(window_size, bool)
                                    or window_size < 1):
        raise ValueError(f"window_size must be a positive int or None; got {window_size!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,):
            shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            raise ValueError(f"sinks must be a tensor of shape [{hq}] (one logit per query head); got {shape}")
        if not sinks.is_floating_point():
            raise ValueError(f"sinks must be a floating-point tensor; got {sinks.dtype}")
        if sinks.device != q.device:
            raise ValueError(f"sinks must be on {q.device}; got {sinks.device}")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float))
                                 or not math.isfinite(sm_scale) or sm_scale <= 0):
        raise ValueError(f"sm_scale must be a positive finite number (the kernels fold it into exp2); got {sm_scale!r}")
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


def _target(t):
    return "cuda" if t.device.type == "cuda" else "c"


def _sink_logits(sinks, heads, device):
    """Sink logits as float32 [H]; "no sink" is a sink of logit -inf (its exp() is 0)."""
    return sinks.detach().float().contiguous() if sinks is not None else _no_sinks(heads, device)


# ---------------------------------------------------------------------------------------------- decode

@functools.lru_cache(maxsize=_CACHE_SIZE)
def _decode_split(heads, heads_kv, dim, seq_new, page_size, causal, window_size, sm_scale, dtype, target, config):
    func = flash_decode_kernel(heads, heads_kv, dim, seq_new, page_size=page_size, causal=causal,
                               window_size=window_size, sm_scale=sm_scale, dtype=dtype, target=target,
                               **config._asdict())
    return compile_kernel(func, out_idx=[], target=target, dtype=dtype, pass_configs=config.pass_configs())


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _decode_merge(heads, dim, seq_new, dtype, target):
    return compile_kernel(flash_decode_merge_kernel(heads, dim, seq_new, dtype=dtype, target=target),
                          out_idx=[3, 4], target=target, dtype=dtype)


@functools.lru_cache(maxsize=16)
def _no_block_table(batch, device):
    """What a contiguous cache passes for the block table (the kernel never reads it)."""
    return torch.zeros(batch, 1, dtype=torch.int32, device=device)


def _cache_layout(q, k_cache, block_table):
    """(capacity of each sequence's cache, page_size or None) after checking the cache's shape."""
    batch = q.shape[0]
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a contiguous cache has one row per sequence: k_cache.shape[0] must be {batch}; "
                             f"got {k_cache.shape[0]}")
        return k_cache.shape[1], None
    if block_table.dim() != 2:
        raise ValueError(f"block_table must have shape [batch, max_pages]; got {list(block_table.shape)}")
    _check_index_tensor("block_table", block_table, (batch, block_table.shape[1]), q.device)
    page_size = k_cache.shape[1]
    if page_size % 16:
        raise ValueError(f"page_size (k_cache.shape[1] = {page_size}) must be a multiple of 16 (a key tile "
                         "never straddles two pages)")
    return block_table.shape[1] * page_size, page_size


def decode_kernels(q, k_cache, *, block_table=None, causal=False, window_size=None, sm_scale=None):
    """The compiled (split, merge) kernels and their ``DecodeConfig`` that ``flash_decode`` runs here."""
    page_size = None if block_table is None else k_cache.shape[1]
    target = _target(q)
    batch, seq_new, heads, dim = q.shape
    heads_kv = k_cache.shape[2]
    config = decode_config(target, heads, heads_kv, dim, seq_new, page_size)
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    causal = bool(causal or window_size is not None)
    split = _decode_split(heads, heads_kv, dim, seq_new, page_size, causal, window_size, scale,
                          _DTYPE_NAMES[q.dtype], target, config)
    return split, _decode_merge(heads, dim, seq_new, _DTYPE_NAMES[q.dtype], target), config


def decode_num_splits(q, k_cache, *, block_table=None):
    """The split count ``flash_decode`` picks when ``num_splits=None`` (``choose_num_splits``).

    It looks at shapes only (the cache's capacity, not ``cache_seqlens``), so choosing costs no wait
    for the GPU; on the CPU it is 1.
    """
    if q.device.type != "cuda":
        return 1
    batch, seq_new, heads, dim = q.shape
    heads_kv = k_cache.shape[2]
    capacity = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    page_size = None if block_table is None else k_cache.shape[1]
    config = decode_config("cuda", heads, heads_kv, dim, seq_new, page_size)
    rows = decode_rows(heads, heads_kv, seq_new)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return choose_num_splits(batch, heads_kv, capacity, num_sms=sms, config=config, dim=dim,
                             row_tiles=math.ceil(rows / config.block_M))


def _check_decode_indices(cache_seqlens, block_table, capacity, page_size, num_pages):
    lengths = cache_seqlens.cpu()  # one wait for the GPU
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > capacity):
        where = "the pages given (max_pages × page_size)" if page_size else "the cache (k_cache.shape[1])"
        raise ValueError(f"cache_seqlens must lie in [0, {capacity}], the capacity of {where}; got values from "
                         f"{int(lengths.min())} to {int(lengths.max())}")
    if page_size is None:
        return
    table = block_table.cpu()
    pages_used = (lengths.long() + page_size - 1) // page_size
    used = torch.arange(table.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    if bad.any():
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the cache "
                         f"(pages 0 … {num_pages - 1}); sequence {b} uses its first {int(pages_used[b])} entries")


def flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=False, sm_scale=None,
                 window_size=None, sinks=None, num_splits=None, return_lse=False, check_indices=True):
    """One decoding step against a KV cache (FlashAttention's ``flash_attn_with_kvcache`` layout).

    q: [B, S_new, H, D], the S_new new query tokens of each sequence. The cache is contiguous,
    k_cache/v_cache [B, S_max, H_kv, D], or paged, [num_pages, page_size, H_kv, D] with an int32
    ``block_table`` [B, max_pages] listing each sequence's pages in order. ``cache_seqlens`` (int32 [B])
    counts each sequence's valid keys, the S_new new tokens (already written to the cache, last)
    included. With ``causal``, new token i of sequence b sits at position ``cache_seqlens[b] − S_new + i``;
    a ``window_size`` W (implies causal) lets it see its last W keys; ``sinks`` (float [H]) are
    gpt-oss's per-head sink logits. ``num_splits`` (None: ``decode_num_splits``) is how many thread
    blocks share one sequence's cache. Returns O [B, S_new, H, D] (and the natural-log LSE
    [B, H, S_new], float32, with ``return_lse``). Forward only.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        layout = "[batch, new_tokens, heads, head_dim]" if name == "q" else \
            "[batch, seq_max, heads_kv, head_dim] or [num_pages, page_size, heads_kv, head_dim]"
        _check_tensor(name, t, 4, layout)
    scale = _check_common("flash_decode", q, k_cache, v_cache, 2, sinks=sinks, window_size=window_size,
                          sm_scale=sm_scale)
    batch, seq_new = q.shape[:2]
    if batch == 0 or seq_new == 0:
        raise ValueError(f"q must hold at least one sequence and one new token; got {tuple(q.shape)}")
    _check_index_tensor("cache_seqlens", cache_seqlens, (batch,), q.device)
    capacity, page_size = _cache_layout(q, k_cache, block_table)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (decoding reads the cache in place; a copy "
                         "would cost more than the step)")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None; got {num_splits!r}")
    if check_indices:
        _check_decode_indices(cache_seqlens, block_table, capacity, page_size, k_cache.shape[0])
    if window_size is not None and window_size >= capacity:
        window_size, causal = None, True  # a window as long as the cache hides only what causal hides

    split, merge, _ = decode_kernels(q, k_cache, block_table=block_table, causal=causal, window_size=window_size,
                                     sm_scale=scale)
    splits = decode_num_splits(q, k_cache, block_table=block_table) if num_splits is None else num_splits
    heads, dim = q.shape[2], q.shape[3]
    o_part = torch.empty(batch, seq_new, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch, seq_new, heads, splits, dtype=torch.float32, device=q.device)
    table = _no_block_table(batch, q.device) if block_table is None else block_table
    split(q.contiguous(), k_cache, v_cache, table, cache_seqlens, o_part, lse_part)
    out, lse = merge(o_part, lse_part, _sink_logits(sinks, heads, q.device))
    return (out, lse) if return_lse else out


def _self_check_decode():
    """``python -m course_utils.flash_decode``: contiguous and paged decoding against the float64 reference."""
    from .device import DEVICE, HAS_GPU
    from .reference import attention_reference

    torch.manual_seed(0)
    dtype = torch.bfloat16 if HAS_GPU else torch.float32
    batch, seq_new, heads, heads_kv, dim = (4, 1, 64, 8, 64) if HAS_GPU else (3, 2, 4, 2, 16)
    seq_max, page_size = (4096, 256) if HAS_GPU else (48, 16)
    q = torch.randn(batch, seq_new, heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, seq_max, heads_kv, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.randint(seq_new, seq_max + 1, (batch,), device=DEVICE, dtype=torch.int32)
    sinks = torch.randn(heads, device=DEVICE)
    pages = seq_max // page_size
    table = torch.randperm(batch * pages, device=DEVICE).view(batch, pages).to(torch.int32)
    k_pages, v_pages = (torch.empty(batch * pages, page_size, heads_kv, dim, device=DEVICE, dtype=dtype)
                        for _ in range(2))
    k_pages[table.long()] = k.view(batch, pages, page_size, heads_kv, dim)
    v_pages[table.long()] = v.view(batch, pages, page_size, heads_kv, dim)
    for name, caches, extra in (("contiguous", (k, v), {}), ("paged", (k_pages, v_pages), dict(block_table=table))):
        out = flash_decode(q, *caches, lengths, causal=True, sinks=sinks, **extra)
        worst = 0.0
        for b in range(batch):
            n = int(lengths[b])
            ref = attention_reference(q[b:b + 1].transpose(1, 2), k[b:b + 1, :n].transpose(1, 2),
                                      v[b:b + 1, :n].transpose(1, 2), causal=True, sinks=sinks)
            worst = max(worst, float((out[b:b + 1].transpose(1, 2).double() - ref.double()).abs().max()))
        print(f"flash_decode, {name} cache: max abs error vs float64 {worst:.2e}")
        assert worst < (2e-2 if HAS_GPU else 1e-5), name
