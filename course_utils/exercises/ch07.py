"""Checkers for the exercises of chapter 07 (the Hopper forward)."""

import torch

from ..bench import H100_MATMUL_TFLOPS, H100_SFU_TFLOPS
from .common import check_exercise

__all__ = ["check_exp_share", "check_wait_count"]


# --- Exercise 1: the exponentials' share in the backward -------------------------------------------

def _exp_share(dim, matmuls):
    return (1 / H100_SFU_TFLOPS) / (2 * matmuls * dim / H100_MATMUL_TFLOPS)


def check_exp_share(fn):
    """Check ``fn(dim, matmuls)`` against the time ratio from the H100's SFU and matmul throughputs."""
    hint = ("One score costs one exp2 (1 / SFU rate) and `matmuls` products of length `dim`, each "
            "2·dim FLOPs (1 / matmul rate per FLOP). Divide the first time by the second.")
    cases = [(64, 2), (128, 2), (64, 5), (128, 5), (256, 2)]
    check_exercise("exp_share", lambda d, m: torch.tensor(float(fn(d, m))),
                   lambda d, m: torch.tensor(_exp_share(d, m)), cases, rtol=1e-6, hint=hint)
    print(f"   backward, D=128: the exponentials take {_exp_share(128, 5):.0%} of the matmul time "
          "— little to hide, so the backward is bound by its matmuls and their synchronisation")


# --- Exercise 2: how many wgmma batches may stay in flight -----------------------------------------

def check_wait_count(fn):
    """Check ``fn(issued, needed) -> N`` for wgmma.wait_group N (batches retire in issue order)."""
    hint = ("Batches finish oldest first. Once at most N are still running, the N newest may be "
            "unfinished: N is the number of batches issued after the one you need.")
    cases = [(["QK0"], "QK0"), (["QK1", "PV0"], "QK1"), (["QK1", "PV0"], "PV0"),
             (["QK2", "PV1", "QK3"], "QK2"), (["A", "B", "C", "D"], "B")]
    check_exercise("wait_count", lambda issued, needed: torch.tensor(int(fn(list(issued), needed))),
                   lambda issued, needed: torch.tensor(len(issued) - 1 - issued.index(needed)), cases,
                   atol=0, rtol=0, hint=hint)
