"""Pictures of chapter 08's Hopper backward: the dataflow of one step, and its timeline.

- ``dataflow``: what one thread block keeps in shared memory and in registers, the five matmuls
  that connect them, and the two paths that leave the registers: dSᵀ through shared memory into
  the dQ matmul, and dQ through shared memory to the copy engine's reduce-add into global memory;
- ``step_schedule``: a model timeline (illustrative durations, not measurements) of one consumer
  warpgroup's steps, synchronous (chapter 05: each matmul waits) or asynchronous (chapter 08).
"""

import matplotlib.patches as mpatches

__all__ = ["dataflow", "step_schedule", "LANES"]

_SHARED, _REGS, _GLOBAL, _TC = "#9ecae1", "#fdd0a2", "#d9d9d9", "#c7e9c0"
_DS, _DQ = "#d62728", "#9467bd"


def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(mpatches.FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor=color,
                                         edgecolor="black", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)
    return (x, y, w, h)


def _arrow(ax, start, end, color="black", style="-|>", rad=0.0, lw=1.0):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle=style, color=color, lw=lw,
                                                         connectionstyle=f"arc3,rad={rad}"))


def dataflow(ax, *, block_M=64, block_N=128, dim=128):
    """One step of the main kernel: shared memory (blue), registers of the consumer warpgroups
    (orange), the tensor cores' five matmuls (green), global memory (grey)."""
    ax.set_xlim(0, 14)
    ax.set_ylim(0, 10)
    ax.axis("off")
    # Global memory and the copy engine.
    _box(ax, 0.2, 8.6, 3.2, 1.0, "HBM: Q, dO, LSE, Δ\n(next query block)", _GLOBAL)
    _box(ax, 10.6, 8.6, 3.2, 1.0, "HBM: dQ_acc (float32)\nΣ over key blocks", _GLOBAL)
    # Shared memory.
    ax.text(1.8, 8.15, "shared memory", ha="center", fontsize=9, weight="bold")
    k = _box(ax, 0.2, 6.9, 1.5, 1.0, f"K\n{block_N}×{dim}", _SHARED)
    v = _box(ax, 1.9, 6.9, 1.5, 1.0, f"V\n{block_N}×{dim}", _SHARED)
    q = _box(ax, 0.2, 5.5, 1.5, 1.0, f"Q ×2 stages\n{block_M}×{dim}", _SHARED)
    do = _box(ax, 1.9, 5.5, 1.5, 1.0, f"dO ×2 stages\n{block_M}×{dim}", _SHARED)
    _box(ax, 0.2, 4.4, 3.2, 0.8, "LSE, Δ ×2 stages", _SHARED)
    ds_s = _box(ax, 0.2, 2.9, 3.2, 1.0, f"dSᵀ ×2 buffers\n{block_N}×{block_M}", _SHARED)
    dq_s = _box(ax, 0.2, 1.3, 3.2, 1.0, f"dQ tile (float32)\n{block_M}×{dim}", _SHARED)
    # Tensor cores.
    ax.text(6.2, 8.15, "tensor cores (wgmma)", ha="center", fontsize=9, weight="bold")
    gemms = {
        "S": _box(ax, 4.6, 6.9, 3.2, 0.8, "① Sᵀ = K Qᵀ", _TC),
        "dP": _box(ax, 4.6, 5.9, 3.2, 0.8, "② dPᵀ = V dOᵀ", _TC),
        "dV": _box(ax, 4.6, 4.4, 3.2, 0.8, "③ dV += Pᵀ dO", _TC),
        "dQ": _box(ax, 4.6, 3.0, 3.2, 0.8, "④ dQ = dS K", _TC),
        "dK": _box(ax, 4.6, 2.0, 3.2, 0.8, "⑤ dK += dSᵀ Q", _TC),
    }
    # Registers.
    ax.text(10.9, 8.15, "registers (2 consumer warpgroups)", ha="center", fontsize=9, weight="bold")
    p = _box(ax, 9.0, 6.9, 3.8, 0.8, "Sᵀ → Pᵀ = exp2(Sᵀ·c − LSE·log2e)", _REGS)
    dp = _box(ax, 9.0, 5.9, 3.8, 0.8, "dPᵀ → dSᵀ = Pᵀ ∘ (dPᵀ − Δ)", _REGS)
    dv = _box(ax, 9.0, 4.4, 3.8, 0.8, f"dV accumulator {block_N}×{dim}", _REGS)
    dq = _box(ax, 9.0, 3.0, 3.8, 0.8, f"dQ {block_M}×{dim} (this key block's share)", _REGS)
    dk = _box(ax, 9.0, 2.0, 3.8, 0.8, f"dK accumulator {block_N}×{dim}", _REGS)

    def right(b):
        return (b[0] + b[2], b[1] + b[3] / 2)

    def left(b):
        return (b[0], b[1] + b[3] / 2)

    _arrow(ax, (1.8, 8.6), (1.8, 7.95), color="gray")
    for src, gemm in ((k, "S"), (q, "S"), (v, "dP"), (do, "dP"), (do, "dV"), (k, "dQ"), (q, "dK")):
        _arrow(ax, right(src), left(gemms[gemm]), color="gray", lw=0.7)
    for gemm, reg in (("S", p), ("dP", dp), ("dV", dv), ("dQ", dq), ("dK", dk)):
        _arrow(ax, right(gemms[gemm]), left(reg))
    _arrow(ax, (9.0, 7.1), right(gemms["dV"]), color=_DS, rad=0.25)  # Pᵀ from registers into dV
    _arrow(ax, (9.0, 6.0), right(gemms["dK"]), color=_DS, rad=0.35)  # dSᵀ from registers into dK
    _arrow(ax, (9.0, 5.95), right(ds_s), color=_DS, rad=-0.25, lw=1.5)  # dSᵀ to shared memory
    _arrow(ax, right(ds_s), left(gemms["dQ"]), color=_DS, lw=1.5)  # ... read by rows in dQ = dS K
    _arrow(ax, (9.0, 3.2), right(dq_s), color=_DQ, rad=0.15, lw=1.5)  # dQ to shared memory
    _arrow(ax, (3.4, 1.6), (12.2, 8.6), color=_DQ, rad=0.45, lw=1.5)  # copy engine reduce-add
    ax.text(8.2, 0.55, "copy engine: cp.reduce.async.bulk (add) — one instruction per tile", color=_DQ,
            fontsize=8, ha="center")
    ax.text(6.2, 1.35, "dSᵀ path", color=_DS, fontsize=8, ha="center")
    handles = [mpatches.Patch(color=c, label=lab) for c, lab in
               ((_SHARED, "shared memory"), (_REGS, "registers"), (_TC, "tensor cores"), (_GLOBAL, "global memory"))]
    ax.legend(handles=handles, loc="lower left", fontsize=7, ncol=4, bbox_to_anchor=(0.0, -0.06))


LANES = ("tensor cores", "FP32 + SFU", "copy engine")


def step_schedule(n_steps, *, asynchronous, gemm=1.0, exp=0.8, ds=0.4, dq_store=0.4, reduce=0.6, read_wait=None):
    """Events ``(lane, start, duration, label, 0)`` and the total time of ``n_steps`` steps of one
    consumer warpgroup, in model units (illustrative, not measured).

    Synchronous (chapter 05): Sᵀ, exp, dPᵀ, dV, dSᵀ, dK, dQ, then dQ's atomics from registers — one
    after the other. Asynchronous (chapter 08): Sᵀ and dPᵀ issued together, the exponentials start
    when Sᵀ is done; dSᵀ when both are; dV, dQ and dK issued together; dQ goes to shared memory while
    dK runs, and the copy engine adds it to global memory while the next step starts.
    ``read_wait``: the warpgroup first waits that long for the copy engine to read dQ's tile (TileLang's wait
    right after the reduce-add, chapter 08's versions before 22); None: the read runs under the next step.
    """
    events, t = [], 0.0
    tc, alu, copy = LANES
    for i in range(n_steps):
        if not asynchronous:
            for lane, label, dur in ((tc, "S", gemm), (alu, "exp", exp), (tc, "dP", gemm), (tc, "dV", gemm),
                                     (alu, "dS", ds), (tc, "dK", gemm), (tc, "dQ", gemm),
                                     (alu, "dQ atomics", dq_store + reduce)):
                events.append((lane, t, dur, f"{label}{i}" if len(label) < 4 else label, 0))
                t += dur
            continue
        events += [(tc, t, gemm, f"S{i}", 0), (tc, t + gemm, gemm, f"dP{i}", 0), (alu, t + gemm, exp, f"exp{i}", 0)]
        t_ds = max(t + 2 * gemm, t + gemm + exp)
        events.append((alu, t_ds, ds, f"dS{i}", 0))
        t_mm = t_ds + ds
        events += [(tc, t_mm, gemm, f"dV{i}", 0), (tc, t_mm + gemm, gemm, f"dQ{i}", 0),
                   (tc, t_mm + 2 * gemm, gemm, f"dK{i}", 0), (alu, t_mm + 2 * gemm, dq_store, "dQ→smem", 0)]
        t_store = max(t_mm + 2 * gemm + dq_store, t_mm + 3 * gemm)
        events.append((copy, t_store, reduce, "reduce-add", 0))
        t = t_store
        if read_wait:
            events.append((alu, t_store, read_wait, "wait", 0))
            t += read_wait
    return events, t + (reduce if asynchronous else 0)
