"""Chapter 07's ablation: the Hopper forward built up one change at a time, as numbered versions.

Like llm.c's ``dev/cuda`` kernels, each version is one line of why. A version either adds a change
to the version before it (the path to the shipped kernel) or varies the version it names without
being kept. Versions 1–4 are chapter 03/04's kernel under different compile options; version 5
is chapter 07's rotated loop (``flash_fwd_hopper_kernel``) and 6–10 its variations; version 11 is
the persistent kernel (``flash_fwd_hopper_persistent_kernel``) and 12-20 its variations; version 21 (D = 64 only) is
one warpgroup per block that issues its own loads (``flash_fwd_hopper_one_warpgroup_kernel``).
A variation is the shipped kernel with the pieces it swaps: the shipped kernels take their tile
order, matmul issue, running-max step, rescale, exponential and row sums as arguments, and the few
pieces measured and not kept are below, each written once.
"""

import dataclasses

import tilelang
import tilelang.language as T

from ..flash_fwd import ForwardTiling, flash_fwd_kernel
from ..flash_fwd_hopper import RotatedPieces, flash_fwd_hopper_kernel
from ..flash_fwd_hopper_one_warpgroup import OneWarpgroupTiling, flash_fwd_hopper_one_warpgroup_kernel
from ..flash_fwd_hopper_persistent import (
    PersistentPieces,
    PersistentTiling,
    flash_fwd_hopper_persistent_kernel,
    tile_order,
)
from ..flash_pieces import ACCUM
from ..tiles import Tiling, compile_kernel
from .version import Version, grouped, renamed
from .version import versions_for as _versions_for

__all__ = ["Version", "VERSIONS", "versions_for", "grouped", "flash_fwd_hopper_variant", "variant_pieces",
           "exp2_on_fma",
           "exp2_on_fma_every", "EXP2_POLY", "exp2_poly", "exp2_poly_share", "exp2_nearly_free", "light_first",
           "issue_when_needed", "stale_max", "SKIPPED_RESCALE", "unfolded_order", "DEFERRED_ROW_SUMS"]

_NO_TMA_NO_WS = {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
                 tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
ROTATED_VARIANT, PERSISTENT_VARIANT = "flash_fwd_hopper_variant", "flash_fwd_hopper_persistent_variant"


# Each kernel's tiling type and pieces type: a version's knobs are grouped into them (``grouped``).
_ARGUMENTS = {flash_fwd_kernel: (ForwardTiling, None), flash_fwd_hopper_kernel: (Tiling, RotatedPieces),
              flash_fwd_hopper_persistent_kernel: (PersistentTiling, PersistentPieces),
              flash_fwd_hopper_one_warpgroup_kernel: (OneWarpgroupTiling, None)}


def _build(version, batch, heads, seq, dim, *, causal, dtype="float16"):
    """Compile ``version`` for self-attention of the given shape (CUDA, sm_90)."""
    knobs = version.knobs_for(dim, causal)
    if version.factory is flash_fwd_kernel:
        knobs["target"] = "cuda"
    knobs = grouped(knobs, *_ARGUMENTS[version.factory])
    func = renamed(version.factory(batch, heads, seq, seq, dim, causal=causal, dtype=dtype, **knobs), version.name)
    return compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype, **version.compile_options)


def _forward(version):
    """A forward version: the forward's default tiling and builder."""
    return dataclasses.replace(version, defaults=dict(block_M=128, block_N=128, threads=256), builder=_build)


# ---------------------------------------------------------------------------- the rotated loop's pieces

def light_first(p, bx, block_M):
    """Query blocks in launch order (the shipped kernel starts the causal kernel's heaviest first)."""
    return bx


@T.macro
def issue_when_needed(Q_s, K_s, V_s, S, P, acc_o, kb, k_start, k_end):
    """Skip the two idle matmuls (first P·V, last QKᵀ) with branches: ptxas then serialises every wgmma."""
    if kb < k_end:
        T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
    if kb > k_start:
        T.wgmma_gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)


def stale_max(threshold):
    """FlashAttention-4's running max: kept stale unless a block's max exceeds it by more than
    ``threshold`` (log2 units); then alpha is exactly 1 and P stays below 2^threshold."""
    @T.macro
    def new_max(tb, S, m, m_prev, row_sum, block_M, scale_log2):
        T.reduce_max(S, row_sum, dim=1, clear=True)
        for i in T.Parallel(block_M):
            m[i] = T.if_then_else((row_sum[i] - m_prev[i]) * scale_log2 > threshold, row_sum[i], m_prev[i])

    return new_max


@T.macro
def _rescale_flag():
    rescale = T.alloc_local([1], "int32")
    return rescale


@T.macro
def _rescale_unless_all_one(acc_o, alpha, rescale, block_M, dim):
    # Each thread holds whole rows' worth of alpha: it skips the rescale when all are 1.
    rescale[0] = 0
    for i in T.Parallel(block_M):
        if alpha[i] != 1:
            rescale[0] = 1
    if rescale[0] != 0:
        for i, j in T.Parallel(block_M, dim):
            acc_o[i, j] *= alpha[i]


# The output accumulator's rescale, skipped by a thread whose rows all have alpha = 1 (with ``stale_max``).
SKIPPED_RESCALE = dataclasses.make_dataclass("Rescale", ["tiles", "apply"], frozen=True)(
    _rescale_flag, _rescale_unless_all_one)


def variant_pieces(heavy_first=True, conditional_issue=False, rescale_threshold=None):
    """The rotated loop's pieces for three switches it does not keep (fields of ``RotatedPieces``)."""
    pieces = {}
    if not heavy_first:
        pieces["order"] = light_first
    if conditional_issue:
        pieces["issue"] = issue_when_needed
    if rescale_threshold is not None:
        pieces.update(new_max=stale_max(rescale_threshold), rescale_step=SKIPPED_RESCALE)
    return pieces


def flash_fwd_hopper_variant(*args, heavy_first=True, conditional_issue=False, rescale_threshold=None, **kwargs):
    """The shipped Hopper kernel with three switches it does not keep, as swapped pieces (``variant_pieces``).

    ``heavy_first=False`` starts the query blocks in index order; ``conditional_issue`` skips the
    two idle matmuls (first P·V, last QKᵀ) with branches, which makes ptxas serialise every wgmma;
    ``rescale_threshold`` t keeps a stale running max unless a block's max exceeds it by more than t
    (log2 units), so most blocks skip the rescale of the output accumulator (FlashAttention-4's idea).
    """
    pieces = RotatedPieces(**variant_pieces(heavy_first, conditional_issue, rescale_threshold))
    return renamed(flash_fwd_hopper_kernel(*args, **kwargs, pieces=pieces), ROTATED_VARIANT)


# ---------------------------------------------------------------------------- the persistent kernel's pieces

def unfolded_order(p, index, block_M):
    """The tiles of a head in query-block order: the causal triangle not folded."""
    return tile_order(dataclasses.replace(p, causal=False, window_size=None), index, block_M)


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


def exp2_on_fma_every(k):
    """FlashAttention-4's split of the exponentials: every ``k``-th group of 8 score columns on the FMA
    units (``exp2_on_fma``), the rest on the SFU. A thread holds 2 columns of each group of 8, so every
    thread takes the same path.

    Versions 17 and 18 measured it 25-37 % slower: ``floorf`` and the float-to-int conversion compile
    to FRND and F2I, which issue at the SFU's rate (16 per SM per clock on Hopper, like MUFU.EX2), so
    each exponential taken off the SFU put two conversions back on a pipe of the same speed.
    ``exp2_poly`` is the same idea without a conversion."""
    def exp2(x, column):
        return T.if_then_else(column // 8 % k == k - 1, exp2_on_fma(x), T.exp2(x))

    return exp2


# 2^f on [-1/2, 1/2]: the minimax polynomials of the relative error (fitted for this course by Lawson's
# iteration), lowest coefficient first. Degree 3 is FlashAttention-4's (its [0, 1) fit, with c0 = 1: 8.8e-5).
EXP2_POLY = {
    3: (0.999928072421268, 0.6932609861164496, 0.24261114098518233, 0.0551716753862813),  # 7.5e-5
    4: (0.9999992614381927, 0.6931218144762303, 0.2402474483130223,
        0.05591786245702471, 0.009570102621815874),  # 2.6e-6
}
# 2^23 + 2^7: x + this, for x in [-127, 128], lands in [2^23, 2^24), where the floats are the integers:
# the sum is x rounded to the nearest integer j, and its bit pattern ends in the 9 bits of 128 + j.
# (A power of two plus a little, so the C backend, which prints float constants with 7 digits, prints it exactly.)
_ROUNDER = 8388736.0


def exp2_poly(x, degree=3):
    """2^x with FP32 adds, multiplies and integer ops only: no SFU, no conversion instruction.

    FlashAttention-4's emulation (``flash_attn/cute``), written for TileLang: j = x rounded to the
    nearest integer by one add (``_ROUNDER``), 2^(x - j) by a polynomial on [-1/2, 1/2]
    (``EXP2_POLY``), and 2^j written into a float's exponent bits from the same sum's bit pattern, then
    one multiply. Degree 3 is 11 instructions on sm_90a (FSETP, 2 FSEL, 3 FADD, 3 FFMA, LEA, FMUL), all at
    the FP32/ALU rates (8× the SFU's); each degree more is one FFMA. For x ≤ 127; x ≤ -127 (a masked
    score's -inf included) gives exactly 0, through 2^j = 0 at j = -127; a NaN stays NaN. Results below
    2^-125 are flushed or approximate, as the SFU's own ``ex2.approx.ftz`` flushes them.

    Degree 3's relative error, 7.5e-5, is far below a 16-bit P's rounding, but it reaches the LSE
    unrounded: a row with one key (or an LSE near 0) is off by up to 7.5e-5, outside float32's tolerance
    (1e-5 + 1e-4·|LSE|), and the course's check rejects it. Degree 4 (2.6e-6) passes.
    """
    # A select, not T.max: fmaxf drops a NaN, and a NaN score must make its row NaN, as in PyTorch.
    clamped = T.if_then_else(x < -127.0, T.float32(-127.0), x)
    rounded = T.reinterpret(clamped + _ROUNDER, "uint32")
    # Through the bit pattern, so that TVM's simplifier does not fold (x + c) - c back into x.
    whole = T.reinterpret(rounded, "float32") - _ROUNDER
    frac = clamped - whole
    coefficients = EXP2_POLY[degree]
    poly = coefficients[-1]
    for c in reversed(coefficients[:-1]):  # Horner: one FFMA per degree
        poly = poly * frac + c
    # The low 9 bits of ``rounded`` are 128 + j: shifted into the exponent field they give the bits of
    # 2^(j + 1); minus one exponent step, 2^j (all zero bits, 0.0, at j = -127).
    power = T.reinterpret(T.shift_left(rounded, T.uint32(23)) - T.uint32(1 << 23), "float32")
    return poly * power


def exp2_poly_share(n, degree=3):
    """FlashAttention-4's split of the exponentials, by ``exp2_poly`` of ``degree``: ``n`` of every 16 groups of 8 score
    columns (spread evenly: the groups g with n·g mod 16 < n) on the FP32 units, the rest on the SFU.
    A thread holds 2 columns of each group of 8 (the wgmma accumulator's layout), so every thread of a
    warp takes the same path, and the choice is a constant once the loop over a thread's scores is unrolled."""
    if not isinstance(n, int) or not 0 <= n <= 16:
        raise ValueError(f"n must be an int in [0, 16] (groups of 8 columns out of 16); got {n!r}")
    if degree not in EXP2_POLY:
        raise ValueError(f"degree must be one of {sorted(EXP2_POLY)}; got {degree!r}")

    def exp2(x, column):
        return T.if_then_else(column // 8 % 16 * n % 16 < n, exp2_poly(x, degree), T.exp2(x))

    return exp2


def exp2_nearly_free(x, column):
    """Not an exponential: max(1 + x·ln 2, 0), two instructions, off the SFU. The upper bound of what
    any cheaper exponential can gain (the output is wrong; it is timed, never checked)."""
    return T.max(x * 0.6931471805599453 + 1.0, 0.0)


@T.macro
def _row_parts(block_M):
    l_part = T.alloc_fragment([block_M, 8], ACCUM)  # row-sum partials
    return l_part


@T.macro
def _zero_row_parts(l_part):
    T.fill(l_part, 0)


@T.macro
def _add_row_parts(tb, S, alpha, l_part, l, block_M, block_N):
    # Column c of l_part sums the columns j ≡ c (mod 8): all held by one thread of the row's 4.
    for i, c in T.Parallel(block_M, 8):
        l_part[i, c] *= alpha[i]
        for k in T.unroll(block_N // 8):
            l_part[i, c] += S[i, k * 8 + c]


@T.macro
def _finish_row_parts(l_part, l):
    T.reduce_sum(l_part, l, dim=1)


# FlashAttention-3's finalize: each thread keeps its partial row sums ([block_M, 8]) and they are reduced
# across the 4 threads of a row once, before the epilogue, instead of after every key block.
DEFERRED_ROW_SUMS = dataclasses.make_dataclass("RowSums", ["tiles", "start", "add", "finish"], frozen=True)(
    _row_parts, _zero_row_parts, _add_row_parts, _finish_row_parts)


# TileLang 0.1.15 cannot lower cp.async + causal + 2 stages on sm_90 ("Downcast from tirx.Sub").
_CP_ASYNC_CAUSAL = dict(num_stages=1)

VERSIONS = [_forward(v) for v in (
    Version(1, "cp.async loads, no warp specialisation, exact exp2",
            "chapter 04's kernel as an Ampere GPU would run it", flash_fwd_kernel, dict(num_stages=2),
            dict(fast_math=False, pass_configs=_NO_TMA_NO_WS), when={"causal": _CP_ASYNC_CAUSAL}),
    Version(2, "+ fast exp2 (ex2.approx)", "the SFU's approximate exp2: one instruction per exponential",
            flash_fwd_kernel, dict(num_stages=2), dict(pass_configs=_NO_TMA_NO_WS), when={"causal": _CP_ASYNC_CAUSAL}),
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
            flash_fwd_hopper_kernel, dict(num_stages=2, **variant_pieces(rescale_threshold=8.0)), kept=False, base=5,
            name=ROTATED_VARIANT),
    Version(9, "  (with light query blocks first)", "the launch order the causal kernel does not use",
            flash_fwd_hopper_kernel, dict(num_stages=2, **variant_pieces(heavy_first=False)), kept=False, base=5,
            causal_only=True, name=ROTATED_VARIANT),
    Version(10, "  (rotated loop, 3 warpgroups, 192 × 128)", "three consumer warpgroups share each K/V tile",
            flash_fwd_hopper_kernel, dict(num_stages=2, block_M=192, threads=384), kept=False, base=5, dims=(64,)),
    Version(11, "+ persistent blocks, peeled loop, folded tile order",
            "next tile's loads under this tile's epilogue; no idle matmul; balanced causal work",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2)),
    Version(12, "  (persistent, query blocks in index order)", "the order without the causal triangle folded",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, order=unfolded_order), kept=False, base=11,
            causal_only=True, name=PERSISTENT_VARIANT),
    Version(13, "  (persistent, with ping-pong)", "consumer warpgroups take turns issuing their matmuls",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, pingpong=True), kept=False, base=11),
    Version(14, "  (persistent, row sums reduced once)", "FlashAttention-3: no cross-thread row sum per key block",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, row_sums=DEFERRED_ROW_SUMS), kept=False, base=11,
            name=PERSISTENT_VARIANT),
    Version(15, "  (persistent, 3 warpgroups, 192 × 128)", "FlashAttention-3's tiling at D = 64",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, block_M=192, threads=384), kept=False, base=11,
            dims=(64,)),
    Version(16, "  (persistent, 3 warpgroups, 192 × 128, ping-pong)", "three warpgroups taking turns",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, block_M=192, threads=384, pingpong=True),
            kept=False, base=11, dims=(64,)),
    Version(17, "  (persistent, 3 warpgroups, 1 in 4 exp2 on the FMA units)",
            "FlashAttention-4: part of the exponentials by a cubic, off the SFU",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, block_M=192, threads=384, exp2=exp2_on_fma_every(4)),
            kept=False, base=15, dims=(64,), name=PERSISTENT_VARIANT),
    Version(18, "  (persistent, 1 in 4 exp2 on the FMA units)", "the same split with two warpgroups",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, exp2=exp2_on_fma_every(4)), kept=False, base=11,
            name=PERSISTENT_VARIANT),
    Version(19, "  (persistent, 3 warpgroups, ping-pong, 2 in 16 exp2 by a polynomial)",
            "FlashAttention-4's split without conversions: rint by an add, 2^j into the exponent bits",
            flash_fwd_hopper_persistent_kernel,
            dict(num_stages=2, block_M=192, threads=384, pingpong=True, exp2=exp2_poly_share(2, degree=4)),
            kept=False, base=16, dims=(64,), name=PERSISTENT_VARIANT),
    Version(20, "  (persistent, ping-pong, 2 in 16 exp2 by a polynomial)", "the same split at D = 128",
            flash_fwd_hopper_persistent_kernel, dict(num_stages=2, pingpong=True, exp2=exp2_poly_share(2, degree=4)),
            kept=False, base=13, dims=(128,), name=PERSISTENT_VARIANT),
    Version(21, "+ one warpgroup per block, its own TMA loads, 3 blocks per SM",
            "cuDNN's tiling at D = 64: no producer warpgroup, so three blocks' softmaxes and matmuls share an SM",
            flash_fwd_hopper_one_warpgroup_kernel, dict(block_M=64, threads=128, num_stages=2, blocks_per_sm=3),
            dims=(64,)),
)]


def versions_for(causal, dim=None):
    """The versions the ablation times for a causal or non-causal problem (at head dimension ``dim``)."""
    return _versions_for(VERSIONS, causal, dim)
