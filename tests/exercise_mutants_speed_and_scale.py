"""The exercises of chapters 04, 07, 08, 09 and 10 that run the learner's code (the chapters on speed and scale),
and their mutants, in ``exercise_harness``'s format; each exercise's prelude is what the chapter's earlier cells
provide. Run by ``tests/test_exercises_ch04_07_to_10.py``.
"""

from exercise_harness import Exercise, Mutant

TILE_PRELUDE = """
import math
import torch
import tilelang.language as T
from course_utils.kernels.tiles import TileBackend
NEG_INF = -T.infinity("float32")
"""

EXERCISES = {
    "ch09_merge_kernel": Exercise("09_varlen_decoding", ("merge_kernel", "merge_macros"), "ch09:check_merge_kernel",
                                  "merge_kernel", TILE_PRELUDE),
    "ch09_paged_lookup": Exercise("09_varlen_decoding", ("paged_scores", "paged_macros"), "ch09:check_paged_scores",
                                  "paged_scores", TILE_PRELUDE),
    "ch07_blocks_per_sm": Exercise("07_hopper_overlap", ("blocks_per_sm",), "ch07:check_blocks_per_sm",
                                   "blocks_per_sm", prelude=""),
}

MUTANTS = [
    # --- chapter 07 (d): how many blocks share an SM ---
    Mutant("ch07_blocks_per_sm", "registers not rounded to a warp's allocation",
           (("per_warp = -(-registers // 8) * 8 * 32", "per_warp = registers * 32"),), "registers not rounded"),
    Mutant("ch07_blocks_per_sm", "no 1 KiB reserved per block",
           (("by_shared = int(228 // (shared_kib + 1))", "by_shared = int(228 // shared_kib)"),), "1 KiB"),
    Mutant("ch07_blocks_per_sm", "no thread limit",
           (("min(by_registers, by_threads, by_shared, 32)", "min(by_registers, by_shared, 32)"),), "2048 threads"),
    Mutant("ch07_blocks_per_sm", "no block limit",
           (("min(by_registers, by_threads, by_shared, 32)", "min(by_registers, by_threads, by_shared)"),),
           "32 blocks"),
    Mutant("ch07_blocks_per_sm", "largest count instead of the smallest",
           (("min(by_registers, by_threads, by_shared, 32)", "max(by_registers, by_threads, by_shared)"),),
           "smallest of the four counts"),
    # --- chapter 09 (c): the split-KV merge kernel ---
    Mutant("ch09_merge_kernel", "LSE not rescaled: weights e^(LSE_s − m), not divided by the total",
           (("T.exp(LSE_part[r, s] - LSE[r])", "T.exp(LSE_part[r, s] - shift[0])"),), "not divided by the total"),
    Mutant("ch09_merge_kernel", "no maximum subtracted",
           (("l[0] += T.exp(LSE_part[r, s] - shift[0])", "l[0] += T.exp(LSE_part[r, s])"),
            ("shift[0] + T.log(l[0])", "T.log(l[0])")),
           "no maximum is subtracted"),
    Mutant("ch09_merge_kernel", "max not carried",
           (("shift[0] = T.max(shift[0], LSE_part[r, s])", "shift[0] = LSE_part[r, s]"),), "not carried"),
    Mutant("ch09_merge_kernel", "no guard for a row no split saw",
           (("T.if_then_else(l[0] > 0, T.exp(LSE_part[r, s] - LSE[r]), 0)", "T.exp(LSE_part[r, s] - LSE[r])"),),
           "no guard"),
    # Right on the fixed rows of old (the largest LSE always first, no row of LSEs all very negative); the rows
    # drawn by shapes.draw_merge_rows put the largest in every position and a row of LSEs all below −104.
    Mutant("ch09_merge_kernel", "running max started at 0, not −∞",
           (("shift[0] = NEG_INF\n", "shift[0] = 0\n"),), "the maximum starts at 0, not at −∞"),
    Mutant("ch09_merge_kernel", "max loop reads split 0 at every s",
           (("shift[0] = T.max(shift[0], LSE_part[r, s])", "shift[0] = T.max(shift[0], LSE_part[r, 0])"),),
           "the maximum is not taken over every split"),
    Mutant("ch09_merge_kernel", "max loop stops one split short",
           (("        for s in T.serial(splits):\n            shift[0] = T.max",
             "        for s in T.serial(splits - 1):\n            shift[0] = T.max"),),
           "the maximum is not taken over every split"),

    # --- chapter 09 (d): the paged-cache lookup ---
    Mutant("ch09_paged_lookup", "wrong page index: table entry kb",
           (("BlockTable[b, kb * block_N // page_size]", "BlockTable[b, kb]"),), "looked up as block-table entry kb"),
    Mutant("ch09_paged_lookup", "block table skipped",
           (("page = BlockTable[b, kb * block_N // page_size]", "page = kb * block_N // page_size"),),
           "logical page number is used as the physical one"),
    Mutant("ch09_paged_lookup", "off by one in the last page: floor instead of ceil",
           (("T.ceildiv(length, block_N)", "length // block_N"),), "last, partial tile is skipped"),
    Mutant("ch09_paged_lookup", "every tile from its page's start",
           (("first = kb * block_N % page_size", "first = 0"),), "first row of its page"),
    # Right when a page holds two tiles, the one configuration checked before; three tiles a page show it.
    Mutant("ch09_paged_lookup", "two tiles per page written in",
           (("page = BlockTable[b, kb * block_N // page_size]", "page = BlockTable[b, kb // 2]"),
            ("first = kb * block_N % page_size", "first = kb % 2 * block_N")),
           "the number of tiles in a page is written in as a constant"),
]

# Correct solutions written differently: the checker must pass them.
VARIANTS = [
    Mutant("ch09_merge_kernel", "no −∞ guard on the max (the ℓ > 0 guards cover that row)",
           (("        shift[0] = T.if_then_else(shift[0] == NEG_INF, 0, shift[0])  # no split saw the row: "
             "no −∞ − (−∞)\n", ""),), ""),
    Mutant("ch09_paged_lookup", "tile count written with integer arithmetic",
           (("T.ceildiv(length, block_N)", "(length + block_N - 1) // block_N"),), ""),
]

PLAIN_PRELUDE = """
import math
import torch
"""

EXERCISES["ch10_ring_step"] = Exercise("10_ring_attention", ("merge_partial",), "ch10:check_merge_partial",
                                       "merge_partial", PLAIN_PRELUDE)
MUTANTS += [
    # --- chapter 10 (c): one ring step, the LSE merge of a partial result ---
    Mutant("ch10_ring_step", "plain average",
           (("new_out = torch.exp(lse - shift)[..., None] * out + torch.exp(lse_b - shift)[..., None] * out_b",
             "new_out = (out + out_b) / 2"),), "averaged"),
    Mutant("ch10_ring_step", "LSE not updated",
           (("return new_out, new_lse", "return new_out, lse"),), "the LSE returned is the old one"),
    Mutant("ch10_ring_step", "no maximum subtracted",
           (("new_lse = torch.logaddexp(lse, lse_b)", "new_lse = torch.log(torch.exp(lse) + torch.exp(lse_b))"),
            ("shift = torch.where(new_lse == float(\"-inf\"), 0.0, new_lse)", "shift = new_lse")),
           "without subtracting the larger LSE"),
    Mutant("ch10_ring_step", "no guard for rows neither part saw",
           (("shift = torch.where(new_lse == float(\"-inf\"), 0.0, new_lse)", "shift = new_lse"),), "no guard"),
    Mutant("ch10_ring_step", "weights swapped",
           (("torch.exp(lse - shift)[..., None] * out + torch.exp(lse_b - shift)[..., None] * out_b",
             "torch.exp(lse_b - shift)[..., None] * out + torch.exp(lse - shift)[..., None] * out_b"),),
           "weights are swapped"),
    # Right on the fixed rows of old (no row of LSEs both below −104, the partial's LSE never 88 above the running
    # one); shapes.draw_merge_rows has both, and the ring's very negative head shows the first too.
    Mutant("ch10_ring_step", "larger LSE floored at 0 (clamp as the −∞ guard)",
           (("new_lse = torch.logaddexp(lse, lse_b)\n",
             "m = torch.maximum(lse, lse_b).clamp(min=0)\n"
             "    new_lse = m + torch.log(torch.exp(lse - m) + torch.exp(lse_b - m))\n"),),
           "the larger LSE is floored at 0"),
    Mutant("ch10_ring_step", "log-add taken around the running LSE (log1p of e^(LSE_b − LSE))",
           (("new_lse = torch.logaddexp(lse, lse_b)\n",
             "new_lse = torch.where(lse == float(\"-inf\"), lse_b, lse + torch.log1p(torch.exp(lse_b - lse)))\n"),),
           "taken around the running LSE"),
]
VARIANTS += [
    Mutant("ch10_ring_step", "max-shift written out instead of logaddexp",
           (("new_lse = torch.logaddexp(lse, lse_b)\n",
             "m = torch.maximum(lse, lse_b)\n    m0 = torch.where(m == float('-inf'), 0.0, m)\n"
             "    new_lse = m0 + torch.log(torch.exp(lse - m0) + torch.exp(lse_b - m0))\n"),), ""),
]

LAYOUT_PRELUDE = TILE_PRELUDE + """
from tilelang.layout import make_linear_layout, make_swizzled_layout
"""

EXERCISES["ch04_pipelined_gemm"] = Exercise("04_pipelining_swizzle_tuning", ("pipelined_gemm", "k_loop_macro"),
                                            "ch04:check_pipelined_gemm", "pipelined_gemm", LAYOUT_PRELUDE)
MUTANTS += [
    # --- chapter 04 (c): the pipelined, swizzled K loop ---
    Mutant("ch04_pipelined_gemm", "one stage",
           (("num_stages=2", "num_stages=1"),), "cp_async_wait<0> right after each copy"),
    Mutant("ch04_pipelined_gemm", "three stages",
           (("num_stages=2", "num_stages=3"),), "3 buffer(s) per shared tile"),
    Mutant("ch04_pipelined_gemm", "not pipelined (T.serial)",
           (("for ko in T.Pipelined(T.ceildiv(K, block_K), num_stages=2):",
             "for ko in T.serial(T.ceildiv(K, block_K)):"),),
           "has no cp.async"),
    Mutant("ch04_pipelined_gemm", "B tile row-major",
           (("B_s: make_swizzled_layout(B_s)", "B_s: make_linear_layout(B_s)"),), "in B_s, one ldmatrix.x4 needs 32"),
    Mutant("ch04_pipelined_gemm", "both tiles row-major",
           (("make_swizzled_layout(A_s)", "make_linear_layout(A_s)"),
            ("make_swizzled_layout(B_s)", "make_linear_layout(B_s)")),
           "8-way bank conflicts"),
    Mutant("ch04_pipelined_gemm", "B not transposed",
           (("T.gemm(A_s, B_s, C_frag, transpose_B=True)", "T.gemm(A_s, B_s, C_frag)"),), "pipelined GEMM loop"),
    # Right with the equal 64 × 64 × 64 tiles of the one case of old; the drawn tilings tell the block sizes apart.
    Mutant("ch04_pipelined_gemm", "A's rows counted with block_N",
           (("A[by * block_M, ko * block_K]", "A[by * block_N, ko * block_K]"),), "A's rows are counted with block_N"),
    Mutant("ch04_pipelined_gemm", "K tiles counted with block_M",
           (("T.ceildiv(K, block_K)", "T.ceildiv(K, block_M)"),), "the K loop counts its tiles in block_M"),
    Mutant("ch04_pipelined_gemm", "B's K columns stepped with block_N",
           (("B[bx * block_N, ko * block_K]", "B[bx * block_N, ko * block_N]"),),
           "B's K columns are stepped with block_N"),
]
VARIANTS += [
    Mutant("ch04_pipelined_gemm", "no annotation: TileLang's own choice is the swizzle",
           (("        if tb.on_gpu:  # layouts exist only on the GPU: the C backend's tiles are plain arrays\n"
             "            T.annotate_layout({A_s: make_swizzled_layout(A_s), B_s: make_swizzled_layout(B_s)})\n", ""),),
           ""),
]

HOPPER_PRELUDE = TILE_PRELUDE + """
from course_utils.kernels.flash_pieces import LOG2E
"""

EXERCISES["ch07_rotated_loop"] = Exercise("07_hopper_overlap", ("async_matmuls", "weighted_sum", "rotated_loop_macro"),
                                          "ch07:check_rotated_loop", "weighted_sum", HOPPER_PRELUDE)
MUTANTS += [
    # --- chapter 07 (c): the rotated loop (all but the first three fail only when lowered for sm_90a) ---
    Mutant("ch07_rotated_loop", "no extra iteration",
           (("T.Pipelined(num_blocks + 1, num_stages=2)", "T.Pipelined(num_blocks, num_stages=2)"),),
           "one extra iteration"),
    # Equal tiles (the one case of old) hide it; the drawn tilings 8 × 6 and 6 × 8 do not.
    Mutant("ch07_rotated_loop", "K's rows counted with block_M",
           (("T.copy(K[b, k_blk * block_N:(k_blk + 1) * block_N, :], K_s)",
             "T.copy(K[b, k_blk * block_M:(k_blk + 1) * block_M, :], K_s)"),), "its own block size"),
    Mutant("ch07_rotated_loop", "V of the same block as K",
           (("v_blk = T.max(kb - 1, 0)", "v_blk = k_blk"),), "one behind K"),
    Mutant("ch07_rotated_loop", "P copied before the exponentials",
           (("            T.copy(S, P)\n", ""),
            ("            wait(1)\n", "            wait(1)\n            T.copy(S, P)\n")),
           "before the exponentials"),
    Mutant("ch07_rotated_loop", "wait between the issues (serialised)",
           (("            issue_scores(Q_s, K_s, S)\n",
             "            issue_scores(Q_s, K_s, S)\n            wait(0)\n"),),
           "a wait sits between the two issues"),
    Mutant("ch07_rotated_loop", "wait(0) for the scores (no overlap)",
           (("            wait(1)\n", "            wait(0)\n"),), "the first wait is wait(0)"),
    Mutant("ch07_rotated_loop", "no wait for the scores (race on S)",
           (("            wait(1)\n", ""),), "the exponentials come before any wait"),
    Mutant("ch07_rotated_loop", "no wait(0) before P is overwritten (race on P)",
           (("            wait(0)\n", ""),), "no wait(0) after the exponentials"),
    # An asynchronous write hazard: the order of issues and waits is right, but P is stored before the wait(0).
    Mutant("ch07_rotated_loop", "P written before the wait(0) that retires the P·V reading it",
           (("            wait(0)\n            T.copy(S, P)\n", "            T.copy(S, P)\n            wait(0)\n"),),
           "P is written (T.copy(S, P)) while the P·V wgmma that reads it may still be running"),
    Mutant("ch07_rotated_loop", "stage released at the issue",
           (("            stage_in_use[0] = K_s[0, 0] + V_s[0, 0]\n", ""),), "released before the last wait"),
    Mutant("ch07_rotated_loop", "exponentials written straight into P before the wait(0)",
           (("                S[i, j] = T.exp2(S[i, j] * scale_log2)\n            wait(0)\n            T.copy(S, P)\n",
             "                P[i, j] = T.exp2(S[i, j] * scale_log2)\n            wait(0)\n"),),
           "P is written"),
    # Right on the CPU (the first P·V adds P = 0) and no step of the order check touches acc, but the clear
    # writes the P·V wgmma's accumulator while wait(1) leaves that wgmma running: only ptxas sees it.
    Mutant("ch07_rotated_loop", "accumulator cleared after the first, wasted P·V, before the wait(0) (ptxas)",
           (("            wait(1)\n", "            wait(1)\n            if kb == 0:\n                T.clear(acc)\n"),),
           "ptxas serialises every wgmma of the kernel (C751"),
]
MUTANTS += [
    Mutant("ch07_rotated_loop", "scores never issued (TileLang's warning names S)",
           (("            issue_scores(Q_s, K_s, S)\n", ""),),
           "TileLang warned: `S` is read before anything writes it"),
    Mutant("ch07_rotated_loop", "P·V issued before QKᵀ (wait(1) then leaves the scores running)",
           (("            issue_scores(Q_s, K_s, S)\n            issue_update(P, V_s, acc)\n",
             "            issue_update(P, V_s, acc)\n            issue_scores(Q_s, K_s, S)\n"),), "Issue QKᵀ first"),
]
VARIANTS += [
    Mutant("ch07_rotated_loop", "block indices clamped with if_then_else",
           (("k_blk = T.min(kb, num_blocks - 1)", "k_blk = T.if_then_else(kb < num_blocks, kb, num_blocks - 1)"),), ""),
]

EXERCISES["ch08_backward_step"] = Exercise("08_hopper_backward",
                                           ("async_pieces", "step_pieces", "key_block_backward", "backward_step_macro"),
                                           "ch08:check_backward_step", "key_block_backward", HOPPER_PRELUDE)
_STEP = "        issue_scores_t(K_s, Q_s, PT)\n        issue_dp_t(V_s, dO_s, dPT)\n"
MUTANTS += [
    # --- chapter 08 (e): one step of the Hopper backward (all but the first two fail only when lowered for sm_90a) ---
    Mutant("ch08_backward_step", "dSᵀ formed before the exponentials",
           (("        probabilities(PT, lse)\n        wait(0)\n        form_ds(PT, dPT, delta, dST, PT_cast)\n",
             "        wait(0)\n        form_ds(PT, dPT, delta, dST, PT_cast)\n        probabilities(PT, lse)\n"),),
           "dSᵀ is formed before the exponentials"),
    Mutant("ch08_backward_step", "dK multiplied with Pᵀ",
           (("        issue_dk(dST, Q_s, dk)\n", "        issue_dk(PT_cast, Q_s, dk)\n"),), "dK is multiplied with Pᵀ"),
    Mutant("ch08_backward_step", "no wait before the exponentials (race on Sᵀ)",
           (("        wait(1)\n        probabilities", "        probabilities"),), "wait(1) before probabilities"),
    Mutant("ch08_backward_step", "dPᵀ issued before Sᵀ (wait(1) leaves Sᵀ running)",
           ((_STEP, "        issue_dp_t(V_s, dO_s, dPT)\n        issue_scores_t(K_s, Q_s, PT)\n"),),
           "Issue Sᵀ first"),
    Mutant("ch08_backward_step", "wait(0) before the exponentials (no overlap with dPᵀ)",
           (("        wait(1)\n        probabilities", "        wait(0)\n        probabilities"),),
           "they no longer overlap it"),
    Mutant("ch08_backward_step", "wait between the issues of Sᵀ and dPᵀ",
           ((_STEP, "        issue_scores_t(K_s, Q_s, PT)\n        wait(0)\n        issue_dp_t(V_s, dO_s, dPT)\n"),),
           "between the issues of Sᵀ and dPᵀ"),
    Mutant("ch08_backward_step", "no wait for dPᵀ (race on dPᵀ)",
           (("        wait(0)\n        form_ds", "        form_ds"),), "dSᵀ reads dPᵀ while its batch"),
    Mutant("ch08_backward_step", "no barrier after the dSᵀ store",
           (("        barrier(DS_BARRIER)\n", ""),), "no barrier between the store of dSᵀ and the dQ issue"),
    Mutant("ch08_backward_step", "barrier before the dSᵀ store",
           (("        T.copy(dST, dST_s)\n        barrier(DS_BARRIER)\n",
             "        barrier(DS_BARRIER)\n        T.copy(dST, dST_s)\n"),),
           "no barrier between the store of dSᵀ and the dQ issue"),
    Mutant("ch08_backward_step", "dK issued before dQ (wait(1) leaves dQ running)",
           (("        issue_dq(dST_s, K_s, dq)\n        issue_dk(dST, Q_s, dk)\n",
             "        issue_dk(dST, Q_s, dk)\n        issue_dq(dST_s, K_s, dq)\n"),), "issue dQ before dK"),
    Mutant("ch08_backward_step", "wait(0) before the dQ store (dK no longer overlapped)",
           (("        wait(1)\n        T.copy(dq, dq_s)", "        wait(0)\n        T.copy(dq, dq_s)"),),
           "no longer runs under dK"),
    Mutant("ch08_backward_step", "no barrier before the reduce-add",
           (("        barrier(DQ_BARRIER)\n", ""),), "no barrier between the store of dQ and the reduce-add"),
    Mutant("ch08_backward_step", "no final wait(0)",
           (("        wait(0)\n        stage_in_use", "        stage_in_use"),), "no wait(0) after the last issue"),
    Mutant("ch08_backward_step", "stage released at the issue",
           (("        stage_in_use[0] = Q_s[0, 0] + dO_s[0, 0]\n", ""),), "released before the last wait"),
    Mutant("ch08_backward_step", "wait between the issues of dV and dQ",
           (("        issue_dv(PT_cast, dO_s, dv)\n", "        issue_dv(PT_cast, dO_s, dv)\n        wait(0)\n"),),
           "between the issues of dV, dQ and dK"),
    # Right on the CPU (the last dK is complete when it is scaled there) and no step of the order check touches dk,
    # but the scale reads and writes dK's accumulator while wait(1) leaves its wgmma running: only ptxas sees it.
    Mutant("ch08_backward_step", "dK scaled by 1/√D in the last step, before the wait(0) (ptxas)",
           (("            for j, d in tb.parallel(block_N, dim):\n                dk[j, d] *= 1 / dim ** 0.5\n", ""),
            ("        wait(1)\n        T.copy(dq, dq_s)\n",
             "        wait(1)\n        if qb == T.ceildiv(dQ_acc.shape[1], dq.shape[0]) - 1:\n"
             "            for j, d in tb.parallel(dk.shape[0], dk.shape[1]):\n"
             "                dk[j, d] *= 1 / int(dk.shape[1]) ** 0.5\n        T.copy(dq, dq_s)\n")),
           "ptxas serialises every wgmma of the kernel (C751"),
]
VARIANTS += [
    Mutant("ch08_backward_step", "dQ issued before dV (dK still last, so wait(1) retires both)",
           (("        issue_dv(PT_cast, dO_s, dv)\n        issue_dq(dST_s, K_s, dq)\n",
             "        issue_dq(dST_s, K_s, dq)\n        issue_dv(PT_cast, dO_s, dv)\n"),), ""),
]

EXERCISES["ch08_reduce_wait"] = Exercise("08_hopper_backward", ("reduce_wait_before",), "ch08:check_reduce_wait",
                                         "reduce_wait_before", TILE_PRELUDE)
_ANSWER = 'return "dSᵀ barrier"'
MUTANTS += [
    # --- chapter 08 (d): where the copy engine's read of dq_s is waited for ---
    Mutant("ch08_reduce_wait", "at the start of the step (safe, TileLang's stall moved only a little)",
           ((_ANSWER, 'return "issue Sᵀ and dPᵀ"'),), "earlier than it needs to be"),
    Mutant("ch08_reduce_wait", "right before the store of dq_s (no barrier after the wait: a race)",
           ((_ANSWER, 'return "store dQ to dq_s"'),), "a race"),
    Mutant("ch08_reduce_wait", "after the dSᵀ barrier (a race)", ((_ANSWER, 'return "issue dV, dQ, dK"'),), "a race"),
    Mutant("ch08_reduce_wait", "at the dQ barrier (dq_s already rewritten)", ((_ANSWER, 'return "dQ barrier"'),),
           "too late"),
    Mutant("ch08_reduce_wait", "not an event of the step", ((_ANSWER, 'return "after the loop"'),),
           "return one of the events"),
]
