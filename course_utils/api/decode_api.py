"""``flash_decode``: chapter 09's decoding kernels behind FlashAttention's ``flash_attn_with_kvcache``.

``flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, ...)`` is one decoding step against a
KV cache, contiguous or paged. ``num_splits`` thread blocks share one sequence's cache, and a merge kernel
combines their partial results by their LSE (one split: one kernel writes the result, no merge).

Every input is checked here, before anything is compiled or launched: a bad input gets a ``ValueError`` (or
``TypeError``) that says what is wrong. Shapes, dtypes and devices are checked from what the host knows, with no
wait for the GPU. The *values* of ``cache_seqlens`` and ``block_table`` would have to be read back for a check,
a wait for the GPU on every step (and no CUDA graph): ``check_indices=None`` (default) checks them only where they
are CPU tensors already, ``True`` everywhere (a debug mode), ``False`` never. Unchecked on the GPU, the kernel
clamps every index into the cache, so a bad one gives a wrong answer for its sequence, never a read outside the
cache.
"""

import functools
from typing import NamedTuple

import torch

from ..core.device import sm_count
from ..core.problem import AttentionProblem
from ..kernels.flash_decode import choose_num_splits, decode_config, decode_row_tiles, decode_rows
from ..kernels.tiles import launcher
from .compiled import compiled
from .inputs import (
    PLAN_SCALAR_TYPES,
    PlanCache,
    check_attention_inputs,
    check_index_tensor,
    check_tensor_dims,
    sink_logits,
    wants_index_check,
)
from .registry import DECODE

__all__ = ["flash_decode", "decode_kernels", "decode_single_kernel", "decode_num_splits"]

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
    check_index_tensor("block_table", block_table, (batch, block_table.shape[1]), q.device)
    page_size = k_cache.shape[1]
    if page_size == 0 or page_size % 16:
        raise ValueError(f"page_size (k_cache.shape[1] = {page_size}) must be a positive multiple of 16 (a key "
                         "tile never straddles two pages)")
    return block_table.shape[1] * page_size, page_size


def _decode_problem(q, k_cache, block_table, causal, window_size, sm_scale):
    pr = AttentionProblem.decode(q, k_cache, page_size=None if block_table is None else k_cache.shape[1],
                                 causal=causal, window_size=window_size, sm_scale=sm_scale)
    return pr, decode_config(pr.target, pr.heads, pr.heads_kv, pr.dim, pr.seq_new, pr.page_size)


def decode_kernels(q, k_cache, *, block_table=None, causal=False, window_size=None, sm_scale=None,
                   merge_allocates=True):
    """The compiled (split, merge) kernels and their ``DecodeConfig`` that ``flash_decode`` runs here
    with two splits or more (one split: ``decode_single_kernel``). The merge returns (O, LSE), or with
    ``merge_allocates=False`` (as ``flash_decode`` calls it) writes them into its last two arguments."""
    pr, config = _decode_problem(q, k_cache, block_table, causal, window_size, sm_scale)
    merge = DECODE["decode_merge_allocating" if merge_allocates else "decode_merge"]
    return compiled(DECODE["decode_split"], pr, config), compiled(merge, pr), config


def decode_single_kernel(q, k_cache, *, block_table=None, causal=False, window_size=None, sm_scale=None):
    """The compiled one-split kernel ``flash_decode`` runs when one split suffices (no merge launch)."""
    return compiled(DECODE["decode_single"], *_decode_problem(q, k_cache, block_table, causal, window_size, sm_scale))


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
    sms = sm_count(q.device)
    return choose_num_splits(batch, heads_kv, capacity, num_sms=sms, config=config,
                             row_tiles=decode_row_tiles(rows, config.block_M, config.kv_heads_per_block))


def _check_decode_indices(cache_seqlens, block_table, capacity, page_size, num_pages):
    lengths = cache_seqlens.cpu()  # on a GPU: one wait for it
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


class _DecodePlan(NamedTuple):
    """What ``flash_decode`` concluded from one signature of its arguments (``_plan_key``): everything
    but the tensors' contents, so one lookup replaces the checks and the kernel and split choices."""

    splits: int
    launch: object  # the one-split kernel, or the split kernel (a callable taking torch tensors)
    merge: object  # None with one split
    out_shape: tuple
    lse_shape: tuple
    part_shape: tuple  # O_part's shape (splits > 1); LSE_part's is part_shape[:-1]
    dtype: torch.dtype
    device: torch.device
    no_table: "torch.Tensor | None"  # what a contiguous cache passes for the block table
    no_sinks: "torch.Tensor | None"  # -inf logits, when sinks is None
    check_indices: bool  # read the index values on the host at every call (CPU tensors, or asked for)
    capacity: int
    page_size: "int | None"
    num_pages: int


_PLANS = PlanCache(max_size=256)  # signatures kept (a model decodes with a handful: one per batch size and layout)
_Tensor = torch.Tensor


def _plan_key(q, k_cache, v_cache, cache_seqlens, block_table, causal, sm_scale, window_size, sinks, num_splits,
              check_indices):
    """Everything the checks and choices of ``flash_decode`` depend on, or None where an argument is of a kind
    the signature cannot describe (the full checks then run, and reject it or not, at every call).

    Scalars are keyed with their type (``num_splits=True`` is refused but equals 1); a tensor by its type,
    shape, dtype and device, and the cache by its contiguity too. Values are never part of it: they are
    checked at every call where they are checked at all (``_DecodePlan.check_indices``). Written out
    inline: it runs at every decoding step (a few µs, against the checks' tens)."""
    if not (isinstance(q, _Tensor) and isinstance(k_cache, _Tensor) and isinstance(v_cache, _Tensor)
            and isinstance(cache_seqlens, _Tensor) and (block_table is None or isinstance(block_table, _Tensor))
            and (sinks is None or isinstance(sinks, _Tensor))):
        return None
    types = (type(causal), type(sm_scale), type(window_size), type(num_splits), type(check_indices))
    if not PLAN_SCALAR_TYPES.issuperset(types):
        return None
    return (types, causal, sm_scale, window_size, num_splits, check_indices,
            type(q), q.shape, q.dtype, q.device,
            type(k_cache), k_cache.shape, k_cache.dtype, k_cache.device, k_cache.is_contiguous(),
            type(v_cache), v_cache.shape, v_cache.dtype, v_cache.device, v_cache.is_contiguous(),
            type(cache_seqlens), cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device,
            None if block_table is None else (type(block_table), block_table.shape, block_table.dtype,
                                              block_table.device),
            None if sinks is None else (type(sinks), sinks.shape, sinks.dtype, sinks.device))


def _decode_plan(q, k_cache, v_cache, cache_seqlens, block_table, causal, sm_scale, window_size, sinks, num_splits,
                 check_indices):
    """Every check of ``flash_decode`` that the host can make without reading a value, and its choices."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        layout = "[batch, new_tokens, heads, head_dim]" if name == "q" else \
            "[batch, seq_max, heads_kv, head_dim] or [num_pages, page_size, heads_kv, head_dim]"
        check_tensor_dims(name, t, 4, layout)
    check_attention_inputs("flash_decode", q, k_cache, v_cache, layout="decode", sinks=sinks, window_size=window_size,
                           sm_scale=sm_scale)
    batch, seq_new = q.shape[:2]
    if batch == 0 or seq_new == 0:
        raise ValueError(f"q must hold at least one sequence and one new token; got {tuple(q.shape)}")
    check_index_tensor("cache_seqlens", cache_seqlens, (batch,), q.device)
    capacity, page_size = _cache_layout(q, k_cache, block_table)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (decoding reads the cache in place; a copy "
                         "would cost more than the step)")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None; got {num_splits!r}")
    wants_check = wants_index_check(check_indices, cache_seqlens, block_table)
    if window_size is not None and window_size >= capacity:
        window_size, causal = None, True  # a window as long as the cache hides only what causal hides

    splits = decode_num_splits(q, k_cache, block_table=block_table) if num_splits is None else num_splits
    heads, dim = q.shape[2], q.shape[3]
    kernel_args = dict(block_table=block_table, causal=causal, window_size=window_size, sm_scale=sm_scale)
    if splits == 1:  # one kernel writes the result: no partials, no merge launch
        launch, merge = launcher(decode_single_kernel(q, k_cache, **kernel_args)), None
    else:
        split, merge, _ = decode_kernels(q, k_cache, merge_allocates=False, **kernel_args)
        launch, merge = launcher(split), launcher(merge)
    return _DecodePlan(splits=splits, launch=launch, merge=merge, out_shape=tuple(q.shape),
                       lse_shape=(batch, heads, seq_new), part_shape=(batch, seq_new, heads, splits, dim),
                       dtype=q.dtype, device=q.device,
                       no_table=_no_block_table(batch, q.device) if block_table is None else None,
                       no_sinks=sink_logits(None, heads, q.device) if sinks is None else None,
                       check_indices=wants_check, capacity=capacity, page_size=page_size,
                       num_pages=k_cache.shape[0])


def flash_decode(q, k_cache, v_cache, cache_seqlens, *, block_table=None, causal=False, sm_scale=None,
                 window_size=None, sinks=None, num_splits=None, return_lse=False, check_indices=None):
    """One decoding step against a KV cache (FlashAttention's ``flash_attn_with_kvcache`` layout).

    q: [B, S_new, H, D], the S_new new query tokens of each sequence. The cache is contiguous,
    k_cache/v_cache [B, S_max, H_kv, D], or paged, [num_pages, page_size, H_kv, D] with an int32
    ``block_table`` [B, max_pages] listing each sequence's pages in order. ``cache_seqlens`` (int32 [B])
    counts each sequence's valid keys, the S_new new tokens (already written to the cache, last)
    included. With ``causal``, new token i of sequence b sits at position ``cache_seqlens[b] − S_new + i``;
    a ``window_size`` W (implies causal) lets it see its last W keys; ``sinks`` (float [H]) are
    gpt-oss's per-head sink logits. ``num_splits`` (None: ``decode_num_splits``) is how many thread
    blocks share one sequence's cache; with one split a single kernel writes the result (no merge
    launch). Returns O [B, S_new, H, D] (and the natural-log LSE [B, H, S_new], float32, with
    ``return_lse``). Forward only.

    No wait for the GPU: every check of shapes, dtypes and devices uses what the host knows, and the
    split count comes from shapes, so a decoding step can be captured in a CUDA graph and replayed with
    new q, cache contents and ``cache_seqlens``. The *values* of the indices are not read on the host
    unless they are there already: ``check_indices`` None (default) checks them (``cache_seqlens`` in
    [0, capacity], the block-table entries a sequence uses naming pages of the cache; ValueError
    otherwise) when they are CPU tensors, and not when they are on a GPU, where reading them would
    stall every step (20–45% of a step on the H100, and no CUDA graph). ``True`` checks them anywhere
    (a debug mode: one sync per call); ``False`` never. Unchecked, the kernel clamps every index into
    the cache (a length into [0, capacity], a page number into [0, num_pages − 1]): a bad index gives
    a wrong result for its own sequence, never a read outside the cache or a fault.

    What the checks conclude depends only on what the host knows (types, shapes, dtypes, devices,
    contiguity, the options), so it is kept per such signature (``_decode_plan``): a decoding loop,
    which calls with the same signature at every step, pays for the checks, the choice of kernels
    and the split count once, and then only for looking the signature up and launching.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, sinks)):
        raise ValueError("flash_decode is forward only: it returns no gradient, so it refuses inputs that require "
                         "one (q, k_cache, v_cache or sinks); call it under torch.no_grad(), pass detached tensors, or "
                         "use flash_attention / flash_attention_varlen, which are differentiable")
    args = (q, k_cache, v_cache, cache_seqlens, block_table, causal, sm_scale, window_size, sinks, num_splits,
            check_indices)
    plan = _PLANS.plan(_plan_key(*args), _decode_plan, *args)
    if plan.check_indices:
        _check_decode_indices(cache_seqlens, block_table, plan.capacity, plan.page_size, plan.num_pages)
    # The kernels take dense tensors; a strided view (block_table = wide[:, :n], a cache_seqlens view, a
    # transposed q) is copied, as FlashAttention accepts it. Contiguous ones pass as they are.
    table = plan.no_table if block_table is None else block_table.contiguous()
    if sinks is None:
        logits = plan.no_sinks
    elif sinks.dtype is torch.float32 and not sinks.requires_grad and sinks.is_contiguous():
        logits = sinks  # what sink_logits would return (the same memory), without making three views of it
    else:
        logits = sink_logits(sinks, plan.out_shape[2], plan.device)
    out = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    if plan.merge is None:
        plan.launch(q.contiguous(), k_cache, v_cache, table, cache_seqlens.contiguous(), logits, out, lse)
        return (out, lse) if return_lse else out
    o_part = torch.empty(plan.part_shape, dtype=torch.float32, device=plan.device)
    lse_part = torch.empty(plan.part_shape[:-1], dtype=torch.float32, device=plan.device)
    plan.launch(q.contiguous(), k_cache, v_cache, table, cache_seqlens.contiguous(), o_part, lse_part)
    plan.merge(o_part, lse_part, logits, out, lse)
    return (out, lse) if return_lse else out
