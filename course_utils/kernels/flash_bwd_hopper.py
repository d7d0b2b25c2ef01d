"""The Hopper backward of chapter 08: FlashAttention-3's schedule, with asynchronous wgmma.

Same mathematics, inputs and outputs as chapter 05's ``flash_bwd_kernel`` (GQA, causal, sliding
window, ragged lengths, S_q ≠ S_k; sinks and the LSE's gradient enter through Δ), for sm_90 GPUs
only. One thread block owns ``block_N`` keys of one (batch, query head) and walks over the query
blocks that see them; its two consumer warpgroups each own half of the keys. Per query block:

    Sᵀ = K Qᵀ, dPᵀ = V dOᵀ          issued together; the exponentials start when Sᵀ is done
    dSᵀ = Pᵀ ∘ (dPᵀ − Δ)            formed in registers, stored to shared memory (dQ needs dS by rows)
    dV += Pᵀ dO, dQ = dS K, dK += dSᵀ Q    issued together; dQ goes to shared memory while dK runs
    dQ_acc += dQ                     one bulk reduce-add by the copy engine (cp.reduce.async.bulk)

``T.wgmma_gemm`` issues a batch of wgmmas without waiting; ``T.wait_wgmma(n)`` waits until at
most ``n`` batches are in flight. TileLang adds the producer warpgroup that streams Q, dO, LSE
and Δ with TMA, two stages deep. The kernel places its own two barriers per step (compile it
with ``PASS_CONFIGS``): with two dSᵀ buffers, TileLang's conservative four are not needed.

``deterministic=True`` builds the dK/dV half of the deterministic backward: no dQ, and one block
sums dK and dV over every query head of its GQA group, so nothing is added atomically.
``flash_bwd_hopper_dq_kernel`` is the other half: dQ with one block per query block, in a fixed
order. The variations chapter 08 measures and does not keep are in ``flash_bwd_hopper_versions``.

    python -m course_utils.check flash_bwd_hopper  # on an H100: check, then time against the peers
"""

from typing import NamedTuple

import tilelang
import tilelang.language as T

from .flash_pieces import (
    LOG2E,
    block_needs_mask,
    consumer_barrier,
    key_block_range,
    prelude,
    query_block_range,
    store_dkv,
    visible,
)
from .generated_code import register as register_generated_code_edit
from .hopper_pieces import keep_stages_until_read
from .tiles import TileBackend, Tiling

__all__ = ["flash_bwd_hopper_kernel", "BackwardPieces", "FA3_PIECES", "FA3_TILING", "flash_bwd_hopper_dq_kernel",
           "probabilities_t", "ds_t", "issue_dq", "needs_mask", "issue_scores", "probabilities_then_ds",
           "issue_dq_then_dk", "stage_dq", "store_dkdv_by_tma", "query_steps", "key_steps", "padded_rows",
           "wait_for_reduce_read", "consumer_barrier", "PASS_CONFIGS", "GEMMS", "WARP_POLICIES", "DQ_BY_ROWS",
           "gemm_policies", "DQ_TILING", "dq_split", "stage_dq_per_warpgroup", "reduce_dq_per_warpgroup"]

ACCUM = "float32"
_GPU = TileBackend("cuda")  # for the pieces chapter 05's kernel shares with this one
# The main kernel places its own barriers (consumer_barrier); TileLang must not add its conservative ones.
# Nor may it reuse shared memory: its reuse plan counts on the barriers it would have added. When the
# loop over query blocks has one iteration (a one-key window, or S_q ≤ block_M), TileLang unrolls it and
# puts dSᵀ over LSE/Δ and dQ's staging tile over K and V: one warpgroup's stores then overwrite what the
# other is still reading (wrong dQ and dK in some runs; docs/hopper_backward.md, commit 4f6f1a4).
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True,
                tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True}
register_generated_code_edit()  # defer_dq_wait: TileLang's own wait after the dQ reduce-add goes
# named barrier ids (TileLang's own syncs use 1-3, chapter 07's ping-pong 8-9)
_DS_BARRIER, _DQ_BARRIER, _EPILOGUE_BARRIER = 6, 5, 7
_DQ_WARPGROUP_BARRIERS = (10, 11)  # dq_per_warpgroup: one per consumer warpgroup, 128 threads each

# The five products of one step, in issue order, and how their two consumer warpgroups may split each one's
# output: "row" stacks the warpgroups along its rows (64 each), "col" puts them side by side along its columns,
# "square" lets TileLang pick by the output's aspect ratio (FlashAttention-3's AtomLayout* choices).
GEMMS = ("s", "dp", "dv", "dk", "dq")
WARP_POLICIES = {"row": T.GemmWarpPolicy.FullRow, "col": T.GemmWarpPolicy.FullCol, "square": T.GemmWarpPolicy.Square}
# Every product split by rows, dQ included (FlashAttention-3's AtomLayoutMdQ = 2): at D = 64 dQ is 128 × 64, which
# TileLang's square split puts side by side (128 × 32 each); the other products are split by key rows already, and
# no other split lowers (the registers of Pᵀ and dSᵀ feed dV and dK as they are).
DQ_BY_ROWS = ("row",) * len(GEMMS)


def gemm_policies(policies, swap_dq):
    """``{gemm: T.GemmWarpPolicy}`` for ``GEMMS``. ``policies``: None (the shipped split: Sᵀ, dPᵀ, dV and dK by
    key rows, as the registers of Pᵀ and dSᵀ feed dV and dK; dQ "square", or "row" when it is computed
    transposed) or a tuple of five names of ``WARP_POLICIES`` in ``GEMMS``' order."""
    shipped = ("row", "row", "row", "row", "row" if swap_dq else "square")
    if policies is None:
        policies = shipped
    if (not isinstance(policies, tuple) or len(policies) != len(GEMMS)
            or any(name not in WARP_POLICIES for name in policies)):
        raise ValueError(f"policies must be None or a tuple of {len(GEMMS)} names (for {', '.join(GEMMS)}) out of "
                         f"{sorted(WARP_POLICIES)}; got {policies!r}")
    return {gemm: WARP_POLICIES[name] for gemm, name in zip(GEMMS, policies)}


def needs_mask(p, qb, kb, block_M, block_N):
    """Whether tile (query block ``qb``, key block ``kb``) has a hidden pair or a row past the queries' end."""
    cond = block_needs_mask(p, qb, kb, block_M, block_N)
    if not isinstance(p.seq_q, int) or p.seq_q % block_M:  # a run-time length (packed) may be ragged
        cond = T.Or(cond, (qb + 1) * block_M > p.seq_q)
    return cond


def padded_rows(block_M):
    """Rows of the LSE and Δ stage buffers: a multiple of 32 floats, so that every stage starts on the
    128-byte boundary TMA needs (80 rows would put the second stage 320 bytes in)."""
    return -(-block_M // 32) * 32


def key_steps(p, qb, block_M, block_N):
    """``(first, end, offset)`` over the key blocks query block ``qb`` sees (see ``query_steps``)."""
    k_start, k_end = key_block_range(p, qb, block_M, block_N)
    return (0, k_end - k_start, k_start) if p.window_size == 1 else (k_start, k_end, 0)


def query_steps(p, kb, block_M, block_N):
    """``(first, end, offset)``: loop ``step`` over ``[first, end)``; the query block is ``offset + step``.

    A one-key window makes the range a single block, and TVM's bound analysis then rejects the
    loop (chapter 05); counting from 0 avoids that.

    Keys that no query sees still get one step, fully masked, which adds exactly 0 to every gradient: warp
    specialisation waits for K's and V's loads inside the first step, and the epilogue stages dK and dV over
    those tiles, so without a step the loads would land over the staged gradients (chunked prefill with a
    window got K's and V's values back as their gradients).
    """
    q_start, q_end = query_block_range(p, kb, block_M, block_N)
    q_end = T.max(q_end, q_start + 1)
    return (0, q_end - q_start, q_start) if p.window_size == 1 else (q_start, q_end, 0)


@T.macro
def wait_for_reduce_read():
    """Wait until the copy engine has read the shared tile of this thread's last bulk reduce-add (a thread that
    issued none passes at once). Placed before the barrier after which that tile is written again, with
    ``generated_code`` deleting TileLang's own wait right after the reduce-add."""
    T.tma_store_wait(0, True)


@T.macro
def probabilities_t(p, PT, lse, qb, kb, block_M, block_N, lse_scale=LOG2E, mask_when=needs_mask):
    """Pᵀ = exp2(Sᵀ · scale · log2e − LSE · log2e) in place; hidden pairs are 0 (selection after QKᵀ).

    The row of ``PT`` is a key, the column a query. Only tiles on a boundary pay for the mask
    (``mask_when``). ``lse_scale``: log2(e), or 1 when the LSE arrives already in base 2.
    """
    if mask_when(p, qb, kb, block_M, block_N):
        for j, i in T.Parallel(block_N, block_M):
            PT[j, i] = T.if_then_else(visible(p, qb * block_M + i, kb * block_N + j, guard_q=True),
                                      T.exp2(PT[j, i] * p.scale_log2 - lse[i] * lse_scale), 0)
    else:
        for j, i in T.Parallel(block_N, block_M):
            PT[j, i] = T.exp2(PT[j, i] * p.scale_log2 - lse[i] * lse_scale)


@T.macro
def ds_t(dST, PT, dPT, delta, block_M, block_N, GT=None):
    """dSᵀ = Pᵀ ∘ (dPᵀ − Δ), in the input dtype (the scale comes later). ``GT``: score_mod′ᵀ, the chain rule
    through chapter 11's score_mod, dSᵀ = Pᵀ ∘ (dPᵀ − Δ) ∘ score_mod′ᵀ (None: no score_mod)."""
    if GT is None:
        for j, i in T.Parallel(block_N, block_M):
            dST[j, i] = PT[j, i] * (dPT[j, i] - delta[i])
    else:
        for j, i in T.Parallel(block_N, block_M):
            dST[j, i] = PT[j, i] * (dPT[j, i] - delta[i]) * GT[j, i]


def _dq_policy(policy, swap_dq):
    if policy is not None:  # not ``policy or``: Square is 0
        return policy
    return gemm_policies(None, swap_dq)["dq"]


@T.macro
def issue_dq(K_s, dST, dq, swap_dq, policy=None):
    """Issue dQ = dS K (or dQᵀ = Kᵀ dSᵀ when ``swap_dq``: block_M rows that 64 does not divide).
    ``policy``: the warpgroups' split of dQ (None: by rows when transposed, else TileLang's square)."""
    if swap_dq:
        T.wgmma_gemm(K_s, dST, dq, transpose_A=True, policy=_dq_policy(policy, swap_dq), clear_accum=True)
    else:
        T.wgmma_gemm(dST, K_s, dq, transpose_A=True, policy=_dq_policy(policy, swap_dq), clear_accum=True)


@T.macro
def issue_scores(K_s, V_s, Q_s, dO_s, PT, dPT, s_policy=T.GemmWarpPolicy.FullRow, dp_policy=T.GemmWarpPolicy.FullRow):
    """Issue Sᵀ = K Qᵀ and dPᵀ = V dOᵀ together and wait for Sᵀ only (dPᵀ may still be running)."""
    T.wgmma_gemm(K_s, Q_s, PT, transpose_B=True, policy=s_policy, clear_accum=True)
    T.wgmma_gemm(V_s, dO_s, dPT, transpose_B=True, policy=dp_policy, clear_accum=True)
    T.wait_wgmma(1)  # Sᵀ is ready; dPᵀ may still be running


@T.macro
def issue_dq_then_dk(K_s, Q_s, dST, dST_cast, dq, dk, swap_dq, dq_policy=None, dk_policy=T.GemmWarpPolicy.FullRow):
    """The shipped ``issue`` step: dQ first, then dK += dSᵀ Q, and wait for dQ only (its store runs under dK)."""
    issue_dq(K_s, dST, dq, swap_dq, dq_policy)
    T.wgmma_gemm(dST_cast, Q_s, dk, policy=dk_policy)  # dK += dSᵀ Q
    T.wait_wgmma(1)  # dV and dQ are done; dK may still be running


@T.macro
def stage_dq(dq, dq_s, swap_dq, block_M, dim):
    """Put this step's dQ into shared memory by rows (transposed back when it was computed as dQᵀ)."""
    if swap_dq:
        for i, d in T.Parallel(block_M, dim):
            dq_s[i, d] = dq[d, i]
    else:
        T.copy(dq, dq_s)


def dq_split(policy, swap_dq, block_M, dim):
    """How ``dq_per_warpgroup`` cuts dQ's staging tile: ``"queries"`` (each consumer warpgroup holds half of the
    query rows of dQ, all of D) or ``"dim"`` (all query rows, half of D), read off the warp policy of the dQ
    product (``policy``) and whether it is computed transposed (``swap_dq``: its output is dQᵀ, D rows by
    ``block_M`` columns). FullRow stacks the two warpgroups along the output's rows, FullCol puts them side by
    side; Square is resolved only where it has one choice (64 output rows: a warpgroup's wgmma owns 64 rows, so
    the warpgroups split the columns). The half must be a whole number of rows and columns."""
    rows = dim if swap_dq else block_M
    if policy == T.GemmWarpPolicy.FullRow:
        by_output_rows = True
    elif policy == T.GemmWarpPolicy.FullCol or (policy == T.GemmWarpPolicy.Square and rows == 64):
        by_output_rows = False
    else:
        raise ValueError(f"dq_per_warpgroup needs dQ's warp policy 'row' or 'col' (so that each warpgroup holds "
                         f"one box of dQ); got {policy!r} for a {'transposed ' if swap_dq else ''}dQ of "
                         f"{block_M} rows × {dim}")
    split = "queries" if by_output_rows != swap_dq else "dim"
    half = block_M if split == "queries" else dim
    if half % 2 or (split == "queries" and not swap_dq and block_M // 2 % 64):
        raise ValueError(f"dq_per_warpgroup cannot cut dQ ({block_M} rows × {dim}) by {split} in two warpgroups")
    return split


@T.macro
def stage_dq_per_warpgroup(dq, dq_wg, swap_dq, split, block_M, dim):
    """Put this step's dQ into ``dq_wg`` = [2, box]: box ``w`` is the part of dQ warpgroup ``w``'s threads hold
    (``dq_split``), so every thread writes only its own warpgroup's box (transposed back when it was computed as
    dQᵀ)."""
    if split == "queries":
        half = block_M // 2
        if swap_dq:
            for i, d in T.Parallel(block_M, dim):
                dq_wg[i // half, i % half, d] = dq[d, i]
        else:
            for i, d in T.Parallel(block_M, dim):
                dq_wg[i // half, i % half, d] = dq[i, d]
    else:
        half = dim // 2
        if swap_dq:
            for i, d in T.Parallel(block_M, dim):
                dq_wg[d // half, i, d % half] = dq[d, i]
        else:
            for i, d in T.Parallel(block_M, dim):
                dq_wg[d // half, i, d % half] = dq[i, d]


@T.macro
def reduce_dq_per_warpgroup(dQ_acc, dq_wg, bz, head, qb, split, block_M, dim):
    """Each consumer warpgroup adds its own box of dQ (``dq_wg[w]``) into the accumulator's rows of query block
    ``qb``: its 128 threads meet on a barrier of their own (``_DQ_WARPGROUP_BARRIERS[w]``, after every
    writing thread's proxy fence), and one of them issues the copy engine's reduce-add of that box. The two
    warpgroups never meet for dQ."""
    T.fence_proxy_async()
    if T.get_thread_binding() < 128:
        T.call_extern("handle", "tl::__sync_thread_partial", _DQ_WARPGROUP_BARRIERS[0], 128)
        if split == "queries":
            T.atomic_add(dQ_acc[bz, head, qb * block_M:qb * block_M + block_M // 2, :], dq_wg[0, :, :],
                         use_tma=True)
        else:
            T.atomic_add(dQ_acc[bz, head, qb * block_M:(qb + 1) * block_M, 0:dim // 2], dq_wg[0, :, :],
                         use_tma=True)
    else:
        T.call_extern("handle", "tl::__sync_thread_partial", _DQ_WARPGROUP_BARRIERS[1], 128)
        if split == "queries":
            T.atomic_add(dQ_acc[bz, head, qb * block_M + block_M // 2:(qb + 1) * block_M, :], dq_wg[1, :, :],
                         use_tma=True)
        else:
            T.atomic_add(dQ_acc[bz, head, qb * block_M:(qb + 1) * block_M, dim // 2:dim], dq_wg[1, :, :],
                         use_tma=True)


@T.macro
def probabilities_then_ds(PT, PT_cast, dPT, dST_cast, dO_s, dv, delta, block_M, block_N, dv_under_ds,
                          dv_policy=T.GemmWarpPolicy.FullRow, ds_from_float32_p=False, GT=None):
    """After ``probabilities_t``: wait for dPᵀ, form dSᵀ and the 16-bit Pᵀ. ``dv_under_ds``: dV += Pᵀ dO is
    issued first, from the rounded Pᵀ, and dSᵀ formed while it runs (from that Pᵀ, or the float32 one with
    ``ds_from_float32_p``); else the caller issues dV later (FlashAttention-3's order). ``GT``: score_mod′ᵀ
    (``ds_t``)."""
    if dv_under_ds:
        T.copy(PT, PT_cast)
        T.wait_wgmma(0)
        T.wgmma_gemm(PT_cast, dO_s, dv, policy=dv_policy)
        ds_t(dST_cast, PT if ds_from_float32_p else PT_cast, dPT, delta, block_M, block_N, GT)
    else:
        T.wait_wgmma(0)
        ds_t(dST_cast, PT, dPT, delta, block_M, block_N, GT)
        T.copy(PT, PT_cast)


@T.macro
def store_dkdv_by_tma(p, dk, dv, dK_tile, dV_tile, K_s, V_s, block_N, dim):
    """Scale dK, then write dK and dV by the copy engine from the K and V tiles' shared memory
    (FlashAttention-3's epilogue): swizzled stmatrix stores and two TMA stores in place of every thread's
    scattered ones. ``dK_tile``, ``dV_tile``: this block's ``block_N`` rows of dK and dV. Only where one
    block owns these rows (no GQA accumulators; else ``store_dkv``)."""
    for j, d in T.Parallel(block_N, dim):
        dk[j, d] *= p.sm_scale
    consumer_barrier(_EPILOGUE_BARRIER)  # both warpgroups have finished reading K_s and V_s
    T.copy(dv, V_s)
    T.copy(dk, K_s)
    consumer_barrier(_EPILOGUE_BARRIER)  # every thread's part is in shared memory, visible to the copy engine
    T.copy(V_s, dV_tile)
    T.copy(K_s, dK_tile)


class BackwardPieces(NamedTuple):
    """The steps of ``flash_bwd_hopper_kernel`` that a config or chapter 08's ablation (``kernels/versions``)
    swaps; the defaults are FlashAttention-3's step, the kernel every ``BackwardConfig`` starts from.

    ``dv_under_ds`` (a ``BackwardConfig`` field, chapter 08's version 14): issue dV as soon as the 16-bit Pᵀ
    exists and form dSᵀ from that rounded Pᵀ while dV runs; off, dSᵀ first, so that the float32 Pᵀ dies
    before dV starts. ``ds_from_float32_p``: with ``dv_under_ds``, dSᵀ from the float32 Pᵀ.

    ``ds_buffers``: shared dSᵀ tiles (1 or 2); ``own_barriers``: the kernel's two barriers per step (compile
    with ``PASS_CONFIGS``; needs two dSᵀ buffers), False leaves them to TileLang.

    ``order(n_kb, bx)``: the key block of launch index ``bx``; ``mask_when(p, qb, kb, block_M, block_N)``:
    which tiles pay for the mask; ``lse_log2``: the LSE arrives already multiplied by log2(e).

    ``issue(K_s, Q_s, dST, dST_cast, dq, dk, swap_dq)``: issue dQ and dK and wait for dQ (None: dQ first, so
    its store runs under dK); ``reduce_dq(p, dQ_acc, dq, dq_s, bz, head, qb, block_M, dim, swap_dq)``: add dQ
    to the accumulator (None: one bulk reduce-add from shared memory by the copy engine).

    ``policies`` (a ``BackwardConfig`` field): how the two consumer warpgroups split each of the five products
    (``gemm_policies``); None is the split by key rows.

    ``dkdv_by_tma`` (a ``BackwardConfig`` field, chapter 08's versions 19 and 20): where one block owns its
    rows of dK and dV, write them through shared memory by TMA (``store_dkdv_by_tma``); off, or with GQA's
    float32 accumulators, from registers (``store_dkv``).

    ``longest_first`` (a ``BackwardConfig`` field, chapter 08's version 21, shipped at D = 128 with the causal
    mask): launch key block 0 of every head, then key block 1 of every head, and so on, instead of one head's
    key blocks after the other's; with the causal mask the first key blocks see the most query blocks, so the
    longest blocks start first and the last wave is of short ones (FlashAttention-3's LPT order).

    ``defer_dq_wait`` (a ``BackwardConfig`` field, chapter 08's version 22): the thread that issued dQ's
    reduce-add waits for the copy engine's read of the staging tile at the next step's dSᵀ barrier, not right
    after issuing it (``generated_code``).

    ``dq_per_warpgroup`` (a ``BackwardConfig`` field, off in every shipped config): each consumer warpgroup stages
    its own box of dQ (the part its threads hold, ``dq_split``) in a staging tile of its own, meets only its own
    128 threads on a named barrier of its own, and one of its threads issues the reduce-add of that box
    (``reduce_dq_per_warpgroup``); with ``defer_dq_wait`` that thread waits for the read at the next dSᵀ barrier.
    Off: both warpgroups stage the whole tile, meet at a 256-thread barrier, and one thread adds it.
    (FlashAttention-4's per-warpgroup dQ handoff, without its writer warp.)

    ``modifiers``: chapter 11's FlexAttention on this loop (``flash_flex_hopper_bwd.BlockMaskSteps``). The loop
    then walks the query blocks a block mask lists (``query_steps``, ``query_block``), recomputes Pᵀ with the
    score_mod and the mask_mod (``probabilities``, with score_mod′ᵀ in ``derivative_tile``, which ``ds_t``
    multiplies in), and the kernel takes the block mask's inputs (``launch``); None: chapter 08's masks.
    """

    dv_under_ds: bool = False
    ds_from_float32_p: bool = False
    ds_buffers: int = 2
    own_barriers: bool = True
    order: object = None
    mask_when: object = needs_mask
    lse_log2: bool = False
    issue: object = None
    reduce_dq: object = None
    policies: tuple | None = None
    dkdv_by_tma: bool = False
    longest_first: bool = False
    defer_dq_wait: bool = False
    modifiers: object = None
    dq_per_warpgroup: bool = False


FA3_PIECES = BackwardPieces()
FA3_TILING = Tiling(64, 128, 2, 256)  # 64 queries per step, 128 resident keys, two stages, two consumer warpgroups


def flash_bwd_hopper_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, sm_scale=None, dtype="float16",
    tiling=FA3_TILING, deterministic=False, pieces=FA3_PIECES,
):
    """Return a ``@T.prim_func`` with chapter 05's contract: dK, dV and the float32 dQ accumulator.

    ``(Q, K, V, dO, LSE, Δ, dQ_acc, dK, dV)``: dQ_acc must be zero on entry and receives Σ dS·K
    (multiply by ``sm_scale`` afterwards); with GQA dK and dV are float32 accumulators, zero on
    entry. ``tiling`` (a ``Tiling``): ``block_N`` keys per block, ``block_M`` queries per step: when
    ``block_M`` is not a multiple of 64 (FlashAttention-3's 80 at D = 128), the dQ product is computed
    transposed, dQᵀ = Kᵀ dSᵀ, since a warpgroup's wgmma owns 64 rows of its output. ``threads`` counts
    the consumer threads (two warpgroups); TileLang adds a producer warpgroup.

    ``deterministic=True``: ``(Q, K, V, dO, LSE, Δ, dK, dV)``, no dQ, dK and dV in the input dtype;
    the grid has one block per K/V head and the loop visits every query head of its group.

    ``pieces``: the steps a ``BackwardConfig`` or chapter 08's ablation swaps (``BackwardPieces``); with
    ``pieces.modifiers``, chapter 11's flex backward and its inputs (``flash_flex_hopper_bwd``).
    """
    block_M, block_N, num_stages, threads = tiling
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    # The pieces the step below reads, under the names its listing in chapter 08 shows.
    dv_under_ds, ds_from_float32_p, mask_when = pieces.dv_under_ds, pieces.ds_from_float32_p, pieces.mask_when
    ds_buffers, own_barriers, issue, reduce_dq = pieces.ds_buffers, pieces.own_barriers, pieces.issue, pieces.reduce_dq
    modifiers = pieces.modifiers
    if modifiers is not None and (deterministic or pieces.longest_first or pieces.order is not None):
        raise ValueError("a flex backward (pieces.modifiers) walks its block mask's query blocks in the launch "
                         "order: it takes neither deterministic, longest_first nor order")
    if own_barriers and ds_buffers != 2 and not deterministic:
        raise ValueError(f"own_barriers drops the barrier before the dSᵀ store: it needs ds_buffers=2; "
                         f"got ds_buffers={ds_buffers}")
    if pieces.defer_dq_wait and not (own_barriers and reduce_dq is None):
        raise ValueError("defer_dq_wait moves the dQ reduce's wait to the kernel's own dSᵀ barrier: it needs "
                         "own_barriers=True and the shipped reduce_dq")
    if pieces.dq_per_warpgroup and not (own_barriers and reduce_dq is None and tiling.threads == 256):
        raise ValueError("dq_per_warpgroup replaces the shipped reduce_dq's 256-thread barrier: it needs "
                         "own_barriers=True, the shipped reduce_dq and two consumer warpgroups (threads=256)")
    defer_dq_wait = pieces.defer_dq_wait and not deterministic  # no dQ to add
    dq_per_warpgroup = pieces.dq_per_warpgroup and not deterministic
    swap_dq = block_M % 64 != 0
    policy = gemm_policies(pieces.policies, swap_dq)
    stat_rows = padded_rows(block_M)
    group = p.group if deterministic else 1  # query heads visited by one block
    dkv_dtype = dtype if p.group == group else ACCUM
    dq_shape = [dim, block_M] if swap_dq else [block_M, dim]
    if dq_per_warpgroup:  # one staging box per consumer warpgroup
        dq_box_split = dq_split(policy["dq"], swap_dq, block_M, dim)
        dq_s_shape = [2, block_M // 2, dim] if dq_box_split == "queries" else [2, block_M, dim // 2]
    else:
        dq_s_shape = [block_M, dim]
    n_kb = p.blocks(seq_k, block_N)
    lse_scale = 1.0 if pieces.lse_log2 else LOG2E

    @T.macro
    def main_loop(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, bx, by, bz, block_mask=None):
        K_s = T.alloc_shared([block_N, dim], dtype)
        V_s = T.alloc_shared([block_N, dim], dtype)
        Q_s = T.alloc_shared([block_M, dim], dtype)
        dO_s = T.alloc_shared([block_M, dim], dtype)
        lse = T.alloc_shared([stat_rows], ACCUM)
        delta = T.alloc_shared([stat_rows], ACCUM)
        PT = T.alloc_fragment([block_N, block_M], ACCUM)  # Sᵀ, then Pᵀ: keys are rows
        dPT = T.alloc_fragment([block_N, block_M], ACCUM)
        PT_cast = T.alloc_fragment([block_N, block_M], dtype)
        dST_cast = T.alloc_fragment([block_N, block_M], dtype)
        dv = T.alloc_fragment([block_N, dim], ACCUM)
        dk = T.alloc_fragment([block_N, dim], ACCUM)
        stage_in_use = T.alloc_local([1], dtype)
        if not deterministic:
            dST_s = T.alloc_shared([ds_buffers, block_N, block_M], dtype)  # two: no barrier before the store
            dq = T.alloc_fragment(dq_shape, ACCUM)
            dq_s = T.alloc_shared(dq_s_shape, ACCUM)
        if modifiers is None:
            GT = None
        else:
            GT = modifiers.derivative_tile(block_N, block_M)  # score_mod′ᵀ (None without a score_mod)

        if pieces.order is None:
            kb = bx
        else:
            kb = pieces.order(n_kb, bx)
        if deterministic:
            kv_head = by
        else:
            kv_head = by // p.group
        T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
        T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
        T.clear(dv)
        T.clear(dk)
        if modifiers is None:
            first, end, offset = query_steps(p, kb, block_M, block_N)
        else:
            first, end, offset = modifiers.query_steps(block_mask, bz, by, kb)
        if group > 1:
            blocks = end - first
            end = first + group * blocks
        for step in T.Pipelined(first, end, num_stages=num_stages):
            if group > 1:  # deterministic GQA: every query head of the group, one after the other
                qb = offset + first + (step - first) % blocks
                head = kv_head * group + (step - first) // blocks
            elif modifiers is None:
                qb = offset + step
                head = by
            else:
                qb = modifiers.query_block(block_mask, bz, by, kb, step)
                head = by
            buf = step % ds_buffers  # the other buffer may still feed the other warpgroup
            T.copy(Q[bz, head, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.copy(dO[bz, head, qb * block_M:(qb + 1) * block_M, :], dO_s)
            T.copy(LSE[bz, head, qb * block_M:(qb + 1) * block_M], lse[0:block_M])
            T.copy(Delta[bz, head, qb * block_M:(qb + 1) * block_M], delta[0:block_M])
            # region: one step
            issue_scores(K_s, V_s, Q_s, dO_s, PT, dPT, policy["s"], policy["dp"])
            if modifiers is None:
                probabilities_t(p, PT, lse, qb, kb, block_M, block_N, lse_scale, mask_when)
            else:
                modifiers.probabilities(block_mask, PT, GT, lse, bz, head, qb, kb)
            probabilities_then_ds(PT, PT_cast, dPT, dST_cast, dO_s, dv, delta, block_M, block_N, dv_under_ds,
                                  policy["dv"], ds_from_float32_p, GT)
            if not deterministic:
                T.copy(dST_cast, dST_s[buf, :, :])
                if defer_dq_wait:  # the last step's dQ tile read: dq_s is written again after this barrier
                    wait_for_reduce_read()
                if own_barriers:
                    consumer_barrier(_DS_BARRIER)
            if not dv_under_ds:
                T.wgmma_gemm(PT_cast, dO_s, dv, policy=policy["dv"])  # dV += Pᵀ dO
            if deterministic:
                T.wgmma_gemm(dST_cast, Q_s, dk, policy=policy["dk"])  # dK += dSᵀ Q
            else:
                if issue is None:
                    issue_dq_then_dk(K_s, Q_s, dST_s[buf, :, :], dST_cast, dq, dk, swap_dq, policy["dq"], policy["dk"])
                else:
                    issue(K_s, Q_s, dST_s[buf, :, :], dST_cast, dq, dk, swap_dq)
                if dq_per_warpgroup:
                    stage_dq_per_warpgroup(dq, dq_s, swap_dq, dq_box_split, block_M, dim)
                    reduce_dq_per_warpgroup(dQ_acc, dq_s, bz, head, qb, dq_box_split, block_M, dim)
                elif reduce_dq is None:
                    stage_dq(dq, dq_s, swap_dq, block_M, dim)
                    if own_barriers:
                        consumer_barrier(_DQ_BARRIER)
                    T.atomic_add(dQ_acc[bz, head, qb * block_M:(qb + 1) * block_M, :], dq_s, use_tma=True)
                else:
                    reduce_dq(p, dQ_acc, dq, dq_s, bz, head, qb, block_M, dim, swap_dq)
            T.wait_wgmma(0)
            keep_stages_until_read(stage_in_use, Q_s, dO_s)
            # endregion
        if defer_dq_wait:  # the last reduce-add reads shared memory that must outlive it
            wait_for_reduce_read()

        # region: epilogue
        owned = dkv_dtype == dtype  # one block owns these rows of dK and dV (no GQA accumulators)
        if pieces.dkdv_by_tma and owned:
            rows = slice(kb * block_N, (kb + 1) * block_N)
            store_dkdv_by_tma(p, dk, dv, dK[bz, kv_head, rows, :], dV[bz, kv_head, rows, :], K_s, V_s, block_N, dim)
        else:
            store_dkv(_GPU, p, dk, dv, dK, dV, (bz, kv_head, kb), block_N, dim, owned=owned)
        # endregion

    grid = (n_kb, p.heads_kv if deterministic else heads, batch)
    q_shape, kv_shape = [batch, heads, seq_q, dim], [batch, p.heads_kv, seq_k, dim]
    if modifiers is not None:  # the flex kernel's inputs: the block mask's and the captured tensors
        return modifiers.launch(main_loop, grid, threads, dkv_dtype)

    if deterministic:
        @T.prim_func
        def flash_bwd_hopper_dkdv(
            Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
            dO: T.Tensor(q_shape, dtype), LSE: T.Tensor(q_shape[:3], ACCUM), Delta: T.Tensor(q_shape[:3], ACCUM),
            dK: T.Tensor(kv_shape, dtype), dV: T.Tensor(kv_shape, dtype),
        ):
            with T.Kernel(*grid, threads=threads) as (bx, by, bz):
                main_loop(Q, K, V, dO, LSE, Delta, None, dK, dV, bx, by, bz)

        return flash_bwd_hopper_dkdv

    @T.prim_func
    def flash_bwd_hopper(
        Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype), LSE: T.Tensor(q_shape[:3], ACCUM), Delta: T.Tensor(q_shape[:3], ACCUM),
        dQ_acc: T.Tensor(q_shape, ACCUM), dK: T.Tensor(kv_shape, dkv_dtype), dV: T.Tensor(kv_shape, dkv_dtype),
    ):
        if pieces.longest_first:  # one launch index over (key block, head), the key block outermost
            with T.Kernel(n_kb * heads, batch, threads=threads) as (bx, bz):
                main_loop(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, bx // heads, bx % heads, bz)
        else:
            with T.Kernel(*grid, threads=threads) as (bx, by, bz):
                main_loop(Q, K, V, dO, LSE, Delta, dQ_acc, dK, dV, bx, by, bz)

    return flash_bwd_hopper


DQ_TILING = Tiling(128, 128, 2, 256)  # flash_bwd_hopper_dq_kernel's default (attention.HOPPER_DQ_TILES per head dim)


def flash_bwd_hopper_dq_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, sm_scale=None, dtype="float16", tiling=DQ_TILING,
):
    """Return a ``@T.prim_func`` ``(Q, K, V, dO, LSE, Δ, dQ)``: dQ alone, one block per query block.

    The deterministic backward's other half. A block recomputes S and dP for its queries against
    every key block they see (as the forward does) and accumulates dQ = scale · Σ dS K in registers,
    always in the same order: nothing is added atomically, and dQ is written once, in the input dtype.
    ``tiling``: a ``Tiling`` (``block_M`` queries per block, ``block_N`` keys per step).
    """
    block_M, block_N, num_stages, threads = tiling
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    q_shape, kv_shape = [batch, heads, seq_q, dim], [batch, p.heads_kv, seq_k, dim]

    @T.prim_func
    def flash_bwd_hopper_dq(
        Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype), V: T.Tensor(kv_shape, dtype),
        dO: T.Tensor(q_shape, dtype), LSE: T.Tensor(q_shape[:3], ACCUM), Delta: T.Tensor(q_shape[:3], ACCUM),
        dQ: T.Tensor(q_shape, dtype),
    ):
        with T.Kernel(p.blocks(seq_q, block_M), heads, batch, threads=threads) as (bx, by, bz):
            Q_s = T.alloc_shared([block_M, dim], dtype)
            dO_s = T.alloc_shared([block_M, dim], dtype)
            K_s = T.alloc_shared([block_N, dim], dtype)
            V_s = T.alloc_shared([block_N, dim], dtype)
            S = T.alloc_fragment([block_M, block_N], ACCUM)
            dP = T.alloc_fragment([block_M, block_N], ACCUM)
            dS_cast = T.alloc_fragment([block_M, block_N], dtype)
            dq = T.alloc_fragment([block_M, dim], ACCUM)
            lse = T.alloc_fragment([block_M], ACCUM)
            delta = T.alloc_fragment([block_M], ACCUM)
            stage_in_use = T.alloc_local([1], dtype)

            qb = bx
            kv_head = by // p.group
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.copy(dO[bz, by, qb * block_M:(qb + 1) * block_M, :], dO_s)
            for i in T.Parallel(block_M):
                lse[i] = T.if_then_else(qb * block_M + i < seq_q, LSE[bz, by, qb * block_M + i] * LOG2E, 0)
                delta[i] = T.if_then_else(qb * block_M + i < seq_q, Delta[bz, by, qb * block_M + i], 0)
            T.clear(dq)
            first, end, offset = key_steps(p, qb, block_M, block_N)
            for step in T.Pipelined(first, end, num_stages=num_stages):
                kb = offset + step
                T.copy(K[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], K_s)
                T.copy(V[bz, kv_head, kb * block_N:(kb + 1) * block_N, :], V_s)
                T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                T.wgmma_gemm(dO_s, V_s, dP, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                T.wait_wgmma(1)
                if needs_mask(p, qb, kb, block_M, block_N):
                    for i, j in T.Parallel(block_M, block_N):
                        S[i, j] = T.if_then_else(visible(p, qb * block_M + i, kb * block_N + j, guard_q=True),
                                                 T.exp2(S[i, j] * p.scale_log2 - lse[i]), 0)
                else:
                    for i, j in T.Parallel(block_M, block_N):
                        S[i, j] = T.exp2(S[i, j] * p.scale_log2 - lse[i])
                T.wait_wgmma(0)
                for i, j in T.Parallel(block_M, block_N):
                    dS_cast[i, j] = S[i, j] * (dP[i, j] - delta[i])
                T.wgmma_gemm(dS_cast, K_s, dq, policy=T.GemmWarpPolicy.FullRow)  # dQ += dS K
                T.wait_wgmma(0)
                keep_stages_until_read(stage_in_use, K_s, V_s)
            for i, d in T.Parallel(block_M, dim):
                dq[i, d] *= p.sm_scale
            T.copy(dq, dQ[bz, by, qb * block_M:(qb + 1) * block_M, :])

    return flash_bwd_hopper_dq
