"""The shared-memory bank model (chapter 04), and its pictures.

Shared memory has 32 banks of 4 bytes; a wavefront carries at most 128 bytes, and a bank serves
one 4-byte word per wavefront (threads reading the *same* word share it). ``wavefronts`` counts
how many wavefronts a warp's request needs under this model, ``ideal_wavefronts`` the fewest it
could need, and ``conflict_table`` compares layouts (element offsets from
``course_utils.pictures.layouts.layout_offsets``) on a few typical warp accesses. ``bank_map`` and
``bank_hits_chart`` draw which banks a tile's chunks fall in and which thread reads which bank.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import matplotlib.patches as mpatches
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from . import plots  # noqa: F401  (importing it applies the course style)

__all__ = [
    "BANKS", "BANK_BYTES", "WAVEFRONT_BYTES", "bank_of", "wavefronts", "ideal_wavefronts", "bank_hits",
    "bank_groups", "warp_access_patterns", "conflict_table", "bank_map", "bank_hits_chart",
]

BANKS = 32  # shared memory banks
BANK_BYTES = 4  # each bank serves one 4-byte word per wavefront
WAVEFRONT_BYTES = BANKS * BANK_BYTES  # 128 bytes at most per wavefront


# --------------------------------------------------------------------------- the model


def bank_of(byte_address):
    """The bank (0..31) that serves a byte address (works on ints and numpy arrays)."""
    return (byte_address // BANK_BYTES) % BANKS


def _words(address, width):
    """The 4-byte words an access of ``width`` bytes at ``address`` touches."""
    return range(address // BANK_BYTES, (address + max(width, 1) - 1) // BANK_BYTES + 1)


def _phases(byte_addresses, width):
    """Split a warp's addresses into the groups the hardware serves together.

    Accesses of 16 bytes are served a quarter-warp (8 threads, 128 bytes) at a time, 8-byte ones a
    half-warp at a time, smaller ones the whole warp at once. (``ldmatrix`` reads its 8x8 matrices
    the same way: 8 row addresses of 16 bytes per phase.)
    """
    addrs = [int(a) for a in np.asarray(byte_addresses).ravel()]
    size = max(1, min(len(addrs), WAVEFRONT_BYTES // max(width, 4)))
    return [addrs[i:i + size] for i in range(0, len(addrs), size)]


def wavefronts(byte_addresses, width):
    """Wavefronts a warp-wide shared-memory request needs: per phase, the most distinct words in one bank."""
    total = 0
    for phase in _phases(byte_addresses, width):
        words = {w for a in phase for w in _words(a, width)}
        total += max(Counter(w % BANKS for w in words).values())
    return total


def ideal_wavefronts(byte_addresses, width):
    """The fewest wavefronts the same request could need: its distinct bytes / 128, per phase."""
    total = 0
    for phase in _phases(byte_addresses, width):
        words = {w for a in phase for w in _words(a, width)}
        total += math.ceil(len(words) * BANK_BYTES / WAVEFRONT_BYTES)
    return total


def bank_hits(byte_addresses, width):
    """For a picture of one phase: {bank: [(word, [threads reading it]), ...]} in thread order."""
    hits = defaultdict(dict)
    for thread, a in enumerate(int(x) for x in np.asarray(byte_addresses).ravel()):
        for w in _words(a, width):
            hits[w % BANKS].setdefault(w, []).append(thread)
    return {bank: list(words.items()) for bank, words in sorted(hits.items())}


def bank_groups(offsets, elem_bytes):
    """For each 16-byte chunk of a tile (rows x chunks): its group of 4 banks (0..7) in its 128-byte line."""
    per_chunk = 16 // elem_bytes
    first = offsets[:, ::per_chunk] * elem_bytes
    return (first % WAVEFRONT_BYTES) // 16


def warp_access_patterns(cols, elem_bytes=2):
    """Three warp-wide accesses to a [rows x cols] tile, as (cells (i, j) per thread, bytes per thread).

    - a copy into the tile (cp.async / vector stores): 32 threads x 16 bytes along the rows;
    - ``ldmatrix.x4`` of a 16x16 operand block: 4 phases of 8 row addresses x 16 bytes;
    - a warp reading one column: 32 rows x one element.
    """
    vec = 16 // elem_bytes
    per_row = cols // vec
    return {
        "copy in: 32 threads x 16 B along rows": ([(t // per_row, (t % per_row) * vec) for t in range(32)], 16),
        "ldmatrix.x4: 16 rows x 32 B (4 phases)": ([(t % 8 + 8 * ((t // 8) % 2), vec * (t // 16))
                                                    for t in range(32)], 16),
        "one column: 32 rows x 2 B": ([(t, 0) for t in range(32)], elem_bytes),
    }


def conflict_table(offsets_by_layout, patterns, elem_bytes=2):
    """Rows (pattern, ideal, wavefronts per layout...) for a set of access patterns and layouts."""
    rows = []
    for name, (cells, width) in patterns.items():
        row = dict(pattern=name)
        for layout_name, offsets in offsets_by_layout.items():
            addrs = [int(offsets[i, j]) * elem_bytes for i, j in cells]
            row.setdefault("ideal", ideal_wavefronts(addrs, width))  # the same for any layout
            row[layout_name] = wavefronts(addrs, width)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- pictures


def _bank_colors():
    """One colour per group of 4 banks (8 groups), shared by both bank pictures."""
    return ListedColormap(plt.get_cmap("tab10").colors[:8])


def bank_map(ax, groups, *, title=None, outline=(), colorbar=False):
    """Rows x 16-byte chunks of a shared tile, each coloured by its group of 4 banks (0..7).

    ``outline`` lists (row, chunk) cells to frame, e.g. the 8 rows one ldmatrix phase reads.
    """
    cmap = _bank_colors()
    data = np.asarray(groups)
    ax.imshow(data, cmap=cmap, vmin=-0.5, vmax=7.5, aspect="auto", interpolation="nearest")
    for (i, j), g in np.ndenumerate(data):
        ax.text(j, i, str(g), ha="center", va="center", fontsize=7, color="white")
    for i, j in outline:
        ax.add_patch(mpatches.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2))
    ax.grid(False)
    ax.set(title=title, xlabel="16-byte chunk of the row", ylabel="row")


def bank_hits_chart(ax, hits, *, title=None, ymax=None):
    """Which thread reads which bank: one column per bank, one box per distinct 4-byte word.

    ``hits`` is ``bank_hits(...)``. A column k boxes tall needs k wavefronts.
    """
    cmap = _bank_colors()
    height = 1
    for bank, words in hits.items():
        for level, (_, threads) in enumerate(words):
            ax.add_patch(mpatches.Rectangle((bank, level), 1, 1, facecolor=cmap(bank // 4), edgecolor="white"))
            ax.text(bank + 0.5, level + 0.5, ",".join(f"t{t}" for t in threads), ha="center", va="center",
                    fontsize=6, color="white", rotation=90 if len(threads) > 1 else 0)
        height = max(height, len(words))
    top = ymax or max(height, 2)
    ax.set(xlim=(0, 32), ylim=(0, top), title=title, xlabel="bank", ylabel="wavefronts (words per bank)")
    ax.set_xticks(range(0, 33, 4))
    ax.set_yticks(range(0, top + 1, max(1, top // 8)))
    ax.grid(False)
