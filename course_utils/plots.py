"""Plotting helpers shared by the chapters, in one consistent style.

Figures use mid-tone colours on an opaque white background, so they read the same in
JupyterLab's light and dark themes. ``save`` writes compressed PNGs under ``figures/``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .bench import FIGURES
from .labels import CUDNN, FA2, NAIVE, OURS

__all__ = ["COLORS", "IMPL_COLORS", "style", "save", "heatmap", "line_chart", "speedup_bars", "roofline",
           "record_caption", "seq_label", "roofline_series", "online_softmax_diagram", "text_table", "pipeline_timeline",
           "forward_comparison_panels", "peer_ratio_heatmaps",
           "bank_map", "bank_hits_chart", "fragment_map"]

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
IMPL_COLORS = {OURS: "#d62728", FA2: "#1f77b4", CUDNN: "#2ca02c", NAIVE: "#7f7f7f"}


def style():
    """Apply the course style (called on import)."""
    plt.rcParams.update({
        "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
        "figure.dpi": 90, "savefig.dpi": 110, "font.size": 10, "axes.titlesize": 11,
        "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
        "axes.prop_cycle": plt.cycler(color=COLORS), "image.cmap": "viridis",
    })


style()


def save(fig, name):
    """Save ``fig`` as ``figures/<name>.png`` (palette-compressed when Pillow can) and return the path."""
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.png"
    fig.savefig(path, bbox_inches="tight")
    try:
        from PIL import Image

        Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)
    except ImportError:
        pass
    return path


def heatmap(ax, matrix, *, title=None, xlabel="key j", ylabel="query i", cmap="viridis",
            colorbar=True, vmin=None, vmax=None, annotate=False, fmt="{:.0f}"):
    """Show a 2-D array (scores, probabilities, a mask, a TFLOP/s table) with the origin top-left."""
    data = np.asarray(matrix.detach().cpu() if hasattr(matrix, "detach") else matrix, dtype=float)
    image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
    ax.grid(False)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    if annotate:
        for (i, j), value in np.ndenumerate(data):
            if np.isfinite(value):
                ax.text(j, i, fmt.format(value), ha="center", va="center", fontsize=8,
                        color="white" if value < np.nanmean(data) else "black")
    return image


def line_chart(ax, rows, *, x, y, group="impl", title=None, xlabel=None, ylabel=None, logx=True,
               logy=False):
    """One line per ``group`` value through the (x, y) points of record rows (list of dicts)."""
    for name in dict.fromkeys(r[group] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[group] == name and r.get(y) is not None)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=name, color=IMPL_COLORS.get(name))
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r[x] for r in rows}), labels=[seq_label(v) for v in sorted({r[x] for r in rows})])
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel or x, ylabel=ylabel or y)
    ax.legend(fontsize=8)


_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def forward_comparison_panels(record, dims=(64, 128), dtypes=("float16", "bfloat16")):
    """TFLOP/s against S for every implementation of a forward comparison record: one panel per
    (dtype, D, causal), with the record's machine as caption. Returns the figure."""
    panels = [(dim, causal) for dim in dims for causal in (False, True)]
    fig, axes = plt.subplots(len(dtypes), len(panels), figsize=(16, 3.5 * len(dtypes)), sharey=True, squeeze=False)
    for r_i, dtype in enumerate(dtypes):
        for c_i, (dim, causal) in enumerate(panels):
            sel = [r for r in record["results"] if (r["dtype"], r["dim"], r["causal"]) == (dtype, dim, causal)]
            line_chart(axes[r_i, c_i], sel, x="seq", y="tflops", title=f"{dtype}, D={dim}, causal={causal}",
                       xlabel="sequence length S", ylabel="TFLOP/s")
            if (r_i, c_i) != (0, 0):
                axes[r_i, c_i].get_legend().remove()
    fig.text(0.01, -0.01, record_caption(record), fontsize=8)
    fig.tight_layout()
    return fig


def peer_ratio_heatmaps(rows, combos, seqs, peers, ours=OURS):
    """One heat map per peer of ours ÷ peer TFLOP/s: a row per (dtype, D, causal) in ``combos``, a
    column per sequence length. Returns the figure."""
    tf = {(r["impl"], r["dtype"], r["dim"], r["causal"], r["seq"]): r["tflops"] for r in rows}
    fig, axes = plt.subplots(1, len(peers), figsize=(7 * len(peers), 4), squeeze=False)
    for ax, peer in zip(axes[0], peers):
        ratio = np.array([[tf[(ours, *c, s)] / tf[(peer, *c, s)] for s in seqs] for c in combos])
        heatmap(ax, ratio, title=f"ours ÷ {peer}", xlabel="S", ylabel="", cmap="RdBu", vmin=0.5, vmax=1.5)
        for (i, j), value in np.ndenumerate(ratio):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(seqs)), labels=[seq_label(s) for s in seqs])
        ax.set_yticks(range(len(combos)),
                      labels=[f"{_DTYPE_SHORT.get(d, d)} D={dim}{' causal' if c else ''}" for d, dim, c in combos])
    fig.tight_layout()
    return fig


def speedup_bars(ax, labels, values, *, baseline=1.0, title=None, ylabel="speedup ×"):
    """Bars of speedups with a dashed line at ``baseline`` and the value written on each bar."""
    bars = ax.bar(labels, values, color=[IMPL_COLORS.get(lbl, COLORS[0]) for lbl in labels])
    ax.axhline(baseline, color="black", linestyle="--", linewidth=1)
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.2f}×", ha="center", va="bottom", fontsize=9)
    ax.set(title=title, ylabel=ylabel)


def roofline(ax, *, peak_tflops, bandwidth_tbs, points=(), title="Roofline", xlim=(1, 1e5)):
    """Draw the roofline min(peak, bandwidth × intensity) and label ``points`` (name, FLOP/byte, TFLOP/s)."""
    intensity = np.logspace(np.log10(xlim[0]), np.log10(xlim[1]), 200)
    ax.plot(intensity, np.minimum(peak_tflops, bandwidth_tbs * intensity), color="black")
    ridge = peak_tflops / bandwidth_tbs
    ax.axvline(ridge, color="gray", linestyle=":", linewidth=1)
    ax.text(ridge * 1.1, peak_tflops * 0.05, f"ridge {ridge:.0f} FLOP/B", fontsize=8, color="gray")
    for i, (name, x, y) in enumerate(points):
        ax.scatter([x], [y], color=IMPL_COLORS.get(name, COLORS[i % len(COLORS)]), zorder=3, label=name)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte of HBM traffic)",
           ylabel="TFLOP/s", title=title)
    if points:
        ax.legend(fontsize=8)


def record_caption(record):
    """One line naming where a record's numbers were measured, for figure captions."""
    m = record["machine"]
    return (f"{m.get('gpu', m.get('cpu'))}, torch {m['torch']}, tilelang {m['tilelang']}, "
            f"CUDA {m.get('cuda')}, driver {m.get('driver')}, {m['date']}")


def seq_label(n):
    """A sequence length as an axis label: 4096 → "4k"."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def roofline_series(ax, name, intensities, tflops_values, labels=(), offset=(5, -3)):
    """Add one implementation's measurements to a ``roofline`` axis: joined points, each labelled.

    Use it after ``roofline(ax, ..., points=())`` when one implementation has several points (one
    per sequence length, say); ``labels`` (empty strings skip a point) are written ``offset``
    points away from their markers.
    """
    color = IMPL_COLORS.get(name)
    ax.plot(intensities, tflops_values, marker="o", linewidth=1, color=color, label=name, zorder=3)
    for x, y, text in zip(intensities, tflops_values, labels):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=offset, fontsize=7,
                    ha="left" if offset[0] >= 0 else "right", color=color or "black")
    ax.legend(fontsize=8)


def online_softmax_diagram(ax, num_blocks=4):
    """The online softmax as a chain: key block j updates the state (m, ℓ, o) left by block j − 1.

    Top row: the key blocks, each read once. Bottom row: the running state after each block; the
    horizontal arrows carry the old state, scaled by α_j = exp(m_{j−1} − m_j). The update rules
    are written underneath.
    """
    from matplotlib.patches import FancyBboxPatch

    def box(x, y, text, color, width=1.8, height=0.8):
        ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.05",
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


def text_table(rows, *, index, columns, value, fmt="{:.0f}", missing="–", width=None):
    """A plain-text table of record rows: one line per ``index`` value, one column per ``columns``
    value, cells ``fmt.format(row[value])`` (``missing`` where no row has that pair). Returns a str."""
    row_keys = sorted(dict.fromkeys(r[index] for r in rows))
    col_keys = list(dict.fromkeys(r[columns] for r in rows))
    cells = {(r[index], r[columns]): fmt.format(r[value]) for r in rows if r.get(value) is not None}
    width = width or max(len(str(c)) for c in col_keys) + 2
    labels = {k: seq_label(k) if isinstance(k, int) else str(k) for k in row_keys}
    first = max(8, len(index), *(len(label) for label in labels.values()))
    lines = [f"{index:>{first}}" + "".join(f"{str(c):>{width}}" for c in col_keys)]
    for k in row_keys:
        lines.append(f"{labels[k]:>{first}}" + "".join(f"{cells.get((k, c), missing):>{width}}" for c in col_keys))
    return "\n".join(lines)


# --- chapter 04: pipelines, shared-memory banks, register fragments -------------------------------

_STEP_COLORS = {"QK": "#d62728", "sm": "#ff7f0e", "PV": "#9467bd", "K": "#1f77b4", "V": "#2ca02c"}


def pipeline_timeline(ax, events, *, title=None, lanes=("load K", "load V", "compute"), xmax=None):
    """Draw (lane, start, duration, label, slot) events as bars (broken_barh): one row per lane,
    split into one thin sub-row per buffer slot, so copies in flight together are all visible."""
    for row, lane in enumerate(lanes):
        spans = [(s, d, lab, slot) for ln, s, d, lab, slot in events if ln == lane]
        slots = max((slot for *_, slot in spans), default=0) + 1
        height = 0.8 / slots
        for s, d, lab, slot in spans:
            y = row - 0.4 + slot * height
            ax.broken_barh([(s, d)], (y, height), facecolors=_STEP_COLORS.get(lab.rstrip("0123456789"), COLORS[7]),
                           edgecolor="white", linewidth=0.8)
            if d >= 0.8:
                ax.text(s + d / 2, y + height / 2, lab, ha="center", va="center", fontsize=7 if slots < 3 else 6,
                        color="white")
    ax.set_yticks(range(len(lanes)), labels=list(lanes))
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if xmax is not None:
        ax.set_xlim(0, xmax)
    ax.grid(axis="y", visible=False)
    ax.set(title=title)


_BANK_CMAP = "tab10"


def bank_map(ax, groups, *, title=None, outline=(), colorbar=False):
    """Rows x 16-byte chunks of a shared tile, each coloured by its group of 4 banks (0..7).

    ``outline`` lists (row, chunk) cells to frame, e.g. the 8 rows one ldmatrix phase reads.
    """
    import matplotlib.patches as mpatches
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(plt.get_cmap(_BANK_CMAP).colors[:8])
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

    ``hits`` is ``course_utils.layouts.bank_hits(...)``. A column k boxes tall needs k wavefronts.
    """
    import matplotlib.patches as mpatches
    from matplotlib.colors import ListedColormap

    cmap = ListedColormap(plt.get_cmap(_BANK_CMAP).colors[:8])
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


def fragment_map(ax, threads, registers=None, *, title=None, rows=None, cols=None, color_by="warp",
                 annotate=False):
    """Who holds each element of a register tile (tables from ``layouts.fragment_tables``).

    ``color_by``: "warp" (each warp's cells labelled with its number), "lane" (thread % 32) or
    "register" (the register index, with a colour bar). ``annotate`` writes 'lane / register' in
    every cell (for a zoomed-in corner). ``rows`` / ``cols`` are (start, stop) ranges to show.
    """
    from matplotlib.colors import ListedColormap

    threads = np.asarray(threads)
    rows = rows or (0, threads.shape[0])
    cols = cols or (0, threads.shape[1])
    t = threads[rows[0]:rows[1], cols[0]:cols[1]]
    regs = None if registers is None else np.asarray(registers)[rows[0]:rows[1], cols[0]:cols[1]]
    extent = (cols[0] - 0.5, cols[1] - 0.5, rows[1] - 0.5, rows[0] - 0.5)
    if color_by == "register":
        image = ax.imshow(regs, cmap="viridis", aspect="auto", interpolation="nearest", extent=extent)
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="register index")
    else:
        key = t // 32 if color_by == "warp" else t % 32
        n = int(key.max()) + 1
        base = plt.get_cmap("tab10" if n <= 10 else "tab20").colors
        cmap = ListedColormap([base[i % len(base)] for i in range(n)])
        ax.imshow(key, cmap=cmap, vmin=-0.5, vmax=n - 0.5, aspect="auto", interpolation="nearest", extent=extent)
        if color_by == "warp" and not annotate:
            for w in np.unique(key):
                ii, jj = np.nonzero(key == w)
                ax.text(cols[0] + jj.mean(), rows[0] + ii.mean(), f"warp {w}", ha="center", va="center",
                        fontsize=8, color="white")
    if annotate:
        for (i, j), thread in np.ndenumerate(t):
            text = f"{thread % 32}" + ("" if regs is None else f"\n{regs[i, j]}")
            ax.text(cols[0] + j, rows[0] + i, text, ha="center", va="center", fontsize=7, color="white",
                    linespacing=0.9)
    ax.grid(False)
    ax.set(title=title, xlabel="column j", ylabel="row i")
