"""Timeline models of the FlashAttention loop (chapters 04 and 07), and their picture.

``pipeline_schedule`` models the order of copies and compute that ``T.Pipelined(num_stages=...)``
generates; ``overlap_schedule`` models chapter 07's rotated loop, where one block's softmax runs
while the tensor cores multiply. Both are models in illustrative units, not measurements;
``pipeline_timeline`` draws their events.
"""

from __future__ import annotations

from .plots import COLORS

__all__ = ["pipeline_schedule", "overlap_schedule", "pipeline_timeline", "block_timelines"]


def pipeline_schedule(num_stages, n_blocks, *, load, qk, softmax, pv):
    """Timeline of the FlashAttention loop as ``T.Pipelined(num_stages=...)`` orders it (a model).

    ``num_stages=0`` is a plain loop: load K, QK^T, softmax, load V, PV, one after the other.
    With ``num_stages=s`` (what TileLang generates for this loop, sm_80 and sm_90a alike) K and V
    each get ``s`` shared buffers; the first ``s`` tiles are loaded up front, and a buffer is
    refilled with the tile ``s`` iterations ahead as soon as the gemm reading it is done. Loads run
    asynchronously and take ``load`` time units each (latency-bound: several may be in flight).
    Returns ``(events, total)``, events as (lane, start, duration, label, slot) with lanes
    "load K", "load V" and "compute"; ``slot`` is the shared buffer a load fills (0 for compute).
    """
    events, t = [], 0.0
    if num_stages == 0:
        for k in range(n_blocks):
            for lane, label, dur in (("load K", f"K{k}", load), ("compute", "QK", qk), ("compute", "sm", softmax),
                                     ("load V", f"V{k}", load), ("compute", "PV", pv)):
                events.append((lane, t, dur, label, 0))
                t += dur
        return events, t
    ready = {}

    def issue(kind, k, at):
        if k < n_blocks:
            events.append((f"load {kind}", at, load, f"{kind}{k}", k % num_stages))
            ready[kind, k] = at + load

    for k in range(min(num_stages, n_blocks)):
        issue("K", k, 0.0)
        issue("V", k, 0.0)
    for k in range(n_blocks):
        t = max(t, ready["K", k])
        events.append(("compute", t, qk, "QK", 0))
        t += qk
        issue("K", k + num_stages, t)  # K buffer free again
        events.append(("compute", t, softmax, "sm", 0))
        t += softmax
        t = max(t, ready["V", k])
        events.append(("compute", t, pv, "PV", 0))
        t += pv
        issue("V", k + num_stages, t)  # V buffer free again
    return events, t


def overlap_schedule(n_blocks, *, qk, softmax, pv, overlap):
    """Timeline of one consumer warpgroup's loop over key blocks, copies assumed hidden (a model).

    Without ``overlap`` each block runs QKᵀ, softmax, P·V one after the other. With ``overlap``
    (chapter 07's rotated loop) iteration k issues QKᵀ of block k and P·V of block k-1 back to back
    on the tensor cores, waits only for QKᵀ, and computes the softmax of block k while P·V runs;
    the idle matmuls of the first and last iteration are labelled "(PV)" and "(QK)".
    Returns ``(events, total)``, events as (lane, start, duration, label, 0) with lanes
    "tensor cores" and "softmax".
    """
    events, t = [], 0.0
    if not overlap:
        for k in range(n_blocks):
            for lane, label, dur in (("tensor cores", f"QK{k}", qk), ("softmax", f"sm{k}", softmax),
                                     ("tensor cores", f"PV{k}", pv)):
                events.append((lane, t, dur, label, 0))
                t += dur
        return events, t
    for k in range(n_blocks + 1):
        events.append(("tensor cores", t, qk, f"QK{k}" if k < n_blocks else "(QK)", 0))
        events.append(("tensor cores", t + qk, pv, f"PV{k - 1}" if k > 0 else "(PV)", 0))
        end = t + qk + pv
        if k < n_blocks:
            events.append(("softmax", t + qk, softmax, f"sm{k}", 0))
            end = max(end, t + qk + softmax)
        t = end
    return events, t


# --------------------------------------------------------------------------- picture

def block_timelines(tiles_per_sm, cost, label=str):
    """Each SM runs its list of tiles back to back (a persistent block's static schedule).

    ``tiles_per_sm``: one list of tiles per SM; ``cost(tile)``: its duration; ``label(tile)``: its text.
    Returns ``(events, makespan)``, events as (lane "SM i", start, duration, label, 0).
    """
    events, ends = [], []
    for sm, tiles in enumerate(tiles_per_sm):
        t = 0.0
        for tile in tiles:
            events.append((f"SM {sm}", t, cost(tile), label(tile), 0))
            t += cost(tile)
        ends.append(t)
    return events, max(ends, default=0.0)


_STEP_COLORS = {"QK": "#d62728", "sm": "#ff7f0e", "PV": "#9467bd", "K": "#1f77b4", "V": "#2ca02c",
                # chapter 08's backward step
                "S": "#d62728", "dP": "#e377c2", "dV": "#9467bd", "dQ": "#8c564b", "dK": "#1f77b4",
                "exp": "#ff7f0e", "dS": "#bcbd22", "dQ atomics": "#7f7f7f", "dQ→smem": "#8c564b",
                "reduce-add": "#2ca02c"}


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
