"""FlexAttention in TileLang: score and mask modifiers, written once, compiled into the kernels.

    out = flex_attention(q, k, v, score_mod=soft_cap, block_mask=create_block_mask(causal, ...))

A ``score_mod(score, b, h, q_idx, kv_idx) -> score`` changes a scaled score; a
``mask_mod(b, h, q_idx, kv_idx) -> bool`` says whether query ``q_idx`` may see key ``kv_idx``
(PyTorch's FlexAttention conventions). Both are plain Python functions written with ordinary
operators and the helpers below (``where``, ``tanh``, ``exp``, …). The same function runs

* on torch tensors, in the float64 reference (``checking.flex_reference``) and in ``create_block_mask``;
* on ``Sym`` values, while a kernel factory builds its ``@T.prim_func``: each operator returns a
  TileLang expression, so the modifier's formula is inlined into the generated C or CUDA;
* on ``Dual`` numbers (value, derivative) in the backward kernel: the chain rule through
  ``score_mod`` comes from evaluating it once on ``Dual(score, 1)``.

Tensors a modifier reads (ALiBi slopes, document ids) are found when it indexes them with b, h,
q_idx or kv_idx (``slopes[h]``), or declared with ``captured(tensor)``, a handle indexed like the
tensor (``doc[b, q_idx]``). The kernels receive every such tensor packed into one float32 and one
int32 input, so one kernel serves new values of the same shapes. ``torch.tanh``, ``torch.where``,
``torch.exp`` and the other torch functions of the helpers work on kernel values and Duals, so a
modifier written for PyTorch's FlexAttention runs unchanged. Kernels are cached on the formula a
modifier traces to (with the Python values it reads), not on the function's identity.

The tracer (``Sym``, ``Dual``, the helpers, ``captured``, ``ModifierPlan``, ``plan_modifiers``,
``cached_plan``) is ``kernels.flex_trace``, named here too. This module has the block masks, the
front door and its kernels (registry rows ``FLEX``, compiled through ``api.compiled`` with the
``AttentionProblem.flex`` of the call and the plan), and the chapter's modifiers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..core import device as _device
from ..core.problem import AttentionProblem
from ..kernels import flash_flex_hopper, flash_flex_hopper_bwd
from ..kernels.flex_pieces import EMPTY, FULL, PARTIAL
from ..kernels.flex_trace import (
    HELPERS,
    Captured,
    Dual,
    ModifierPlan,
    ReadOutOfRange,
    Sym,
    abs,
    cached_plan,
    captured,
    clamp,
    exp,
    fixed_module,
    log,
    maximum,
    minimum,
    name_of,
    plan_modifiers,
    sigmoid,
    sqrt,
    tanh,
    where,
)
from ..kernels.tiles import Tiling
from .compiled import compiled
from .inputs import check_attention_inputs
from .registry import FLEX
from .registry import HELPERS as HELPER_ROWS

__all__ = ["flex_attention", "create_block_mask", "BlockMask", "captured", "Captured", "where", "tanh", "exp", "log",
           "sqrt", "abs", "minimum", "maximum", "sigmoid", "clamp", "ReadOutOfRange", "Sym", "Dual", "ModifierPlan",
           "plan_modifiers", "cached_plan", "noop_mask", "visible_pairs", "index_grids", "reference_mask", "EMPTY",
           "PARTIAL", "FULL", "HELPERS", "default_block", "FlexConfig", "default_flex_config", "uses_hopper_forward",
           "uses_hopper_backward", "FlexBackwardKernels", "flex_forward_kernel", "flex_backward_kernels",
           "flex_forward_uses_hopper", "flex_forward_row", "forward_row", "FWD_KERNELS", "flex_forward",
           "flex_backward", "FlexFunction", "causal_mask", "soft_cap",
           "alibi_slopes", "alibi", "document_ids", "document_mask", "prefix_lm", "window_with_globals"]

fixed_module(__name__)  # the chapter's modifiers below are fixed code: fingerprints count them by identity


def noop_mask(b, h, q_idx, kv_idx):
    """Every query sees every key."""
    return q_idx >= 0


# --- The modifiers on tensors of indices -----------------------------------------------------------------------

def index_grids(batch_ids, head_ids, seq_q, seq_k, device):
    """b, h, q_idx, kv_idx as int64 tensors that broadcast to [B, H, S_q, S_k]: what a modifier receives on torch
    tensors (``create_block_mask``, the float64 reference)."""
    b = torch.as_tensor(batch_ids, device=device).view(-1, 1, 1, 1)
    h = torch.as_tensor(head_ids, device=device).view(1, -1, 1, 1)
    q_idx = torch.arange(seq_q, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(seq_k, device=device).view(1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def reference_mask(mask_mod, b, h, q_idx, kv_idx):
    """``mask_mod`` on tensors of indices, refused unless it returns a boolean tensor."""
    out = mask_mod(b, h, q_idx, kv_idx)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"mask_mod `{name_of(mask_mod)}` must return a boolean tensor on tensor inputs; got {got}")
    return out


# --- Block masks -----------------------------------------------------------------------------------------------

class BlockMask(NamedTuple):
    """Which (query block, key block) tiles a mask leaves empty, full or partial, and the lists the kernels walk.

    ``state`` [B', H', query blocks, key blocks] holds EMPTY, PARTIAL or FULL (B' and H' are 1 when
    the mask does not depend on b or h). A tile that runs past the end of the queries or keys is
    never FULL: only PARTIAL tiles pay for the mask. The forward walks, for each query block,
    ``kv_count`` key blocks listed in ``kv_list``; the backward walks, for each key block,
    ``q_count`` query blocks listed in ``q_list`` (all int32, on the device of the inputs).
    ``longest_rows_last``: every query block lists at least as many key blocks as the one before (a causal mask,
    prefix-LM, a sliding window), which the persistent Hopper forward's folded order balances.
    ``rows_by_cost`` [B', H', query blocks] int32: each mask row's query blocks by the number of key blocks they
    list, most first (ties in increasing order): the persistent Hopper forward's sorted tile order
    (``FlexConfig(fwd_kernel="persistent_sorted")``), made once with the mask.
    """

    state: torch.Tensor
    kv_count: torch.Tensor
    kv_list: torch.Tensor
    q_count: torch.Tensor
    q_list: torch.Tensor
    block: tuple
    seq_q: int
    seq_k: int
    mask_mod: object
    longest_rows_last: bool = False
    rows_by_cost: torch.Tensor = None

    @property
    def shape(self):
        return (self.state.shape[0], self.state.shape[1], self.seq_q, self.seq_k)

    def fraction_skipped(self):
        """The share of (query block, key block) tiles the kernels skip."""
        return int((self.state == EMPTY).sum()) / self.state.numel()

    def without_skipping(self):
        """The same mask with no tile skipped: EMPTY tiles become PARTIAL (visited and masked). What skipping saves
        is the time difference."""
        state = torch.where(self.state == EMPTY, PARTIAL, self.state).int()
        return _with_lists(state, self.block, self.seq_q, self.seq_k, self.mask_mod)

    def counts(self):
        """{"empty": n, "partial": n, "full": n} tiles."""
        return {name: int((self.state == s).sum()) for name, s in (("empty", EMPTY), ("partial", PARTIAL),
                                                                    ("full", FULL))}

    def __repr__(self):
        c = self.counts()
        return (f"BlockMask(shape={self.shape}, block={self.block}, mask_mod={name_of(self.mask_mod)}, "
                f"{c['full']} full, {c['partial']} partial, {c['empty']} empty tiles: "
                f"{self.fraction_skipped():.0%} skipped)")


def default_block(device):
    """The tile of the flex kernels on ``device``: 128 × 128 on a GPU (FlexAttention's default), 16 × 16 on the CPU."""
    return (128, 128) if torch.device(device).type == "cuda" else (16, 16)


def _check_size(value, name, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}; got {value!r}")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", block=None):
    """Evaluate ``mask_mod`` on every (b, h, q_idx, kv_idx) and summarise it per tile: a ``BlockMask``.

    ``B`` or ``H`` None: the mask does not depend on b (h), evaluated at 0 and shared. ``block``:
    (query rows, keys) per tile, default ``default_block(device)``. The mask is evaluated a band of
    query blocks at a time, so a long sequence never holds its whole Q_LEN × KV_LEN mask.
    """
    plan_modifiers(mask_mod=mask_mod)
    _check_size(B, "B", True)
    _check_size(H, "H", True)
    _check_size(Q_LEN, "Q_LEN")
    _check_size(KV_LEN, "KV_LEN")
    block = default_block(device) if block is None else tuple(block)
    if len(block) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in block):
        raise ValueError(f"block must be (query rows, keys), two positive ints; got {block!r}")
    bm, bn = block
    nq, nk = -(-Q_LEN // bm), -(-KV_LEN // bn)
    bb, hh = B or 1, H or 1
    state = torch.empty(bb, hh, nq, nk, dtype=torch.int32, device=device)
    band = max(1, (1 << 24) // (bb * hh * bm * nk * bn))  # query blocks per evaluation
    for q0 in range(0, nq, band):
        q1 = min(nq, q0 + band)
        b, h, q_idx, kv_idx = index_grids(range(bb), range(hh), (q1 - q0) * bm, nk * bn, device)
        q_idx = q_idx + q0 * bm
        inside = (q_idx < Q_LEN) & (kv_idx < KV_LEN)
        visible = reference_mask(mask_mod, b, h, q_idx.clamp(max=Q_LEN - 1), kv_idx.clamp(max=KV_LEN - 1))
        visible = (visible & inside).expand(bb, hh, (q1 - q0) * bm, nk * bn)
        tiles = visible.reshape(bb, hh, q1 - q0, bm, nk, bn)
        inside_tiles = inside.expand_as(visible).reshape(bb, hh, q1 - q0, bm, nk, bn)
        any_visible = tiles.any(dim=5).any(dim=3)
        all_visible = tiles.all(dim=5).all(dim=3) & inside_tiles.all(dim=5).all(dim=3)
        state[:, :, q0:q1] = torch.where(all_visible, FULL, torch.where(any_visible, PARTIAL, EMPTY)).int()
    return _with_lists(state, block, Q_LEN, KV_LEN, mask_mod)


def visible_pairs(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu"):
    """How many (b, h, query, key) pairs ``mask_mod`` leaves visible (B, H: as in ``create_block_mask``).

    The exact work of a masked attention: FLOPs are 4 · D · this many (forward). Evaluated a band
    of queries at a time.
    """
    bb, hh = B or 1, H or 1
    band = max(1, (1 << 24) // (bb * hh * KV_LEN))
    total = 0
    for q0 in range(0, Q_LEN, band):
        b, h, q_idx, kv_idx = index_grids(range(bb), range(hh), min(band, Q_LEN - q0), KV_LEN, device)
        total += int(reference_mask(mask_mod, b, h, q_idx + q0, kv_idx).expand(bb, hh, -1, KV_LEN).sum())
    return total


def _with_lists(state, block, seq_q, seq_k, mask_mod):
    """The BlockMask of ``state``: the non-empty blocks of each row (column) first, in increasing order."""
    visited = state != EMPTY
    kv_list = torch.sort((~visited).int(), dim=-1, stable=True).indices.int()
    q_list = torch.sort((~visited).transpose(-1, -2).int(), dim=-1, stable=True).indices.int()
    kv_count = visited.sum(-1).int().contiguous()
    longest_rows_last = bool((kv_count[..., 1:] >= kv_count[..., :-1]).all())
    rows_by_cost = torch.sort(kv_count, dim=-1, descending=True, stable=True).indices.int().contiguous()
    return BlockMask(state.contiguous(), kv_count, kv_list.contiguous(), visited.sum(-2).int().contiguous(),
                     q_list.contiguous(), block, seq_q, seq_k, mask_mod, longest_rows_last, rows_by_cost)



# --- The compiled kernels --------------------------------------------------------------------------------------

class FlexConfig(NamedTuple):
    """Threads and pipeline stages of the flex kernels, and the backward's query tile (the forward's tile is the
    BlockMask's block).

    ``fwd_kernel``: on an sm_90 GPU, "hopper" runs the forward on one of chapter 07's kernels wherever they apply
    (``uses_hopper_forward``): the persistent one (``flex_fwd_hopper_persistent_kernel``) at D = 128, else the
    rotated loop (``flex_fwd_hopper_kernel``), both with ``fwd_hopper_stages`` stages (``forward_row``);
    "persistent" and "rotated" ask for one of them, and "sm80" keeps chapter 03's loop (``flex_fwd_kernel``, with
    ``fwd_stages``), to compare them. "persistent_sorted" asks for the persistent kernel
    taking its tiles longest first by the block mask's own counts (``BlockMask.rows_by_cost``) instead of the
    causal mask's folded order, which "hopper" chooses at D = 128 where the rows do not grow down.
    ``bwd_kernel``: "hopper" runs the backward on chapter 08's Hopper loop (``flash_flex_hopper_bwd``, its own
    64-row steps, two stages and two consumer warpgroups) where it can (``uses_hopper_backward``), else chapter
    05's loop with ``bwd_block_M``, ``bwd_threads`` and ``bwd_stages``; "sm80" always chapter 05's loop.
    """

    fwd_threads: int
    fwd_stages: int
    bwd_block_M: int
    bwd_threads: int
    bwd_stages: int
    bwd_kernel: str = "hopper"
    fwd_kernel: str = "hopper"
    fwd_hopper_stages: int = 2


def default_flex_config(device_type, mask_block):
    """Small and serial on the CPU; on a GPU the threads and stages of chapter 04's tuned forward and chapter 05's
    tuned backward (``TUNED_FORWARD_CONFIG``, ``TUNED_BACKWARD_CONFIG``: 128 × 128 and 64 × 128 tiles)."""
    if device_type != "cuda":  # the backward's query tile: the largest divisor of the mask's query block up to 16
        return FlexConfig(1, 1, max(d for d in range(1, 17) if mask_block[0] % d == 0), 1, 1)
    return FlexConfig(256, 1, min(64, mask_block[0]), 256, 1)


FWD_KERNELS = ("hopper", "persistent", "persistent_sorted", "rotated", "sm80")
# The FLEX row of each forward kernel a config names (``forward_row``; "hopper" chooses between the first two).
_NAMED_FORWARD_ROWS = {"persistent": "flex_fwd_hopper_persistent",
                       "persistent_sorted": "flex_fwd_hopper_persistent_sorted", "rotated": "flex_fwd_hopper"}


def uses_hopper_forward(pr, config):
    """Whether problem ``pr`` (an ``AttentionProblem.flex``) runs its forward on one of chapter 07's kernels: asked
    for by ``config.fwd_kernel`` (anything but "sm80"), on an sm_90 GPU, with the BlockMask's 128 × 128 tiles,
    D = 64 or 128 and 16-bit inputs."""
    if config.fwd_kernel not in FWD_KERNELS:
        raise ValueError(f"FlexConfig.fwd_kernel must be one of {FWD_KERNELS}; got {config.fwd_kernel!r}")
    return (config.fwd_kernel != "sm80" and pr.target == "cuda" and _device.is_hopper()
            and pr.mask_block == flash_flex_hopper.HOPPER_FLEX_BLOCK and pr.dim in flash_flex_hopper.HOPPER_FLEX_DIMS
            and pr.dtype in ("float16", "bfloat16"))


BWD_KERNELS = ("hopper", "sm80")


def uses_hopper_backward(target, dim, mask_block, config):
    """Whether the backward runs on chapter 08's Hopper loop: asked for (``config.bwd_kernel``), on an sm_90 GPU,
    with the 128 × 128 block mask it walks and a head dim it is built for."""
    if config.bwd_kernel not in BWD_KERNELS:
        raise ValueError(f"FlexConfig.bwd_kernel must be one of {BWD_KERNELS}; got {config.bwd_kernel!r}")
    return (config.bwd_kernel == "hopper" and target == "cuda" and _device.is_hopper()
            and tuple(mask_block) == flash_flex_hopper_bwd.HOPPER_FLEX_BLOCK
            and dim in flash_flex_hopper_bwd.HOPPER_FLEX_DIMS)


class FlexBackwardKernels(NamedTuple):
    """The compiled backward: Δ, the main kernel (dK, dV and dQ's float32 accumulator), dQ's cast, and with GQA
    the dK/dV cast (else None): the dense backward's ``HELPERS`` around a ``FLEX`` row."""

    preprocess: object
    main: object
    postprocess_dq: object
    postprocess_dkv: object


# The registry rows compile through the one cache, keyed by (row, problem, plan, tiling): a plan is equal to
# another with the same ``key`` (its traced formulas and the layout of what it reads), so an equal formula of
# another function object finds the kernel already compiled.
def forward_row(problem, config, longest_rows_last):
    """The name of the ``FLEX`` row the forward runs: on Hopper (``uses_hopper_forward``) chapter 07's persistent
    kernel at D = 128, in the causal mask's folded order where the block mask's rows grow down
    (``BlockMask.longest_rows_last``: the order pairs a long row with a short one) and longest row first otherwise
    (``BlockMask.rows_by_cost``), and the rotated loop at D = 64, unless ``config.fwd_kernel`` names one; else
    chapter 03's loop."""
    if not uses_hopper_forward(problem, config):
        return "flex_fwd"
    if config.fwd_kernel == "hopper":  # the persistent kernel measured at D = 128 only (docs/flex_hopper.md)
        if problem.dim != 128:
            return "flex_fwd_hopper"
        return "flex_fwd_hopper_persistent" if longest_rows_last else "flex_fwd_hopper_persistent_sorted"
    return _NAMED_FORWARD_ROWS[config.fwd_kernel]


def _forward_kernel(problem, plan, config, row_name):
    """The compiled forward of ``problem`` (an ``AttentionProblem.flex``) with ``plan``'s modifiers on the ``FLEX``
    row ``row_name`` (``forward_row``): its tile is the block mask's."""
    row = FLEX[row_name]
    stages = config.fwd_stages if row.name == "flex_fwd" else config.fwd_hopper_stages
    return compiled(row, problem, plan=plan, tiling=Tiling(*problem.mask_block, stages, config.fwd_threads))


def _backward_kernels(problem, plan, config):
    """The compiled ``FlexBackwardKernels`` of ``problem`` with ``plan``'s modifiers. The Δ kernel and the casts do
    not depend on the block mask: they are compiled for the problem without it."""
    small = dict(block=16, threads=1) if problem.target == "c" else dict(block=64, threads=128)
    unmasked = problem.replace(mask_shape=None, mask_block=None)
    pre = compiled(HELPER_ROWS["bwd_preprocess"], unmasked, **small)
    if uses_hopper_backward(problem.target, problem.dim, problem.mask_block, config):
        main = compiled(FLEX["flex_bwd_hopper"], problem, plan=plan)  # its own tiling
    else:
        tiling = Tiling(config.bwd_block_M, problem.mask_block[1], config.bwd_stages, config.bwd_threads)
        main = compiled(FLEX["flex_bwd"], problem, plan=plan, tiling=tiling)
    post_q = compiled(HELPER_ROWS["bwd_postprocess_dq"], unmasked, **small)
    post_kv = None
    if problem.heads_kv != problem.heads:
        post_kv = compiled(HELPER_ROWS["bwd_postprocess_dkv"], unmasked, **small)
    return FlexBackwardKernels(pre, main, post_q, post_kv)


def flex_forward_kernel(q, k, plan, block_mask, sm_scale, config=None):
    """The compiled forward: ``kernel(q, k, v, kv_count, kv_list, state, floats, ints) -> (out, lse)``."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    problem = AttentionProblem.flex(q, k, block_mask, sm_scale)
    return _forward_kernel(problem, plan, config, forward_row(problem, config, block_mask.longest_rows_last))


def flex_backward_kernels(q, k, plan, block_mask, sm_scale, config=None):
    """The compiled ``FlexBackwardKernels`` for these shapes, modifiers and block mask."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    return _backward_kernels(AttentionProblem.flex(q, k, block_mask, sm_scale), plan, config)


def flex_forward_uses_hopper(q, k, block_mask, sm_scale=1.0, config=None):
    """Whether ``flex_forward_kernel`` runs these inputs on the Hopper kernel (``uses_hopper_forward``)."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    return uses_hopper_forward(AttentionProblem.flex(q, k, block_mask, sm_scale), config)


def flex_forward_row(q, k, block_mask, sm_scale=1.0, config=None):
    """The name of the ``FLEX`` row ``flex_forward_kernel`` runs for these inputs (``forward_row``)."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    return forward_row(AttentionProblem.flex(q, k, block_mask, sm_scale), config, block_mask.longest_rows_last)


def flex_forward(q, k, v, plan, block_mask, sm_scale, config=None):
    """(O, LSE) of the flex forward kernel (no autograd); the persistent kernel's sorted order also reads the block
    mask's ``rows_by_cost``."""
    bm = block_mask
    config = config or default_flex_config(q.device.type, bm.block)
    problem = AttentionProblem.flex(q, k, bm, sm_scale)
    row = forward_row(problem, config, bm.longest_rows_last)
    kernel = _forward_kernel(problem, plan, config, row)
    order = (bm.rows_by_cost,) if row == "flex_fwd_hopper_persistent_sorted" else ()
    return kernel(q, k, v, bm.kv_count, bm.kv_list, bm.state, *plan.pack(q.device), *order)


def flex_backward(q, k, v, out, lse, d_out, plan, block_mask, sm_scale, *, d_lse=None, config=None, delta=None):
    """(dQ, dK, dV) of flex attention from the forward's O and LSE. ``delta`` replaces Δ (a planted bug)."""
    kernels = flex_backward_kernels(q, k, plan, block_mask, sm_scale, config)
    d_out = d_out.contiguous()
    if delta is None:
        delta = kernels.preprocess(out, d_out)
        if d_lse is not None:
            delta = (delta - d_lse.float()).contiguous()
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    if kernels.postprocess_dkv is None:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
    bm = block_mask
    kernels.main(q, k, v, d_out, lse, delta, bm.q_count, bm.q_list, bm.state, *plan.pack(q.device), dq_acc, dk, dv)
    dq = kernels.postprocess_dq(dq_acc)
    if kernels.postprocess_dkv is not None:
        dk, dv = kernels.postprocess_dkv(dk), kernels.postprocess_dkv(dv)
    return dq, dk, dv


class FlexFunction(torch.autograd.Function):
    """flex attention as an autograd Function: (q, k, v, plan, block_mask, sm_scale) -> (O, LSE)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, block_mask, sm_scale):
        out, lse = flex_forward(q, k, v, plan, block_mask, sm_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.flex = (plan, block_mask, sm_scale)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dq, dk, dv = flex_backward(q, k, v, out, lse, d_out, *ctx.flex, d_lse=d_lse)
        return dq, dk, dv, None, None, None


# --- The public function ---------------------------------------------------------------------------------------

def _check_block_mask(block_mask, mask_mod, q, k):
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must come from create_block_mask; got {type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError(f"block_mask was made from mask_mod `{name_of(block_mask.mask_mod)}`, not "
                         f"`{name_of(mask_mod)}`")
    bb, hh = block_mask.state.shape[:2]
    if (block_mask.seq_q, block_mask.seq_k) != (q.shape[2], k.shape[2]):
        raise ValueError(f"block_mask is for Q_LEN={block_mask.seq_q}, KV_LEN={block_mask.seq_k}; q has "
                         f"{q.shape[2]} queries and k {k.shape[2]} keys")
    if bb not in (1, q.shape[0]) or hh not in (1, q.shape[1]):
        raise ValueError(f"block_mask is for B={bb}, H={hh}; q has B={q.shape[0]}, H={q.shape[1]}")
    if block_mask.state.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.state.device}; q is on {q.device}")


def _check_shared_dims(plan, block_mask, q):
    """A block mask evaluated at b = 0 (h = 0) alone is wrong for a mask that reads b (h)."""
    for dim, (name, reads) in enumerate((("B", plan.mask_reads_b), ("H", plan.mask_reads_h))):
        if reads and block_mask.state.shape[dim] == 1 and q.shape[dim] > 1:
            raise ValueError(f"mask_mod `{name_of(plan.mask_mod)}` reads {'bh'[dim]}, but block_mask was built with "
                             f"{name}=None (evaluated at {'bh'[dim]} = 0 only); build it with "
                             f"create_block_mask(..., {name}={q.shape[dim]}, ...)")


def _check_backward_block(block, q, k, v):
    """The backward walks a mask query block in steps of its own tile: refuse, before the forward, a block it
    cannot walk."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return
    step = default_flex_config(q.device.type, block).bwd_block_M
    if block[0] % step:
        raise ValueError(f"block {tuple(block)}: the backward on {q.device.type} walks query blocks in steps of "
                         f"{step} rows, which must divide the block's {block[0]} query rows; use a block of "
                         f"{step} · n rows (or {step} or fewer), or call without gradients")


def flex_attention(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, sm_scale=None, return_lse=False):
    """Attention with a score modifier and a mask, compiled into the course's TileLang kernels.

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] (GQA when H_kv < H). ``score_mod(score, b, h,
    q_idx, kv_idx)`` changes each scaled score; ``mask_mod(b, h, q_idx, kv_idx)`` hides pairs.
    ``block_mask`` (``create_block_mask``) says which tiles to skip; given a mask_mod alone, it is
    built here (once per call: build it yourself to reuse it). Returns O (and the natural-log LSE
    [B, H, S_q], float32, with ``return_lse``); rows that see no key get O = 0 and LSE = −∞.
    Differentiable (once) with respect to q, k and v.
    """
    check_attention_inputs("flex_attention", q, k, v, sm_scale=sm_scale)
    if block_mask is not None:
        _check_block_mask(block_mask, mask_mod, q, k)
        mask_mod = block_mask.mask_mod
    plan = cached_plan(score_mod, mask_mod)
    plan.check_reads(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    plan.check_no_grad()
    if block_mask is None:  # over the b and h the mask reads
        block_mask = create_block_mask(mask_mod or noop_mask, q.shape[0] if plan.mask_reads_b else None,
                                       q.shape[1] if plan.mask_reads_h else None, q.shape[2], k.shape[2],
                                       device=q.device)
    _check_shared_dims(plan, block_mask, q)
    _check_backward_block(block_mask.block, q, k, v)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)
    out, lse = FlexFunction.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, block_mask, sm_scale)
    return (out, lse) if return_lse else out



# --- The modifiers of the chapter ------------------------------------------------------------------------------

def causal_mask(b, h, q_idx, kv_idx):
    """Causal attention of a self-attention layer: a query sees its own and earlier keys."""
    return q_idx >= kv_idx


def soft_cap(cap=50.0):
    """Gemma 2's logit soft-capping: score → cap · tanh(score / cap), a score_mod."""
    cap = float(cap)

    def soft_cap_score(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return soft_cap_score


def alibi_slopes(heads):
    """ALiBi's head slopes 2^(−8(h+1)/H) (Press et al., 2022), float32 [heads]."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32)


def alibi(slopes):
    """ALiBi: score + slope[h] · (kv_idx − q_idx), a score_mod reading a captured tensor of slopes [H]."""
    slope = captured(slopes, "alibi_slopes")

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slope[h] * (kv_idx - q_idx)

    return alibi_score


def document_ids(lengths, device="cpu"):
    """The document id of each token of a packed sequence of documents of ``lengths``, int32 [Σ lengths]."""
    lengths = torch.as_tensor(lengths)
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths).to(device)


def document_mask(doc_ids, causal=True):
    """Document masking of a packed batch: a query sees keys of its own document (and, if causal, not later ones).

    ``doc_ids``: the document of each token, [S] (shared by the batch) or [B, S] (one packing per row).
    """
    doc = captured(doc_ids, "document_id")
    per_row = doc_ids.dim() == 2

    def same_document(b, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) if per_row else (doc[q_idx] == doc[kv_idx])

    def document_causal(b, h, q_idx, kv_idx):
        return same_document(b, q_idx, kv_idx) & (q_idx >= kv_idx)

    def document(b, h, q_idx, kv_idx):
        return same_document(b, q_idx, kv_idx)

    return document_causal if causal else document


def prefix_lm(prefix_length):
    """Prefix-LM: the first ``prefix_length`` tokens see each other both ways; the rest is causal."""
    prefix_length = int(prefix_length)

    def prefix_lm_mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix_length) | (q_idx >= kv_idx)

    return prefix_lm_mask


def window_with_globals(window, n_global):
    """A causal sliding window of ``window`` keys, plus ``n_global`` global tokens every query sees and that see
    every earlier token (Longformer's pattern, causal)."""
    window, n_global = int(window), int(n_global)

    def window_global(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        return causal & ((q_idx - kv_idx < window) | (kv_idx < n_global) | (q_idx < n_global))

    return window_global
