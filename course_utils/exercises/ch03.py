"""Checkers for chapter 03: which K/V blocks a query block visits, and the FLOPs the kernel executes."""

import torch

from ..diagrams import SKIPPED, tile_classes
from .common import ExerciseWrong, check_exercise

__all__ = ["check_kv_blocks_visited", "check_kernel_flops"]

# (q_block, block_M, block_N, seq, causal): multiples and non-multiples of the blocks, one block,
# a sequence shorter than one block, block_M != block_N both ways.
_VISIT_CASES = [
    (0, 16, 16, 64, False), (3, 16, 16, 64, False), (2, 16, 16, 56, False),
    (0, 16, 16, 64, True), (1, 16, 16, 64, True), (3, 16, 16, 56, True), (0, 16, 16, 7, True),
    (0, 128, 64, 512, True), (3, 128, 64, 512, True), (1, 64, 128, 512, True), (2, 64, 128, 512, True),
    (4, 64, 128, 300, True), (2, 128, 128, 300, False),
]

_FLOP_CASES = [
    (1, 1, 64, 16, 16, 16, False), (1, 1, 64, 16, 16, 16, True), (2, 3, 56, 32, 16, 16, True),
    (4, 16, 4096, 128, 128, 128, True), (1, 16, 16384, 128, 128, 128, True),
    (2, 8, 1000, 64, 128, 64, True), (2, 8, 1000, 64, 64, 128, False),
]


def _visited(q_block, block_M, block_N, seq, causal):
    row = tile_classes(seq, seq, block_M, block_N, causal=causal)[q_block]
    kbs = [kb for kb, c in enumerate(row) if c != SKIPPED]
    return kbs[0], kbs[-1] + 1


def _as_pair(result):
    if isinstance(result, range):
        if result.step != 1:
            raise ExerciseWrong(f"return consecutive key blocks (step 1); got {result}")
        return (result.start, result.stop)
    return tuple(int(x) for x in result)


def check_kv_blocks_visited(fn):
    """``fn(q_block, block_M, block_N, seq, causal)`` must return (first, stop) of the visited key blocks."""
    check_exercise(
        "kv_blocks_visited", lambda *a: torch.tensor(_as_pair(fn(*a))),
        lambda *a: torch.tensor(_visited(*a)), _VISIT_CASES, atol=0, rtol=0,
        hint="Non-causal: every key block, 0 .. ⌈seq/block_N⌉. Causal: stop after the block that holds "
             "the key of the query block's last row, i.e. ⌈(q_block+1)·block_M / block_N⌉, "
             "but never past the last key block.")


def _kernel_flops(batch, heads, seq, dim, block_M, block_N, causal):
    classes = tile_classes(seq, seq, block_M, block_N, causal=causal)
    return 4.0 * batch * heads * int((classes != SKIPPED).sum()) * block_M * block_N * dim


def check_kernel_flops(fn):
    """``fn(batch, heads, seq, dim, block_M, block_N, causal)`` must return the FLOPs of the two
    matmuls the kernel executes (whole tiles, masked parts included)."""
    check_exercise(
        "kernel_flops", lambda *a: torch.tensor(float(fn(*a)), dtype=torch.float64),
        lambda *a: torch.tensor(_kernel_flops(*a), dtype=torch.float64), _FLOP_CASES, atol=0, rtol=1e-12,
        hint="Each visited tile costs two block_M×block_N×dim matmuls, 2·2·block_M·block_N·dim FLOPs; "
             "sum the visited tiles of every query block and multiply by batch·heads.")
