"""Claims about a record: computed from the record in the cell that shows it, printed, and checked.

A chapter that says "ours is ahead of FlashAttention-2 at every length" types a judgement that goes
stale the day the record is re-measured. Here the judgement is computed from the record instead:

    claim_count("ours faster than FA2", {s: ours[s] > fa2[s] for s in seqs}, cases="lengths", says="all")
    # ✓ ours faster than FA2 in 12 of 12 lengths (says: all)

    claim_ratio("packed/dense", ratios, target=0.9, says="not met")
    # ✓ packed/dense 0.76–0.79×, target 0.9×: not met (says: not met)

Each function prints one line with the numbers it computed. With ``says`` (the words the chapter's
prose uses), the line is a check: it raises ``CheckFailed`` when the record contradicts the words,
naming what the record shows, so prose and record cannot drift apart silently. Markdown then keeps
only those words (or none), and the numbers live in the printed line. Without ``says`` the line is
a statement only, printed without a ✓.

``readme_claims()`` builds the README's claims block the same way (``python -m course_utils.measure.claims``);
tests/test_claims.py checks that the README shows exactly that block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..checking.checks import CheckFailed, check_true

__all__ = ["Claim", "claim_count", "claim_ratio", "claim_change", "claim_order", "readme_claims"]


@dataclass(frozen=True)
class Claim:
    """What a claim function computed: its printed ``text`` and its ``verdict`` (the words it supports)."""

    text: str
    verdict: str

    def __str__(self):
        return self.text


def _settle(text, verdict, says, allowed):
    """Print ``text``; with ``says``, check that the record's verdict is what the prose says."""
    if says is None:
        print(text)
        return Claim(text, verdict)
    if says not in allowed:
        raise ValueError(f"says must be one of {sorted(allowed)}, got {says!r}")
    ok = says == verdict or (says == "most" and verdict == "all") or (says == "some" and verdict in ("most", "all"))
    if not ok:
        raise CheckFailed(f"✗ {text}: the prose says {says!r}, the record says {verdict!r}; update the prose")
    check_true(True, f"{text} (says: {says})")
    return Claim(text, verdict)


def _values(values, argument):
    if isinstance(values, Mapping):
        values = list(values.values())
    values = [float(v) for v in values]
    if not values:
        raise ValueError(f"{argument} is empty: a claim needs at least one value")
    return values


def _fmt(x):
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def claim_count(label, outcomes, *, cases="cases", says=None, name_exceptions=5):
    """Count the cases where something holds: "``label`` in k of n ``cases``".

    ``outcomes``: booleans, or a mapping case → boolean (then up to ``name_exceptions`` of the cases
    where it fails are named, when few do). ``says``: "all", "most" (more than half), "some" (at
    least one), "none", or "not all"; checked against the count.
    """
    items = list(outcomes.items()) if isinstance(outcomes, Mapping) else list(enumerate(outcomes))
    if not items:
        raise ValueError("outcomes is empty: a count needs at least one case")
    if not all(isinstance(bool(v), bool) for _, v in items):
        raise TypeError("outcomes must be booleans")
    hits = sum(bool(v) for _, v in items)
    n = len(items)
    verdict = "all" if hits == n else "none" if hits == 0 else "most" if 2 * hits > n else "some"
    text = f"{label} in {hits} of {n} {cases}"
    misses = [case for case, v in items if not v]
    if isinstance(outcomes, Mapping) and 0 < len(misses) <= name_exceptions:
        text += " (not in: " + ", ".join(map(str, misses)) + ")"
    if says == "not all":
        says_checked = "not all"
        verdict_checked = "not all" if hits < n else "all"
        if says_checked != verdict_checked:
            raise CheckFailed(f"✗ {text}: the prose says 'not all', the record says 'all'; update the prose")
        check_true(True, f"{text} (says: not all)")
        return Claim(text, verdict)
    return _settle(text, verdict, says, {"all", "most", "some", "none"})


def claim_ratio(label, ratios, *, target=None, says=None, unit="×", near=0.05):
    """The range of some ratios (or other values): "``label`` 0.76–0.79×", and a ``target`` if given.

    With a target (values at least ``target`` meet it), the verdict is "met" (every value), "met in
    k of n", or "not met" (none); ``says`` ("met", "not met", "partly met") is checked against it.
    Without a target, the verdict is "above 1" or "below 1" (every value on that side of 1) or
    "mixed"; ``says="near 1"`` holds when every value is within ``near`` of 1 (a change within noise).
    """
    values = _values(ratios, "ratios")
    lo, hi = min(values), max(values)
    span = f"{_fmt(lo)}{unit}" if _fmt(lo) == _fmt(hi) else f"{_fmt(lo)}–{_fmt(hi)}{unit}"
    text = f"{label} {span}"
    if target is None:
        verdict = "above 1" if lo > 1 else "below 1" if hi < 1 else "mixed"
        if says == "near 1" and max(abs(lo - 1), abs(hi - 1)) <= near:
            verdict = "near 1"
        if says == "near 1":
            text += f" (near 1: within ±{near:.0%})"
        return _settle(text, verdict, says, {"above 1", "below 1", "mixed", "near 1"})
    target = float(target)
    met = sum(v >= target for v in values)
    verdict = "met" if met == len(values) else "not met" if met == 0 else "partly met"
    shown = "met" if verdict == "met" else "not met" if verdict == "not met" else f"met in {met} of {len(values)}"
    text += f", target {_fmt(target)}{unit}: {shown}"
    return _settle(text, verdict, says, {"met", "not met", "partly met"})


def claim_change(label, before, after, *, names=("before", "after"), unit="", same_within=0.05, says=None):
    """Two values and their relative change: "``label``: before 0.149 ms → after 0.203 ms (+36%)".

    The verdict is "about the same" when |after/before − 1| ≤ ``same_within``, else "higher" or
    "lower"; ``says`` is checked against it.
    """
    before, after = float(before), float(after)
    if before <= 0:
        raise ValueError(f"before must be positive, got {before}")
    change = after / before - 1
    verdict = "about the same" if abs(change) <= same_within else "higher" if change > 0 else "lower"
    u = f" {unit}" if unit else ""
    text = f"{label}: {names[0]} {_fmt(before)}{u}, {names[1]} {_fmt(after)}{u} ({change:+.0%})"
    return _settle(text, verdict, says, {"about the same", "higher", "lower"})


def claim_order(label, values, *, unit="", says=None):
    """Whether values, in the order given (a mapping key → value), rise or fall: the verdict is
    "increasing", "decreasing" or "no consistent order"; ``says`` is checked against it."""
    if not isinstance(values, Mapping) or len(values) < 2:
        raise ValueError("values must be a mapping of at least two keys to numbers, in the order to compare")
    seq = _values(values, "values")
    steps = [b - a for a, b in zip(seq, seq[1:])]
    verdict = ("increasing" if all(s > 0 for s in steps) else "decreasing" if all(s < 0 for s in steps)
               else "no consistent order")
    u = f" {unit}" if unit else ""
    text = f"{label}: " + ", ".join(f"{k}: {_fmt(v)}{u}" for k, v in zip(values, seq)) + f" ({verdict})"
    return _settle(text, verdict, says, {"increasing", "decreasing", "no consistent order"})


def _quiet(fn, *args, **kwargs):
    """A claim's text, without printing it (for the README block)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs).text


def readme_claims() -> str:
    """The README's prose about the records, computed from them (tests/test_claims.py compares)."""
    from ..core.labels import CUDNN, FA2, OURS
    from .bench import FIGURES, load_record

    def paired(rows, keys, peer, mode=None):
        t = {}
        for r in rows:
            if mode is not None and r.get("mode") != mode:
                continue
            t[(r["impl"],) + tuple(r[k] for k in keys)] = r["tflops"]
        return {k[1:]: t[k] / t[(peer,) + k[1:]] for k in t if k[0] == OURS and (peer,) + k[1:] in t}

    keys = ("seq", "dim", "dtype", "causal")
    fwd = load_record("ch07_forward_vs_peers_h100")["results"]
    bwd = load_record("ch08_backward_vs_peers_h100")["results"]
    fa2_f, cudnn_f = paired(fwd, keys, FA2), paired(fwd, keys, CUDNN)
    fa2_b, cudnn_b = paired(bwd, keys, FA2, "bwd"), paired(bwd, keys, CUDNN, "bwd")
    lines = [
        "- " + _quiet(claim_count, "chapter 07's forward faster than FlashAttention-2", [r > 1 for r in fa2_f.values()],
                      cases="cases (S 1k–16k, D 64/128, fp16/bf16, causal or not)") + ";",
        "- " + _quiet(claim_count, "chapter 07's forward at least as fast as cuDNN",
                      [r >= 1 for r in cudnn_f.values()], cases="cases (chapter 07 lists the others and why)")
        + ";",
        "- " + _quiet(claim_ratio, f"chapter 08's backward over {len(fa2_b)} cases: ÷ FlashAttention-2",
                      fa2_b.values()) + ", " + _quiet(claim_ratio, "÷ cuDNN", cudnn_b.values()) + ";",
    ]
    ring = load_record("ch10_ring_attention_h200x2")["results"]["rows"]
    speedups = {}
    for row in ring:
        if not (row["causal"] and row["layout"] == "contiguous"):  # the unbalanced split is shown as such
            speedups.setdefault(row["seq"], []).append(row["ms"]["one_gpu"] / row["ms"]["ring"])
    for seq in sorted(speedups, reverse=True):
        lines.append("- " + _quiet(claim_ratio, f"chapter 10's ring attention on two H200s, S = {seq // 1024}k "
                                   "(zigzag causal and non-causal, fp16/bf16): ÷ one GPU's time", speedups[seq]) + ";")
    from .benchmarks.ch10_ring import RECORD_4, memory_record

    for row in memory_record()["results"]["memory"]:
        lines.append("- " + _quiet(claim_ratio, f"chapter 10's ring on two H200s, the longest sequence it holds ÷ one "
                                   f"GPU's ({row['name']} heads, causal, bf16, D=128)",
                                   [row["ring_over_one_gpu_longest"]], target=1.8) + ";")
    four = load_record(RECORD_4)["results"]["rows"]
    for seq in sorted({row["seq"] for row in four}, reverse=True)[:2]:
        lines.append("- " + _quiet(claim_ratio, f"chapter 10's ring attention on four H200s, S = {seq // 1024}k "
                                   "(zigzag causal and non-causal, bf16): ÷ one GPU's time",
                                   [row["speedup"] for row in four if row["seq"] == seq]) + ";")
    for row in memory_record(4)["results"]["memory"]:
        lines.append("- " + _quiet(claim_ratio, f"chapter 10's ring on four H200s, the longest sequence it holds ÷ "
                                   f"one GPU's ({row['name']} heads, causal, bf16, D=128)",
                                   [row["ring_over_one_gpu_longest"]]) + ";")
    for schedule, ratios in _varlen_ratios(load_record("ch09_varlen_h100")["results"]).items():
        lines.append("- " + _quiet(claim_ratio, f"chapter 09's packed forward, {schedule} schedule, ÷ our dense "
                                   "kernel on equal lengths", ratios, target=0.9) + ";")
    decode = load_record("ch09_decode_h100")["results"]
    ours_d = [r for r in decode if r["impl"] == OURS and "error" not in r]
    lines.append("- " + _quiet(claim_ratio, "chapter 09's decoding kernel, K/V read bandwidth ÷ a plain `torch.sum` "
                               "read of the same bytes, caches of a GiB or more",
                               [r["fraction_of_sum"] for r in ours_d if r["bytes"] >= 2**30]) + ";")
    peers_d = [r for r in decode if "SDPA" in r["impl"] and "error" not in r]
    same = ("dim", "batch", "context")
    lines.append("- " + _quiet(claim_count, "the fastest of SDPA's decoding forms faster than chapter 09's kernel",
                               [min((p["ms"] for p in peers_d if all(p[k] == r[k] for k in same)),
                                    default=float("inf")) < r["ms"] for r in ours_d],
                               cases="decoding cases") + ";")
    varlen = load_record("ch09_varlen_h100")["results"]
    ms_v = {(r["impl"], r["mode"]): r["ms"] for r in varlen if r["causal"]}
    padded = [ms_v[peer, mode] / min(t for (impl, m), t in ms_v.items() if m == mode and "packed" in impl)
              for (peer, mode) in ms_v if peer == f"{CUDNN}, padded"]
    lines.append("- " + _quiet(claim_ratio, "cuDNN on chapter 09's batch padded to its longest sequence (causal, "
                               "forward and backward): its time ÷ our packed kernels'", padded) + ";")
    fa2 = {}
    for name in ("ch03_forward_vs_peers_h100", "ch04_forward_final_h100", "ch07_forward_ablation_h100",
                 "ch07_persistent_vs_rotated_h100", "ch07_forward_vs_peers_h100"):
        fa2[name] = [r["tflops"] for r in load_record(name)["results"] if r["impl"] == FA2 and r["seq"] == 4096
                     and r["dim"] == 128 and r["dtype"] == "float16" and not r["causal"]]
        if len(fa2[name]) != 1:
            raise ValueError(f"{name}: expected one FlashAttention-2 row at fp16, D=128, S=4k, non-causal")
    same_call = [v for (v,) in fa2.values()]
    lines.append("- " + _quiet(claim_ratio, f"the same FlashAttention-2 forward (fp16, D=128, S=4k, non-causal) in "
                               f"{len(same_call)} records: {min(same_call):.0f}–{max(same_call):.0f} TFLOP/s, "
                               "the fastest ÷ the slowest", [max(same_call) / min(same_call)]) + ";")
    timings = [load_record(p.stem).get("timing") or "" for p in sorted(FIGURES.glob("*.json"))]
    lines.append("- " + _quiet(claim_count, "records that time calls issued back to back",
                               ["back to back" in t for t in timings], cases="records in `figures/`") + ";")
    lines.append("- " + _quiet(claim_count, "records whose implementations take turns in changing orders (the method "
                               "since 2026-11-27; chapter 08, section 7)",
                               ["order changes" in t for t in timings], cases="records in `figures/`") + ".")
    return "\n".join(lines)


def _varlen_ratios(rows):
    """Packed ÷ dense TFLOP/s of ours in chapter 09's varlen record (forward rows), by schedule."""
    import re

    from ..core.labels import OURS

    dense = {(r["causal"], r["dtype"]): r["tflops"] for r in rows
             if r["mode"] == "fwd" and r["impl"] == f"{OURS}, dense equal lengths"}
    out = {}
    for r in rows:
        schedule = re.fullmatch(re.escape(OURS) + r", packed \((\w+)\)", r["impl"])
        if r["mode"] == "fwd" and schedule and (r["causal"], r["dtype"]) in dense:
            out.setdefault(schedule.group(1), []).append(r["tflops"] / dense[r["causal"], r["dtype"]])
    return out


if __name__ == "__main__":
    print(readme_claims())

