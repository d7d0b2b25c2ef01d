"""The shapes and inputs every kernel checker draws, from the classes a kernel's index arithmetic can get wrong.

A checker compiles one kernel per shape (a couple of seconds each on the C backend), so it can afford four
or five; a fixed list of that size leaves whole classes untried (the causal offset S_k − S_q at other
residues modulo the tile, block_M ≠ block_N on the causal path). Here the classes are named and the
shapes are drawn to cover them:

- the tile bound of a causal walk at every residue modulo the tile it is counted in. A query block that
  walks key blocks (the forward, dQ) stops at ⌈((qb+1)·block_M + past) / block_N⌉; a key block that walks
  query blocks (dK/dV) starts at ⌊(kb·block_N − past) / block_M⌋ (past = S_k − S_q). Both are drawn with
  block_M > block_N and block_M < block_N, with tiles that are not multiples of each other (3 × 4, 6 × 4),
  so that one shape meets several residues, and the offset past at residues 0, 1 and tile − 1;
- S not a multiple of the tile, S below one block, one query row, one key;
- rows that see no key (causal with S_q > S_k), and a window's start at its residues where there is one;
- per head, rows whose scores are all very negative, all very large, or large (``attention_inputs``).

``draw_shapes`` is seeded and greedy: from candidate sequence lengths it keeps the shape that adds the most
classes still missing, until the required ones are covered; ``shape_classes`` names what one shape covers
(for the tests and the tables). Every kernel checker and chapter 05's end-to-end check use it; chapter 07's
rotated loop, whose key length is a whole number of blocks, draws from ``draw_whole_blocks``, and chapter 04's
GEMM, whose tiles are three block sizes, from ``draw_gemm_shapes``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

__all__ = ["Shape", "shape_classes", "required_classes", "draw_shapes", "attention_inputs", "HEAD_KINDS",
           "KEY_WALK_TILINGS", "QUERY_WALK_TILINGS", "describe",
           "draw_lengths", "WHOLE_BLOCK_TILINGS", "whole_block_classes", "draw_whole_blocks",
           "length_classes", "draw_residue_lengths", "GemmShape", "GEMM_TILINGS", "gemm_classes",
           "draw_gemm_shapes", "merge_row_classes", "required_merge_classes", "draw_merge_rows",
           "describe_merge_rows"]

# A query block walking key blocks counts its stop in block_N; a key block walking query blocks its start in block_M.
KEY_WALK_TILINGS = ((3, 4), (6, 4))    # (block_M, block_N): block_M < block_N and block_M > block_N
QUERY_WALK_TILINGS = ((4, 3), (4, 6))


@dataclass(frozen=True)
class Shape:
    seq_q: int
    seq_k: int
    block_M: int
    block_N: int
    causal: bool = True
    window: int | None = None

    @property
    def past(self):
        """The causal offset S_k − S_q: query q sees key k iff k <= q + past."""
        return self.seq_k - self.seq_q

    def label(self):
        mask = f"window {self.window}" if self.window is not None else "causal" if self.causal else "non-causal"
        return f"{mask}, S_q={self.seq_q}, S_k={self.seq_k}, {self.block_M}×{self.block_N} tiles"


def _relation(a, b, first, second):
    return f"{first} {'<' if a < b else '>' if a > b else '='} {second}"


def shape_classes(shape, walk="keys"):
    """The classes ``shape`` covers for a kernel whose thread blocks walk ``walk`` ("keys": a query block
    visits key blocks, as the forward and dQ do; "queries": a key block visits query blocks, as dK/dV does)."""
    s, out = shape, set()
    M, N, past = s.block_M, s.block_N, s.past
    out.add("non-causal" if not s.causal and s.window is None else "causal")
    if s.seq_q % M:
        out.add("S_q not a multiple of block_M")
    if s.seq_k % N:
        out.add("S_k not a multiple of block_N")
    if s.seq_q < M:
        out.add("S_q below one block")
    if s.seq_q == 1:
        out.add("one query row")
    if s.seq_k == 1:
        out.add("one key")
    masked = s.causal or s.window is not None
    if masked and past < 0:
        out.add("rows that see no key")
    if masked and past > 0:
        out.add("S_q < S_k")
    if s.window is not None and past >= s.window:  # keys k <= past − window are before every row's window
        out.add("keys no query sees")
    if s.window is not None and past - s.window + 1 >= N:
        out.add("a key block no query sees")
        if (past - s.window + 1) % N == 0:  # visiting one block early reads only keys no query may see
            out.add("the first key any query sees is the first of a block")
    if not masked:
        return frozenset(out)
    if walk == "keys":
        tile, rel = N, _relation(M, N, "block_M", "block_N")
        out.add(f"offset S_k − S_q ≡ {past % N} (mod block_N)")
        for qb in range(-(-s.seq_q // M)):
            if (qb + 1) * M > s.seq_q:  # a ragged last block: its last rows are padding, not a visible bound
                continue
            end = (qb + 1) * M + past  # keys [0, end) are what the block's last row may see
            if 1 < end <= s.seq_k:  # (a row that sees one key has dS = 0: its last key must not be its only one)
                out.add(f"causal stop ≡ {end % tile} (mod block_N), {rel}")
            if s.window is not None:
                first = qb * M + past - s.window + 1  # the first key the block's first row sees
                if 0 < first < s.seq_k:
                    out.add(f"window start ≡ {first % tile} (mod block_N)")
    else:
        tile, rel = M, _relation(N, M, "block_N", "block_M")
        out.add(f"offset S_k − S_q ≡ {past % M} (mod block_M)")
        for kb in range(-(-s.seq_k // N)):
            first_query = kb * N - past  # the first query that sees the block's first key
            if 0 < first_query < s.seq_q:
                out.add(f"causal start ≡ {first_query % tile} (mod block_M), {rel}")
    return frozenset(out)


def required_classes(walk, tilings, window=False, residues=None):
    """The classes the causal shapes drawn for ``walk`` over ``tilings`` must cover: the bound at every residue
    of its tile, or at ``residues`` ("edges": 0, 1 and tile − 1, what one tiling of equal blocks can afford)."""
    out = {"rows that see no key", "S_q < S_k", "S_q not a multiple of block_M", "S_k not a multiple of block_N"}
    for M, N in tilings:
        tile = N if walk == "keys" else M
        rel = _relation(M, N, "block_M", "block_N") if walk == "keys" else _relation(N, M, "block_N", "block_M")
        bound = "causal stop" if walk == "keys" else "causal start"
        every = range(tile) if residues != "edges" else sorted({0, 1, tile - 1})
        out |= {f"{bound} ≡ {r} (mod {'block_N' if walk == 'keys' else 'block_M'}), {rel}" for r in every}
        out |= {f"offset S_k − S_q ≡ {r} (mod {'block_N' if walk == 'keys' else 'block_M'})"
                for r in {0, 1, tile - 1}}
        if window and walk == "keys":
            out |= {f"window start ≡ {r} (mod block_N)" for r in range(tile)}
            out |= {"a key block no query sees", "the first key any query sees is the first of a block"}
    return out


def draw_shapes(walk="keys", *, tilings=None, seed=0, max_seq=40, window=None, limit=4, edges=True, residues=None):
    """Shapes that cover ``required_classes(walk, tilings)``, most classes first, then the edge shapes.

    ``walk`` "both": the classes of both walks (a forward and a backward that share one tiling).
    Greedy over seeded candidates (S_q, S_k ≤ ``max_seq`` for each tiling): each step keeps the candidate
    adding the most required classes still missing (fewer elements break ties), at most ``limit`` masked
    shapes. ``edges`` adds a non-causal shape with S_q below one block and one key (a kernel that masks
    when it should not) and a causal one with a single query row. Returns the list of ``Shape``s."""
    tilings = tilings or (KEY_WALK_TILINGS if walk == "keys" else QUERY_WALK_TILINGS)
    rng = random.Random(seed)
    causal = window is None
    candidates = [Shape(sq, sk, M, N, causal=causal, window=window)
                  for M, N in tilings for sq in range(1, max_seq + 1) for sk in range(1, max_seq + 1)]
    rng.shuffle(candidates)
    covered = {c: frozenset().union(*(shape_classes(c, w) for w in (("keys", "queries") if walk == "both"
                                                                    else (walk,)))) for c in candidates}
    walks = ("keys", "queries") if walk == "both" else (walk,)
    missing = set().union(*(required_classes(w, tilings, window=window is not None, residues=residues)
                            for w in walks))
    def greedy(first):
        chosen, left = [first], missing - covered[first]
        while left and len(chosen) < limit:
            best = max(candidates, key=lambda c: (len(covered[c] & left), -(c.seq_q * c.seq_k)))
            if not covered[best] & left:
                break
            chosen.append(best)
            left = left - covered[best]
        return chosen, left

    # Greedy from each of the few best first shapes; the fewest shapes that cover the most wins.
    firsts = sorted(candidates, key=lambda c: (-len(covered[c] & missing), c.seq_q * c.seq_k))[:12]
    chosen, missing = min((greedy(first) for first in firsts), key=lambda r: (len(r[1]), len(r[0])))
    if missing:
        raise ValueError(f"draw_shapes({walk!r}, {tilings}): {limit} shapes leave {sorted(missing)} uncovered")
    if edges:
        M, N = max(tilings)  # the tiling with the larger block_M, so that S_q can sit below one block
        chosen.append(Shape(M - 1, 2 * N + 1, M, N, causal=False, window=None))
        if window is None:
            chosen.append(Shape(1, 1, M, N, causal=True))
    return chosen


def draw_lengths(specs, *, residues="edges", limit=4, max_seq=48):
    """Sequence lengths (S_q, S_k) for kernels that share them but not their tiles (chapter 05's capstone: the
    forward at its tiles, dK/dV and dQ at theirs). ``specs``: ((block_M, block_N), walks) pairs; the lengths cover
    ``required_classes`` of every walk of every tiling (named per tiling), greedily as ``draw_shapes`` does."""
    def classes(seq_q, seq_k):
        return frozenset(f"{M}×{N} {c}" for (M, N), walks in specs for w in walks
                         for c in shape_classes(Shape(seq_q, seq_k, M, N), w))

    required = {f"{M}×{N} {c}" for (M, N), walks in specs for w in walks
                for c in required_classes(w, ((M, N),), residues=residues)}
    candidates = [(sq, sk) for sq in range(1, max_seq + 1) for sk in range(1, max_seq + 1)]
    covered = {c: classes(*c) for c in candidates}

    def greedy(first):
        chosen, left = [first], required - covered[first]
        while left and len(chosen) < limit:
            best = max(candidates, key=lambda c: (len(covered[c] & left), -(c[0] * c[1])))
            if not covered[best] & left:
                break
            chosen.append(best)
            left = left - covered[best]
        return chosen, left

    firsts = sorted(candidates, key=lambda c: (-len(covered[c] & required), c[0] * c[1]))[:12]
    chosen, missing = min((greedy(first) for first in firsts), key=lambda r: (len(r[1]), len(r[0])))
    if missing:
        raise ValueError(f"draw_lengths: {limit} pairs of lengths leave {sorted(missing)} uncovered")
    return chosen


# A key length that is a whole number of key blocks (chapter 07's rotated loop): block_M > block_N and block_M <
# block_N, tiles that are not multiples of each other, so that a tile counted with the other block size shows.
WHOLE_BLOCK_TILINGS = ((8, 6), (6, 8))


def whole_block_classes(shape):
    """The classes a non-causal shape whose S_k is a whole number of key blocks covers: how many key blocks (one:
    the rotated loop's first and extra iterations clamp to the same block), the tiles' relation, ragged query rows."""
    blocks = shape.seq_k // shape.block_N
    out = {f"{min(blocks, 3)}{'+' if blocks >= 3 else ''} key block{'s' if blocks > 1 else ''}",
           _relation(shape.block_M, shape.block_N, "block_M", "block_N")}
    if shape.seq_q % shape.block_M:
        out.add("S_q not a multiple of block_M")
    if shape.seq_q < shape.block_M:
        out.add("S_q below one block")
    return frozenset(out)


def draw_whole_blocks(tilings=WHOLE_BLOCK_TILINGS, counts=(1, 2, 3)):
    """Non-causal shapes, S_q = S_k = n · block_N for each n of ``counts``, the tilings taken in turn, block_M >
    block_N first (a tile counted with the other block size then fails to compile, which names it). With the
    default tilings every S_q is ragged in block_M; ``whole_block_classes`` names what each covers."""
    order = sorted(tilings, key=lambda tiling: tiling[0] < tiling[1])
    shapes = []
    for index, n in enumerate(counts):
        M, N = order[index % len(order)]
        shapes.append(Shape(n * N, n * N, M, N, causal=False))
    return shapes


def length_classes(length, moduli):
    """The classes one sequence length covers against the tiles it is cut into (``moduli``: a tile, a page):
    its residue modulo each at 0, 1 and m − 1 (an empty one has none: it reads no tile), empty, shorter than the
    smallest, longer than the largest."""
    out = {f"length ≡ {length % m} (mod {m})" for m in moduli if length and length % m in (0, 1, m - 1)}
    if length == 0:
        out.add("empty")
    elif length < min(moduli):
        out.add("shorter than one tile")
    if length > max(moduli):
        out.add("past one page")
    return frozenset(out)


def draw_residue_lengths(moduli, *, max_length, seed=0, limit=6):
    """Sequence lengths (at most ``limit``, up to ``max_length``) that cover ``length_classes`` for every residue 0,
    1 and m − 1 of every modulus, an empty sequence, one shorter than a tile and one past a page; seeded greedy as
    ``draw_shapes`` is. Chapter 09's paged lookup cuts a sequence into tiles of block_N inside pages of
    page_size, and a slip in either shows at its own residues."""
    required = {f"length ≡ {r} (mod {m})" for m in moduli for r in {0, 1, m - 1}}
    required |= {"empty", "shorter than one tile", "past one page"}
    candidates = list(range(max_length + 1))
    random.Random(seed).shuffle(candidates)
    chosen, left = [], set(required)
    while left and len(chosen) < limit:
        best = max(candidates, key=lambda n: (len(length_classes(n, moduli) & left), -n))
        if not length_classes(best, moduli) & left:
            break
        chosen.append(best)
        left -= length_classes(best, moduli)
    if left:
        raise ValueError(f"draw_residue_lengths({moduli}): {limit} lengths leave {sorted(left)} uncovered")
    return chosen


# A GEMM's tiles (chapter 04 (c)): three different block sizes, block_M < block_N in one tiling and > in the other,
# and block_K the smallest in one, so that a K loop counted in block_M or block_N ends before the last K tile.
GEMM_TILINGS = ((32, 16, 8), (16, 32, 24))


@dataclass(frozen=True)
class GemmShape:
    M: int
    N: int
    K: int
    block_M: int
    block_N: int
    block_K: int

    def label(self):
        return f"M={self.M}, N={self.N}, K={self.K}, {self.block_M} × {self.block_N} × {self.block_K} tiles"


def gemm_classes(shape):
    """The classes a GEMM shape (C = A Bᵀ, A [M, K], B [N, K], one block per block_M × block_N tile of C, a K loop
    over block_K) covers: each size ragged in its block and past two blocks (where an offset counted with another
    block size differs, and still reads inside the matrix), the blocks' relation, and a K loop counted in another
    block size ending early."""
    s, out = shape, set()
    for name, size, block in (("M", s.M, s.block_M), ("N", s.N, s.block_N), ("K", s.K, s.block_K)):
        if size % block:
            out.add(f"{name} not a multiple of block_{name}")
        if size > 2 * block:  # an offset counted with a smaller or larger block still lands inside the matrix
            out.add(f"{name} past two blocks")
    out.add(_relation(s.block_M, s.block_N, "block_M", "block_N"))
    if len({s.block_M, s.block_N, s.block_K}) == 3:
        out.add("three different block sizes")
    for name, block in (("M", s.block_M), ("N", s.block_N)):
        # K > block: a K step of block_M lands inside K, so it reads other columns than a loop that stops early
        if -(-s.K // block) < -(-s.K // s.block_K) and s.K > block:
            out.add(f"fewer K tiles counted in block_{name}")
    return frozenset(out)


def draw_gemm_shapes(tilings=GEMM_TILINGS, *, seed=0, max_size=100, candidates=3000):
    """One ``GemmShape`` per tiling, together covering every class ``gemm_classes`` names for the tilings: seeded
    candidates (sizes up to ``max_size``), each tiling taking the one that adds the most classes still missing
    (the smallest product M·N·K breaks ties: a compiled case runs in well under a second)."""
    rng = random.Random(seed)
    required = {f"{name} {what}" for name in "MNK" for what in (f"not a multiple of block_{name}", "past two blocks")}
    required |= {"block_M < block_N", "block_M > block_N", "three different block sizes",
                 "fewer K tiles counted in block_M", "fewer K tiles counted in block_N"}
    required &= set().union(*(gemm_classes(GemmShape(max_size - 1, max_size - 1, max_size - 1, *t)) for t in tilings))
    chosen, missing = [], set(required)
    for tiling in tilings:
        pool = [GemmShape(rng.randint(1, max_size), rng.randint(1, max_size), rng.randint(1, max_size), *tiling)
                for _ in range(candidates)]
        best = max(pool, key=lambda s: (len(gemm_classes(s) & missing), len(gemm_classes(s) & required),
                                        -(s.M * s.N * s.K)))
        chosen.append(best)
        missing -= gemm_classes(best)
    if missing:
        raise ValueError(f"draw_gemm_shapes({tilings}): {sorted(missing)} uncovered")
    return chosen


# Per head: what its rows' scores look like. "very negative": every score of a row near −700 (exp of it
# underflows in float32 unless the running max is subtracted); "very large": near +700 (overflows unless it is).
HEAD_KINDS = ("plain", "very negative", "large", "very large")


def attention_inputs(batch, heads, seq_q, seq_k, dim, *, seed, kinds=HEAD_KINDS, heads_kv=None):
    """Q [B, H, S_q, D], K and V [B, H_kv, S_k, D], float32, seeded; head h of Q is of kind
    ``kinds[h % len(kinds)]`` ("plain", "large" logits ×4, every score of a row "very negative" or
    "very large", of size about 700). K's rows share one direction so that those scores are all extreme."""
    heads_kv = heads_kv or heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=g)
    k, v = (torch.randn(batch, heads_kv, seq_k, dim, generator=g) for _ in range(2))
    direction = torch.ones(dim) / dim ** 0.5  # a unit vector every key leans along
    group = heads // heads_kv
    for h in range(heads):
        kind = kinds[h % len(kinds)]
        if kind == "large":
            q[:, h] *= 4.0
        elif kind in ("very negative", "very large"):
            hk = h // group
            k[:, hk] = 0.3 * k[:, hk] + 8.0 * direction  # every key ≈ 8·u
            sign = -1.0 if kind == "very negative" else 1.0
            q[:, h] = sign * 88.0 * direction + 0.3 * q[:, h]  # every score ≈ ±700, spread by a few units
    return q, k, v


def describe(shapes, walk="keys"):
    """Every class the shapes cover, sorted (for tables and tests)."""
    out = set()
    for shape in shapes:
        out |= shape_classes(shape, walk)
    return sorted(out)


# --- The rows of a merge of partial results: chapter 09 (c)'s split-KV merge, chapter 10 (c)'s ring step ---------
# A merge's "shape" is what one row of partial LSEs looks like: which part holds the largest (a maximum taken over
# the wrong parts misses it, and e^{gap} overflows float32 once the gap passes 88), which part saw no key (LSE −∞),
# and the LSEs' size (all past 88: e^{LSE} overflows; all below −104: e^{LSE} is 0 in float32, subnormals included,
# which a maximum that starts at 0 turns into a row no part saw).
_SPAN = 88.0  # e^x overflows float32 past 88.7
_TINY = -104.0  # e^x is 0 in float32 below −103.97


def merge_row_classes(row):
    """The classes one row of partial LSEs (natural log, −∞ for a part that saw no key) covers."""
    n, inf = len(row), float("-inf")
    finite = [(x, i) for i, x in enumerate(row) if x != inf]
    if not finite:
        return frozenset({"no part saw the row"})
    out = set()
    if row[0] == inf:
        out.add("the first part saw no key")
    if row[-1] == inf:
        out.add("the last part saw no key")
    if len(finite) >= 2:
        (top, at), (second, _) = sorted(finite, reverse=True)[:2]
        where = "first" if at == 0 else "last" if at == n - 1 else "in the middle"
        if top - second > _SPAN:
            out.add(f"the largest LSE {where}, more than 88 above the rest")
        if top == second:
            out.add("a tie for the largest LSE")
    if min(x for x, _ in finite) > _SPAN:
        out.add("every LSE past 88")
    if max(x for x, _ in finite) < _TINY:
        out.add("every LSE below −104")
    return frozenset(out)


def required_merge_classes(parts):
    """What the drawn rows of a merge of ``parts`` partial results must cover."""
    where = ("first", "last") + (("in the middle",) if parts >= 3 else ())
    return ({"no part saw the row", "the first part saw no key", "the last part saw no key",
             "a tie for the largest LSE", "every LSE past 88", "every LSE below −104"}
            | {f"the largest LSE {w}, more than 88 above the rest" for w in where})


def draw_merge_rows(parts, *, seed, moderate=2):
    """LSE rows [rows, parts] (float32, natural log, −∞ where a part saw no key) covering
    ``required_merge_classes(parts)``, one row per class in a fixed order, then ``moderate`` rows of ordinary
    LSEs (N(0, 4²)); the values inside each class are seeded. Returns (rows, labels): labels[i] names row i's
    class ("ordinary" for the moderate rows)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    inf = float("-inf")

    def ordinary():
        return (torch.randn(parts, generator=g) * 4).tolist()

    def build(kind):
        row = ordinary()
        if kind == "no part saw the row":
            row = [inf] * parts
        elif kind == "the first part saw no key":
            row[0] = inf
        elif kind == "the last part saw no key":
            row[-1] = inf
        elif kind == "a tie for the largest LSE":
            top = max(row) + 1.0
            i, j = rng.sample(range(parts), 2)
            row[i] = row[j] = top
        elif kind == "every LSE past 88":
            row = [x / 4 + 95.0 for x in row]
        elif kind == "every LSE below −104":
            row = [x / 4 - 112.0 for x in row]
        else:  # the largest in one part, far above the rest
            at = 0 if " first," in kind else parts - 1 if " last," in kind else rng.randrange(1, parts - 1)
            row[at] = 100.0 + rng.uniform(0, 50)
        return row

    kinds = [kind for kind in _SHORT if kind in required_merge_classes(parts)]
    rows, labels = [], []
    for kind in kinds:
        row = build(kind)
        assert kind in merge_row_classes(row), (kind, row)
        rows.append(row)
        labels.append(kind)
    for _ in range(moderate):
        rows.append(ordinary())
        labels.append("ordinary")
    return torch.tensor(rows, dtype=torch.float32), labels


_SHORT = {"no part saw the row": "no part saw it", "the first part saw no key": "first part empty",
          "the last part saw no key": "last part empty", "a tie for the largest LSE": "a tie",
          "every LSE past 88": "all LSEs > 88", "every LSE below −104": "all LSEs < −104",
          "the largest LSE first, more than 88 above the rest": "largest first (+88)",
          "the largest LSE in the middle, more than 88 above the rest": "largest in the middle (+88)",
          "the largest LSE last, more than 88 above the rest": "largest last (+88)"}


def describe_merge_rows(labels):
    """'0 no part saw it, 1 a tie, …': each row's class, short (for a case's label)."""
    return ", ".join(f"{i} {_SHORT.get(label, label)}" for i, label in enumerate(labels))
