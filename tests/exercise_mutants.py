"""The kernel exercises and their mutants: the notebook's solution with one planted bug each.

An exercise names the notebook, the functions its cells define (the given skeleton and the
learner's solution cell, read from the notebook's .py), the checker and the prelude of imports
the chapter's first cell provides. A mutant is a list of (find, replace) edits applied to that
source (each find text must occur; every occurrence is replaced) and a piece of the diagnosis the
checker must give. ``tests/test_exercises_ch02_03_05_06.py`` runs them.
"""

from exercise_harness import Exercise, Mutant

PRELUDE = """
import math
import torch
import tilelang.language as T
from course_utils.kernels.flash_pieces import LOG2E
from course_utils.kernels.tiles import TileBackend
"""

EXERCISES = {
    "ch02_online_softmax": Exercise("02_online_softmax", ("online_softmax",), "ch02:check_online_softmax_kernel",
                                    "online_softmax", PRELUDE),
    "ch03_forward": Exercise("03_flash_forward", ("flash_forward", "forward_tile_macros"),
                             "ch03:check_flash_forward", "flash_forward", PRELUDE),
    "ch03_full_forward": Exercise("03_flash_forward", ("my_softmax_step", "my_flash_forward"),
                                  "ch03:check_my_flash_forward", "my_flash_forward", PRELUDE),
    "ch05_delta": Exercise("05_backward", ("my_delta",), "ch05:check_my_delta", "my_delta", PRELUDE),
    "ch05_dkdv": Exercise("05_backward", ("my_dkdv",), "ch05:check_my_dkdv", "my_dkdv", PRELUDE),
    "ch05_dq": Exercise("05_backward", ("my_dq",), "ch05:check_my_dq", "my_dq", PRELUDE),
    "ch05_backward": Exercise("05_backward", ("flash_backward", "backward_step_macros"),
                              "ch05:check_flash_backward", "flash_backward", PRELUDE),
    "ch06_own_gpt_oss": Exercise("06_gqa_window_sinks", ("my_softmax_step", "my_gpt_oss_forward"),
                                 "ch06:check_my_gpt_oss_forward", "my_gpt_oss_forward", PRELUDE),
    "ch06_window_sinks": Exercise("06_gqa_window_sinks", ("gpt_oss_forward", "window_block_range", "sink_epilogue"),
                                  "ch06:check_gpt_oss_forward", "gpt_oss_forward", PRELUDE),
}

# Exercise 06 (e)'s start of the running max, at the sink (the line before it included).
_SINK_START = ("            for i in tb.parallel(block_M):  # the sink's logit in raw score units: every e^x ≤ 1\n"
               "                m[i] = Sinks[h] * math.sqrt(dim)\n")

MUTANTS = [
    # --- chapter 02: the online-softmax update of a row-softmax kernel ---
    Mutant("ch02_online_softmax", "rescale forgotten",
           (("l[i] = l[i] * T.exp2(m_prev[i] * scale_log2 - shift[i]) + row_sum[i]", "l[i] = l[i] + row_sum[i]"),),
           "ℓ is not rescaled"),
    Mutant("ch02_online_softmax", "max reset per block",
           (("T.reduce_max(x, m, dim=1, clear=False)", "T.reduce_max(x, m, dim=1)"),),
           "running max is reset"),
    Mutant("ch02_online_softmax", "masked-row guard missing",
           (("shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)", "shift[i] = m[i] * scale_log2"),),
           "guard"),
    Mutant("ch02_online_softmax", "log2(e) missing",
           (("m[i] * scale_log2)", "m[i] * scale)"), ("x[i, j] = T.exp2(x[i, j] * scale_log2 - shift[i])\n",
                                                      "x[i, j] = T.exp2(x[i, j] * scale - shift[i])\n"),
            ("m_prev[i] * scale_log2", "m_prev[i] * scale")),
           "log2(e) is missing"),
    Mutant("ch02_online_softmax", "rescale factor from the new max",
           (("l[i] * T.exp2(m_prev[i] * scale_log2 - shift[i])", "l[i] * T.exp2(m[i] * scale_log2 - shift[i])"),),
           "ℓ is not rescaled"),  # α = exp2(m·c − m·c) = 1: the same bug

    # --- chapter 03: the forward's key-tile loop and epilogue ---
    Mutant("ch03_forward", "accumulator rescale forgotten",
           (("        for i, j in tb.parallel(block_M, dim):\n            acc_o[i, j] *= alpha[i]\n", ""),),
           "acc_o is not rescaled"),
    Mutant("ch03_forward", "denominator rescale forgotten",
           (("l[i] = l[i] * alpha[i] + row_sum[i]", "l[i] = l[i] + row_sum[i]"),),
           "ℓ is not rescaled"),
    Mutant("ch03_forward", "max reset per block",
           (("T.reduce_max(S, m, dim=1, clear=False)", "T.reduce_max(S, m, dim=1)"),),
           "running max is reset"),
    Mutant("ch03_forward", "log2(e) missing",
           (("shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)\n            alpha[i] = "
             "T.exp2(m_prev[i] * scale_log2 - shift[i])",
             "shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * sm_scale)\n            alpha[i] = "
             "T.exp2(m_prev[i] * sm_scale - shift[i])"),
            ("S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])", "S[i, j] = T.exp2(S[i, j] * sm_scale - shift[i])")),
           "log2(e) is missing"),
    Mutant("ch03_forward", "causal bound off by one",
           (("k <= q + past", "k < q + past"),), "off by one"),
    Mutant("ch03_forward", "causal diagonal top-left",
           (("k <= q + past", "k <= q"),), "aligned top-left"),
    Mutant("ch03_forward", "bounds mask missing",
           (("T.And(k < seq_k, k <= q + past) if causal else k < seq_k", "k <= q + past if causal else True"),),
           "keys past the end of K are not masked"),
    Mutant("ch03_forward", "masked scores set to 0",
           (("S[i, j] = T.if_then_else(visible, S[i, j], neg_inf)", "S[i, j] = T.if_then_else(visible, S[i, j], 0)"),),
           "set to 0, not −∞"),
    Mutant("ch03_forward", "0/0 for rows that see no key",
           (("acc_o[i, j] = T.if_then_else(l[i] > 0, acc_o[i, j] / l[i], 0)", "acc_o[i, j] = acc_o[i, j] / l[i]"),),
           "0/0"),
    Mutant("ch03_forward", "LSE left in base 2",
           (("(shift[i] + T.log2(l[i])) / LOG2E", "shift[i] + T.log2(l[i])"),), "LSE is in base 2"),

    # --- chapter 03 (d): the whole forward kernel ---
    Mutant("ch03_full_forward", "max reset per block",
           (("T.reduce_max(S, m, dim=1, clear=False)", "T.reduce_max(S, m, dim=1)"),), "running max is reset"),
    Mutant("ch03_full_forward", "softmax scale missing",
           (("scale_log2 = LOG2E / math.sqrt(dim)", "scale_log2 = LOG2E"),
            ("LOG2E / math.sqrt(dim), seq_k - seq_q", "LOG2E, seq_k - seq_q")), "softmax scale 1/√D is missing"),
    Mutant("ch03_full_forward", "causal bound off by one", (("k <= q + past", "k < q + past"),), "off by one"),
    Mutant("ch03_full_forward", "bounds mask missing",
           (("T.And(k < seq_k, k <= q + past) if causal else k < seq_k", "k <= q + past if causal else True"),),
           "keys past the end of K are not masked"),
    Mutant("ch03_full_forward", "accumulator rescale forgotten",
           (("        for i, j in tb.parallel(block_M, dim):\n            acc_o[i, j] *= alpha[i]\n", ""),),
           "acc_o is not rescaled"),
    Mutant("ch03_full_forward", "0/0 for rows that see no key",
           (("acc_o[i, j] = T.if_then_else(l[i] > 0, acc_o[i, j] / l[i], 0)", "acc_o[i, j] = acc_o[i, j] / l[i]"),),
           "0/0"),
    Mutant("ch03_full_forward", "LSE left in base 2",
           (("(shift[i] + T.log2(l[i])) / LOG2E", "shift[i] + T.log2(l[i])"),), "LSE is in base 2"),
    Mutant("ch03_full_forward", "K not transposed", (("T.gemm(Q_s, K_s, S, transpose_B=True)", "T.gemm(Q_s, K_s, S)"),),
           "transpose_B=True"),
    # Wrong only on shapes or scores a fixed list of cases may not draw (shapes.draw_shapes covers their classes).
    Mutant("ch03_full_forward", "causal stop one key block short at a block edge",
           (("T.ceildiv((qb + 1) * block_M + past, block_N))", "T.ceildiv((qb + 1) * block_M + past - 1, block_N))"),),
           "one key block short"),
    Mutant("ch03_full_forward", "causal stop split in two ceilings (right if block_N | block_M)",
           (("T.ceildiv((qb + 1) * block_M + past, block_N))",
             "(qb + 1) * block_M // block_N + T.ceildiv(past, block_N))"),),
           "adds the query block's key blocks and the offset's separately"),
    Mutant("ch03_full_forward", "running max started at 0 (right unless every score of a row is very negative)",
           (("T.fill(m, neg_inf)", "T.fill(m, 0)"),), "running max starts at 0"),
    Mutant("ch03_full_forward", "no max subtracted (right unless the scores are very large)",
           (("shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)", "shift[i] = 0.0"),
            ("alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])", "alpha[i] = 1.0")),
           "nothing is subtracted before the exponential"),
    Mutant("ch03_full_forward", "float32 register tile fed to T.gemm (right on the CPU, rejected for sm_90a)",
           (("T.copy(S, P)\n        T.gemm(P, V_s, acc_o)", "T.gemm(S, V_s, acc_o)"),),
           "lowered for sm_90a"),

    # --- chapter 05: one step of the backward ---
    Mutant("ch05_backward", "Δ omitted",
           (("PT[j, i] * (dPT[j, i] - delta[i])", "PT[j, i] * dPT[j, i]"),), "Δ is missing"),
    Mutant("ch05_backward", "dK missing the softmax scale",
           (("dk[j, d] *= sm_scale", "dk[j, d] *= 1.0"),), "dK is missing the softmax scale"),
    Mutant("ch05_backward", "dQ missing the softmax scale",
           (("dq[i, d] *= sm_scale", "dq[i, d] *= 1.0"),), "dQ is missing the softmax scale"),
    Mutant("ch05_backward", "LSE used as a base-2 logarithm",
           (("lse[i] * LOG2E", "lse[i]"),), "natural log"),
    Mutant("ch05_backward", "causal mask missing from the recomputed P",
           (("visible(qb * block_M + i, kb * block_N + j)", "True"),), "mask"),

    # --- chapter 05 capstone: Δ, dK/dV and dQ kernels ---
    Mutant("ch05_delta", "O times O", (("o[i, d] *= do[i, d]", "o[i, d] *= o[i, d]"),), "dO ∘ dO or O ∘ O"),
    Mutant("ch05_dkdv", "Δ omitted",
           (("sm_scale * PT[j, i] * (dPT[j, i] - delta[i])", "sm_scale * PT[j, i] * dPT[j, i]"),),
           "Δ is missing"),
    Mutant("ch05_dkdv", "dK missing the softmax scale", (("dST[j, i] = sm_scale * PT", "dST[j, i] = PT"),),
           "dK is missing the softmax scale"),
    Mutant("ch05_dkdv", "LSE used as a base-2 logarithm", (("lse[i] * LOG2E), 0)", "lse[i]), 0)"),), "natural log"),
    Mutant("ch05_dkdv", "causal walk starts without the offset S_k − S_q",
           (("(kb * block_N - past) // block_M", "(kb * block_N) // block_M"),), "causal walk starts"),
    Mutant("ch05_dkdv", "causal start rounded up (right when block_M divides kb·block_N − past)",
           (("(kb * block_N - past) // block_M", "T.ceildiv(kb * block_N - past, block_M)"),), "rounded up"),
    Mutant("ch05_dkdv", "causal start divided by block_N (right when block_M = block_N)",
           (("(kb * block_N - past) // block_M", "(kb * block_N - past) // block_N"),), "divide it by block_M"),
    Mutant("ch05_dkdv", "float32 register tile fed to T.gemm (right on the CPU, rejected for sm_90a)",
           (("T.copy(PT, PT_s)\n                T.gemm(PT_s, dO_s, dv)", "T.gemm(PT, dO_s, dv)"),),
           "lowered for sm_90a"),
    Mutant("ch05_dq", "dQ missing the softmax scale", (("dq[i, d] *= sm_scale", "dq[i, d] *= 1.0"),),
           "dQ is missing the softmax scale"),
    Mutant("ch05_dq", "Δ omitted", (("p * (dP[i, j] - delta[i])", "p * dP[i, j]"),), "Δ is missing"),
    Mutant("ch05_dq", "causal stop one key block short at a block edge",
           (("T.ceildiv((qb + 1) * block_M + past, block_N))", "T.ceildiv((qb + 1) * block_M + past - 1, block_N))"),),
           "one key block short"),
    Mutant("ch05_dq", "causal stop split in two ceilings (right if block_N | block_M)",
           (("T.ceildiv((qb + 1) * block_M + past, block_N))",
             "(qb + 1) * block_M // block_N + T.ceildiv(past, block_N))"),),
           "adds the query block's key blocks and the offset's separately"),
    Mutant("ch05_dq", "dS kept in a register tile and fed to T.gemm (rejected for sm_90a)",
           (("tb.shared([block_M], f32), tb.shared([block_M, block_N], f32)",
             "tb.shared([block_M], f32), tb.fragment([block_M, block_N], f32)"),), "lowered for sm_90a"),

    # --- chapter 06: the sink in the epilogue and the window's key-block range ---
    Mutant("ch06_window_sinks", "sink left out",
           (("            l[i] += T.exp2(sink * LOG2E - shift[i])\n", ""),), "sink is missing"),
    Mutant("ch06_window_sinks", "sink left out of the LSE",
           (("            l[i] += T.exp2(sink * LOG2E - shift[i])\n            lse[i] = T.if_then_else(l[i] > 0, "
             "(shift[i] + T.log2(l[i])) / LOG2E, neg_inf)\n",
             "            lse[i] = T.if_then_else(l[i] > 0, (shift[i] + T.log2(l[i])) / LOG2E, neg_inf)\n"
             "            l[i] += T.exp2(sink * LOG2E - shift[i])\n"),),
           "sink is left out of the LSE"),
    Mutant("ch06_window_sinks", "sink multiplied by the softmax scale",
           (("sink * LOG2E", "sink * scale_log2"),), "multiplied by the softmax scale"),
    Mutant("ch06_window_sinks", "sink without log2(e)",
           (("T.exp2(sink * LOG2E - shift[i])", "T.exp2(sink - shift[i])"),), "log2(e)"),
    Mutant("ch06_window_sinks", "sink not shifted",
           (("T.exp2(sink * LOG2E - shift[i])", "T.exp2(sink * LOG2E)"),), "shift"),
    Mutant("ch06_window_sinks", "window start from the block's last row",
           (("qb * block_M + past - window + 1", "(qb + 1) * block_M - 1 + past - window + 1"),),
           "first row"),
    Mutant("ch06_window_sinks", "window start rounded up",
           (("(qb * block_M + past - window + 1) // block_N", "T.ceildiv(qb * block_M + past - window + 1, block_N)"),),
           "rounded up"),
    Mutant("ch06_window_sinks", "window start one key early",
           (("qb * block_M + past - window + 1", "qb * block_M + past - window"),), "no row of the query block"),
    Mutant("ch06_window_sinks", "no window skipping",
           (("start = T.max(0, (qb * block_M + past - window + 1) // block_N)", "start = 0"),),
           "no row of the query block"),

    Mutant("ch06_window_sinks", "causal stop one key short at a block edge",
           (("T.ceildiv((qb + 1) * block_M + past, block_N))", "T.ceildiv((qb + 1) * block_M + past - 1, block_N))"),),
           "diagonal key when that key is the first of a block"),
    # (No "unguarded shift" mutant here: the skeleton starts m at the sink, so m = −∞ only in a head without a
    # sink, where exp2(−∞ − (−∞)) is NaN and the ℓ > 0 guards of the LSE and the division give the right row.)

    # --- chapter 06 (e): GQA, window and sinks in the learner's own forward ---
    Mutant("ch06_own_gpt_oss", "GQA heads tiled instead of grouped",
           (("h // group, kb", "h % heads_kv, kb"),), "h // group"),
    Mutant("ch06_own_gpt_oss", "window mask one key too wide",
           (("k > q + past - window", "k >= q + past - window"),), "one key too many"),
    Mutant("ch06_own_gpt_oss", "running max started at −∞",
           ((_SINK_START, "            T.fill(m, neg_inf)\n"),),
           "the running max starts at −∞: with a sink logit of 100"),
    Mutant("ch06_own_gpt_oss", "running max started at the sink's logit, not in raw score units",
           (("m[i] = Sinks[h] * math.sqrt(dim)", "m[i] = Sinks[h]"),), "in the wrong units"),
    # With m started at the sink, the unguarded shift only meets m = −∞ in a head without a sink, where the ℓ > 0
    # guards give the right row (as in (d)); started at −∞, the rows that see no key show it.
    Mutant("ch06_own_gpt_oss", "sink with the unguarded shift, running max started at −∞",
           (("T.exp2(Sinks[h] * LOG2E - shift[i])", "T.exp2(Sinks[h] * LOG2E - m[i] * scale_log2)"),
            (_SINK_START, "            T.fill(m, neg_inf)\n")),
           "unguarded shift"),
    Mutant("ch06_own_gpt_oss", "window start from the block's last row",
           (("(qb * block_M + past - window + 1) // block_N", "((qb + 1) * block_M + past - window) // block_N"),),
           "first row"),
    Mutant("ch06_own_gpt_oss", "sink left out",
           (("                l[i] += T.exp2(Sinks[h] * LOG2E - shift[i])\n", ""),),
           "sink is missing"),
    Mutant("ch06_own_gpt_oss", "float32 register tile fed to T.gemm (right on the CPU, rejected for sm_90a)",
           (("T.copy(S, P)\n        T.gemm(P, V_s, acc_o)", "T.gemm(S, V_s, acc_o)"),), "lowered for sm_90a"),
]

# Correct solutions written differently: the checker must pass them (a diagnosis never names a right kernel).
VARIANTS = [
    Mutant("ch03_forward", "mask filled in before the gemm (S = visible ? 0 : −∞, then S += Q Kᵀ)",
           (("        T.clear(S)\n        T.gemm(Q_s, K_s, S, transpose_B=True)\n", ""),
            ("S[i, j] = T.if_then_else(visible, S[i, j], neg_inf)\n",
             "S[i, j] = T.if_then_else(visible, 0, neg_inf)\n        T.gemm(Q_s, K_s, S, transpose_B=True)\n")),
           ""),
    Mutant("ch05_backward", "softmax scale folded into dS once",
           (("dST[j, i] = PT[j, i] * (dPT[j, i] - delta[i])",
             "dST[j, i] = sm_scale * PT[j, i] * (dPT[j, i] - delta[i])"),
            ("dq[i, d] *= sm_scale", "dq[i, d] *= 1.0"), ("dk[j, d] *= sm_scale", "dk[j, d] *= 1.0")),
           ""),
]
