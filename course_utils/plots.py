"""Plotting helpers shared by the chapters, in one consistent style.

Figures use mid-tone colours on an opaque white background, so they read the same in
JupyterLab's light and dark themes. ``save`` writes compressed PNGs under ``figures/``.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .bench import FIGURES

__all__ = ["COLORS", "IMPL_COLORS", "style", "save", "heatmap", "line_chart", "speedup_bars",
           "roofline", "record_caption"]

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
IMPL_COLORS = {
    "TileLang (ours)": "#d62728",
    "FlashAttention-2 (SDPA flash)": "#1f77b4",
    "cuDNN (SDPA cudnn)": "#2ca02c",
    "naive PyTorch": "#7f7f7f",
}


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
        ax.set_xticks(sorted({r[x] for r in rows}), labels=[_short(v) for v in sorted({r[x] for r in rows})])
    if logy:
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel or x, ylabel=ylabel or y)
    ax.legend(fontsize=8)


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


def _short(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def roofline_series(ax, name, intensities, tflops_values, labels=()):
    """Add one implementation's measurements to a ``roofline`` axis: joined points, each labelled.

    Use it after ``roofline(ax, ..., points=())`` when one implementation has several points (one
    per sequence length, say); ``labels`` are written next to the points.
    """
    color = IMPL_COLORS.get(name)
    ax.plot(intensities, tflops_values, marker="o", linewidth=1, color=color, label=name, zorder=3)
    for x, y, text in zip(intensities, tflops_values, labels):
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, -3), fontsize=7,
                    color=color or "black")
    ax.legend(fontsize=8)
