"""Explanatory pictures of how FlashAttention splits its work into tiles and grids (chapter 02 onwards).

- ``online_softmax_diagram``: the online softmax as a chain of states over key blocks;
- ``tile_classes``: for each (query block, key block) tile, whether the kernel skips it, visits it
  whole, or visits it with a mask (the causal diagonal, a window edge, keys past the end);
- ``grid_mapping``: which thread block (blockIdx.x, .y, .z) owns which query block of which
  (batch, head), and how many K/V tiles it streams;
- ``tile_visits``: the tiles over the score matrix, skipped triangle and masked diagonal visible;
- ``visit_table``: the same as text, exact block indices;
- ``backward_grid``, ``dq_layout_map``: the backward's grid and its dQ accumulator layout;
- ``gqa_heads``: which K/V head each query head reads under grouped-query attention;
- ``ring_circle``, ``ring_schedule``, ``ring_block_map``, ``ring_work_map``: ring attention (chapter
  10): the ring, who holds which K/V shard when, which rank computes which blocks at which step.
Visibility follows ``course_utils.core.reference.visibility_mask`` (causal bottom-right aligned).
"""

from __future__ import annotations

import matplotlib
import matplotlib.patches as mpatches
import numpy as np

from ..core.reference import visibility_mask
from . import plots  # noqa: F401  (importing it applies the course style)

__all__ = ["SKIPPED", "FULL", "MASKED", "TILE_COLORS", "online_softmax_diagram", "tile_classes", "visit_table",
           "grid_mapping", "tile_visits", "gqa_heads", "backward_grid", "dq_layout_map", "ring_circle", "ring_schedule",
           "ring_block_map", "ring_work_map"]

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
                tiles = f"{work[qb]} tile" + ("s" if work[qb] != 1 else "")
                ax.text(col + 0.5, qb + 0.5, f"({bx},{by},{bz})\n{tiles}", ha="center", va="center", fontsize=7,
                        color="white" if work[qb] / n_k > 0.6 else "black")
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


# --- chapter 02: the online softmax -------------------------------------------------------------

def online_softmax_diagram(ax, num_blocks=4):
    """The online softmax as a chain: key block j updates the state (m, ℓ, o) left by block j − 1.

    Top row: the key blocks, each read once. Bottom row: the running state after each block; the
    horizontal arrows carry the old state, scaled by α_j = exp(m_{j−1} − m_j). The update rules
    are written underneath.
    """
    def box(x, y, text, color, width=1.8, height=0.8):
        ax.add_patch(mpatches.FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.05",
                                             facecolor=color, edgecolor="black", linewidth=0.8))
        ax.text(x, y, text, ha="center", va="center", fontsize=9)

    def arrow(x0, x1, y0, y1, label=None, dx=0.0, dy=0.0):
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", lw=1.1))
        if label:
            ax.text((x0 + x1) / 2 + dx, (y0 + y1) / 2 + dy, label, ha="center", va="center", fontsize=9)

    step, top, bottom, half = 2.6, 2.1, 0.0, 0.95
    box(-0.15, bottom, "start\n$m=-\\infty,\\ \\ell=o=0$", "#e8e8e8", width=2.2)
    for j in range(num_blocks):
        x = (j + 1) * step
        box(x, top, f"key block {j}\n$S_{j},\\ V_{j}$", "#aec7e8")
        box(x, bottom, f"$m_{j},\\ \\ell_{j},\\ o_{j}$", "#ffbb78")
        arrow(x, x, top - 0.45, bottom + 0.45)
        arrow(x - step + (1.0 if j == 0 else half), x - half, bottom, bottom, f"$\\times\\alpha_{j}$", dy=0.25)
    x_end = (num_blocks + 1) * step
    box(x_end, bottom, "$O = o\\,/\\,\\ell$\n$\\mathrm{LSE} = m + \\log \\ell$", "#98df8a", width=2.0)
    arrow(x_end - step + half, x_end - 1.05, bottom, bottom)
    rules = ("block $j$:   $m_j = \\max(m_{j-1},\\ \\mathrm{rowmax}\\, S_j)$,   "
             "$\\alpha_j = e^{m_{j-1} - m_j}$,   $P_j = e^{S_j - m_j}$,   "
             "$\\ell_j = \\alpha_j \\ell_{j-1} + \\mathrm{rowsum}\\, P_j$,   $o_j = \\alpha_j o_{j-1} + P_j V_j$")
    ax.text(x_end / 2, bottom - 0.95, rules, ha="center", va="center", fontsize=9)
    ax.set(xlim=(-1.4, x_end + 1.1), ylim=(-1.3, 2.6), aspect="equal")
    ax.axis("off")


# --- chapter 06: grouped-query attention -----------------------------------------------------------

def gqa_heads(ax, heads, heads_kv, *, title=None):
    """Draw which K/V head each query head reads under GQA: query head h uses K/V head h // group.

    Top row: the query heads (one thread-block column ``by`` each in the forward grid); bottom row:
    the K/V heads, each shared by ``group = heads // heads_kv`` query heads, one colour per group.
    """
    group = heads // heads_kv
    colors = matplotlib.colormaps["tab10"].colors
    span = max(heads, 1)
    kv_x = [(g + 0.5) * span / heads_kv for g in range(heads_kv)]
    for h in range(heads):
        g = h // group
        x = h + 0.5
        ax.add_patch(mpatches.FancyBboxPatch((x - 0.4, 1.6), 0.8, 0.6, boxstyle="round,pad=0.02",
                                             facecolor=colors[g % 10], edgecolor="black", lw=0.8, alpha=0.85))
        ax.text(x, 1.9, f"q{h}", ha="center", va="center", fontsize=8, color="white")
        ax.annotate("", xy=(kv_x[g], 0.62), xytext=(x, 1.58),
                    arrowprops=dict(arrowstyle="->", lw=0.9, color=colors[g % 10]))
    width = min(0.8 * group, span / heads_kv - 0.2)
    for g, x in enumerate(kv_x):
        ax.add_patch(mpatches.FancyBboxPatch((x - width / 2, 0.0), width, 0.6, boxstyle="round,pad=0.02",
                                             facecolor=colors[g % 10], edgecolor="black", lw=0.8))
        ax.text(x, 0.3, f"K{g}, V{g}", ha="center", va="center", fontsize=9, color="white")
    ax.text(-0.3, 1.9, "query heads\n(by)", ha="right", va="center", fontsize=9)
    ax.text(-0.3, 0.3, "K/V heads\n(by // group)", ha="right", va="center", fontsize=9)
    ax.set(xlim=(-2.6, span + 0.2), ylim=(-0.2, 2.4))
    ax.axis("off")
    ax.set_title(title or f"GQA: {heads} query heads, {heads_kv} K/V heads, group = {group}")


# --- chapter 05: the backward pass ------------------------------------------------------------------

def backward_grid(ax, seq_q, seq_k, block_M, block_N, *, causal=False, title=None):
    """The backward's key-block-major grid over the score matrix, and who writes which gradient.

    Column ``kb`` of tiles belongs to thread block ``blockIdx.x = kb``: it keeps K and V of those keys
    resident and walks down its column (numbers: the order of the walk), so dK and dV of its keys have
    one writer. Skipped tiles (causal) are hatched. On the right, each query block's dQ rows receive
    one atomic add per visited tile in their row: one small square per writing thread block.
    """
    classes = tile_classes(seq_q, seq_k, block_M, block_N, causal=causal)
    n_q, n_k = classes.shape
    colors = matplotlib.colormaps["tab10"].colors
    for (qb, kb), c in np.ndenumerate(classes):
        visited = c != SKIPPED
        ax.add_patch(mpatches.Rectangle((kb, qb), 1, 1, lw=0.8, edgecolor="black",
                                        facecolor=colors[kb % 10] if visited else TILE_COLORS[SKIPPED],
                                        alpha=0.75 if visited else 1.0, hatch=None if visited else "//"))
        if visited:
            step = qb - int(np.argmax(classes[:, kb] != SKIPPED)) + 1
            ax.text(kb + 0.5, qb + 0.5, str(step), ha="center", va="center", fontsize=9, color="white",
                    fontweight="bold")
    for kb in range(n_k):
        ax.text(kb + 0.5, -0.15, f"block {kb}", ha="center", va="bottom", fontsize=8, color=colors[kb % 10])
        ax.add_patch(mpatches.Rectangle((kb + 0.08, n_q + 0.25), 0.84, 0.6, facecolor=colors[kb % 10],
                                        edgecolor="black", lw=0.8))
        ax.text(kb + 0.5, n_q + 0.55, "dK, dV", ha="center", va="center", fontsize=7, color="white")
    ax.text(-0.1, n_q + 0.55, "written once\n(registers)", ha="right", va="center", fontsize=8)
    x0, width = n_k + 0.5, 0.9 + 0.22 * n_k
    ax.text(x0 + width / 2, -0.15, "dQ_acc (float32)", ha="center", va="bottom", fontsize=8)
    for qb in range(n_q):
        writers = [kb for kb in range(n_k) if classes[qb, kb] != SKIPPED]
        ax.add_patch(mpatches.Rectangle((x0, qb + 0.08), width, 0.84, facecolor="white", edgecolor="black", lw=0.8))
        for n, kb in enumerate(writers):
            ax.add_patch(mpatches.Rectangle((x0 + 0.08 + 0.22 * n, qb + 0.3), 0.18, 0.4, facecolor=colors[kb % 10],
                                            edgecolor="none", alpha=0.85))
        ax.text(x0 + width + 0.1, qb + 0.5, f"{len(writers)} atomic add{'s' if len(writers) != 1 else ''}",
                ha="left", va="center", fontsize=8)
    ax.set_xlim(-1.6, x0 + width + 1.9)
    ax.set_ylim(n_q + 1.0, -0.6)
    ax.set_yticks(np.arange(n_q) + 0.5, [f"qb {q}" for q in range(n_q)], fontsize=8)
    ax.set_xticks([])
    ax.tick_params(length=0)
    ax.grid(False)
    for side in ("left", "bottom", "top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_aspect("equal")
    kind = "causal" if causal else "non-causal"
    ax.set_title(title or f"{kind}: grid over key blocks, each walks down its column", fontsize=10)


def dq_layout_map(ax_tile, ax_memory, offsets, lanes, registers):
    """Where each element of an 8 × 8 dQ tile goes under a permuted accumulator layout.

    ``offsets``, ``lanes`` and ``registers`` are 8 × 8 integer arrays: the element's offset in the
    64-float chunk, and the thread (lane) and register that hold it in the tensor-core accumulator.
    Left: the tile as it sits in a row-major dQ (each row of 8 floats is 32 contiguous bytes; rows
    are a whole dQ row apart), cells coloured by register and labelled with lane and new offset.
    Right: the 64 floats of the permuted chunk in address order, two rows of 32 (128 bytes each),
    each labelled with its lane and the (l, d) it stores: one row is what the 32 lanes write with
    one instruction for one register.
    """
    reg_colors = {0: "#aec7e8", 1: "#ffbb78"}
    for (l, d), off in np.ndenumerate(offsets):
        reg = int(registers[l, d]) % 2
        ax_tile.add_patch(mpatches.Rectangle((d, l), 1, 1, facecolor=reg_colors[reg], edgecolor="white", lw=1.5))
        ax_tile.text(d + 0.5, l + 0.5, f"t{lanes[l, d]}\n→{off}", ha="center", va="center", fontsize=7)
    ax_tile.set(xlim=(0, 8), ylim=(8, 0), xlabel="column d", ylabel="row l")
    ax_tile.set_xticks(np.arange(8) + 0.5, range(8))
    ax_tile.set_yticks(np.arange(8) + 0.5, range(8))
    ax_tile.set_aspect("equal")
    ax_tile.grid(False)
    ax_tile.tick_params(length=0)
    ax_tile.set_title("row-major 8 × 8 tile: lane tN holds it, → new offset", fontsize=10)
    for (l, d), off in np.ndenumerate(offsets):
        row, col = divmod(int(off), 32)
        reg = int(registers[l, d]) % 2
        ax_memory.add_patch(mpatches.Rectangle((col, row), 1, 1, facecolor=reg_colors[reg], edgecolor="white",
                                               lw=1))
        ax_memory.text(col + 0.5, row + 0.5, f"t{lanes[l, d]}   ({l},{d})", ha="center", va="center", fontsize=7,
                       rotation=90)
    ax_memory.set(xlim=(0, 32), ylim=(2, 0), xlabel="offset in the row (floats; a row is 128 bytes)")
    ax_memory.set_xticks(np.arange(0, 32, 4) + 0.5, range(0, 32, 4))
    ax_memory.set_yticks([0.5, 1.5], ["offsets 0–31\nregister 0", "offsets 32–63\nregister 1"], fontsize=8)
    ax_memory.set_aspect("auto")
    ax_memory.grid(False)
    ax_memory.tick_params(length=0)
    ax_memory.set_title("the same 64 floats under make_dq_layout, in address order: lane (l, d)", fontsize=10)


# --- chapter 10: ring attention ----------------------------------------------------------------------

def _rank_color(rank):
    return plots.COLORS[rank % len(plots.COLORS)]


def ring_circle(ax, world):
    """The ranks on a ring: each keeps its queries and sends its current K/V shard to the next rank."""
    angles = np.pi / 2 - 2 * np.pi * np.arange(world) / world
    xy = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    for r, (x, y) in enumerate(xy):
        ax.add_patch(mpatches.Circle((x, y), 0.27, facecolor=_rank_color(r), alpha=0.85, edgecolor="black"))
        ax.text(x, y, f"rank {r}\nQ{r}", ha="center", va="center", fontsize=9, color="white")
    for r in range(world):
        start, end = xy[r], xy[(r + 1) % world]
        direction = (end - start) / np.linalg.norm(end - start)
        ax.annotate("", xy=end - 0.32 * direction, xytext=start + 0.32 * direction,
                    arrowprops=dict(arrowstyle="->", lw=1.6, connectionstyle="arc3,rad=-0.25"))
    ax.text(0, 0, "K/V shards\ntravel\nclockwise", ha="center", va="center", fontsize=9)
    ax.set(xlim=(-1.45, 1.45), ylim=(-1.45, 1.45), aspect="equal")
    ax.axis("off")


def ring_schedule(ax, world):
    """Which K/V shard each rank holds at each step: rank r − s (mod world) at step s."""
    for r in range(world):
        for s in range(world):
            owner = (r - s) % world
            ax.add_patch(mpatches.Rectangle((s, r), 1, 1, facecolor=_rank_color(owner), alpha=0.8, edgecolor="white",
                                            lw=2))
            ax.text(s + 0.5, r + 0.5, f"K/V {owner}", ha="center", va="center", fontsize=9, color="white")
    ax.set_xlim(0, world)
    ax.set_ylim(world, 0)
    ax.set_xticks(np.arange(world) + 0.5, [f"step {s}" for s in range(world)])
    ax.set_yticks(np.arange(world) + 0.5, [f"rank {r}" for r in range(world)])
    ax.tick_params(length=0)
    ax.grid(False)
    ax.set_title("the K/V shard each rank holds\n(and computes with, while the next one arrives)")


def ring_block_map(ax, world, layout, *, causal=True, chunk=4):
    """The S × S score matrix split into 2·world chunks of ``chunk`` tokens: each visible (query, key)
    pair coloured by the rank that computes it (the owner of the query), each chunk pair labelled
    with the ring step at which that rank holds the key's shard. Drawn from the token positions of
    ``ring.sequence_positions`` and the causal mask alone, not from ``ring.step_blocks``."""
    from ..api.ring import sequence_positions

    seq_local = 2 * chunk
    seq = world * seq_local
    owner = np.empty(seq, dtype=int)
    for r in range(world):
        owner[sequence_positions(world, r, seq_local, layout).numpy()] = r
    visible = visibility_mask(seq, seq, causal=causal).numpy()
    image = np.ones((seq, seq, 3))
    for i in range(seq):
        image[i, visible[i]] = matplotlib.colors.to_rgb(_rank_color(owner[i]))
    ax.imshow(image, extent=(0, seq, seq, 0), interpolation="nearest")
    for a in range(2 * world):
        for b in range(2 * world):
            block = visible[a * chunk:(a + 1) * chunk, b * chunk:(b + 1) * chunk]
            if block.any():
                step = (owner[a * chunk] - owner[b * chunk]) % world
                ax.text(b * chunk + chunk / 2, a * chunk + chunk / 2, f"s{step}", ha="center", va="center",
                        fontsize=8, color="white" if block.all() else "black")
    for edge in range(0, seq + 1, chunk):
        ax.axhline(edge, color="white", lw=1)
        ax.axvline(edge, color="white", lw=1)
    ticks = np.arange(2 * world) * chunk + chunk / 2
    ax.set_xticks(ticks, [f"c{c}" for c in range(2 * world)], fontsize=8)
    ax.set_yticks(ticks, [f"c{c}\nr{owner[c * chunk]}" for c in range(2 * world)], fontsize=7)
    ax.set(xlabel="key chunk", ylabel="query chunk (rank)")
    ax.grid(False)
    ax.set_title(f"{layout}: {2 * world} chunks on {world} ranks\ncolour: computing rank; label: ring step")


def ring_work_map(ax, work, *, title=None):
    """Work of each rank (rows) at each step (columns), in S_local × S_local blocks, with the
    busiest rank of each step underneath: with one lap in lockstep, the steps take that long."""
    world = work.shape[0]
    ax.imshow(work, cmap="Blues", vmin=0, vmax=1.3, extent=(0, world, world, 0))
    for r in range(world):
        for s in range(world):
            ax.text(s + 0.5, r + 0.5, f"{work[r, s]:g}", ha="center", va="center", fontsize=9,
                    color="white" if work[r, s] >= 0.8 else "black")
    busiest = work.max(axis=0)
    for s in range(world):
        ax.text(s + 0.5, world + 0.45, f"{busiest[s]:g}", ha="center", va="center", fontsize=9, fontweight="bold")
    ax.set_xlim(0, world)
    ax.set_ylim(world + 0.9, 0)
    ax.axhline(world, color="black", lw=1)
    ax.set_xticks(np.arange(world) + 0.5, [f"step {s}" for s in range(world)], fontsize=8)
    ax.set_yticks(list(np.arange(world) + 0.5) + [world + 0.45], [f"rank {r}" for r in range(world)] + ["max"],
                  fontsize=8)
    ax.tick_params(length=0)
    ax.grid(False)
    total, critical = work.sum(), busiest.sum()
    ax.set_title(title or f"{critical:g} blocks on the critical path; {total / world:g} if balanced")
