"""Chapter 07's ablation: the Hopper forward built up one change at a time, as numbered versions.

Like llm.c's ``dev/cuda`` kernels, each version is one line of why. A version either adds a change
to the version before it (the path to the shipped kernel) or varies the version it names without
being kept. Versions 1–4 are chapter 03/04's kernel under different compile options; version 5
is chapter 07's rotated loop (``flash_fwd_hopper_kernel``) and 6–9 its variations
(``flash_fwd_hopper_variant``, its skeleton with the switches it does not keep). Version 10 is the
persistent kernel (``flash_fwd_hopper_persistent_kernel``) and the later ones its variations
(``flash_fwd_hopper_persistent_variant``).
"""

from dataclasses import dataclass, field

import tilelang
import tilelang.language as T

from ..flash_fwd import flash_fwd_kernel
from ..flash_fwd_hopper import flash_fwd_hopper_kernel
from ..flash_fwd_hopper_persistent import (
    H100_SMS,
    first_turn,
    flash_fwd_hopper_persistent_kernel,
    tile_count,
    tile_index,
    tile_order,
    tiles_per_block,
)
from ..flash_fwd_hopper_persistent import pass_turn as pass_turn_n
from ..flash_fwd_hopper_persistent import wait_for_turn as wait_for_turn_n
from ..flash_pieces import (
    ACCUM,
    NEG_INF,
    forward_epilogue,
    forward_tiles,
    init_running_max,
    key_block_range,
    mask_scores,
    online_softmax,
    prelude,
)
from ..hopper_pieces import issue_matmuls, keep_stages_until_read, pass_turn, wait_for_turn
from ..tiles import TileBackend, compile_kernel

__all__ = ["Version", "VERSIONS", "versions_for", "flash_fwd_hopper_variant", "flash_fwd_hopper_persistent_variant",
           "exp2_on_fma"]

_NO_TMA_NO_WS = {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
                 tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


@dataclass(frozen=True)
class Version:
    """One row of the ablation: a kernel factory, its knobs and compile options, and why it exists."""

    number: int
    label: str
    why: str
    factory: object
    knobs: dict = field(default_factory=dict)
    compile_options: dict = field(default_factory=dict)
    kept: bool = True  # on the path to the shipped kernel; False for a variation that was measured and dropped
    base: int | None = None  # for a variation: the number of the version it varies
    causal_only: bool = False
    causal_knobs: dict = field(default_factory=dict)  # knobs that differ when causal
    dims: tuple = (64, 128)  # head dimensions the version is measured at

    def build(self, batch, heads, seq, dim, *, causal, dtype="float16"):
        """Compile this version for self-attention of the given shape (CUDA, sm_90)."""
        knobs = {**dict(block_M=128, block_N=128, threads=256), **self.knobs, **(self.causal_knobs if causal else {})}
        if self.factory is flash_fwd_kernel:
            knobs["target"] = "cuda"
        func = self.factory(batch, heads, seq, seq, dim, causal=causal, dtype=dtype, **knobs)
        return compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype, **self.compile_options)


def flash_fwd_hopper_variant(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None,
    dtype="float16", block_M=128, block_N=128, num_stages=2, threads=256, pingpong=False,
    heavy_first=True, conditional_issue=False, rescale_threshold=None,
):
    """The shipped Hopper kernel with three switches it does not keep.

    ``heavy_first=False`` starts the query blocks in index order; ``conditional_issue`` skips the
    two idle matmuls (first P·V, last QKᵀ) with branches, which makes ptxas serialise every wgmma;
    ``rescale_threshold`` t keeps a stale running max unless a block's max exceeds it by more than t
    (log2 units), so most blocks skip the rescale of the output accumulator (FlashAttention-4's idea).
    """
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    scale_log2 = p.scale_log2
    accum = "float32"

    @T.prim_func
    def flash_fwd_hopper_variant(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], accum),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], accum),
    ):
        with T.Kernel(p.blocks(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_s, K_s, V_s, O_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = forward_tiles(
                tb, block_M, block_N, dim, dtype)
            stage_in_use = T.alloc_local([1], dtype)
            rescale = T.alloc_local([1], "int32")

            qb = (p.blocks(seq_q, block_M) - 1 - bx) if p.masked and heavy_first else bx
            kv_head = by // p.group
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(P, 0)
            init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
            k_start, k_end = key_block_range(p, qb, block_M, block_N)

            for kb in T.Pipelined(k_start, k_end + 1, num_stages=num_stages):
                k_blk = T.max(T.min(kb, k_end - 1), 0)
                v_blk = T.max(kb - 1, k_start)
                T.copy(K[bz, kv_head, k_blk * block_N:(k_blk + 1) * block_N, :], K_s)
                T.copy(V[bz, kv_head, v_blk * block_N:(v_blk + 1) * block_N, :], V_s)
                if pingpong:
                    wait_for_turn(kb, k_start)
                if conditional_issue:
                    if kb < k_end:
                        T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    if kb > k_start:
                        T.wgmma_gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                else:
                    issue_matmuls(Q_s, K_s, V_s, S, P, acc_o)
                if pingpong:
                    pass_turn()
                T.wait_wgmma(1)
                if kb < k_end:
                    mask_scores(tb, p, S, qb, kb, block_M, block_N)
                    T.copy(m, m_prev)
                    if rescale_threshold is None:
                        T.reduce_max(S, m, dim=1, clear=False)
                    else:
                        T.reduce_max(S, row_sum, dim=1, clear=True)
                        for i in T.Parallel(block_M):
                            # A stale max unless the new one is larger by more than the threshold:
                            # then alpha is exactly 1 and P stays below 2^threshold.
                            m[i] = T.if_then_else(
                                (row_sum[i] - m_prev[i]) * scale_log2 > rescale_threshold, row_sum[i], m_prev[i])
                    for i in T.Parallel(block_M):
                        shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] * scale_log2)
                        alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
                    for i, j in T.Parallel(block_M, block_N):
                        S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])
                    T.reduce_sum(S, row_sum, dim=1)
                    for i in T.Parallel(block_M):
                        l[i] = l[i] * alpha[i] + row_sum[i]
                    T.wait_wgmma(0)
                    if rescale_threshold is None:
                        for i, j in T.Parallel(block_M, dim):
                            acc_o[i, j] *= alpha[i]
                    else:
                        # Each thread holds whole rows' worth of alpha: it skips the rescale when all are 1.
                        rescale[0] = 0
                        for i in T.Parallel(block_M):
                            if alpha[i] != 1:
                                rescale[0] = 1
                        if rescale[0] != 0:
                            for i, j in T.Parallel(block_M, dim):
                                acc_o[i, j] *= alpha[i]
                    T.copy(S, P)
                else:
                    T.wait_wgmma(0)
                keep_stages_until_read(stage_in_use, K_s, V_s)

            forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim,
                             has_sinks)

    return flash_fwd_hopper_variant


# 2^f on [0, 1) by a cubic (the coefficients FlashAttention-4 uses); relative error about 1e-4.
_EXP2_CUBIC = (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625)


def exp2_on_fma(x):
    """2^x on the FP32 units: 2^floor(x) by writing the exponent bits, 2^frac(x) by a cubic.

    0 below 2^-126 (a masked score, -inf, stays exactly 0) and NaN stays NaN.
    """
    clamped = T.max(x, -126.0)
    whole = T.floor(clamped)
    frac = clamped - whole
    c0, c1, c2, c3 = _EXP2_CUBIC
    cubic = ((c3 * frac + c2) * frac + c1) * frac + c0
    scaled = T.reinterpret(T.reinterpret(cubic, "int32") + T.shift_left(T.cast(whole, "int32"), 23), "float32")
    return T.if_then_else(x >= -126.0, scaled, T.if_then_else(x < -126.0, T.float32(0), x))


def flash_fwd_hopper_persistent_variant(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None,
    dtype="float16", block_M=128, block_N=128, num_stages=2, threads=256, pingpong=False, num_ctas=H100_SMS,
    folded=True, deferred_row_sum=False, fma_exp2_every=None,
):
    """The persistent kernel with three switches it does not keep.

    ``folded=False`` takes the tiles of a head in query-block order instead of pairing the heaviest
    with the lightest; ``deferred_row_sum`` keeps each thread's partial row sums (8 columns per row
    in a [block_M, 8] fragment) and reduces them across the 4 threads of a row once, in the epilogue
    (FlashAttention-3's ``finalize``), instead of after every key block; ``fma_exp2_every`` k computes
    the exponentials of every k-th group of 8 score columns with ``exp2_on_fma`` instead of the SFU
    (FlashAttention-4's split of the exponentials between the two units).
    """
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    if not folded:
        p_order = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, sm_scale=sm_scale)  # masked=False: index order
    else:
        p_order = p
    consumers = block_M // 64
    n_kb = p.blocks(seq_k, block_N)
    total = tile_count(p, batch, block_M)
    num_ctas = max(1, min(num_ctas, (total + 1) // 2))
    scale_log2 = p.scale_log2

    def exponential(x, column):
        if fma_exp2_every is None:
            return T.exp2(x)
        # By groups of 8 columns: a thread holds 2 columns of each group, so every thread takes the same path.
        return T.if_then_else(column // 8 % fma_exp2_every == fma_exp2_every - 1, exp2_on_fma(x), T.exp2(x))

    @T.macro
    def softmax_step(S, m, m_prev, shift, alpha, row_sum, l, l_part):
        if deferred_row_sum:
            T.copy(m, m_prev)
            T.reduce_max(S, m, dim=1, clear=False)
            for i in T.Parallel(block_M):
                shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] * scale_log2)
                alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
            for i, j in T.Parallel(block_M, block_N):
                S[i, j] = exponential(S[i, j] * scale_log2 - shift[i], j)
            # Column c of l_part sums the columns j ≡ c (mod 8): all held by one thread of the row's 4.
            for i, c in T.Parallel(block_M, 8):
                l_part[i, c] *= alpha[i]
                for k in T.unroll(block_N // 8):
                    l_part[i, c] += S[i, k * 8 + c]
        elif fma_exp2_every is not None:
            T.copy(m, m_prev)
            T.reduce_max(S, m, dim=1, clear=False)
            for i in T.Parallel(block_M):
                shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] * scale_log2)
                alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
            for i, j in T.Parallel(block_M, block_N):
                S[i, j] = exponential(S[i, j] * scale_log2 - shift[i], j)
            T.reduce_sum(S, row_sum, dim=1)
            for i in T.Parallel(block_M):
                l[i] = l[i] * alpha[i] + row_sum[i]
        else:
            online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, scale_log2)

    @T.prim_func
    def flash_fwd_hopper_persistent_variant(
        Q: T.Tensor([batch, heads, seq_q, dim], dtype),
        K: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        V: T.Tensor([batch, p.heads_kv, seq_k, dim], dtype),
        Sinks: T.Tensor([heads], ACCUM),
        Output: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], ACCUM),
    ):
        with T.Kernel(num_ctas, threads=threads + 128) as cta:
            Q_s = T.alloc_shared([block_M, dim], dtype)
            K_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            V_s = T.alloc_shared([num_stages, block_N, dim], dtype)
            O_s = T.alloc_shared([block_M, dim], dtype)
            S = T.alloc_fragment([block_M, block_N], ACCUM)
            P = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, dim], ACCUM)
            m = T.alloc_fragment([block_M], ACCUM)
            m_prev = T.alloc_fragment([block_M], ACCUM)
            shift = T.alloc_fragment([block_M], ACCUM)
            alpha = T.alloc_fragment([block_M], ACCUM)
            row_sum = T.alloc_fragment([block_M], ACCUM)
            l = T.alloc_fragment([block_M], ACCUM)  # noqa: E741
            l_part = T.alloc_fragment([block_M, 8], ACCUM) if deferred_row_sum else row_sum  # row-sum partials
            q_full = T.alloc_barrier(128)
            q_empty = T.alloc_barrier(threads)
            k_full = T.alloc_barrier([128] * num_stages)
            k_empty = T.alloc_barrier([threads] * num_stages)
            v_full = T.alloc_barrier([128] * num_stages)
            v_empty = T.alloc_barrier([threads] * num_stages)
            it = T.alloc_var("int32", init=0)

            if T.get_thread_binding() < 128:
                T.set_max_nreg(24, 0)
                for w in T.serial(tiles_per_block(total, num_ctas, cta)):
                    bz, by, qb = tile_order(p_order, tile_index(num_ctas, cta, w), block_M)
                    kv_head = by // p.group
                    k_start, k_end = key_block_range(p, qb, block_M, block_N)
                    T.mbarrier_wait_parity(q_empty[0], (w & 1) ^ 1)
                    T.tma_copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s, barrier=q_full[0])
                    T.mbarrier_arrive(q_full[0])
                    for j in T.serial(T.max(k_end - k_start, 1)):
                        kb = T.max(T.min(k_start + j, n_kb - 1), 0)
                        stage, phase = it % num_stages, (it // num_stages) & 1
                        T.mbarrier_wait_parity(k_empty[stage], phase ^ 1)
                        T.tma_copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s[stage, :, :],
                                   barrier=k_full[stage])
                        T.mbarrier_arrive(k_full[stage])
                        T.mbarrier_wait_parity(v_empty[stage], phase ^ 1)
                        T.tma_copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s[stage, :, :],
                                   barrier=v_full[stage])
                        T.mbarrier_arrive(v_full[stage])
                        it = it + 1
            else:
                T.set_max_nreg(240 if consumers == 2 else 160, 1)
                if pingpong:
                    first_turn(consumers)
                for w in T.serial(tiles_per_block(total, num_ctas, cta)):
                    bz, by, qb = tile_order(p_order, tile_index(num_ctas, cta, w), block_M)
                    k_start, k_end = key_block_range(p, qb, block_M, block_N)
                    T.fill(acc_o, 0)
                    T.fill(l, 0)
                    if deferred_row_sum:
                        T.fill(l_part, 0)
                    init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
                    T.mbarrier_wait_parity(q_full[0], w & 1)
                    stage = it % num_stages
                    T.mbarrier_wait_parity(k_full[stage], (it // num_stages) & 1)
                    if pingpong:
                        wait_for_turn_n(consumers)
                    T.wgmma_gemm(Q_s, K_s[stage, :, :], S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                 clear_accum=True)
                    if pingpong:
                        pass_turn_n(consumers)
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(k_empty[stage])
                    mask_scores(tb, p, S, qb, T.max(T.min(k_start, n_kb - 1), 0), block_M, block_N)
                    softmax_step(S, m, m_prev, shift, alpha, row_sum, l, l_part)
                    T.copy(S, P)
                    for j in T.serial(1, T.max(k_end - k_start, 1)):
                        k_stage, v_stage = (it + 1) % num_stages, it % num_stages
                        T.mbarrier_wait_parity(k_full[k_stage], ((it + 1) // num_stages) & 1)
                        if pingpong:
                            wait_for_turn_n(consumers)
                        T.wgmma_gemm(Q_s, K_s[k_stage, :, :], S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                     clear_accum=True)
                        T.mbarrier_wait_parity(v_full[v_stage], (it // num_stages) & 1)
                        T.wgmma_gemm(P, V_s[v_stage, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                        if pingpong:
                            pass_turn_n(consumers)
                        T.wait_wgmma(1)
                        T.mbarrier_arrive(k_empty[k_stage])
                        mask_scores(tb, p, S, qb, k_start + j, block_M, block_N)
                        softmax_step(S, m, m_prev, shift, alpha, row_sum, l, l_part)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(v_empty[v_stage])
                        for i, d in T.Parallel(block_M, dim):
                            acc_o[i, d] *= alpha[i]
                        T.copy(S, P)
                        it = it + 1
                    T.mbarrier_arrive(q_empty[0])
                    v_stage = it % num_stages
                    T.mbarrier_wait_parity(v_full[v_stage], (it // num_stages) & 1)
                    T.wgmma_gemm(P, V_s[v_stage, :, :], acc_o, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(0)
                    T.mbarrier_arrive(v_empty[v_stage])
                    it = it + 1
                    if deferred_row_sum:
                        T.reduce_sum(l_part, l, dim=1)
                    T.tma_store_wait()
                    forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim,
                                     has_sinks, wait_for_store=False)
                T.tma_store_wait()

    return flash_fwd_hopper_persistent_variant


# TileLang 0.1.15 cannot lower cp.async + causal + 2 stages on sm_90 ("Downcast from tirx.Sub").
_CP_ASYNC_CAUSAL = dict(num_stages=1)

VERSIONS = [
    Version(1, "cp.async loads, no warp specialisation, exact exp2",
            "chapter 04's kernel as an Ampere GPU would run it", flash_fwd_kernel, dict(num_stages=2),
            dict(fast_math=False, pass_configs=_NO_TMA_NO_WS), causal_knobs=_CP_ASYNC_CAUSAL),
    Version(2, "+ fast exp2 (ex2.approx)", "the SFU's approximate exp2: one instruction per exponential",
            flash_fwd_kernel, dict(num_stages=2), dict(pass_configs=_NO_TMA_NO_WS), causal_knobs=_CP_ASYNC_CAUSAL),
    Version(3, "+ TMA loads, producer warpgroup, setmaxnreg",
            "Hopper's copy engine, fed by a warpgroup of its own", flash_fwd_kernel, dict(num_stages=2)),
    Version(4, "  (chapter 04's tuning: 1 stage)", "the tiling chapter 04's sweep picked", flash_fwd_kernel,
            dict(num_stages=1), kept=False, base=3),
    Version(5, "+ softmax overlapped with async wgmma", "the rotated loop: exponentials run while P·V runs",
            flash_fwd_hopper_kernel, dict(num_stages=2)),
    Version(6, "  (with 128 × 192 tiles)", "fewer, longer iterations", flash_fwd_hopper_kernel,
            dict(num_stages=2, block_N=192), kept=False, base=5),
    Version(7, "  (with ping-pong between the warpgroups)", "one warpgroup's softmax under the other's matmuls",
            flash_fwd_hopper_kernel, dict(num_stages=2, pingpong=True), kept=False, base=5),
    Version(8, "  (with rescales skipped under 2^8)", "FlashAttention-4: most blocks need no rescale",
            flash_fwd_hopper_variant, dict(num_stages=2, rescale_threshold=8.0), kept=False, base=5),
    Version(9, "  (with light query blocks first)", "the launch order the causal kernel does not use",
            flash_fwd_hopper_variant, dict(num_stages=2, heavy_first=False), kept=False, base=5, causal_only=True),
    Version(10, "  (rotated loop, 3 warpgroups, 192 × 128)", "three consumer warpgroups share each K/V tile",
            flash_fwd_hopper_kernel, dict(num_stages=2, block_M=192, threads=384), kept=False, base=5, dims=(64,)),
    Version(11, "+ persistent blocks, peeled loop, folded tile order",
            "next tile's loads under this tile's epilogue; no idle matmul; balanced causal work",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2)),
    Version(12, "  (persistent, query blocks in index order)", "the order without the causal triangle folded",
            flash_fwd_hopper_persistent_variant, dict(num_stages=2, folded=False), kept=False, base=11,
            causal_only=True),
    Version(13, "  (persistent, with ping-pong)", "consumer warpgroups take turns issuing their matmuls",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, pingpong=True), kept=False, base=11),
    Version(14, "  (persistent, row sums reduced once)", "FlashAttention-3: no cross-thread row sum per key block",
            flash_fwd_hopper_persistent_variant, dict(num_stages=2, deferred_row_sum=True), kept=False, base=11),
    Version(15, "  (persistent, 3 warpgroups, 192 × 128)", "FlashAttention-3's tiling at D = 64",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, block_M=192, threads=384), kept=False, base=11,
            dims=(64,)),
    Version(16, "  (persistent, 3 warpgroups, 192 × 128, ping-pong)", "three warpgroups taking turns",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, block_M=192, threads=384, pingpong=True),
            kept=False, base=11, dims=(64,)),
    Version(17, "  (persistent, 3 warpgroups, 1 in 4 exp2 on the FMA units)",
            "FlashAttention-4: part of the exponentials by a cubic, off the SFU",
            flash_fwd_hopper_persistent_variant, dict(num_stages=2, block_M=192, threads=384, fma_exp2_every=4),
            kept=False, base=15, dims=(64,)),
    Version(18, "  (persistent, 1 in 4 exp2 on the FMA units)", "the same split with two warpgroups",
            flash_fwd_hopper_persistent_variant, dict(num_stages=2, fma_exp2_every=4), kept=False, base=11),
]


def versions_for(causal, dim=None):
    """The versions the ablation times for a causal or non-causal problem (at head dimension ``dim``)."""
    return [v for v in VERSIONS if (causal or not v.causal_only) and (dim is None or dim in v.dims)]
