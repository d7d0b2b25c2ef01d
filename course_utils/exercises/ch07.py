"""Checkers for the exercises of chapter 07 (the Hopper forward)."""

import torch

from .common import check_exercise

__all__ = ["check_wasted_share", "check_wait_count", "HINTS"]

HINTS = {
    "a": ["A query block that sees n key blocks runs n + 1 iterations of two matmuls; two of them (the first "
          "P·V, the last QKᵀ) do nothing. With the causal mask, n depends on the query block.",
          "Loop over the query blocks qb: n = ⌈S / block_N⌉, or causal min(that, ⌈(qb + 1)·block_M / block_N⌉); "
          "add 2·(n + 1) to the issued count and 2 to the wasted count; divide at the end."],
    "b": ["Batches finish oldest first: once at most N are running, the N newest may still be unfinished.",
          "N is the number of batches issued after the one you need: len(issued) − 1 − issued.index(needed)."],
}


# --- Exercise 1: the matmuls the rotated loop issues for nothing ------------------------------------

def _wasted_share(seq, block_M, block_N, causal):
    issued = wasted = 0
    num_k_blocks = -(-seq // block_N)
    for qb in range(-(-seq // block_M)):
        n = min(num_k_blocks, -(-((qb + 1) * block_M) // block_N)) if causal else num_k_blocks
        issued += 2 * (n + 1)  # one extra iteration, two matmuls per iteration
        wasted += 2  # the first P·V (P = 0) and the last QKᵀ (its scores are never used)
    return wasted / issued


def check_wasted_share(fn):
    """Check ``fn(seq, block_M, block_N, causal)``: the share of issued matmuls that do nothing useful."""
    hint = ("A query block with n key blocks runs n + 1 iterations of two matmuls each, and exactly "
            "two of them are wasted. With the causal mask, n depends on the query block (chapter 03's "
            "kv_blocks_visited). Sum over the query blocks before dividing.")
    cases = [(4096, 128, 128, False), (4096, 128, 128, True), (1000, 128, 192, True), (100, 128, 128, False),
             (4096, 128, 192, True)]
    check_exercise("wasted_share", lambda *a: torch.tensor(float(fn(*a))), lambda *a: torch.tensor(_wasted_share(*a)),
                   cases, rtol=1e-9, hint=hint)
    for causal in (False, True):
        print(f"   S=1k, 128 × 128 tiles, causal={causal}: {_wasted_share(1024, 128, 128, causal):.1%} of the "
              "issued matmul work is wasted — the price of never branching around a wgmma")


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
