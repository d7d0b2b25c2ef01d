"""The FP8 forward (chapter 12), emulated on TileLang's C backend: FP8 values kept in float32 tiles.

Q, K and V arrive already quantised to e4m3 (``api.fp8`` is the producer step): every value is an
e4m3 number stored in a float32, with one descale per block of ``block_M`` query rows, per block of
``block_N`` keys, and per (batch, K/V head) for V. The kernel is chapter 03's loop with three changes,
as FlashAttention-3 does it in FP8:

- the descales of the Q block and of the K tile multiply ``sm_scale · log2(e)``: one constant per tile,
  folded into the exponent, so the scores are never rescaled on their own;
- P (at most 1 after the running max) is multiplied by the fixed ``P_SCALE`` and rounded to e4m3
  before ``P V``, the FP8 operand the tensor cores would take; the row sums ℓ come from P before
  rounding, as in FlashAttention-3;
- the epilogue multiplies by V's descale and divides by ``P_SCALE · ℓ``.

The C backend has no FP8 arithmetic: ``round_to_e4m3`` rounds a float32 to the nearest e4m3 value
(ties to even, as a hardware conversion does) and the products run in float32, which holds the product
of two e4m3 numbers exactly. The matmuls' float32 accumulation is what the tensor cores do too.

For ``target="cuda"`` the same source declares its tiles ``float8_e4m3fn``: the two ``T.gemm`` calls become FP8
``wgmma`` for sm_90a, P is converted by its store into an FP8 register tile, and V arrives transposed (``[B, H_kv, D,
S_k]``, keys contiguous), because FP8 ``wgmma`` reads only K-major operands, with its keys in ``wgmma_key_slot`` order
within each group of 16, the order of P's columns in registers. On Hopper ``api.fp8`` runs the tile step in
chapter 07's persistent kernel (``flash_fwd_fp8_persistent``; chapter 12, section 8: checked, timed on an H200).
"""

import math

import tilelang.language as T

from .flash_pieces import LOG2E, NEG_INF, key_block_range, mask_scores, prelude, visible
from .tiles import TileBackend, Tiling

__all__ = ["flash_fwd_fp8_kernel", "flash_fwd_fp8_hopper_kernel", "round_to_e4m3", "fp8_tile_step", "fp8_scores",
           "fp8_softmax", "fp8_softmax_scaled", "E4M3_MAX", "wgmma_key_slot", "WGMMA_KEY_GROUP",
           "P_SCALE", "FP8_DTYPE", "FP8_TILING", "FP8_HOPPER_TILING"]

E4M3_MAX = 448.0  # the largest finite e4m3 value (the "fn" variant: no infinities)
# P ≤ 1 is multiplied by this before rounding: a power of two (its descale is exact) that puts P = 1 at
# e4m3's exponent 8, so probabilities down to 2⁻¹⁴ keep full precision instead of falling into subnormals.
P_SCALE = 256.0
P_SCALE_LOG2 = math.log2(P_SCALE)  # the Hopper kernel folds P_SCALE into the exponent
# torch.float8_e4m3fn's name in TVM ("float8_e4m3" is another DLPack type code, 8 against torch's 10)
FP8_DTYPE = "float8_e4m3fn"
_E4M3_MIN_EXPONENT = -6  # the smallest normal e4m3 number is 2⁻⁶; below it the spacing stays 2⁻⁹
_E4M3_MANTISSA_BITS = 3


def round_to_e4m3(x):
    """The e4m3 value nearest to ``x ≥ 0`` (ties to even), as a float32 TileLang expression, saturating at 448.

    The spacing of e4m3 numbers in [2ᵉ, 2ᵉ⁺¹) is 2ᵉ⁻³ (three mantissa bits), and subnormals keep the spacing of
    the smallest binade. ``nearbyint`` rounds ties to even under the default rounding mode (``round`` would
    round them away from zero, unlike a hardware conversion).
    """
    exponent = T.max(T.floor(T.log2(x)), T.float32(_E4M3_MIN_EXPONENT))
    step = T.exp2(exponent - _E4M3_MANTISSA_BITS)
    return T.min(T.nearbyint(x / step) * step, T.float32(E4M3_MAX))


WGMMA_KEY_GROUP = 16  # the slots permute keys within groups of 16: V's padding (V_KEY_ALIGN) keeps whole groups


def wgmma_key_slot(j):
    """The column of the FP8 P tile, and the key position of the V tile, that hold key ``j`` of a score tile.

    FP8 ``wgmma`` takes P from registers in the layout of its A operand: in each group of 16 columns, the thread
    ``t`` of a quad holds columns 4t .. 4t+3. The score accumulator gives that thread columns 2t, 2t+1, 8+2t and
    9+2t instead, so copying S into P in key order would move bytes between threads (TileLang refuses: "Layout
    infer conflict"). P V sums over keys, and any order of the keys gives the same sum if P's columns and V's keys
    follow it: so column j goes to the slot its thread already owns, and the producer step writes V's keys in the
    same order. FlashAttention-3 permutes P's registers instead (its paper, section 3.3). Works on ints, integer
    tensors and TileLang expressions alike."""
    group, j16 = j // WGMMA_KEY_GROUP * WGMMA_KEY_GROUP, j % WGMMA_KEY_GROUP
    return group + (j16 % 8) // 2 * 4 + j16 // 8 * 2 + j16 % 2


def fp8_scores(tb, p, block_M, block_N):
    """A ``T.macro`` scaling a tile of raw FP8 scores into exp2 units, masked: ``scores(S, exponent_scale, qb, kb)``.

    ``exponent_scale`` is the Q block's and the K tile's descales times sm_scale · log2(e): one multiply per
    score, as without FP8."""

    @T.macro
    def scores(S, exponent_scale, qb, kb):
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.if_then_else(visible(p, qb * block_M + i, kb * block_N + j), S[i, j] * exponent_scale,
                                     NEG_INF)

    return scores


def fp8_softmax(tb, block_M, block_N):
    """A ``T.macro`` folding a tile of scaled scores into the running max and ℓ: ``softmax(S, m, m_prev, alpha, l,
    row_sum)`` leaves P (before its rounding) in ``S`` and the accumulator's rescale factor in ``alpha``.

    m is carried in exp2 units of the real scores, not of the raw ones: the next tile's descales differ from this
    one's. ℓ sums P before it is rounded, as FlashAttention-3 does."""

    @T.macro
    def softmax(S, m, m_prev, alpha, l, row_sum):
        T.copy(m, m_prev)
        T.reduce_max(S, m, dim=1, clear=False)
        for i in tb.parallel(block_M):
            alpha[i] = T.if_then_else(m[i] == NEG_INF, 1, T.exp2(m_prev[i] - m[i]))
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.if_then_else(m[i] == NEG_INF, 0, T.exp2(S[i, j] - m[i]))
        T.reduce_sum(S, row_sum, dim=1)
        for i in tb.parallel(block_M):
            l[i] = l[i] * alpha[i] + row_sum[i]

    return softmax


def fp8_softmax_scaled(block_M, block_N, exp2=None):
    """``fp8_softmax`` for the Hopper kernel, in fewer instructions per score: ``softmax(S, exponent_scale, m, m_prev,
    alpha, shift, l, row_max, row_sum)`` on raw scores ``S`` leaves P · P_SCALE in ``S`` and ℓ · P_SCALE in ``l``.

    The same arithmetic up to the rounding of one step: the descales multiply the row max (a positive factor keeps
    the max where it was), then ``exp2(S · scale − shift)`` is one fused multiply-add per score, with P_SCALE
    folded into the shift (``m − 8``), so P needs no multiply before its rounding. ℓ sums P · P_SCALE, exactly
    P_SCALE times ℓ (a power of two); the epilogue divides by it alone. ``exp2(x, column)``: the exponential of
    score column ``column`` (None: ``T.exp2``, the SFU's), as ``online_softmax`` takes it."""
    exponential = exp2 or (lambda x, column: T.exp2(x))

    @T.macro
    def softmax(S, exponent_scale, m, m_prev, alpha, shift, l, row_max, row_sum):
        T.copy(m, m_prev)
        T.reduce_max(S, row_max, dim=1)
        for i in T.Parallel(block_M):
            m[i] = T.max(m_prev[i], row_max[i] * exponent_scale)
            alpha[i] = T.if_then_else(m[i] == NEG_INF, 1, T.exp2(m_prev[i] - m[i]))
            shift[i] = T.if_then_else(m[i] == NEG_INF, 0, m[i] - P_SCALE_LOG2)  # masked scores stay -inf: P = 0
        for i, j in T.Parallel(block_M, block_N):
            S[i, j] = exponential(S[i, j] * exponent_scale - shift[i], j)
        T.reduce_sum(S, row_sum, dim=1)
        for i in T.Parallel(block_M):
            l[i] = l[i] * alpha[i] + row_sum[i]

    return softmax


def fp8_tile_step(tb, p, block_M, block_N):
    """The key-tile step of the FP8 forward as a ``T.macro``: scores, descales folded into the exponent,
    the online softmax in exp2 units, P rounded to e4m3 at ``P_SCALE``, then ``acc_o += P V``."""

    scores, softmax = fp8_scores(tb, p, block_M, block_N), fp8_softmax(tb, block_M, block_N)

    @T.macro
    def tile_step(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, alpha, l, row_sum, q_descale, k_descale, qb, kb):
        # region: scores
        T.clear(S)
        T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        scores(S, q_descale * k_descale * p.scale_log2, qb, kb)
        # endregion
        # region: softmax
        softmax(S, m, m_prev, alpha, l, row_sum)
        # endregion
        # region: quantise P
        if tb.on_gpu:  # the store into the FP8 tile converts (round to nearest even, saturating)
            for i, j in tb.parallel(block_M, block_N):
                P[i, wgmma_key_slot(j)] = S[i, j] * P_SCALE
        else:
            for i, j in tb.parallel(block_M, block_N):
                P[i, j] = round_to_e4m3(S[i, j] * P_SCALE)
        # endregion
        for i, j in tb.parallel(block_M, acc_o.shape[1]):
            acc_o[i, j] *= alpha[i]
        # On the GPU V_s holds a tile of Vᵀ [D, keys], keys in wgmma_key_slot order: FP8 wgmma reads B K-major only.
        T.gemm(P, V_s, acc_o, transpose_B=tb.on_gpu, policy=T.GemmWarpPolicy.FullRow)

    return tile_step


FP8_TILING = Tiling(16, 16, 1, 256)  # flash_fwd_fp8_kernel's default: 16 × 16 tiles, one stage
FP8_HOPPER_TILING = Tiling(128, 128, 2, 256)  # flash_fwd_fp8_hopper_kernel's: two consumer warpgroups, two stages


def flash_fwd_fp8_kernel(batch, heads, seq_q, seq_k, dim, *, heads_kv=None, causal=False, sm_scale=None, v_keys=None,
                         target="c", tiling=FP8_TILING, out_dtype="float32"):
    """A ``@T.prim_func`` (Q, K, V, Q_descale, K_descale, V_descale) -> (O, LSE) on e4m3 values: float32 tiles
    holding them on the C backend, ``float8_e4m3fn`` tiles on CUDA.

    Q [B, H, S_q, D], K [B, H_kv, S_k, D], V [B, H_kv, S_k, D] on the C backend and Vᵀ [B, H_kv, D, v_keys] on CUDA,
    keys in ``wgmma_key_slot`` order (``v_keys`` ≥ S_k, default S_k: the producer pads the keys to a multiple of 16,
    so that TMA finds each row of Vᵀ 16-byte aligned and the slots permute whole groups);
    Q_descale [B, H, ⌈S_q/block_M⌉], K_descale [B, H_kv, ⌈S_k/block_N⌉], V_descale [B, H_kv]: a quantised value
    times its descale is the input it stands for. O is ``out_dtype`` (float32 on the C backend; on CUDA the inputs'
    16-bit type, rounded once from the float32 accumulator, as a cast afterwards would); the LSE is the natural log
    of the row's denominator of the scaled scores, as ``flash_attention``'s. ``tiling``: a ``Tiling``.
    """
    block_M, block_N, num_stages, threads = tiling
    tb = TileBackend(target)
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, sm_scale=sm_scale)
    f32 = "float32"
    fp8 = FP8_DTYPE if tb.on_gpu else f32  # the C backend keeps e4m3 values in float32
    v_shape = [batch, p.heads_kv, dim, v_keys or seq_k] if tb.on_gpu else [batch, p.heads_kv, seq_k, dim]
    q_blocks, k_blocks = p.blocks(seq_q, block_M), p.blocks(seq_k, block_N)
    tile_step = fp8_tile_step(tb, p, block_M, block_N)

    # region: launch
    @T.prim_func
    def flash_fwd_fp8(Q: T.Tensor([batch, heads, seq_q, dim], fp8), K: T.Tensor([batch, p.heads_kv, seq_k, dim], fp8),
                      V: T.Tensor(v_shape, fp8),
                      Q_descale: T.Tensor([batch, heads, q_blocks], f32),
                      K_descale: T.Tensor([batch, p.heads_kv, k_blocks], f32),
                      V_descale: T.Tensor([batch, p.heads_kv], f32),
                      O: T.Tensor([batch, heads, seq_q, dim], out_dtype),
                      LSE: T.Tensor([batch, heads, seq_q], f32)):
        with tb.kernel(q_blocks, heads, batch, threads=threads) as (qb, h, b):
            # endregion
            Q_s, K_s = tb.shared([block_M, dim], fp8), tb.shared([block_N, dim], fp8)
            V_s = tb.shared([dim, block_N] if tb.on_gpu else [block_N, dim], fp8)
            S, P = tb.fragment([block_M, block_N], f32), tb.fragment([block_M, block_N], fp8)
            acc_o = tb.fragment([block_M, dim], f32)
            m, m_prev, alpha, l, row_sum, lse = (tb.fragment([block_M], f32) for _ in range(6))
            kv_head = h // p.group
            T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, NEG_INF)
            k_start, k_end = key_block_range(p, qb, block_M, block_N)
            for kb in T.Pipelined(k_start, k_end, num_stages=num_stages):
                T.copy(K[b, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
                if tb.on_gpu:
                    T.copy(V[b, kv_head, :, kb * block_N:(kb + 1) * block_N], V_s)
                else:
                    T.copy(V[b, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
                tile_step(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, alpha, l, row_sum, Q_descale[b, h, qb],
                          K_descale[b, kv_head, kb], qb, kb)
            # region: epilogue
            # V's descale and P's fixed scale are undone once, with the division by ℓ.
            for i in tb.parallel(block_M):
                lse[i] = T.if_then_else(l[i] == 0, NEG_INF, (m[i] + T.log2(l[i])) / LOG2E)
            for i, j in tb.parallel(block_M, dim):
                acc_o[i, j] = T.if_then_else(l[i] == 0, 0, acc_o[i, j] * V_descale[b, kv_head] / (P_SCALE * l[i]))
            # endregion
            T.copy(acc_o, O[b, h, qb * block_M:(qb + 1) * block_M, :])
            T.copy(lse, LSE[b, h, qb * block_M:(qb + 1) * block_M])

    return flash_fwd_fp8


def flash_fwd_fp8_hopper_kernel(batch, heads, seq_q, seq_k, dim, *, heads_kv=None, causal=False, sm_scale=None,
                                v_keys=None, tiling=FP8_HOPPER_TILING, out_dtype="float32"):
    """The FP8 forward on chapter 07's rotated loop, for sm_90a: what ``flash_attention_fp8`` ran on Hopper before
    ``flash_fwd_fp8_persistent_kernel`` (its ``loop="rotated"``; chapter 12's record times it beside that one).

    Arguments and results as ``flash_fwd_fp8_kernel(..., target="cuda")`` (Vᵀ in, keys padded to ``v_keys``). The
    arithmetic is the tile step's up to one rounding per score (``fp8_softmax_scaled``, masks on boundary tiles
    only), within what the emulation's slack allows; the schedule is chapter 07's: iteration
    ``kb`` issues Q Kᵀ of key block ``kb`` and P V of block ``kb − 1`` as two asynchronous wgmma batches, then
    computes the softmax of block ``kb`` while P V still runs. P stays in registers, its columns in
    ``wgmma_key_slot`` order (V's keys arrive in the same order), so each warpgroup's P V needs no barrier.
    """
    block_M, block_N, num_stages, threads = tiling
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, sm_scale=sm_scale)
    f32, fp8 = "float32", FP8_DTYPE
    q_blocks, k_blocks = p.blocks(seq_q, block_M), p.blocks(seq_k, block_N)
    tb = TileBackend("cuda")
    softmax = fp8_softmax_scaled(block_M, block_N)

    @T.prim_func
    def flash_fwd_fp8_hopper(Q: T.Tensor([batch, heads, seq_q, dim], fp8),
                             K: T.Tensor([batch, p.heads_kv, seq_k, dim], fp8),
                             V: T.Tensor([batch, p.heads_kv, dim, v_keys or seq_k], fp8),
                             Q_descale: T.Tensor([batch, heads, q_blocks], f32),
                             K_descale: T.Tensor([batch, p.heads_kv, k_blocks], f32),
                             V_descale: T.Tensor([batch, p.heads_kv], f32),
                             O: T.Tensor([batch, heads, seq_q, dim], out_dtype),
                             LSE: T.Tensor([batch, heads, seq_q], f32)):
        with T.Kernel(q_blocks, heads, batch, threads=threads) as (qb, h, b):
            Q_s, K_s = T.alloc_shared([block_M, dim], fp8), T.alloc_shared([block_N, dim], fp8)
            V_s, P = T.alloc_shared([dim, block_N], fp8), T.alloc_fragment([block_M, block_N], fp8)
            S, acc_o = T.alloc_fragment([block_M, block_N], f32), T.alloc_fragment([block_M, dim], f32)
            m, m_prev, alpha, shift, l, row_max, row_sum, lse = (T.alloc_fragment([block_M], f32) for _ in range(8))
            stage_in_use = T.alloc_local([1], f32)
            kv_head = h // p.group
            T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, NEG_INF)
            T.fill(P, 0)  # the first iteration's P V adds nothing
            k_start, k_end = key_block_range(p, qb, block_M, block_N)
            # region: rotated loop
            for kb in T.Pipelined(k_start, k_end + 1, num_stages=num_stages):
                k_blk = T.max(T.min(kb, k_end - 1), 0)
                v_blk = T.max(kb - 1, k_start)
                T.copy(K[b, kv_head, k_blk * block_N:(k_blk + 1) * block_N, :], K_s)
                T.copy(V[b, kv_head, :, v_blk * block_N:(v_blk + 1) * block_N], V_s)
                # Both issued every iteration: ptxas serialises wgmma batches issued under a condition (chapter 07).
                T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                T.wgmma_gemm(P, V_s, acc_o, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(1)  # the scores are ready; P V may still be running
                if kb < k_end:
                    mask_scores(tb, p, S, qb, kb, block_M, block_N)  # only the tiles on a boundary
                    softmax(S, Q_descale[b, h, qb] * K_descale[b, kv_head, k_blk] * p.scale_log2, m, m_prev, alpha,
                            shift, l, row_max, row_sum)
                    T.wait_wgmma(0)  # P V of the previous block is in acc_o and no longer reads P
                    for i, j in T.Parallel(block_M, dim):
                        acc_o[i, j] *= alpha[i]
                    for i, j in T.Parallel(block_M, block_N):
                        P[i, wgmma_key_slot(j)] = S[i, j]  # S holds P · P_SCALE
                else:
                    T.wait_wgmma(0)
                # Read both stage buffers after the last wait, so that they are released only once read.
                stage_in_use[0] = T.Cast(f32, K_s[0, 0]) + T.Cast(f32, V_s[0, 0])
            # endregion
            # l holds ℓ · P_SCALE (fp8_softmax_scaled)
            for i in T.Parallel(block_M):
                lse[i] = T.if_then_else(l[i] == 0, NEG_INF, (m[i] + T.log2(l[i]) - P_SCALE_LOG2) / LOG2E)
            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] = T.if_then_else(l[i] == 0, 0, acc_o[i, j] * V_descale[b, kv_head] / l[i])
            T.copy(acc_o, O[b, h, qb * block_M:(qb + 1) * block_M, :])
            T.copy(lse, LSE[b, h, qb * block_M:(qb + 1) * block_M])

    return flash_fwd_fp8_hopper
