"""FlexAttention's kernels in TileLang: chapter 03's forward and chapter 05's backward, with modifiers.

The factories take a ``flex.ModifierPlan`` and call its ``score``, ``score_and_derivative`` and
``mask`` on their index expressions while they build the ``@T.prim_func``: the modifiers' formulas
are inlined into the generated code. The loops walk the lists of a ``flex.BlockMask``: the
forward visits, for its query block, only the key blocks that are not EMPTY and evaluates the
mask only on PARTIAL ones; the backward visits, for its key block, only the query blocks that
are not EMPTY. The backward's query tile may be a fraction of the mask's query block (64 rows of
128 on a GPU), so one mask serves both.

On an sm_90 GPU the forward runs chapter 07's rotated loop instead (``flash_flex_hopper``), where it applies.

    python -m course_utils.check flex     # check against the float64 reference (and time it, on a GPU)
"""

from typing import NamedTuple

import tilelang.language as T
import torch
from torch.autograd.function import once_differentiable

from ..core.device import is_hopper
from .flash_bwd import flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from .flash_flex_hopper import HOPPER_FLEX_BLOCK, HOPPER_FLEX_DIMS, flex_fwd_hopper_kernel
from .flash_pieces import NEG_INF, forward_epilogue, forward_tiles, online_softmax, prelude, store_dkv
from .flex_pieces import EMPTY, FULL, PARTIAL, flex_prelude, mask_dims, modify_scores, recompute_probabilities
from .tiles import TileBackend, compile_kernel

__all__ = ["flex_fwd_kernel", "flex_bwd_kernel", "recompute_probabilities", "FlexConfig", "default_flex_config",
           "flex_forward_kernel", "flex_backward_kernels", "flex_backward", "FlexFunction", "EMPTY", "PARTIAL", "FULL"]

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def flex_fwd_kernel(batch, heads, seq_q, seq_k, dim, plan, mask_shape, *, heads_kv=None, sm_scale=None,
                    dtype="float16", block_M=128, block_N=128, num_stages=1, threads=256, target=None):
    """Return a ``@T.prim_func`` computing O and LSE with the modifiers of ``plan`` (a ``ModifierPlan``).

    ``mask_shape`` is the shape of the BlockMask's ``state`` [B', H', S_q blocks, S_k blocks], whose
    tiles must be block_M × block_N. Inputs after V: KVCount, KVList, State (the BlockMask's),
    the packed captured tensors (``plan.pack``); outputs O and LSE.
    """
    tb = TileBackend(target)
    p = flex_prelude(plan, heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)
    mb, mh, n_qb, n_kb = mask_shape
    b_step, h_step = mask_dims(mask_shape)
    n_float, n_int = plan.sizes

    # region: launch
    @T.prim_func
    def flex_fwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        KVCount: T.Tensor([mb, mh, n_qb], "int32"),
        KVList: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        State: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        CapturedF: T.Tensor([n_float], "float32"),
        CapturedI: T.Tensor([n_int], "int32"),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], "float32"),
    ):
        with tb.kernel(n_qb, heads, batch, threads=threads) as (bx, by, bz):
            Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_tiles(
                tb, block_M, block_N, dim, dtype)
            captured = (CapturedF, CapturedI)
            qb = bx
            kv_head = by // p.group
            mbz, mby = bz * b_step, by * h_step
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, NEG_INF)
            # endregion

            for t in T.Pipelined(KVCount[mbz, mby, qb], num_stages=num_stages):
                # region: scores
                kb = KVList[mbz, mby, qb, t]  # only the key blocks the mask does not leave empty
                T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
                T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                # endregion
                modify_scores(tb, plan, captured, State, S, bz, by, mbz, mby, qb, kb, block_M, block_N, seq_k, sm_scale)

                online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, p.scale_log2)
                T.copy(S, P)
                for i, j in tb.parallel(block_M, dim):
                    acc_o[i, j] *= alpha[i]
                T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
                T.gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

            forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, None, bz, by, qb, block_M, dim, False)

    return flex_fwd


def flex_bwd_kernel(batch, heads, seq_q, seq_k, dim, plan, mask_shape, mask_block, *, heads_kv=None, sm_scale=None,
                    dtype="float16", block_M=64, num_stages=1, threads=256, target=None):
    """Return a ``@T.prim_func`` computing dK, dV and the float32 dQ accumulator (before its scale).

    One block per (mask key block, query head, batch entry): ``block_N`` = the mask's key block,
    resident; it walks the mask's non-empty query blocks in ``block_M``-row steps. With a score_mod,
    dS = P ∘ (dP − Δ) ∘ score_mod′(s), the derivative from a Dual evaluation. Accumulator contract as
    ``flash_bwd.flash_bwd_kernel`` (dQ_acc, and the GQA dK/dV, zero on entry).
    """
    tb = TileBackend(target)
    has_score = plan.score_mod is not None
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)
    mb, mh, n_qb, n_kb = mask_shape
    mask_M, block_N = mask_block
    if mask_M % block_M:
        raise ValueError(f"the backward's query tile ({block_M}) must divide the mask's query block ({mask_M})")
    steps = mask_M // block_M  # backward query tiles per mask query block
    b_step, h_step = mask_dims(mask_shape)
    n_float, n_int = plan.sizes
    accum = "float32"
    dkv_dtype = dtype if p.group == 1 else accum

    @T.prim_func
    def flex_bwd(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        dO: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
        Delta: T.Tensor([batch, heads, seq_q], accum),
        QCount: T.Tensor([mb, mh, n_kb], "int32"),
        QList: T.Tensor([mb, mh, n_kb, n_qb], "int32"),
        State: T.Tensor([mb, mh, n_qb, n_kb], "int32"),
        CapturedF: T.Tensor([n_float], "float32"),
        CapturedI: T.Tensor([n_int], "int32"),
        dQ_acc: T.Tensor([batch, heads, seq_q, dim], accum),
        dK: T.Tensor([batch, p.heads_kv, seq_k, dim], dkv_dtype),
        dV: T.Tensor([batch, p.heads_kv, seq_k, dim], dkv_dtype),
    ):
        with tb.kernel(n_kb, heads, batch, threads=threads) as (bx, by, bz):
            K_s = tb.shared([block_N, dim], dtype)
            V_s = tb.shared([block_N, dim], dtype)
            Q_s = tb.shared([block_M, dim], dtype)
            dO_s = tb.shared([block_M, dim], dtype)
            lse = tb.shared([block_M], accum)
            delta = tb.shared([block_M], accum)
            PT = tb.fragment([block_N, block_M], accum)  # Sᵀ, then Pᵀ
            GT = tb.fragment([block_N, block_M], accum)  # score_mod′(s)ᵀ (0 where hidden)
            dPT = tb.fragment([block_N, block_M], accum)
            PT_cast = tb.fragment([block_N, block_M], dtype)
            dST_cast = tb.fragment([block_N, block_M], dtype)
            dST_s = tb.shared([block_N, block_M], dtype)
            dv = tb.fragment([block_N, dim], accum)
            dk = tb.fragment([block_N, dim], accum)
            dq = tb.fragment([block_M, dim], accum)
            captured = (CapturedF, CapturedI)
            kv_head = by // p.group
            mbz, mby = bz * b_step, by * h_step
            T.copy(K[bz, kv_head, bx * block_N:(bx + 1) * block_N, :], K_s)
            T.copy(V[bz, kv_head, bx * block_N:(bx + 1) * block_N, :], V_s)
            T.clear(dv)
            T.clear(dk)

            for step in T.Pipelined(QCount[mbz, mby, bx] * steps, num_stages=num_stages):
                # region: recompute P
                mask_qb = QList[mbz, mby, bx, step // steps]
                qb = mask_qb * steps + step % steps
                T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
                T.copy(LSE[bz, by, qb * block_M:(qb + 1) * block_M], lse)
                T.clear(PT)
                T.gemm(K_s, Q_s, PT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                # A FULL tile skips the mask; only a PARTIAL one evaluates mask_mod (and the ends of the sequences).
                if State[mbz, mby, mask_qb, bx] == FULL:
                    recompute_probabilities(tb, plan, captured, PT, GT, lse, bz, by, qb, bx, block_M, block_N, seq_q,
                                            seq_k, sm_scale, p.scale_log2, False)
                else:
                    recompute_probabilities(tb, plan, captured, PT, GT, lse, bz, by, qb, bx, block_M, block_N, seq_q,
                                            seq_k, sm_scale, p.scale_log2, True)
                # endregion
                T.copy(dO[bz, by, qb * block_M:(qb + 1) * block_M, :], dO_s)
                T.clear(dPT)
                T.gemm(V_s, dO_s, dPT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(PT, PT_cast)
                T.gemm(PT_cast, dO_s, dv, policy=T.GemmWarpPolicy.FullRow)  # dV += Pᵀ dO
                # region: chain rule
                T.copy(Delta[bz, by, qb * block_M:(qb + 1) * block_M], delta)
                if has_score:
                    for j, i in tb.parallel(block_N, block_M):
                        dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i]) * GT[j, i]  # through score_mod
                else:
                    for j, i in tb.parallel(block_N, block_M):
                        dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i])
                # endregion
                T.gemm(dST_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)  # dK += dSᵀ Q
                T.copy(dST_cast, dST_s)
                T.clear(dq)
                T.gemm(dST_s, K_s, dq, transpose_A=True)
                for i, d in tb.parallel(block_M, dim):
                    if qb * block_M + i < seq_q:
                        T.atomic_add(dQ_acc[bz, by, qb * block_M + i, d], dq[i, d])

            store_dkv(tb, p, dk, dv, dK, dV, (bz, kv_head, bx), block_N, dim)

    return flex_bwd


# --- Compiled kernels, cached --------------------------------------------------------------------------------------

class FlexConfig(NamedTuple):
    """Threads and pipeline stages of the flex kernels, and the backward's query tile (the forward's tile is the
    BlockMask's block).

    ``fwd_kernel``: on an sm_90 GPU, "hopper" runs the forward on chapter 07's rotated loop
    (``flex_fwd_hopper_kernel``, with ``fwd_hopper_stages`` stages) wherever it applies
    (``uses_hopper_forward``), and "sm80" keeps chapter 03's loop (``flex_fwd_kernel``, with ``fwd_stages``),
    to compare them.
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


class _FlexProblem(NamedTuple):
    batch: int
    heads: int
    heads_kv: int
    seq_q: int
    seq_k: int
    dim: int
    dtype: str
    sm_scale: float
    target: str
    mask_shape: tuple
    mask_block: tuple


def _problem(q, k, block_mask, sm_scale):
    return _FlexProblem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], _DTYPE_NAMES[q.dtype],
                        float(sm_scale), "cuda" if q.device.type == "cuda" else "c", tuple(block_mask.state.shape),
                        tuple(block_mask.block))


_CACHE_SIZE = 64


class _KernelCache:
    """Compiled kernels by (problem, ``plan.key``, config): the plan itself (the modifier functions, the tensors of
    this call) is not part of the key, so an equal formula of another function object reuses the kernel."""

    def __init__(self, build):
        self.build, self.kernels = build, {}

    def __call__(self, pr, plan_key, plan, config):
        key = (pr, plan_key, config)
        if key not in self.kernels:
            if len(self.kernels) >= _CACHE_SIZE:
                self.kernels.pop(next(iter(self.kernels)))
            self.kernels[key] = self.build(pr, plan, config)
        return self.kernels[key]

    def cache_clear(self):
        self.kernels.clear()


FWD_KERNELS = ("hopper", "sm80")


def uses_hopper_forward(pr, config):
    """Whether problem ``pr`` (a ``_FlexProblem``) runs its forward on chapter 07's rotated loop: asked for by
    ``config.fwd_kernel``, on an sm_90 GPU, with the BlockMask's 128 × 128 tiles, D = 64 or 128 and 16-bit inputs."""
    if config.fwd_kernel not in FWD_KERNELS:
        raise ValueError(f"FlexConfig.fwd_kernel must be one of {FWD_KERNELS}; got {config.fwd_kernel!r}")
    return (config.fwd_kernel == "hopper" and pr.target == "cuda" and is_hopper() and pr.mask_block == HOPPER_FLEX_BLOCK
            and pr.dim in HOPPER_FLEX_DIMS and pr.dtype in ("float16", "bfloat16"))


def _build_forward(pr, plan, config):
    block_M, block_N = pr.mask_block
    shape = (pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, plan, pr.mask_shape)
    common = dict(heads_kv=pr.heads_kv, sm_scale=pr.sm_scale, dtype=pr.dtype, block_M=block_M, block_N=block_N,
                  threads=config.fwd_threads)
    if uses_hopper_forward(pr, config):
        func = flex_fwd_hopper_kernel(*shape, num_stages=config.fwd_hopper_stages, **common)
    else:
        func = flex_fwd_kernel(*shape, num_stages=config.fwd_stages, target=pr.target, **common)
    return compile_kernel(func, out_idx=[8, 9], target=pr.target, dtype=pr.dtype)


class FlexBackwardKernels(NamedTuple):
    preprocess: object
    main: object
    postprocess_dq: object
    postprocess_dkv: object


_compiled_forward = _KernelCache(_build_forward)


BWD_KERNELS = ("hopper", "sm80")


def uses_hopper_backward(target, dim, mask_block, config):
    """Whether the backward runs on chapter 08's Hopper loop: asked for (``config.bwd_kernel``), on an sm_90 GPU,
    with the 128 × 128 block mask it walks and a head dim it is built for."""
    from ..core.device import is_hopper
    from .flash_flex_hopper_bwd import HOPPER_FLEX_BLOCK, HOPPER_FLEX_DIMS

    if config.bwd_kernel not in BWD_KERNELS:
        raise ValueError(f"FlexConfig.bwd_kernel must be one of {BWD_KERNELS}; got {config.bwd_kernel!r}")
    return (config.bwd_kernel == "hopper" and target == "cuda" and is_hopper()
            and tuple(mask_block) == HOPPER_FLEX_BLOCK and dim in HOPPER_FLEX_DIMS)


def _build_backward_main(pr, plan, config):
    if uses_hopper_backward(pr.target, pr.dim, pr.mask_block, config):
        from .flash_bwd_hopper import PASS_CONFIGS
        from .flash_flex_hopper_bwd import flex_bwd_hopper_kernel

        func = flex_bwd_hopper_kernel(pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, plan, pr.mask_shape,
                                      pr.mask_block, heads_kv=pr.heads_kv, sm_scale=pr.sm_scale, dtype=pr.dtype)
        return compile_kernel(func, out_idx=[], target=pr.target, dtype=pr.dtype, pass_configs=PASS_CONFIGS)
    func = flex_bwd_kernel(pr.batch, pr.heads, pr.seq_q, pr.seq_k, pr.dim, plan, pr.mask_shape, pr.mask_block,
                           heads_kv=pr.heads_kv, sm_scale=pr.sm_scale, block_M=config.bwd_block_M,
                           num_stages=config.bwd_stages, threads=config.bwd_threads, dtype=pr.dtype, target=pr.target)
    return compile_kernel(func, out_idx=[], target=pr.target, dtype=pr.dtype)


def _build_backward(pr, plan, config):
    small = 16 if pr.target == "c" else 64
    threads = 1 if pr.target == "c" else 128
    common = dict(dtype=pr.dtype, target=pr.target)

    def build(func, out_idx):
        return compile_kernel(func, out_idx=out_idx, target=pr.target, dtype=pr.dtype)

    pre = build(flash_bwd_preprocess_kernel(pr.batch, pr.heads, pr.seq_q, pr.dim, block=small, threads=threads,
                                            **common), [2])
    main = _build_backward_main(pr, plan, config)
    post_q = build(flash_bwd_postprocess_kernel(pr.batch, pr.heads, pr.seq_q, pr.dim, scale=pr.sm_scale, block=small,
                                                threads=threads, **common), [1])
    post_kv = None
    if pr.heads_kv != pr.heads:
        post_kv = build(flash_bwd_postprocess_kernel(pr.batch, pr.heads_kv, pr.seq_k, pr.dim, block=small,
                                                     threads=threads, **common), [1])
    return FlexBackwardKernels(pre, main, post_q, post_kv)


_compiled_backward = _KernelCache(_build_backward)


def flex_forward_kernel(q, k, plan, block_mask, sm_scale, config=None):
    """The compiled forward: ``kernel(q, k, v, kv_count, kv_list, state, floats, ints) -> (out, lse)``."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    return _compiled_forward(_problem(q, k, block_mask, sm_scale), plan.key, plan, config)


def flex_backward_kernels(q, k, plan, block_mask, sm_scale, config=None):
    """The compiled ``FlexBackwardKernels`` for these shapes, modifiers and block mask."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    return _compiled_backward(_problem(q, k, block_mask, sm_scale), plan.key, plan, config)


def flex_forward_uses_hopper(q, k, block_mask, sm_scale=1.0, config=None):
    """Whether ``flex_forward_kernel`` runs these inputs on the Hopper kernel (``uses_hopper_forward``)."""
    config = config or default_flex_config(q.device.type, block_mask.block)
    return uses_hopper_forward(_problem(q, k, block_mask, sm_scale), config)


def flex_forward(q, k, v, plan, block_mask, sm_scale, config=None):
    """(O, LSE) of the flex forward kernel (no autograd)."""
    kernel = flex_forward_kernel(q, k, plan, block_mask, sm_scale, config)
    bm = block_mask
    return kernel(q, k, v, bm.kv_count, bm.kv_list, bm.state, *plan.pack(q.device))


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

