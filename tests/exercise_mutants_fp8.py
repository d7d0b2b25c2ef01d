"""Chapter 12's exercises and their mutants: the notebook's solution with one planted bug each.

(a) quantises a tensor block by block in PyTorch; (b) is the FP8 forward's key-tile step in TileLang, checked on
the C backend against the float64 emulation of the same FP8 roundings, then lowered for sm_90a and sm_80.
``tests/test_exercises_ch12.py`` runs them (the same harness as ``exercise_mutants.py``).
"""

from exercise_harness import Exercise, Mutant

PRELUDE = """
import math
import torch
import tilelang.language as T
from course_utils.api.fp8 import E4M3_MAX, P_SCALE
from course_utils.kernels.flash_fwd_fp8 import round_to_e4m3
from course_utils.kernels.flash_pieces import LOG2E
from course_utils.kernels.tiles import TileBackend
"""

EXERCISES = {
    "ch12_quantise": Exercise("12_fp8_attention", ("quantise_tile",), "ch12:check_quantise_tile", "quantise_tile",
                              PRELUDE),
    "ch12_fp8_forward": Exercise("12_fp8_attention", ("fp8_forward", "fp8_tile_macros"), "ch12:check_fp8_forward",
                                 "fp8_forward", PRELUDE),
}

MUTANTS = [
    # --- (a): the quantiser ---
    Mutant("ch12_quantise", "one scale for the whole tensor",
           (("amax = padded.unflatten(-2, (blocks, block)).abs().amax(dim=(-1, -2))",
             "amax = padded.abs().amax(dim=(-2, -1))[..., None].expand(*padded.shape[:-2], blocks)"),),
           "one scale for the whole tensor"),
    Mutant("ch12_quantise", "the scale returned instead of the descale",
           (("return (x.float() / per_row).to(torch.float8_e4m3fn), descale",
             "return (x.float() / per_row).to(torch.float8_e4m3fn), 1 / descale"),), "not the descale"),
    Mutant("ch12_quantise", "a block of zeros divides by zero",
           (("descale = torch.where(amax == 0, torch.ones_like(amax), amax / E4M3_MAX)", "descale = amax / E4M3_MAX"),),
           "a block of zeros"),

    # --- (b): the FP8 tile step ---
    Mutant("ch12_fp8_forward", "descales missing from the exponent",
           (("exponent_scale = Q_descale[b, h, qb] * K_descale[b, h, kb] * scale_log2",
             "exponent_scale = scale_log2"),),
           "the descales are missing"),
    Mutant("ch12_fp8_forward", "Q's descale applied twice",
           (("exponent_scale = Q_descale[b, h, qb] * K_descale[b, h, kb] * scale_log2",
             "exponent_scale = Q_descale[b, h, qb] * Q_descale[b, h, qb] * K_descale[b, h, kb] * scale_log2"),),
           "a descale is applied twice"),
    Mutant("ch12_fp8_forward", "P not quantised",
           (("P[i, j] = round_to_e4m3(S[i, j] * P_SCALE)", "P[i, j] = S[i, j] * P_SCALE"),), "P is not quantised"),
    Mutant("ch12_fp8_forward", "the key tile's descale from the query block",
           (("K_descale[b, h, kb]", "K_descale[b, h, qb]"),), "the wrong block"),
    Mutant("ch12_fp8_forward", "P rounded in the float32 score tile fed to T.gemm (right on the CPU, rejected for "
           "sm_90a)",
           (("P[i, j] = round_to_e4m3(S[i, j] * P_SCALE)\n        T.gemm(P, V_s, acc_o)",
             "S[i, j] = round_to_e4m3(S[i, j] * P_SCALE)\n        T.gemm(S, V_s, acc_o)"),), "lowered for sm_90a"),
]

VARIANTS = []  # correct rewrites that must pass (none yet)
