"""The shapes the kernel checkers draw (``course_utils.exercises.shapes``) cover the classes a kernel's index
arithmetic can get wrong, the same way every time, in well under a second; the heads of every kind are what
they claim to be."""

import time

import pytest
import torch

from course_utils.exercises.shapes import (
    HEAD_KINDS,
    KEY_WALK_TILINGS,
    QUERY_WALK_TILINGS,
    Shape,
    attention_inputs,
    describe,
    draw_shapes,
    required_classes,
    shape_classes,
)


@pytest.mark.parametrize("walk, window", [("keys", None), ("queries", None), ("keys", 5)],
                         ids=["forward and dQ", "dK/dV", "window"])
def test_drawn_shapes_cover_every_required_class(walk, window):
    start = time.perf_counter()
    shapes = draw_shapes(walk, seed=61, window=window)
    assert time.perf_counter() - start < 2.0
    tilings = KEY_WALK_TILINGS if walk == "keys" else QUERY_WALK_TILINGS
    assert required_classes(walk, tilings, window=window is not None) <= set(describe(shapes, walk))
    assert len(shapes) <= 6  # each is a compilation (about two seconds)
    assert draw_shapes(walk, seed=61, window=window) == shapes  # seeded


def test_every_residue_of_the_bound_is_met_both_ways():
    covered = set(describe(draw_shapes("keys", seed=31), "keys"))
    for relation in ("block_M < block_N", "block_M > block_N"):
        for residue in range(4):
            assert f"causal stop ≡ {residue} (mod block_N), {relation}" in covered
    for residue in (0, 1, 3):
        assert f"offset S_k − S_q ≡ {residue} (mod block_N)" in covered
    assert {"rows that see no key", "S_q < S_k", "S_q below one block", "one query row", "one key",
            "non-causal"} <= covered


def test_the_capstone_draw_meets_the_edge_residues_of_equal_tiles():
    shapes = draw_shapes("both", tilings=((16, 16),), residues="edges", seed=61, max_seq=40, limit=3, edges=False)
    covered = set(describe(shapes, "keys")) | set(describe(shapes, "queries"))
    for residue in (0, 1, 15):
        assert f"causal stop ≡ {residue} (mod block_N), block_M = block_N" in covered
        assert f"causal start ≡ {residue} (mod block_M), block_N = block_M" in covered


def test_a_stop_residue_counts_only_where_the_last_row_sees_more_than_one_key():
    # S_q = 17, S_k = 2 with 16 × 16 tiles: the first block's last row sees key 0 alone (dS = 0 there).
    assert not any(c.startswith("causal stop") for c in shape_classes(Shape(17, 2, 16, 16), "keys"))
    assert "causal stop ≡ 1 (mod block_N), block_M = block_N" in shape_classes(Shape(16, 17, 16, 16), "keys")


def test_head_kinds_have_the_scores_they_claim():
    q, k, v = attention_inputs(1, len(HEAD_KINDS), 6, 9, 16, seed=1)
    scores = q @ k.transpose(-1, -2)
    assert scores[0, HEAD_KINDS.index("very negative")].max() < -500
    assert scores[0, HEAD_KINDS.index("very large")].min() > 500
    # still a spread between keys of a row, or the softmax would be flat
    assert (scores[0, HEAD_KINDS.index("very large")].std(-1) > 1).all()
    assert torch.equal(attention_inputs(1, 4, 6, 9, 16, seed=1)[0], q)


def test_the_capstone_lengths_meet_each_kernels_own_tiles():
    """Chapter 05's capstone calls the forward (32 × 8 tiles by default) and dK/dV, dQ (16 × 16) on the same
    lengths: they meet the edge residues of every kernel's bound at its own tiles."""
    from course_utils.exercises.shapes import draw_lengths

    lengths = draw_lengths([((32, 8), ("keys",)), ((16, 16), ("keys", "queries"))], max_seq=80)
    assert len(lengths) <= 4
    for M, N, walk, bound, residues in ((32, 8, "keys", "causal stop", (0, 1, 7)),
                                        (16, 16, "keys", "causal stop", (0, 1, 15)),
                                        (16, 16, "queries", "causal start", (0, 1, 15))):
        covered = set(describe([Shape(sq, sk, M, N) for sq, sk in lengths], walk))
        assert {r for r in residues if any(c.startswith(f"{bound} ≡ {r} ") for c in covered)} == set(residues)


def test_whole_block_shapes_cover_one_two_and_more_blocks_both_ways():
    from course_utils.exercises.shapes import draw_whole_blocks, whole_block_classes

    shapes = draw_whole_blocks()
    covered = set().union(*(whole_block_classes(s) for s in shapes))
    assert {"1 key block", "2 key blocks", "3+ key blocks", "block_M > block_N", "block_M < block_N",
            "S_q not a multiple of block_M", "S_q below one block"} <= covered
    assert all(s.seq_k % s.block_N == 0 and not s.causal for s in shapes)
    assert shapes[0].block_M > shapes[0].block_N  # a tile counted with the other block size fails to compile first


def test_residue_lengths_meet_every_edge_of_the_tile_and_the_page():
    from course_utils.exercises.shapes import draw_residue_lengths, length_classes

    for moduli in ((4, 8), (2, 6)):
        lengths = draw_residue_lengths(moduli, max_length=3 * max(moduli), seed=5)
        covered = set().union(*(length_classes(n, moduli) for n in lengths))
        assert {f"length ≡ {r} (mod {m})" for m in moduli for r in (0, 1, m - 1)} <= covered
        assert {"empty", "shorter than one tile", "past one page"} <= covered
        assert draw_residue_lengths(moduli, max_length=3 * max(moduli), seed=5) == lengths  # seeded


def test_gemm_shapes_tell_the_block_sizes_apart():
    """Chapter 04 (c)'s GEMM: every size ragged and past two blocks, three different block sizes, block_M < and >
    block_N, and a K loop counted in block_M or block_N ending early, in two shapes, the same every time."""
    from course_utils.exercises.shapes import GEMM_TILINGS, GemmShape, draw_gemm_shapes, gemm_classes

    start = time.perf_counter()
    shapes = draw_gemm_shapes(seed=4)
    assert time.perf_counter() - start < 2.0
    covered = set().union(*(gemm_classes(s) for s in shapes))
    for name in "MNK":
        assert {f"{name} not a multiple of block_{name}", f"{name} past two blocks"} <= covered
    assert {"block_M < block_N", "block_M > block_N", "three different block sizes",
            "fewer K tiles counted in block_M", "fewer K tiles counted in block_N"} <= covered
    assert [(s.block_M, s.block_N, s.block_K) for s in shapes] == list(GEMM_TILINGS)
    assert draw_gemm_shapes(seed=4) == shapes
    # Equal tiles, the one case of old, cover none of the classes that tell the block sizes apart.
    assert not {"three different block sizes", "fewer K tiles counted in block_M"} & gemm_classes(
        GemmShape(96, 80, 160, 64, 64, 64))


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_merge_rows_put_the_largest_lse_everywhere_and_the_extremes_in(parts):
    """Chapters 09 (c) and 10 (c)'s merges: one row per class (the largest LSE first, last and, with three parts or
    more, in the middle, far above the rest; the first and the last part empty; no part; a tie; every LSE past 88
    and every LSE below −104), the same every time; the fixed rows of old missed two of them."""
    import math

    from course_utils.exercises.shapes import draw_merge_rows, merge_row_classes, required_merge_classes

    rows, labels = draw_merge_rows(parts, seed=7)
    assert rows.shape == (len(labels), parts) and rows.dtype == torch.float32
    covered = set().union(*(merge_row_classes(row) for row in rows.tolist()))
    assert required_merge_classes(parts) <= covered
    assert all(label == "ordinary" or label in merge_row_classes(row) for row, label in zip(rows.tolist(), labels))
    assert torch.equal(draw_merge_rows(parts, seed=7)[0], rows)  # seeded
    # Chapter 10 (c)'s rows of old: running empty, partial empty, both, LSEs 100 and 95 or 105, ordinary.
    inf = -math.inf
    old = set().union(*(merge_row_classes(r) for r in ([inf, 1.0], [2.0, inf], [inf, inf], [100.0, 95.0],
                                                        [100.0, 105.0], [0.5, -1.0])))
    assert not {"every LSE below −104", "the largest LSE last, more than 88 above the rest"} & old
