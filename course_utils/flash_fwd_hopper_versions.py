"""Chapter 07's ablation: the Hopper forward built up one change at a time, as numbered versions.

Like llm.c's ``dev/cuda`` kernels, each version is one line of why. A version either adds a change
to the version before it (the path to the shipped kernel) or varies the version it names without
being kept. Versions 1–4 are chapter 03/04's kernel under different compile options; version 5
is the kernel ``flash_attention`` runs on Hopper (``flash_fwd_hopper_kernel``); the later ones
are ``flash_fwd_hopper_variant``, the shipped kernel's skeleton with the switches it does not keep.
"""

from dataclasses import dataclass, field

import tilelang
import tilelang.language as T

from .flash_fwd import flash_fwd_kernel
from .flash_fwd_hopper import flash_fwd_hopper_kernel, issue_matmuls, keep_stages_until_read, pass_turn, wait_for_turn
from .flash_pieces import (NEG_INF, forward_epilogue, forward_tiles, init_running_max, key_block_range, mask_scores,
                           prelude)
from .tiles import TileBackend, compile_kernel

__all__ = ["Version", "VERSIONS", "versions_for", "flash_fwd_hopper_variant"]

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
    causal_only: bool = False
    causal_knobs: dict = field(default_factory=dict)  # knobs that differ when causal

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
            dict(num_stages=1), kept=False),
    Version(5, "+ softmax overlapped with async wgmma", "the rotated loop: exponentials run while P·V runs",
            flash_fwd_hopper_kernel, dict(num_stages=2)),
    Version(6, "  (with 128 × 192 tiles)", "fewer, longer iterations", flash_fwd_hopper_kernel,
            dict(num_stages=2, block_N=192), kept=False),
    Version(7, "  (with ping-pong between the warpgroups)", "one warpgroup's softmax under the other's matmuls",
            flash_fwd_hopper_kernel, dict(num_stages=2, pingpong=True), kept=False),
    Version(8, "  (with rescales skipped under 2^8)", "FlashAttention-4: most blocks need no rescale",
            flash_fwd_hopper_variant, dict(num_stages=2, rescale_threshold=8.0), kept=False),
    Version(9, "  (with light query blocks first)", "the launch order the causal kernel does not use",
            flash_fwd_hopper_variant, dict(num_stages=2, heavy_first=False), kept=False, causal_only=True),
]


def versions_for(causal):
    """The versions the ablation times for a causal or non-causal problem."""
    return [v for v in VERSIONS if causal or not v.causal_only]
