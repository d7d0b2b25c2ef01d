"""Pictures for chapter 09: packed batches and their tiles, the two schedules, split-KV decoding with its
merge, GQA packing, and a paged KV cache with its block table."""

import matplotlib.patches as mpatches
import numpy as np

from .diagrams import MASKED, SKIPPED, TILE_COLORS, tile_classes
from .plots import COLORS

__all__ = ["packed_batch", "schedules", "split_kv", "gqa_tile", "paged_cache"]

_PAD = "#d9d9d9"


def _seq_color(b):
    return COLORS[b % len(COLORS)]


def packed_batch(ax_padded, ax_packed, lengths, block, *, causal=True):
    """Left: the batch padded to its longest sequence, one row per sequence, in query tiles of ``block``
    rows. Right: the packed batch's attention as one block-diagonal matrix over all tokens, each
    sequence with its own tiles (visited, masked or skipped) starting where it starts."""
    longest, total = max(lengths), sum(lengths)
    for b, n in enumerate(lengths):
        ax_padded.add_patch(mpatches.Rectangle((0, b), n, 0.8, color=_seq_color(b)))
        ax_padded.add_patch(mpatches.Rectangle((n, b), longest - n, 0.8, facecolor=_PAD, hatch="//",
                                               edgecolor="white"))
        for start in range(0, longest, block):
            ax_padded.add_patch(mpatches.Rectangle((start, b), block, 0.8, fill=False, edgecolor="black", lw=0.5))
    ax_padded.set(xlim=(0, longest), ylim=(len(lengths), -0.2), xlabel="token position",
                  yticks=np.arange(len(lengths)) + 0.4, yticklabels=[f"seq {b} ({n})" for b, n in enumerate(lengths)])
    padded_tiles = len(lengths) * -(-longest // block)
    real_tiles = sum(-(-n // block) for n in lengths)
    ax_padded.set_title(f"padded: {padded_tiles} query tiles, {padded_tiles - real_tiles} of them padding only",
                        fontsize=9)

    start = 0
    for b, n in enumerate(lengths):
        if n:
            classes = tile_classes(n, n, block, block, causal=causal)
            for qb, row in enumerate(classes):
                for kb, c in enumerate(row):
                    height, width = min(block, n - qb * block), min(block, n - kb * block)
                    ax_packed.add_patch(mpatches.Rectangle((start + kb * block, start + qb * block), width, height,
                                                           facecolor=TILE_COLORS[c], edgecolor="white", lw=0.5))
            ax_packed.add_patch(mpatches.Rectangle((start, start), n, n, fill=False, edgecolor=_seq_color(b), lw=2))
        start += n
    ax_packed.set(xlim=(0, total), ylim=(total, 0), aspect="equal", xlabel="key (packed index)",
                  ylabel="query (packed index)")
    ax_packed.set_title("packed: each sequence's own tiles; nothing outside the diagonal blocks", fontsize=9)
    handles = [mpatches.Patch(color=TILE_COLORS[c], label=label) for c, label in
               ((1, "visited"), (MASKED, "visited with the mask"), (SKIPPED, "skipped (causal)"))]
    ax_packed.legend(handles=handles, fontsize=7, loc="upper right")


def schedules(ax_grid, ax_list, lengths, block, work_list):
    """The two ways to hand out query blocks: a grid sized for the longest sequence (idle blocks grey),
    and the work list, one block per real (sequence, query block), in launch order."""
    most = -(-max(lengths) // block)
    for b, n in enumerate(lengths):
        for slot in range(most):
            busy = slot * block < n
            ax_grid.add_patch(mpatches.Rectangle((slot, b), 0.9, 0.9, facecolor=_seq_color(b) if busy else _PAD))
            if not busy:
                ax_grid.text(slot + 0.45, b + 0.45, "exit", ha="center", va="center", fontsize=6, color="gray")
    ax_grid.set(xlim=(0, most), ylim=(len(lengths), 0), xlabel="blockIdx.x (query block slot)",
                ylabel="blockIdx.z (sequence)", yticks=[], xticks=[])
    idle = len(lengths) * most - len(work_list)
    ax_grid.set_title(f'"grid": {len(lengths) * most} blocks launched, {idle} exit at once', fontsize=9)
    for i, (b, qb) in enumerate(work_list):
        ax_list.add_patch(mpatches.Rectangle((i, 0), 0.9, 0.9, facecolor=_seq_color(b)))
        ax_list.text(i + 0.45, 0.45, str(qb), ha="center", va="center", fontsize=7, color="white")
    ax_list.set(xlim=(0, max(len(work_list), 1)), ylim=(1, 0), xticks=[], yticks=[],
                xlabel="blockIdx.x → (sequence = colour, query block = number), heaviest first")
    ax_list.set_title(f'"list": {len(work_list)} blocks, each reads its (sequence, block) from the list',
                      fontsize=9)


def split_kv(ax, context, splits, block_N):
    """One sequence's cache cut into ``splits`` ranges of whole key tiles; each range's block writes a
    partial (O_s, LSE_s), and the merge combines them."""
    tiles = -(-context // block_N)
    for s in range(splits):
        first, last = s * tiles // splits, (s + 1) * tiles // splits
        ax.add_patch(mpatches.Rectangle((first, 2), last - first, 0.8, facecolor=_seq_color(s), edgecolor="white"))
        middle = (first + last) / 2
        ax.annotate("", xy=(middle, 1.25), xytext=(middle, 2), arrowprops=dict(arrowstyle="->"))
        ax.text(middle, 1.05, f"block {s}\n(O$_{s}$, LSE$_{s}$)", ha="center", va="top", fontsize=8)
        ax.annotate("", xy=(tiles / 2, -0.3), xytext=(middle, 0.35), arrowprops=dict(arrowstyle="->", color="gray"))
    for t in range(tiles + 1):
        ax.plot([t, t], [2, 2.8], color="white", lw=0.5)
    ax.text(tiles / 2, -0.45, r"merge: $\mathrm{LSE} = \log \sum_s e^{\mathrm{LSE}_s}$,   "
            r"$O = \sum_s e^{\mathrm{LSE}_s - \mathrm{LSE}}\, O_s$   (the sink: one more state with $O = 0$)",
            ha="center", va="top", fontsize=9)
    ax.text(0, 3.0, f"the cache of one sequence and K/V head: {tiles} key tiles of {block_N}", fontsize=9)
    ax.set(xlim=(-0.5, tiles + 0.5), ylim=(-1.3, 3.4))
    ax.axis("off")


def gqa_tile(ax, heads, heads_kv, seq_new, block_M):
    """The query tile of one K/V head: its group's query heads for every new token (row r = token
    r // group, head r % group), padded to ``block_M`` rows; one K/V tile serves all of them."""
    group = heads // heads_kv
    rows = group * seq_new
    for r in range(block_M):
        real = r < rows
        color = _seq_color(r // group) if real else _PAD
        ax.add_patch(mpatches.Rectangle((0, r), 4, 0.9, facecolor=color))
        label = f"token {r // group}, head {r % group}" if real else "padding (not stored)"
        ax.text(2, r + 0.45, label, ha="center", va="center", fontsize=7, color="white" if real else "gray")
    ax.add_patch(mpatches.Rectangle((6, 0), 6, min(block_M, 8) * 0.9, facecolor="#9467bd"))
    ax.text(9, min(block_M, 8) * 0.45, "K tile\n(read once for\nthe whole group)", ha="center", va="center",
            fontsize=8, color="white")
    ax.annotate("", xy=(6, 2), xytext=(4.2, 2), arrowprops=dict(arrowstyle="<->"))
    ax.text(5.1, 2.6, "Q·Kᵀ", ha="center", fontsize=8)
    ax.set(xlim=(-0.2, 12.5), ylim=(block_M, -0.5))
    ax.set_title(f"GQA packing: {group} query heads × {seq_new} new token(s) = {rows} rows of a {block_M}-row tile",
                 fontsize=9)
    ax.axis("off")


def paged_cache(ax, lengths, page_size, table, num_pages):
    """Each sequence's logical pages (left), the physical page pool (right), and the block table that
    maps one to the other. Pages a sequence does not use are grey."""
    for b, n in enumerate(lengths):
        used = -(-n // page_size)
        for j in range(table.shape[1]):
            page = int(table[b, j])
            in_use = j < used
            ax.add_patch(mpatches.Rectangle((j, -b * 1.2), 0.9, 0.9, facecolor=_seq_color(b) if in_use else _PAD))
            ax.text(j + 0.45, -b * 1.2 + 0.45, str(page) if in_use else "–", ha="center", va="center", fontsize=7,
                    color="white" if in_use else "gray")
            if in_use:
                x = 8 + page % 8
                y = -(page // 8) * 1.2
                ax.add_patch(mpatches.Rectangle((x, y), 0.9, 0.9, facecolor=_seq_color(b)))
                ax.text(x + 0.45, y + 0.45, f"{b}.{j}", ha="center", va="center", fontsize=6, color="white")
        ax.text(-0.3, -b * 1.2 + 0.45, f"seq {b} ({n})", ha="right", va="center", fontsize=8)
    for page in range(num_pages):
        x, y = 8 + page % 8, -(page // 8) * 1.2
        ax.add_patch(mpatches.Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor="gray", lw=0.5))
    ax.text(table.shape[1] / 2, 1.3, "block table: page numbers", ha="center", fontsize=9)
    ax.text(12, 1.3, f"page pool ({num_pages} pages of {page_size} keys; label = seq.page)", ha="center", fontsize=9)
    ax.set(xlim=(-3, 16.5), ylim=(-max(len(lengths), -(-num_pages // 8)) * 1.2 - 0.2, 1.8))
    ax.axis("off")
