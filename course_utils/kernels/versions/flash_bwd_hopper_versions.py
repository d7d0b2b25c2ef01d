"""Chapter 08's ablation: the Hopper backward built up one change at a time, as numbered versions.

As in ``flash_fwd_hopper_versions``, each version is one line of why. Version 1 is chapter 05's
kernel; the others are ``flash_bwd_hopper_variant``, one kernel skeleton with the switches the
shipped kernel (``flash_bwd_hopper_kernel``) does not need, plus ``fused_preprocess``: a
preprocess that also zeroes the dQ accumulator and stores LSE·log2(e). A version either adds a
change to the version before it (the path to the shipped kernel) or varies the version it names
without being kept.

Every version runs the whole backward (preprocess, main kernel, postprocess) through
``Version.backward``, so the ablation times what a training step pays.
"""

import functools
import threading

import tilelang.language as T
import torch

from ..flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from ..flash_bwd_hopper import PASS_CONFIGS, consumer_barrier, needs_mask, padded_rows, query_steps
from ..flash_pieces import LOG2E, prelude, visible
from ..hopper_pieces import keep_stages_until_read
from ..tiles import TileBackend, compile_kernel
from .version import Version
from .version import versions_for as _versions_for

__all__ = ["Version", "VERSIONS", "SHIPPED_VERSION", "shipped_version", "versions_for", "flash_bwd_hopper_variant",
           "fused_preprocess_kernel", "MANUAL_SYNC_PASS_CONFIGS"]

ACCUM = "float32"
# With manual_sync the kernel places its own barriers, as the shipped kernel does.
MANUAL_SYNC_PASS_CONFIGS = PASS_CONFIGS
_DS_BARRIER, _DQ_BARRIER = 6, 5


def flash_bwd_hopper_variant(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, sm_scale=None,
    dtype="float16", block_M=64, block_N=128, num_stages=2, threads=256,
    asynchronous=True, dq_reduce="tma", mask_all_tiles=False, dq_before_dk=True, ds_buffers=1,
    manual_sync=False, light_first=False, lse_log2=False, dv_during_ds=True, ds_from_rounded_p=False,
):
    """The Hopper backward's main kernel with the switches the ablation varies (chapter 05's contract).

    ``asynchronous=False``: synchronous ``T.gemm`` in chapter 05's order (each matmul waits).
    ``dq_reduce``: "atomic" adds dQ from registers element by element; "tma" stores it to shared
    memory and has the copy engine add the tile (cp.reduce.async.bulk). ``mask_all_tiles``: the
    mask on every tile, not only on boundary tiles. ``dq_before_dk``: issue dQ before dK, so dQ's
    store runs while dK is on the tensor cores. ``ds_buffers``: 1 or 2 shared dSᵀ tiles.
    ``manual_sync``: the kernel's own two barriers per step instead of TileLang's four (compile with
    ``MANUAL_SYNC_PASS_CONFIGS``; needs ``ds_buffers=2``). ``light_first``: causal key blocks in
    reverse order (the light ones first). ``lse_log2``: LSE arrives already multiplied by log2(e)
    (``fused_preprocess_kernel``). ``dv_during_ds``: issue dV before forming dSᵀ, so the two overlap
    (False: FlashAttention-3's order, dSᵀ first, fewer live registers). ``ds_from_rounded_p``: form
    dSᵀ from the 16-bit Pᵀ that dV uses, so the float32 Pᵀ dies early (fewer live registers).
    """
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    if manual_sync and ds_buffers != 2:
        raise ValueError("manual_sync drops the barrier before the dS store: it needs ds_buffers=2")
    swap_dq = block_M % 64 != 0
    stat_rows = padded_rows(block_M)
    dkv_dtype = dtype if p.group == 1 else ACCUM
    dq_shape = [dim, block_M] if swap_dq else [block_M, dim]
    lse_scale = 1.0 if lse_log2 else LOG2E
    policy = T.GemmWarpPolicy.FullRow
    q_shape, kv_shape = [batch, heads, seq_q, dim], [batch, p.heads_kv, seq_k, dim]
    n_kb = p.blocks(seq_k, block_N)

    @T.macro
    def gemm(A, B, C, transpose_A=False, transpose_B=False, policy=T.GemmWarpPolicy.Square, clear_accum=False):
        if asynchronous:
            T.wgmma_gemm(A, B, C, transpose_A=transpose_A, transpose_B=transpose_B, policy=policy,
                         clear_accum=clear_accum)
        else:
            T.gemm(A, B, C, transpose_A=transpose_A, transpose_B=transpose_B, policy=policy, clear_accum=clear_accum)

    @T.macro
    def wait(n):
        if asynchronous:
            T.wait_wgmma(n)

    @T.macro
    def masked_exp(PT, lse, qb, kb):
        for j, i in T.Parallel(block_N, block_M):
            PT[j, i] = T.if_then_else(visible(p, qb * block_M + i, kb * block_N + j, guard_q=True),
                                      T.exp2(PT[j, i] * p.scale_log2 - lse[i] * lse_scale), 0)

    @T.prim_func
    def flash_bwd_hopper_variant(
        Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype), LSE: T.Tensor(q_shape[:3], ACCUM), Delta: T.Tensor(q_shape[:3], ACCUM),
        dQ_acc: T.Tensor(q_shape, ACCUM), dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
    ):
        with T.Kernel(n_kb, heads, batch, threads=threads) as (bx, by, bz):
            K_s = T.alloc_shared([block_N, dim], dtype)
            V_s = T.alloc_shared([block_N, dim], dtype)
            Q_s = T.alloc_shared([block_M, dim], dtype)
            dO_s = T.alloc_shared([block_M, dim], dtype)
            lse = T.alloc_shared([stat_rows], ACCUM)
            delta = T.alloc_shared([stat_rows], ACCUM)
            PT = T.alloc_fragment([block_N, block_M], ACCUM)
            dPT = T.alloc_fragment([block_N, block_M], ACCUM)
            PT_cast = T.alloc_fragment([block_N, block_M], dtype)
            dST_cast = T.alloc_fragment([block_N, block_M], dtype)
            dv = T.alloc_fragment([block_N, dim], ACCUM)
            dk = T.alloc_fragment([block_N, dim], ACCUM)
            stage_in_use = T.alloc_local([1], dtype)
            dST_s = T.alloc_shared([ds_buffers, block_N, block_M], dtype)
            dq = T.alloc_fragment(dq_shape, ACCUM)
            dq_s = T.alloc_shared([block_M, dim], ACCUM)

            if light_first:
                kb = n_kb - 1 - bx
            else:
                kb = bx
            kv_head = by // p.group
            T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
            T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
            T.clear(dv)
            T.clear(dk)
            first, end, offset = query_steps(p, kb, block_M, block_N)
            for step in T.Pipelined(first, end, num_stages=num_stages):
                qb = offset + step
                buf = step % ds_buffers
                T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
                T.copy(dO[bz, by, qb * block_M:(qb + 1) * block_M, :], dO_s)
                T.copy(LSE[bz, by, qb * block_M:(qb + 1) * block_M], lse[0:block_M])
                T.copy(Delta[bz, by, qb * block_M:(qb + 1) * block_M], delta[0:block_M])
                gemm(K_s, Q_s, PT, transpose_B=True, policy=policy, clear_accum=True)
                gemm(V_s, dO_s, dPT, transpose_B=True, policy=policy, clear_accum=True)
                wait(1)
                if mask_all_tiles:
                    masked_exp(PT, lse, qb, kb)
                elif needs_mask(p, qb, kb, block_M, block_N):
                    masked_exp(PT, lse, qb, kb)
                else:
                    for j, i in T.Parallel(block_N, block_M):
                        PT[j, i] = T.exp2(PT[j, i] * p.scale_log2 - lse[i] * lse_scale)
                if dv_during_ds:
                    T.copy(PT, PT_cast)
                    wait(0)
                    gemm(PT_cast, dO_s, dv, policy=policy)
                    if ds_from_rounded_p:
                        for j, i in T.Parallel(block_N, block_M):
                            dST_cast[j, i] = PT_cast[j, i] * (dPT[j, i] - delta[i])
                    else:
                        for j, i in T.Parallel(block_N, block_M):
                            dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i])
                else:
                    wait(0)
                    for j, i in T.Parallel(block_N, block_M):
                        dST_cast[j, i] = PT[j, i] * (dPT[j, i] - delta[i])
                    T.copy(PT, PT_cast)
                T.copy(dST_cast, dST_s[buf, :, :])
                if manual_sync:
                    consumer_barrier(_DS_BARRIER)
                if not dv_during_ds:
                    gemm(PT_cast, dO_s, dv, policy=policy)
                if dq_before_dk:
                    if swap_dq:
                        gemm(K_s, dST_s[buf, :, :], dq, transpose_A=True, policy=policy, clear_accum=True)
                    else:
                        gemm(dST_s[buf, :, :], K_s, dq, transpose_A=True, clear_accum=True)
                    gemm(dST_cast, Q_s, dk, policy=policy)
                    wait(1)
                else:
                    gemm(dST_cast, Q_s, dk, policy=policy)
                    if swap_dq:
                        gemm(K_s, dST_s[buf, :, :], dq, transpose_A=True, policy=policy, clear_accum=True)
                    else:
                        gemm(dST_s[buf, :, :], K_s, dq, transpose_A=True, clear_accum=True)
                    wait(0)
                if dq_reduce == "tma":
                    if swap_dq:
                        for i, d in T.Parallel(block_M, dim):
                            dq_s[i, d] = dq[d, i]
                    else:
                        T.copy(dq, dq_s)
                    if manual_sync:
                        consumer_barrier(_DQ_BARRIER)
                    T.atomic_add(dQ_acc[bz, by, qb * block_M:(qb + 1) * block_M, :], dq_s, use_tma=True)
                elif swap_dq:
                    for i, d in T.Parallel(block_M, dim):
                        if qb * block_M + i < seq_q:
                            T.atomic_add(dQ_acc[bz, by, qb * block_M + i, d], dq[d, i])
                else:
                    for i, d in T.Parallel(block_M, dim):
                        if qb * block_M + i < seq_q:
                            T.atomic_add(dQ_acc[bz, by, qb * block_M + i, d], dq[i, d])
                wait(0)
                keep_stages_until_read(stage_in_use, Q_s, dO_s)

            for j, d in T.Parallel(block_N, dim):
                dk[j, d] *= p.sm_scale
            if p.group == 1:
                T.copy(dv, dV[bz, kv_head, kb * block_N:(kb + 1) * block_N, :])
                T.copy(dk, dK[bz, kv_head, kb * block_N:(kb + 1) * block_N, :])
            else:
                for j, d in T.Parallel(block_N, dim):
                    if kb * block_N + j < seq_k:
                        T.atomic_add(dV[bz, kv_head, kb * block_N + j, d], dv[j, d])
                        T.atomic_add(dK[bz, kv_head, kb * block_N + j, d], dk[j, d])

    return flash_bwd_hopper_variant


def fused_preprocess_kernel(batch, heads, seq_q, dim, *, dtype="float16", block=64, threads=128):
    """(O, dO, LSE) -> (Δ, LSE·log2(e), dQ_acc = 0): chapter 05's preprocess, plus the two things the
    main kernel would otherwise get from a memset and a multiply per score (FlashAttention-3's)."""
    tb = TileBackend("cuda")

    @T.prim_func
    def fused_preprocess(
        O: T.Tensor([batch, heads, seq_q, dim], dtype),
        dO: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], ACCUM),
        Delta: T.Tensor([batch, heads, seq_q], ACCUM),
        LSE_log2: T.Tensor([batch, heads, seq_q], ACCUM),
        dQ_acc: T.Tensor([batch, heads, seq_q, dim], ACCUM),
    ):
        with tb.kernel(T.ceildiv(seq_q, block), heads, batch, threads=threads) as (bx, by, bz):
            o = tb.fragment([block, dim], ACCUM)
            do = tb.fragment([block, dim], ACCUM)
            zeros = tb.fragment([block, dim], ACCUM)
            delta = tb.fragment([block], ACCUM)
            T.copy(O[bz, by, bx * block:(bx + 1) * block, :], o)
            T.copy(dO[bz, by, bx * block:(bx + 1) * block, :], do)
            for i, d in tb.parallel(block, dim):
                o[i, d] *= do[i, d]
            T.reduce_sum(o, delta, dim=1)
            T.copy(delta, Delta[bz, by, bx * block:(bx + 1) * block])
            for i in tb.parallel(block):
                if bx * block + i < seq_q:
                    LSE_log2[bz, by, bx * block + i] = LSE[bz, by, bx * block + i] * LOG2E
            T.clear(zeros)
            T.copy(zeros, dQ_acc[bz, by, bx * block:(bx + 1) * block, :])

    return fused_preprocess


def _build(version, batch, heads, seq, dim, *, causal, dtype="float16", heads_kv=None, window_size=None, seq_k=None):
    """Compile the three kernels of ``version``; returns a function (q, k, v, out, lse, dO) -> grads."""
    seq_k = seq if seq_k is None else seq_k
    heads_kv = heads if heads_kv is None else heads_kv
    knobs = version.knobs_for(dim, causal)
    variant = dict(heads_kv=heads_kv, causal=causal, window_size=window_size, dtype=dtype)
    if version.factory is flash_bwd_kernel:  # version 1: chapter 05's kernel, synchronous T.gemm
        func = flash_bwd_kernel(batch, heads, seq, seq_k, dim, target="cuda", **variant,
                                **{k: knobs[k] for k in ("block_M", "block_N", "num_stages", "threads")})
    else:
        func = version.factory(batch, heads, seq, seq_k, dim, **variant, **knobs)
    options = dict(pass_configs=MANUAL_SYNC_PASS_CONFIGS) if knobs.get("manual_sync") else {}
    main = compile_kernel(func, out_idx=[], target="cuda", dtype=dtype, **options)
    fused = knobs.get("lse_log2", False)  # FlashAttention-3's preprocess
    key = (batch, heads, heads_kv, seq, seq_k, dim, dtype, fused)
    with _HELPER_LOCK:  # versions built in parallel threads share one compile of each helper
        lock = _HELPER_LOCKS.setdefault(key, threading.Lock())
    with lock:
        pre, post_q, post_kv = _helper_kernels(*key)

    def backward(q, k, v, out, lse, d_out):
        if fused:
            delta, lse_arg, dq_acc = pre(out, d_out, lse)
        else:
            delta, lse_arg = pre(out, d_out), lse
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if post_kv is None:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        else:
            dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
        main(q, k, v, d_out, lse_arg, delta, dq_acc, dk, dv)
        dq = post_q(dq_acc)
        if post_kv is not None:
            dk, dv = post_kv(dk), post_kv(dv)
        return dq, dk, dv

    return backward


def _backward(number, label, why, knobs=None, *, chapter05=False, **fields):
    """A backward version: chapter 08's variant skeleton (or chapter 05's kernel), the backward's default
    tiling and builder. ``knobs``: "all", a head dim, or (head dim, causal) -> keywords."""
    knobs = dict(knobs or {})
    return Version(number, label, why, flash_bwd_kernel if chapter05 else flash_bwd_hopper_variant,
                   knobs=knobs.pop("all", {}), when=knobs, builder=_build,
                   defaults=dict(block_M=64, block_N=128, num_stages=2, threads=256), **fields)


_HELPER_LOCK, _HELPER_LOCKS = threading.Lock(), {}


@functools.lru_cache(maxsize=32)
def _helper_kernels(batch, heads, heads_kv, seq, seq_k, dim, dtype, fused):
    """The preprocess and postprocess kernels every version of one shape shares (compiled once)."""
    def build(func, out_idx):
        return compile_kernel(func, out_idx=out_idx, target="cuda", dtype=dtype)

    if fused:
        pre = build(fused_preprocess_kernel(batch, heads, seq, dim, dtype=dtype), [3, 4, 5])
    else:
        pre = build(flash_bwd_preprocess_kernel(batch, heads, seq, dim, dtype=dtype, target="cuda"), [2])
    post_q = build(flash_bwd_postprocess_kernel(batch, heads, seq, dim, scale=1.0 / dim ** 0.5, dtype=dtype,
                                                target="cuda"), [1])
    post_kv = None
    if heads_kv != heads:
        post_kv = build(flash_bwd_postprocess_kernel(batch, heads_kv, seq_k, dim, dtype=dtype, target="cuda"), [1])
    return pre, post_q, post_kv


# The path to the shipped kernel. Knob dicts: "all", a head dim, or (head dim, causal).
_ATOMIC_1 = dict(dq_reduce="atomic", dq_before_dk=False, num_stages=1)
_FA3_TILES = {(128, False): dict(block_M=80), 64: dict(block_M=128)}
_SHIPPED = dict(dv_during_ds=False, ds_buffers=2, manual_sync=True)

VERSIONS = [
    _backward(1, "chapter 05's kernel (synchronous T.gemm)", "every matmul waits; dQ by per-element atomics",
              chapter05=True, knobs={"all": dict(num_stages=1)}),
    _backward(2, "+ FlashAttention-3's order with async wgmma",
              "Sᵀ and dPᵀ issued together, exponentials under dPᵀ, dSᵀ under dV",
              knobs={"all": dict(_ATOMIC_1, mask_all_tiles=True)}),
    _backward(3, "+ mask only on boundary tiles", "interior tiles skip the visibility test", knobs={"all": _ATOMIC_1}),
    _backward(4, "+ two stages for Q and dO", "the next query block loads during this one",
              knobs={"all": dict(_ATOMIC_1, num_stages=2)}),
    _backward(5, "+ dQ by one bulk reduce-add from shared memory", "the copy engine adds the whole tile",
              knobs={"all": dict(dq_before_dk=False)}),
    _backward(6, "+ dQ issued before dK", "dQ's trip through shared memory runs while dK is on the tensor cores",
              knobs={"all": dict()}),
    _backward(7, "+ dSᵀ formed before dV is issued", "fewer live registers: P and dP die before dV starts",
              knobs={"all": dict(dv_during_ds=False)}),
    _backward(8, "+ two dSᵀ buffers, our own two barriers", "TileLang's four barriers per step become two",
              knobs={"all": _SHIPPED}, shipped_code=True),
    _backward(9, "+ FlashAttention-3's tiles (80 × 128 at D=128, 128 × 128 at D=64)",
              "more queries per step; dQᵀ = Kᵀ dSᵀ where 80 rows cannot be split in 64s",
              knobs={"all": _SHIPPED, **_FA3_TILES}, shipped_code=True),
    _backward(10, "  (TileLang's four barriers)", "two dSᵀ buffers, barriers left to TileLang",
              knobs={"all": dict(_SHIPPED, manual_sync=False), **_FA3_TILES}, kept=False),
    _backward(11, "  (FlashAttention-3's preprocess)", "Δ, LSE·log2(e) and dQ_acc = 0 in one kernel",
              knobs={"all": dict(_SHIPPED, lse_log2=True), **_FA3_TILES}, kept=False),
    _backward(12, "  (one stage)", "one Q/dO stage", knobs={"all": dict(_SHIPPED, num_stages=1), **_FA3_TILES},
              kept=False),
    _backward(13, "  (per-element dQ atomics)", "dQ added from registers",
              knobs={"all": dict(_SHIPPED, dq_reduce="atomic"), **_FA3_TILES}, kept=False),
    _backward(14, "  (dV under dSᵀ, dSᵀ from the 16-bit P)", "overlap kept, registers saved by rounding P first",
              knobs={"all": dict(_SHIPPED, dv_during_ds=True, ds_from_rounded_p=True), **_FA3_TILES}, kept=False),
    _backward(15, "  (80 × 128 tiles with the causal mask)", "FlashAttention-3 keeps 64 × 128 when masked",
              knobs={"all": _SHIPPED, (128, True): dict(block_M=80)}, kept=False, causal_only=True, dims=(128,),
              shipped_code=True),
    _backward(16, "  (light key blocks first)", "the launch order the causal kernel does not use",
              knobs={"all": dict(_SHIPPED, light_first=True), **_FA3_TILES}, kept=False, causal_only=True),
]
SHIPPED_VERSION = 9


def versions_for(causal, dim=None):
    """The versions the ablation times for a causal or non-causal problem."""
    return _versions_for(VERSIONS, causal, dim)


def shipped_version(dim, causal, tiling):
    """The version whose row in the ablation is the shipped kernel at ``tiling`` (block_M, block_N)."""
    candidates = [v for v in VERSIONS if v.shipped_code and (causal or not v.causal_only) and dim in v.dims
                  and v.tiling(dim, causal) == tuple(tiling)]
    return max(candidates, key=lambda v: v.number == SHIPPED_VERSION)
