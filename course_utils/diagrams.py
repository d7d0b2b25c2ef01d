"""Pictures of how the FlashAttention forward splits its work (chapter 03 onwards).

- ``tile_classes``: for each (query block, key block) tile, whether the kernel skips it, visits it
  whole, or visits it with a mask (the causal diagonal, a window edge, keys past the end);
- ``grid_mapping``: which thread block (blockIdx.x, .y, .z) owns which query block of which
  (batch, head), and how many K/V tiles it streams;
- ``tile_visits``: the tiles over the score matrix, skipped triangle and masked diagonal visible;
- ``visit_table``: the same as text, exact block indices.
Visibility follows ``course_utils.reference.visibility_mask`` (causal bottom-right aligned).
"""

from __future__ import annotations

import matplotlib
import matplotlib.patches as mpatches
import numpy as np

from .reference import visibility_mask

__all__ = ["SKIPPED", "FULL", "MASKED", "TILE_COLORS", "tile_classes", "visit_table", "grid_mapping",
           "tile_visits"]

SKIPPED, FULL, MASKED = 0, 1, 2
TILE_COLORS = {FULL: "#1f77b4", MASKED: "#ff7f0e", SKIPPED: "#d9d9d9"}
_LABELS = {FULL: "visited, no mask needed", MASKED: "visited, needs the mask", SKIPPED: "skipped"}


def _ceil(a, b):
    return -(-a // b)


def tile_classes(seq_q, seq_k, block_M, block_N, *, causal=False, window_size=None):
    """Int array [⌈S_q/block_M⌉, ⌈S_k/block_N⌉]: SKIPPED, FULL or MASKED for every tile.

    A tile is visited when at least one of its (query, key) pairs is visible, and needs the mask
    when some pair in it is not (masked out, or a key position past the end of K).
    """
    visible = visibility_mask(seq_q, seq_k, causal=causal, window_size=window_size).numpy()
    n_q, n_k = _ceil(seq_q, block_M), _ceil(seq_k, block_N)
    classes = np.full((n_q, n_k), SKIPPED, dtype=int)
    for qb in range(n_q):
        for kb in range(n_k):
            tile = visible[qb * block_M:(qb + 1) * block_M, kb * block_N:(kb + 1) * block_N]
            padded = (kb + 1) * block_N > seq_k
            if tile.any():
                classes[qb, kb] = FULL if tile.all() and not padded else MASKED
    return classes


def visit_table(seq_q, seq_k, block_M, block_N, *, causal=False, window_size=None):
    """Print, for each query block, its rows, the key blocks it visits and those that need the mask."""
    classes = tile_classes(seq_q, seq_k, block_M, block_N, causal=causal, window_size=window_size)
    print(f"S_q={seq_q} S_k={seq_k} block {block_M}×{block_N} causal={causal} window={window_size}")
    print(f"{'q block':>7}  {'rows':>9}  {'key blocks visited':<20}  masked")
    for qb, row in enumerate(classes):
        rows = f"{qb * block_M}–{min((qb + 1) * block_M, seq_q) - 1}"
        visited = [kb for kb, c in enumerate(row) if c != SKIPPED]
        span = f"{visited[0]}..{visited[-1]}" if visited else "none"
        masked = [kb for kb, c in enumerate(row) if c == MASKED]
        print(f"{qb:>7}  {rows:>9}  {span:<20}  {masked}")
    print(f"tiles visited: {int((classes != SKIPPED).sum())} of {classes.size}")


def grid_mapping(ax, batch, heads, seq, block_M, block_N=None, *, causal=False):
    """Draw the launch grid (⌈S/block_M⌉, H, B): each cell is one thread block, labelled with its
    (blockIdx.x, .y, .z) and coloured by the number of K/V tiles it streams. Causal kernels hand the
    last (busiest) query block to blockIdx.x = 0 so that it starts first."""
    block_N = block_N or block_M
    work = (tile_classes(seq, seq, block_M, block_N, causal=causal) != SKIPPED).sum(axis=1)
    n_q, n_k = len(work), _ceil(seq, block_N)
    cmap = matplotlib.colormaps["Blues"]
    for bz in range(batch):
        for by in range(heads):
            col = bz * heads + by
            for qb in range(n_q):
                bx = n_q - 1 - qb if causal else qb
                shade = cmap(0.15 + 0.7 * work[qb] / n_k)
                ax.add_patch(mpatches.Rectangle((col, qb), 1, 1, facecolor=shade, edgecolor="white", lw=2))
                ax.text(col + 0.5, qb + 0.5, f"({bx},{by},{bz})\n{work[qb]} tile{'s' if work[qb] != 1 else ''}", ha="center", va="center",
                        fontsize=7, color="white" if work[qb] / n_k > 0.6 else "black")
        if bz:
            ax.axvline(bz * heads, color="black", lw=1.5)
    ax.set_xlim(0, batch * heads)
    ax.set_ylim(n_q, 0)
    ax.set_xticks(np.arange(batch * heads) + 0.5,
                  [f"b{bz} h{by}" for bz in range(batch) for by in range(heads)], fontsize=8)
    ax.set_yticks(np.arange(n_q) + 0.5,
                  [f"rows {q * block_M}–{min((q + 1) * block_M, seq) - 1}" for q in range(n_q)], fontsize=8)
    ax.grid(False)
    ax.set_title(f"{'causal' if causal else 'non-causal'}: grid ({n_q}, {heads}, {batch}) = "
                 f"(query blocks, heads, batch)\ncell: (blockIdx.x, .y, .z) and K/V tiles streamed")


def tile_visits(ax, seq_q, seq_k, block_M, block_N, *, causal=False, window_size=None, title=None):
    """Draw the score matrix as tiles: visited whole (blue), visited with a mask (orange), or
    skipped (hatched grey). Inside a visited tile, strong cells are the visible (query, key) pairs
    and pale cells are computed but masked out. The thick frame is the real S_q × S_k matrix: a
    last tile that sticks out holds positions past the end. Returns legend handles."""
    classes = tile_classes(seq_q, seq_k, block_M, block_N, causal=causal, window_size=window_size)
    n_q, n_k = classes.shape
    visible = np.zeros((n_q * block_M, n_k * block_N), dtype=bool)
    visible[:seq_q, :seq_k] = visibility_mask(seq_q, seq_k, causal=causal, window_size=window_size).numpy()
    tile_of = np.kron(classes, np.ones((block_M, block_N), dtype=int))
    image = np.zeros(visible.shape + (4,))
    for c in (FULL, MASKED):
        image[tile_of == c, :3] = matplotlib.colors.to_rgb(TILE_COLORS[c])
    image[..., 3] = np.where(tile_of == SKIPPED, 0.0, np.where(visible, 0.85, 0.2))
    ax.imshow(image, extent=(0, n_k * block_N, n_q * block_M, 0), interpolation="nearest", zorder=1)
    for (qb, kb), c in np.ndenumerate(classes):
        ax.add_patch(mpatches.Rectangle((kb * block_N, qb * block_M), block_N, block_M, lw=0.8,
                                        facecolor=TILE_COLORS[SKIPPED] if c == SKIPPED else "none",
                                        edgecolor="black", hatch="//" if c == SKIPPED else None, zorder=2))
    ax.add_patch(mpatches.Rectangle((0, 0), seq_k, seq_q, fill=False, edgecolor="black", lw=2.5, zorder=3))
    ax.set_xlim(0, n_k * block_N)
    ax.set_ylim(n_q * block_M, 0)
    ax.set_xticks(np.arange(n_k) * block_N + block_N / 2, [f"kb {k}" for k in range(n_k)], fontsize=8)
    ax.set_yticks(np.arange(n_q) * block_M + block_M / 2, [f"qb {q}" for q in range(n_q)], fontsize=8)
    ax.tick_params(length=0)
    ax.grid(False)
    ax.set_aspect("equal")
    kind = f"window {window_size}" if window_size else ("causal" if causal else "non-causal")
    visits = int((classes != SKIPPED).sum())
    ax.set_title(title or f"{kind}, S_q={seq_q}, S_k={seq_k}\n{visits} of {classes.size} tiles visited")
    return [mpatches.Patch(facecolor=TILE_COLORS[c], alpha=0.85 if c != SKIPPED else 1.0, edgecolor="black",
                           label=_LABELS[c], hatch="//" if c == SKIPPED else None) for c in (FULL, MASKED, SKIPPED)]
