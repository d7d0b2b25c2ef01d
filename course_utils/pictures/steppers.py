"""Step-by-step pictures: the online softmax block by block, and the forward's walk over the tiles.

Each stepper draws a static figure first (every step, or the finished walk): that is what a
notebook run headlessly (nbval, ``run_notebooks``) records, so outputs stay deterministic. In a
notebook opened in JupyterLab or Jupyter Notebook, and when ipywidgets is installed, a slider (and
a play button) follows the figure to step through one frame at a time. ``COURSE_WIDGETS=1`` forces
the widget on (VS Code, other front ends), ``COURSE_WIDGETS=0`` off.
"""

from __future__ import annotations

import math
import os

import matplotlib.patches as mpatches
import matplotlib.pyplot as plt
import numpy as np
import torch

from ..kernels.softmax import online_softmax_update
from . import diagrams

__all__ = ["widgets_enabled", "online_softmax_steps", "online_softmax_stepper", "tile_walk_steps",
           "tile_walk_stepper"]


def widgets_enabled():
    """Whether to add a slider widget: ipywidgets present, in a Jupyter kernel started by a Jupyter server."""
    flag = os.environ.get("COURSE_WIDGETS", "auto").lower()
    if flag in ("0", "off", "no", "false"):
        return False
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return False
    # JupyterLab and Notebook start kernels with JPY_SESSION_NAME set; nbclient and nbval do not.
    return flag in ("1", "on", "yes", "true") or "JPY_SESSION_NAME" in os.environ


def _stepper(n_steps, draw, label):
    """Show a slider and a play button that redraw ``draw(step)`` (a function making one figure)."""
    import ipywidgets as widgets
    from IPython.display import display

    slider = widgets.IntSlider(value=0, min=0, max=n_steps - 1, description=label, continuous_update=False)
    play = widgets.Play(value=0, min=0, max=n_steps - 1, interval=1500)
    widgets.jslink((play, "value"), (slider, "value"))

    def show(step):
        draw(step)
        plt.show()

    display(widgets.VBox([widgets.HBox([play, slider]), widgets.interactive_output(show, {"step": slider})]))


# --- The online softmax, block by block --------------------------------------------------------------

def online_softmax_steps(scores, values, block_N):
    """The state after each key block, for every row of ``scores`` [rows, N] (float64).

    Returns a list of dicts: the block's columns, the old and new running max m, α = e^(m_old − m_new),
    ℓ, and the output so far o/ℓ (attention over the keys seen, [rows, D])."""
    m = torch.full(scores.shape[:1], -math.inf, dtype=scores.dtype)
    l = torch.zeros_like(m)
    o = torch.zeros(scores.shape[0], values.shape[1], dtype=scores.dtype)
    steps = []
    for start in range(0, scores.shape[1], block_N):
        block = scores[:, start:start + block_N]
        m_new, l, alpha = online_softmax_update(m, l, block)
        p = torch.exp(block - torch.where(m_new == -math.inf, 0.0, m_new)[:, None])
        o = o * alpha[:, None] + p @ values[start:start + block_N]
        steps.append(dict(cols=(start, min(start + block_N, scores.shape[1])), m_old=m, m=m_new, alpha=alpha,
                          l=l, out=o / l[:, None]))
        m = m_new
    return steps


def _draw_softmax_step(axes, scores, reference, steps, step, row):
    ax_s, ax_t, ax_o = axes
    s = steps[step]
    start, stop = s["cols"]
    data = scores.numpy().copy()
    finite = data[np.isfinite(data)]
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("white")  # masked scores (−∞)
    ax_s.imshow(np.where(np.isfinite(data), data, np.nan), aspect="auto", cmap=cmap, interpolation="nearest",
                vmin=float(finite.min()), vmax=float(finite.max()))
    ax_s.add_patch(mpatches.Rectangle((stop - 0.5, -0.5), scores.shape[1] - stop, scores.shape[0],
                                      facecolor="#d9d9d9", alpha=0.9, edgecolor="none"))  # not read yet
    ax_s.add_patch(mpatches.Rectangle((start - 0.5, -0.5), stop - start, scores.shape[0], fill=False,
                                      edgecolor="#d62728", lw=2.5))
    ax_s.add_patch(mpatches.Rectangle((-0.5, row - 0.5), scores.shape[1], 1, fill=False,
                                      edgecolor="black", lw=1.2, ls="--"))
    ax_s.set(title=f"block {step}: keys {start}–{stop - 1} (red); grey: not read yet; white: −∞",
             xlabel="key j", ylabel="row")
    ax_s.grid(False)
    ax_t.axis("off")
    cells = [[f"{r}", f"{float(s['m_old'][r]):.2f}", f"{float(s['m'][r]):.2f}", f"{float(s['alpha'][r]):.3f}",
              f"{float(s['l'][r]):.3f}"] for r in range(scores.shape[0])]
    table = ax_t.table(cellText=cells, colLabels=["row", "m old", "m new", "α", "ℓ"], loc="center",
                       cellLoc="center")
    table.scale(1, 1.3)
    for r in range(scores.shape[0]):
        if float(s["alpha"][r]) < 1 and step > 0:  # the max moved: the old state was rescaled
            table[r + 1, 3].set_facecolor("#ffd8b0")
    ax_t.set_title("state after it (orange: α < 1, the max moved)")
    dims = np.arange(reference.shape[1])
    ax_o.plot(dims, reference[row].numpy(), "k--", lw=1.2, label="reference (all keys)")
    ax_o.plot(dims, s["out"][row].numpy(), "o-", color="#d62728", ms=3, lw=1, label=f"o/ℓ after block {step}")
    err = float((s["out"][row] - reference[row]).abs().max())
    outs = torch.stack([st["out"][row] for st in steps])
    low, high = float(min(outs.min(), reference[row].min())), float(max(outs.max(), reference[row].max()))
    ax_o.set(title=f"row {row} (dashed): o/ℓ so far, error {err:.0e}", xlabel="feature d",
             ylim=(low - 0.1 * (high - low), high + 0.1 * (high - low)))
    ax_o.legend(fontsize=7, loc="lower right")


def online_softmax_stepper(scores, values, block_N, *, row=0):
    """Draw every block of the online softmax (static), then a stepper widget where available.

    ``scores`` [rows, N] are already scaled; ``values`` [N, D]. Returns the list of states."""
    scores, values = scores.double().cpu(), values.double().cpu()
    steps = online_softmax_steps(scores, values, block_N)
    reference = torch.softmax(scores, dim=-1) @ values

    def frame(fig, axes, step):
        _draw_softmax_step(axes, scores, reference, steps, step, row)

    fig, axes = plt.subplots(len(steps), 3, figsize=(13, 2.9 * len(steps)),
                             gridspec_kw=dict(width_ratios=[1.3, 1.0, 1.0]), squeeze=False)
    for step in range(len(steps)):
        frame(fig, axes[step], step)
    fig.tight_layout()
    plt.show()
    if widgets_enabled():
        def draw(step):
            fig, axes = plt.subplots(1, 3, figsize=(13, 3.2), gridspec_kw=dict(width_ratios=[1.3, 1.0, 1.0]))
            frame(fig, axes, step)
            fig.tight_layout()
        _stepper(len(steps), draw, "key block")
    return steps


# --- The forward's walk over the tiles ---------------------------------------------------------------

def tile_walk_steps(seq_q, seq_k, block_M, block_N, *, causal=False, window_size=None, heads=1, heads_kv=1):
    """The tiles the forward computes, in the order of its grid and loop: a list of (head, q_block, k_block,
    class) with class ``diagrams.FULL`` or ``diagrams.MASKED``; skipped tiles never appear. Thread blocks
    run head by head; with a mask the last query block goes first (``blockIdx.x = 0``)."""
    classes = diagrams.tile_classes(seq_q, seq_k, block_M, block_N, causal=causal, window_size=window_size)
    masked = causal or window_size is not None
    order = range(classes.shape[0] - 1, -1, -1) if masked else range(classes.shape[0])
    return [(h, qb, kb, int(classes[qb, kb])) for h in range(heads) for qb in order
            for kb in range(classes.shape[1]) if classes[qb, kb] != diagrams.SKIPPED]


def _draw_walk(ax_tiles, ax_heads, config, steps, upto, highlight=True):
    seq_q, seq_k, block_M, block_N = (config[k] for k in ("seq_q", "seq_k", "block_M", "block_N"))
    kw = dict(causal=config.get("causal", False), window_size=config.get("window_size"))
    heads, heads_kv = config.get("heads", 1), config.get("heads_kv", 1)
    h, qb, kb, _ = steps[upto]
    diagrams.tile_visits(ax_tiles, seq_q, seq_k, block_M, block_N, **kw)
    done = [(q, k) for hh, q, k, _ in steps[:upto + 1] if hh == h]
    for n, (q, k) in enumerate(done):
        ax_tiles.text(k * block_N + block_N / 2, q * block_M + block_M / 2, str(n + 1), ha="center", va="center",
                      fontsize=8, color="black", zorder=5, fontweight="bold")
    if not highlight:
        return
    ax_tiles.add_patch(mpatches.Rectangle((0, qb * block_M), seq_k, block_M, fill=False, edgecolor="#2ca02c", lw=2,
                                          ls="--", zorder=6))
    ax_tiles.add_patch(mpatches.Rectangle((kb * block_N, qb * block_M), block_N, block_M, fill=False,
                                          edgecolor="#d62728", lw=3, zorder=7))
    kind = "window " + str(kw["window_size"]) if kw["window_size"] else ("causal" if kw["causal"] else "non-causal")
    ax_tiles.set_title(f"{kind}: step {upto + 1}/{len(steps)}, head {h}, query block {qb} (green), "
                       f"key block {kb} (red)\nnumbers: order of the tiles this head's thread blocks computed",
                       fontsize=9)
    if ax_heads is not None:
        diagrams.gqa_heads(ax_heads, heads, heads_kv)
        group = heads // heads_kv
        ax_heads.add_patch(mpatches.Rectangle((h + 0.05, 1.5), 0.9, 0.8, fill=False, edgecolor="#d62728", lw=3))
        ax_heads.set_title(f"thread block (bx, by={h}) reads K/V head {h // group}: "
                           f"{group} query heads share each K/V tile", fontsize=9)


def tile_walk_stepper(configs):
    """Draw the finished walk of each configuration (static), then a stepper widget where available.

    ``configs`` maps a name to keyword arguments of ``tile_walk_steps`` (seq_q, seq_k, block_M, block_N,
    and causal, window_size, heads, heads_kv). Returns {name: steps}."""
    walks = {name: tile_walk_steps(**cfg) for name, cfg in configs.items()}
    gqa = [name for name, cfg in configs.items() if cfg.get("heads", 1) > 1][:1]
    fig, axes = plt.subplots(1, len(configs) + len(gqa), figsize=(4.6 * (len(configs) + len(gqa)), 5.0),
                             squeeze=False)
    for ax, (name, cfg) in zip(axes[0], configs.items()):
        _draw_walk(ax, None, cfg, walks[name], len(walks[name]) - 1, highlight=False)
        heads = cfg.get("heads", 1)
        ax.set_title(f"{name}: {len(walks[name])} tiles computed" + (f" ({heads} heads)" if heads > 1 else "") +
                     "\nnumbers: the order in which one head's thread blocks compute them", fontsize=9)
    for ax, name in zip(axes[0][len(configs):], gqa):
        cfg = configs[name]
        diagrams.gqa_heads(ax, cfg["heads"], cfg["heads_kv"], title=f"{name}: the K/V head each query head reads")
    fig.tight_layout()
    plt.show()
    if widgets_enabled():
        import ipywidgets as widgets
        from IPython.display import display

        choice = widgets.Dropdown(options=list(configs), description="walk")
        out = widgets.Output()

        def redraw(change=None):
            out.clear_output(wait=True)
            cfg, steps = configs[choice.value], walks[choice.value]
            with out:
                def draw(step):
                    gqa = cfg.get("heads", 1) > 1
                    fig, axes = plt.subplots(1, 2 if gqa else 1, figsize=(11 if gqa else 6, 5.2), squeeze=False)
                    _draw_walk(axes[0][0], axes[0][1] if gqa else None, cfg, steps, step)
                    fig.tight_layout()
                _stepper(len(steps), draw, "tile")

        choice.observe(redraw, names="value")
        display(choice, out)
        redraw()
    return walks
