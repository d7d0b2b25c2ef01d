"""``flash_attention_varlen``: chapter 09's packed kernels behind FlashAttention's ``flash_attn_varlen_func``.

``flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)``: a batch of
sequences of different lengths, packed without padding (``q`` is ``[total_q, H, D]``; sequence ``b`` is rows
``cu_seqlens_q[b] … cu_seqlens_q[b+1] − 1``), each attended independently. Differentiable with respect to q, k, v
and sinks. Decoding against a KV cache, the chapter's other front door, is ``decode_api.flash_decode``.

Every input is checked here, before anything is compiled or launched: a bad input gets a ``ValueError`` (or
``TypeError``) that says what is wrong. Shapes, dtypes, devices and the ``max_seqlen`` arguments are checked from
what the host knows, with no wait for the GPU. The *values* of ``cu_seqlens`` would have to be read back for a
check, a wait for the GPU on every call (and no CUDA graph): ``check_indices=None`` (default) checks them only
where they are CPU tensors already, ``True`` everywhere (a debug mode), ``False`` never.
"""

import functools
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..core.device import is_hopper, sm_count
from ..core.problem import AttentionProblem
from ..kernels.flash_varlen import (
    OWN_BARRIERS_PASS_CONFIGS,
    SCHEDULES,
    lse_row_layout,
    varlen_work_list,
)
from ..kernels.flash_varlen_hopper import varlen_pair_list
from .attention import (
    HOPPER_BACKWARD_CONFIGS,
    BackwardConfig,
    ForwardConfig,
    default_backward_config,
    default_forward_config,
)
from .compiled import compiled

# checking.fuzz and measure.benchmarks.ch09_varlen_decode reach decoding through this module: fuzz clears the
# compiled kernels and plans it finds here between planted bugs.
from .decode_api import (  # noqa: F401
    _PLANS,
    decode_kernels,
    decode_num_splits,
    decode_single_kernel,
    flash_decode,
)
from .inputs import (
    check_attention_inputs,
    check_index_tensor,
    check_tensor_dims,
    sink_logits,
    sink_probability,
    wants_index_check,
)
from .registry import HELPERS, PACKED_BACKWARD, PACKED_FORWARD

__all__ = ["flash_attention_varlen", "varlen_kernels",
           "VARLEN_SCHEDULE", "VARLEN_CUDA_CONFIG", "VARLEN_CUDA_BACKWARD_CONFIG", "VARLEN_PERSISTENT_CONFIG",
           "VARLEN_HOPPER_BACKWARD_CONFIGS"]

_CACHE_SIZE = 32


# The schedule both kernels use when none is given. Measured on the H100 (64k tokens in sequences of
# 128–8192, 2026-11-23, two runs), the two are within 5% of each other once each block reads its
# sequence's lengths once (before that, up to 1.5× apart): the grid ahead in the backward by 2–5%, the
# forward within ±2%. The grid needs no work list. (The lists are made on the host from the lengths and
# cached by them: every layer of a model sees the same batch.)
VARLEN_SCHEDULE = "grid"
# The packed forward on CUDA GPUs other than Hopper (and head dims without a Hopper default): chapter 03's
# loop with chapter 04's pipelining.
VARLEN_CUDA_CONFIG = ForwardConfig(128, 128, 2, 256)
# The packed backward there: chapter 05's tuned tiling.
VARLEN_CUDA_BACKWARD_CONFIG = BackwardConfig(64, 128, 1, 256)
# On Hopper: chapter 07's persistent forward and chapter 08's backward under the packed prelude,
# tiled as the dense kernels are. Measured on an H200 (2026-11-26, 64k tokens in 128-8192, H=16, D=128,
# fp16; docs/varlen_and_decoding.md): forward 510 / 552 TFLOP/s causal / full (chapter 03's loop: 0.76-0.80x
# the dense kernel, this one 0.93-0.97x), backward 396 / 447 (chapter 05's loop 338 / 366).
VARLEN_HOPPER_DIMS = (64, 128)
VARLEN_PERSISTENT_CONFIG = ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True)
# At D = 128 the dense kernel's config itself, but for its launch order (so a change to one reaches the other).
# Its fields (chapter 08's version 20: dV under dSᵀ, dK and dV stored by TMA where a tile is all one sequence's) were
# measured against the plain step (docs/varlen_and_decoding.md). Not ``longest_first``:
# launched as the dense kernel launches it (per sequence, key block 0 of every head first) it was +0.6…+2.4% causal,
# under the 2% bar in two of three blocks; key block 0 of all (sequence, head) pairs first had taken 1.6 times as long
# (no two running blocks shared their Q and dO). ``defer_dq_wait`` (version 22) so that packed and dense run the same
# step. With the causal mask 80 query rows (version 23): 0.94-0.97× the dense kernel on chapter 09's record batch
# against 0.81-0.82× with 64 rows, 3 blocks (commit 73d96a1).
VARLEN_HOPPER_BACKWARD_CONFIGS = {
    **{(128, masked): HOPPER_BACKWARD_CONFIGS[128, masked]._replace(longest_first=False) for masked in (False, True)},
    (64, False): BackwardConfig(128, 128, 2, 256, kernel="flash_bwd_hopper", defer_dq_wait=True),
    (64, True): BackwardConfig(128, 128, 2, 256, kernel="flash_bwd_hopper", defer_dq_wait=True),
}
VARLEN_FORWARD_KERNELS = tuple(PACKED_FORWARD)
VARLEN_BACKWARD_KERNELS = tuple(PACKED_BACKWARD)


class _Plan(NamedTuple):
    """What the kernels need beyond the tensors: the longest lengths, and for the "list" schedule (whose
    work lists are made on the host from ``cu_seqlens``) the work lists and the backward's LSE layout."""

    max_seqlen_q: int
    max_seqlen_k: int
    forward_items: "torch.Tensor | None" = None  # "list" schedule only, on the device: (sequence, query block)
    backward_items: "torch.Tensor | None" = None  # (sequence, key block), heaviest first
    lse_index: "torch.Tensor | None" = None  # on the device; None: made on the device from cu_seqlens_q


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _plan(bounds_q, bounds_k, max_seqlen_q, max_seqlen_k, fwd_block, bwd_config, causal, device):
    """The "list" schedule's plan, from cu_seqlens read on the host (cached by them: every layer of a
    model sees the same batch)."""
    lengths_q = torch.tensor(bounds_q[1:]) - torch.tensor(bounds_q[:-1])
    lengths_k = torch.tensor(bounds_k[1:]) - torch.tensor(bounds_k[:-1])
    fwd = varlen_work_list(lengths_q, lengths_k, fwd_block, causal=causal).to(device)
    bwd = varlen_work_list(lengths_q, lengths_k, bwd_config.block_N, causal=causal, by_keys=True).to(device)
    _, index = lse_row_layout(bounds_q, bwd_config.block_M)
    return _Plan(max_seqlen_q, max_seqlen_k, fwd, bwd, index.to(device))


def _lse_rows(total_q, batch, block_M):
    """The number of columns of ``lse_row_layout`` from host-known sizes (no read of cu_seqlens)."""
    return (total_q + batch * block_M + block_M - 1) // block_M * block_M


def _lse_index_on_device(cu_seqlens_q, total_q, block_M, rows):
    """``lse_row_layout``'s index computed on the device from cu_seqlens_q (no wait for the GPU): token t
    of sequence b goes to column t − cu_seqlens_q[b] + (cu_seqlens_q[b] + b·block_M) // block_M · block_M.
    Clamped into [0, rows): unchecked bad cu_seqlens give wrong gradients, never a write out of bounds."""
    cu = cu_seqlens_q.long()
    t = torch.arange(total_q, device=cu.device)
    b = torch.searchsorted(cu[1:], t, right=True)  # the sequence of each token: ends ≤ t come before it
    q0 = cu[b.clamp(max=cu.shape[0] - 1)]
    return (t - q0 + (q0 + b * block_M) // block_M * block_M).clamp(0, rows - 1)


INT32_MAX = 2 ** 31 - 1


def _check_max_seqlen(name, max_seqlen, total):
    """An int the kernels' int32 grid can hold, and no longer than the packed tensor (host-known: no wait)."""
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{name} must be an int; got {type(max_seqlen).__name__}")
    if not 0 <= max_seqlen <= INT32_MAX:
        raise ValueError(f"{name} = {max_seqlen} must lie in [0, 2**31 - 1]: the kernels take it as an int32")
    if max_seqlen > total:
        raise ValueError(f"{name} = {max_seqlen} is longer than the packed length {total}: no sequence can be")


def _check_bounds(name, bounds, total, max_seqlen, max_name):
    """cu_seqlens read on the host: starts at 0, never decreases, ends at the packed length."""
    if bounds[0] != 0:
        raise ValueError(f"{name}[0] must be 0 (prefix sums of the lengths); got {bounds[0]}")
    for b in range(len(bounds) - 1):
        if bounds[b + 1] < bounds[b]:
            raise ValueError(f"{name} must be non-decreasing (prefix sums of the lengths); "
                             f"{name}[{b + 1}] = {bounds[b + 1]} < {name}[{b}] = {bounds[b]}")
    if bounds[-1] != total:
        raise ValueError(f"{name}[-1] = {bounds[-1]} must equal the packed length {total} of the tensor")
    longest = max(bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1))
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"{max_name} must be an int; got {type(max_seqlen).__name__}")
    if max_seqlen < longest:
        b = max(range(len(bounds) - 1), key=lambda i: bounds[i + 1] - bounds[i])
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the length {longest} of sequence {b}")


def _default_configs(target, dim, masked):
    """The (forward, backward) configs of the fastest packed kernels measured for ``target`` and head dim."""
    if target != "cuda":
        return default_forward_config("cpu", dim, masked), default_backward_config("cpu")
    if is_hopper() and dim in VARLEN_HOPPER_DIMS:
        return VARLEN_PERSISTENT_CONFIG, VARLEN_HOPPER_BACKWARD_CONFIGS[dim, bool(masked)]
    return VARLEN_CUDA_CONFIG, VARLEN_CUDA_BACKWARD_CONFIG


def _varlen_configs(target, dim, masked, config, backward_config):
    """The configs to run (the given ones, else the defaults), after checking that their rows of
    ``PACKED_FORWARD``/``PACKED_BACKWARD`` exist and run here."""
    if config is None or backward_config is None:
        fwd, bwd = _default_configs(target, dim, masked)
    if config is not None:
        fwd = ForwardConfig(*config)
        if fwd.pingpong and "pingpong" not in getattr(PACKED_FORWARD.get(fwd.kernel), "options", ()):
            raise ValueError("config.pingpong is available for packed batches only with kernel="
                             "'flash_fwd_hopper_persistent': the packed ping-pong of the rotated loop never finished "
                             "on the H100 (2026-11-23)")
        if fwd.blocks_per_sm != 1:
            raise ValueError(f"config.blocks_per_sm={fwd.blocks_per_sm!r}: the packed forward runs one block per SM")
    if backward_config is not None:
        bwd = BackwardConfig(*backward_config)
    if fwd.kernel not in PACKED_FORWARD:
        raise ValueError(f"config.kernel must be one of {VARLEN_FORWARD_KERNELS}; got {fwd.kernel!r}")
    if bwd.kernel not in PACKED_BACKWARD:
        raise ValueError(f"backward_config.kernel must be one of {VARLEN_BACKWARD_KERNELS}; got {bwd.kernel!r}")
    on_hopper = target == "cuda" and is_hopper()
    for field, kernel, row in (("config", fwd.kernel, PACKED_FORWARD[fwd.kernel]),
                               ("backward_config", bwd.kernel, PACKED_BACKWARD[bwd.kernel])):
        if row.hopper_only and not on_hopper:
            raise ValueError(f"{field}.kernel={kernel!r} is {row.what}: it needs an sm_90 GPU")
    if fwd.kernel == "flash_fwd_hopper_persistent" and fwd.threads != 2 * fwd.block_M:
        raise ValueError(f"the persistent forward runs one consumer warpgroup per 64 query rows: config.threads must "
                         f"be 2 * block_M = {2 * fwd.block_M}; got {fwd.threads}")
    return fwd, bwd


def _varlen_forward(pr, config, schedule, num_ctas=None):
    """The compiled packed forward; ``num_ctas`` (the GPU's SMs) for the persistent kernel, which ignores
    ``schedule`` (it walks ``varlen_pair_list``)."""
    row = PACKED_FORWARD[config.kernel]
    if not row.takes_schedule:
        return compiled(row, pr, config, num_ctas=num_ctas)
    own = pr.target == "cuda" and config.kernel == "flash_fwd" and is_hopper()  # chapter 03's loop on sm_90
    return compiled(row, pr, config, pass_configs=OWN_BARRIERS_PASS_CONFIGS if own else None, schedule=schedule,
                    own_barriers=own)


def _forward_ctas(config, device):
    """One persistent block per SM of ``device`` for the persistent forward; None for the others."""
    if config.kernel != "flash_fwd_hopper_persistent":
        return None
    return sm_count(device)


def _varlen_backward(pr, config, schedule):
    return compiled(PACKED_BACKWARD[config.kernel], pr, config, schedule=schedule)


def _varlen_small_kernels(dim, dtype, target):
    """Δ and the scale-and-cast kernel: per-token work, the same for every batch and head count (compiled for a
    problem of one head)."""
    pr = AttentionProblem(heads=1, heads_kv=1, dim=dim, dtype=dtype, target=target, sm_scale=1.0)
    small = dict(block=16 if target == "c" else 64, threads=1 if target == "c" else 128)
    return compiled(HELPERS["varlen_delta"], pr, **small), compiled(HELPERS["varlen_scale_cast"], pr, **small)


def _schedule_arg(schedule, plan, forward):
    if schedule == "grid":
        return plan.max_seqlen_q if forward else plan.max_seqlen_k
    return plan.forward_items if forward else plan.backward_items


class _FlashAttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, plan, problem, config, backward_config, schedule):
        fwd = _varlen_forward(problem, config, schedule, _forward_ctas(config, q.device))
        logits = sink_logits(sinks, problem.heads, q.device)
        if config.kernel == "flash_fwd_hopper_persistent":  # its work list is made on the device: no wait
            pairs, count = varlen_pair_list(cu_q, cu_k, problem.heads, config.block_M, plan.max_seqlen_q)
            out, lse = fwd(q, k, v, cu_q, cu_k, pairs, count, logits)
        else:
            out, lse = fwd(q, k, v, cu_q, cu_k, _schedule_arg(schedule, plan, True), logits)
        ctx.save_for_backward(q, k, v, out, lse, logits, cu_q, cu_k)
        ctx.args = (plan, problem, backward_config, schedule)
        ctx.has_sinks = sinks is not None
        ctx.set_materialize_grads(False)  # as flash_attention's: an unused output's gradient stays None, not zeros
        return out, lse

    @staticmethod
    @once_differentiable  # the backward is kernels, not PyTorch ops
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse, logits, cu_q, cu_k = ctx.saved_tensors
        plan, pr, config, schedule = ctx.args
        delta_kernel, scale_cast = _varlen_small_kernels(pr.dim, pr.dtype, pr.target)
        d_out = torch.zeros_like(out) if d_out is None else d_out.contiguous()
        total = q.shape[0]
        delta = torch.empty(pr.heads, total, dtype=torch.float32, device=q.device)
        delta_kernel(out, d_out, delta)
        if d_lse is not None:  # ∂LSE_i/∂S_ij = P_ij: the LSE's gradient joins dS = P ∘ (dP − Δ) as Δ − dLSE
            delta -= d_lse.float()
        # Both in the block-aligned layout the copy engine can load (lse_row_layout).
        rows = _lse_rows(q.shape[0], cu_q.shape[0] - 1, config.block_M)
        index = plan.lse_index if plan.lse_index is not None else _lse_index_on_device(cu_q, q.shape[0],
                                                                                       config.block_M, rows)
        lse_rows, delta_rows = (torch.zeros(pr.heads, rows, dtype=torch.float32, device=q.device) for _ in range(2))
        lse_rows[:, index] = lse
        delta_rows[:, index] = delta
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        gqa = pr.heads_kv != pr.heads
        dk, dv = ((torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)) if gqa
                  else (torch.empty_like(k), torch.empty_like(v)))
        _varlen_backward(pr, config, schedule)(q, k, v, d_out, lse_rows, delta_rows, cu_q, cu_k,
                                               _schedule_arg(schedule, plan, False), dq_acc, dk, dv)
        dq = scale_cast(dq_acc.view(-1, pr.dim), pr.sm_scale).view(q.shape)
        if gqa:
            dk, dv = (scale_cast(t.view(-1, pr.dim), 1.0).view(k.shape) for t in (dk, dv))
        d_sinks = None
        if ctx.has_sinks and ctx.needs_input_grad[3]:
            # d(loss)/d(sink_h) = −Σ_t P_sink[h, t] · (Δ − dLSE)[h, t], with P_sink = exp(sink_h − LSE).
            d_sinks = -(sink_probability(logits[:, None], lse) * delta).sum(dim=1)
        return dq, dk, dv, d_sinks, None, None, None, None, None, None, None


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                           sm_scale=None, window_size=None, sinks=None, return_lse=False, schedule=None, config=None,
                           backward_config=None, check_indices=None):
    """Attention over a packed batch of variable-length sequences (FlashAttention's ``flash_attn_varlen_func``).

    q: [total_q, H, D]; k, v: [total_k, H_kv, D] (H a multiple of H_kv: GQA). ``cu_seqlens_q`` and
    ``cu_seqlens_k`` (int32 [B + 1], on q's device) are the prefix sums of the lengths: sequence b is
    q rows ``cu_seqlens_q[b] … cu_seqlens_q[b+1] − 1`` against k/v rows likewise; a sequence may be
    empty. ``max_seqlen_*`` must be at least the longest length. Masking as in ``flash_attention``
    for each sequence on its own (causal aligned bottom-right when its q and k lengths differ; a
    ``window_size`` implies causal; ``sinks`` float [H]). Returns O [total_q, H, D] (and the
    natural-log LSE [H, total_q], float32, with ``return_lse``). Differentiable once with respect to
    q, k, v and sinks, through O and the LSE. ``schedule`` ("list" or "grid", see
    ``course_utils.kernels.flash_varlen``), ``config`` (a ``ForwardConfig``) and ``backward_config`` choose
    the kernels; the defaults are the fastest measured: on Hopper GPUs (D = 64 or 128) chapter 07's
    persistent forward (``VARLEN_PERSISTENT_CONFIG``, which makes its own work list on the device and
    ignores ``schedule``) and chapter 08's backward (``VARLEN_HOPPER_BACKWARD_CONFIGS``), elsewhere chapter
    03's and chapter 05's loops.

    No wait for the GPU with the default "grid" schedule: as in FlashAttention's
    ``flash_attn_varlen_func``, the caller passes ``max_seqlen_q``/``max_seqlen_k`` (known on the host
    where the batch was packed), and the kernels take them from there instead of reading
    ``cu_seqlens`` back. Checked without a read: each is an int in [0, 2³¹ − 1] (the kernels' int32)
    and no longer than the packed q (k). The values of ``cu_seqlens`` (start at 0, non-decreasing, end
    at the packed length, no sequence longer than ``max_seqlen_*``) are checked (ValueError) when
    ``check_indices`` is True, or None (default) and they are CPU tensors; on a GPU, by default, they
    are trusted (an unchecked bad ``cu_seqlens``, or a ``max_seqlen`` shorter than a sequence, gives
    wrong results, and the backward's writes stay clamped in bounds). The "list" schedule makes its
    work lists on the host, so it reads ``cu_seqlens`` (and checks them) on every call.
    """
    check_tensor_dims("q", q, 3, "[total_q, heads, head_dim]")
    check_tensor_dims("k", k, 3, "[total_k, heads_kv, head_dim]")
    check_tensor_dims("v", v, 3, "[total_k, heads_kv, head_dim]")
    check_attention_inputs("flash_attention_varlen", q, k, v, layout="packed", sinks=sinks, window_size=window_size,
                           sm_scale=sm_scale)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if isinstance(t, torch.Tensor) and t.dim() != 1:
            raise ValueError(f"{name} must be 1-D ([batch + 1]); got shape {list(t.shape)}")
        check_index_tensor(name, t, (t.shape[0] if isinstance(t, torch.Tensor) else 0,), q.device)
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have batch + 1 ≥ 2 entries; got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(f"the packed q and k must hold at least one token each; got {q.shape[0]} and {k.shape[0]}")
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0])
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0])
    schedule = VARLEN_SCHEDULE if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {schedule!r}")
    bounds_q = bounds_k = None
    if schedule == "list" or wants_index_check(check_indices, cu_seqlens_q):
        bounds_q, bounds_k = tuple(cu_seqlens_q.tolist()), tuple(cu_seqlens_k.tolist())  # on a GPU: a wait for it
        _check_bounds("cu_seqlens_q", bounds_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
        _check_bounds("cu_seqlens_k", bounds_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
    if window_size is not None and window_size >= max_seqlen_k:
        window_size, causal = None, True  # a window as long as every sequence hides only what causal hides
    causal = bool(causal or window_size is not None)
    problem = AttentionProblem.packed(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale)
    fwd_config, bwd_config = _varlen_configs(problem.target, problem.dim, causal, config, backward_config)
    plan = _plan(bounds_q, bounds_k, max_seqlen_q, max_seqlen_k, fwd_config.block_M, bwd_config, causal,
                 q.device) if schedule == "list" else _Plan(max_seqlen_q, max_seqlen_k)
    out, lse = _FlashAttentionVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), sinks,
                                           cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), plan, problem,
                                           fwd_config, bwd_config, schedule)
    return (out, lse) if return_lse else out


def varlen_kernels(q, k, *, causal=False, window_size=None, sm_scale=None, schedule=None, config=None,
                   backward_config=None):
    """The compiled (forward, backward main) kernels ``flash_attention_varlen`` runs for q and k like these."""
    problem = AttentionProblem.packed(q, k, causal=causal, window_size=window_size, sm_scale=sm_scale)
    fwd_config, bwd_config = _varlen_configs(problem.target, problem.dim, problem.causal, config, backward_config)
    schedule = VARLEN_SCHEDULE if schedule is None else schedule
    return (_varlen_forward(problem, fwd_config, schedule, _forward_ctas(fwd_config, q.device)),
            _varlen_backward(problem, bwd_config, schedule))
