"""Hopper pieces the sm_90 kernels share: asynchronous wgmma issue, the ping-pong turn between two
consumer warpgroups, and keeping TMA stage buffers alive until their wgmmas have read them.

Chapter 07's rotated forward introduced them; the Hopper backward (chapter 08), the packed forward
(chapter 09) and the ablation versions use them too.
"""

import tilelang.language as T

__all__ = ["issue_matmuls", "wait_for_turn", "pass_turn", "keep_stages_until_read"]


@T.macro
def issue_matmuls(Q_s, K_s, V_s, S, P, acc_o):
    """Issue S = Q Kᵀ of this key block and acc_o += P V of the previous one, without waiting."""
    T.wgmma_gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
    T.wgmma_gemm(P, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)


# Ping-pong passes the turn to issue matmuls between the two consumer warpgroups with named
# barriers 8 and 9. They are plain extern calls: TileLang's warp specialisation would move a
# T.sync_threads into the producer's branch.
@T.macro
def wait_for_turn(kb, k_start):
    """Block this warpgroup until the other one has issued its matmuls (warpgroup 0 goes first)."""
    warpgroup = T.get_thread_binding() // 128
    if kb == k_start and warpgroup == 1:
        T.call_extern("handle", "tl::__named_barrier_arrive", 8, 256)
    T.call_extern("handle", "tl::__sync_thread_partial", 8 + warpgroup, 256)


@T.macro
def pass_turn():
    """Let the other consumer warpgroup issue its matmuls."""
    T.call_extern("handle", "tl::__named_barrier_arrive", 9 - T.get_thread_binding() // 128, 256)


@T.macro
def keep_stages_until_read(stage_in_use, K_s, V_s):
    """Read both stage buffers after the last wait, so warp specialisation releases them only once
    the wgmmas that read them are done (it would release them when the wgmma is *issued*)."""
    stage_in_use[0] = K_s[0, 0] + V_s[0, 0]
