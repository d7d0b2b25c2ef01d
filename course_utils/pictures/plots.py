"""Charts of measurements (TFLOP/s lines, heat maps, rooflines, tables of records) and the course style.

Importing this module applies the style, so every course picture (``diagrams``, ``banks``,
``layouts``, ``schedules`` import it) looks the same. Figures use mid-tone colours on an opaque
white background, so they read the same in JupyterLab's light and dark themes. ``save`` writes
compressed PNGs under ``figures/`` (in the runs that make the committed notebooks).
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt
import numpy as np

from ..core.labels import CUDNN, FA2, FA4, NAIVE, OURS
from ..measure.bench import FIGURES

__all__ = ["COLORS", "IMPL_COLORS", "style", "save", "heatmap", "line_chart", "speedup_bars", "order_effect_bars",
           "roofline", "record_caption", "seq_label", "roofline_series", "text_table", "forward_comparison_panels",
           "peer_ratio_heatmaps", "kernel_timeline"]

COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
IMPL_COLORS = {OURS: "#d62728", FA2: "#1f77b4", CUDNN: "#2ca02c", FA4: "#9467bd", NAIVE: "#7f7f7f"}


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
    """Save ``fig`` as ``figures/<name>.png`` (palette-compressed when Pillow can); return that path.

    The figures are tracked files made with the committed notebooks, so only the run that writes
    those (``run_notebooks --in-place`` on a GPU, which sets ``COURSE_WRITE_FIGURES=1``) writes them;
    a learner's own run or a test run leaves them as they are. The path returned is relative to the
    repository, so the stored output is the same on every machine.
    """
    path = FIGURES / f"{name}.png"
    if os.environ.get("COURSE_WRITE_FIGURES") == "1":
        FIGURES.mkdir(exist_ok=True)
        fig.savefig(path, bbox_inches="tight")
        try:
            from PIL import Image

            Image.open(path).convert("RGB").quantize(colors=128).save(path, optimize=True)
        except ImportError:
            pass
    return path.relative_to(FIGURES.parent)


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


def _case_label(dtype, dim, causal):
    return f"{_DTYPE_SHORT.get(dtype, dtype)} D={dim}{' causal' if causal else ''}"


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
                      labels=[_case_label(*c) for c in combos])
    fig.tight_layout()
    return fig


def order_effect_bars(rows, orders):
    """Grouped bars of cuDNN's time ÷ ours (above 1: ours faster), one group per case, one bar per way of
    taking turns in ``orders`` (chapter 08's ``timing_order`` record). Returns the figure."""
    cases = list(dict.fromkeys((r["dtype"], r["dim"], r["causal"], r["seq"]) for r in rows))
    value = {(r["dtype"], r["dim"], r["causal"], r["seq"], r["order"]): r["cudnn_over_ours"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.8 / len(orders)
    for k, order in enumerate(orders):
        xs = np.arange(len(cases)) + (k - (len(orders) - 1) / 2) * width
        ax.bar(xs, [value[(*c, order)] for c in cases], width, label=order, color=COLORS[k % len(COLORS)])
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(cases)), labels=[f"{_case_label(*c[:3])} S={seq_label(c[3])}" for c in cases])
    ax.set(ylabel="cuDNN's time ÷ ours", ylim=(0.85, 1.15),
           title="the same kernels, timed in turns of different order")
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
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
    gpus = f"{m['gpu_count']}× " if m.get("gpu_count", 1) > 1 else ""
    return (f"{gpus}{m.get('gpu', m.get('cpu'))}, torch {m['torch']}, tilelang {m['tilelang']}, "
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


_KIND_COLORS = {"attention": "#1f77b4", "merge and sums": "#9467bd", "communication": "#ff7f0e"}


def kernel_timeline(ax, spans, *, title=None):
    """GPU kernels over time, one lane per CUDA stream: ``spans`` are [stream, kind, start_ms, end_ms]
    (``benchmarks.ch10_ring.timeline_spans``); kinds "attention", "merge and sums", "communication".
    A lane is named by what runs on it: the compute stream, or NCCL's stream."""
    streams = list(dict.fromkeys(s[0] for s in sorted(spans, key=lambda s: s[0])))
    names = []
    for lane, stream in enumerate(streams):
        kinds = {s[1] for s in spans if s[0] == stream}
        names.append("NCCL stream" if kinds == {"communication"} else f"compute stream ({stream})"
                     if "communication" not in kinds else f"stream {stream}")
        for _, kind, start, end in (s for s in spans if s[0] == stream):
            ax.barh(lane, end - start, left=start, height=0.6, color=_KIND_COLORS.get(kind, "#7f7f7f"),
                    edgecolor="none")
    ax.set_yticks(range(len(streams)), names)
    ax.set_ylim(len(streams) - 0.4, -0.6)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="y", visible=False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLORS.values()]
    ax.legend(handles, list(_KIND_COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=8, ncol=3,
              frameon=False)
    ax.set_title(title)
