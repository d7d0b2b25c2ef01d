"""The Hopper forward of chapter 07: softmax overlapped with the tensor cores (FlashAttention-3's idea).

Same inputs, outputs and variants as ``flash_fwd_kernel`` (GQA, causal, sliding window, sinks,
natural-log LSE), for sm_90 GPUs only. What changes is the schedule of one thread block:

* the loop is *rotated*: iteration ``kb`` issues the scores of key block ``kb`` (QKᵀ) and the
  output update of key block ``kb - 1`` (P·V) as two asynchronous wgmma batches, then computes
  the softmax of block ``kb`` while P·V is still running on the tensor cores
  (``T.wgmma_gemm`` issues without waiting; ``T.wait_wgmma(n)`` waits until at most ``n``
  batches are in flight);
* with ``pingpong`` the two consumer warpgroups take turns issuing their matmuls, so one
  warpgroup's softmax runs while the other's matmuls use the tensor cores.

TileLang still adds the producer warpgroup that streams K and V with TMA (warp specialisation).
The variations chapter 07 measures and does not keep are in ``flash_fwd_hopper_versions``.

    python -m course_utils.check flash_fwd_hopper  # on an H100: check, then time against the peers
"""

from typing import NamedTuple

import tilelang.language as T

from .flash_pieces import (
    forward_epilogue,
    forward_tiles,
    init_running_max,
    key_block_range,
    mask_scores,
    online_softmax,
    prelude,
)
from .hopper_pieces import issue_matmuls, keep_stages_until_read, pass_turn, wait_for_turn
from .tiles import TileBackend, Tiling

__all__ = ["flash_fwd_hopper_kernel", "rotated_loop", "RotatedPieces", "ROTATED_PIECES", "ROTATED_TILING"]


@T.macro
def rotated_loop(tb, tiles, stage_in_use, K, V, bz, kv_head, k_start, k_end, key_block, score_step, block_M,
                 block_N, dim, scale_log2, num_stages, pingpong=False, issue=None, new_max=None, rescale_step=None,
                 rescale=None):
    """The key loop of a rotated Hopper forward: steps ``k_start … k_end − 1`` fold key block ``key_block(step)``
    into the output accumulator and the row statistics of ``tiles`` (``forward_tiles`` without ``O_s``); one more
    step finishes the last P·V.

    Two steps are the caller's: ``key_block(step)``, the key block a step reads (the dense kernel: the step itself;
    flex: the block mask's list), and ``score_step(S, kb)``, what happens to the raw scores of key block ``kb``
    between QKᵀ and the online softmax (the dense kernel: ``mask_scores``; flex: its score_mod and mask_mod).
    The loads clamp the step, to ``0 … k_end − 1`` for K and from ``k_start`` on for V, so that the TMA producer
    always loads a valid block: ``key_block`` must give one for 0 too, even when ``k_end ≤ k_start``.
    The other arguments are ``flash_fwd_hopper_kernel``'s.
    """
    Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l = tiles  # noqa: E741
    # region: rotated loop
    # One extra iteration: iteration kb computes QKᵀ of block kb and P·V of block kb - 1.
    for kb in T.Pipelined(k_start, k_end + 1, num_stages=num_stages):
        k_blk = key_block(T.max(T.min(kb, k_end - 1), 0))
        v_blk = key_block(T.max(kb - 1, k_start))
        T.copy(K[bz, kv_head, k_blk * block_N:(k_blk + 1) * block_N, :], K_s)
        T.copy(V[bz, kv_head, v_blk * block_N:(v_blk + 1) * block_N, :], V_s)
        # Both matmuls are issued in every iteration (P is 0 in the first, the scores of the last are
        # unused): ptxas serialises wgmma batches whose issue is conditional (chapter 07 shows it).
        if pingpong:
            wait_for_turn(kb, k_start)
        if issue is None:
            issue_matmuls(Q_s, K_s, V_s, S, P, acc_o)
        else:
            issue(Q_s, K_s, V_s, S, P, acc_o, kb, k_start, k_end)
        if pingpong:
            pass_turn()
        T.wait_wgmma(1)  # the scores are ready; P·V may still be running
        if kb < k_end:
            score_step(S, key_block(kb))
            online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, scale_log2, new_max=new_max)
            T.wait_wgmma(0)
            if rescale_step is None:
                for i, j in T.Parallel(block_M, dim):
                    acc_o[i, j] *= alpha[i]
            else:
                rescale_step.apply(acc_o, alpha, rescale, block_M, dim)
            T.copy(S, P)
        else:
            T.wait_wgmma(0)
        keep_stages_until_read(stage_in_use, K_s, V_s)
    # endregion


def _same_block(step):
    """The dense kernel's key loop reads key block ``step`` at step ``step``."""
    return step


class RotatedPieces(NamedTuple):
    """The rotated loop's switch and the steps chapter 07's ablation swaps (``kernels/versions``); the defaults are
    the shipped kernel, and None is the shipped step.

    ``pingpong`` (a ``ForwardConfig`` field): the two consumer warpgroups take turns issuing their matmuls
    (FlashAttention-3's inter-warpgroup schedule). ``order(p, bx, block_M)``: the query block of launch index ``bx``
    (shipped: heaviest first when masked); ``issue(Q_s, K_s, V_s, S, P, acc_o, kb, k_start, k_end)``: the two
    matmuls (shipped: ``issue_matmuls``, both every iteration); ``new_max``: ``online_softmax``'s running-max step;
    ``rescale_step``: the output accumulator's rescale (a piece with ``tiles()`` and ``apply(acc_o, alpha, tiles,
    block_M, dim)``; shipped: every element, every block).
    """

    pingpong: bool = False
    order: object = None
    issue: object = None
    new_max: object = None
    rescale_step: object = None


ROTATED_PIECES = RotatedPieces()
ROTATED_TILING = Tiling(128, 128, 2, 256)  # two consumer warpgroups of 64 query rows, 128 keys per step, 2 stages


def flash_fwd_hopper_kernel(
    batch, heads, seq_q, seq_k, dim, *,
    heads_kv=None, causal=False, window_size=None, has_sinks=False, sm_scale=None, dtype="float16",
    tiling=ROTATED_TILING, pieces=ROTATED_PIECES,
):
    """Return a ``@T.prim_func`` computing O and LSE; the problem's parameters as in ``flash_fwd_kernel``, its
    ``tiling`` a ``Tiling`` and its swapped steps a ``RotatedPieces``.

    ``tiling.threads`` counts the consumer threads (two warpgroups); TileLang adds a producer warpgroup.
    """
    block_M, block_N, num_stages, threads = tiling
    pingpong, order, issue, new_max, rescale_step = pieces
    tb = TileBackend("cuda")
    p = prelude(heads, seq_q, seq_k, dim, heads_kv=heads_kv, causal=causal, window_size=window_size,
                sm_scale=sm_scale)
    accum = "float32"

    @T.prim_func
    def flash_fwd_hopper(
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
            rescale = rescale_step.tiles() if rescale_step is not None else None

            if order is None:
                qb = (p.blocks(seq_q, block_M) - 1 - bx) if p.masked else bx  # heaviest query blocks first
            else:
                qb = order(p, bx, block_M)
            kv_head = by // p.group
            T.copy(Q[bz, by, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(P, 0)
            init_running_max(tb, p, m, Sinks, by, block_M, has_sinks)
            k_start, k_end = key_block_range(p, qb, block_M, block_N)

            rotated_loop(tb, (Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, row_sum, l), stage_in_use, K, V,
                         bz, kv_head, k_start, k_end, _same_block,
                         lambda S, kb: mask_scores(tb, p, S, qb, kb, block_M, block_N), block_M, block_N, dim,
                         p.scale_log2, num_stages, pingpong=pingpong, issue=issue, new_max=new_max,
                         rescale_step=rescale_step, rescale=rescale)

            forward_epilogue(tb, p, acc_o, l, m, shift, O_s, Output, LSE, Sinks, bz, by, qb, block_M, dim,
                             has_sinks)

    return flash_fwd_hopper
