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

**Faster means beyond the noise.** A ratio of speeds is a ``Ratio``: its value and the bounds it may
take given the spread between rounds. ``speed_ratio(row, peer)`` builds one from two rows of a record:
when both store ``ms_spread`` (the min, median and max of each round's median, ``bench.with_spreads``),
the bounds are the peer's fastest round ÷ ours' slowest and the peer's slowest ÷ ours' fastest. A
record without a stored spread, and a plain number given to a claim function, gets the band
``NO_SPREAD_BAND`` (±6%) around its value: two records of chapter 07's forward taken side by side a
minute apart (``ch07_persistent_vs_rotated_h100`` and ``ch07_forward_vs_peers_h100``, as of commit 0edbad2)
put ours ÷ cuDNN up to 11% apart on the same case (1.109 at fp16, D=128, S=16k), and ±6% is the smallest band in which
every such pair overlaps (√1.109 ≈ 1.053; tests/test_claims.py recomputes it). A ratio is *above 1*
(ours faster, ahead, ≥) only when its lower bound clears 1, *below 1* only when its upper bound is
under 1, and *level* otherwise. ``claim_versus`` counts cases that way, and ``claim_count`` refuses a
label that compares speeds ("faster", "ahead", "≥", "at least as fast"): such a count of plain
booleans cannot see the noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..checking.checks import CheckFailed, check_true

__all__ = ["Claim", "Ratio", "NO_SPREAD_BAND", "speed_ratio", "claim_count", "claim_ratio", "claim_versus",
           "claim_change", "claim_order", "readme_claims"]

# The relative band around a ratio whose record stores no spread (see the module's docstring).
NO_SPREAD_BAND = 0.06

# Words of a count that compares speeds: such a count goes through claim_versus, which sees the noise.
SPEED_WORDS = ("faster", "slower", "ahead", "behind", "≥", "≤", "at least as fast", "as fast as")


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
    if says != verdict:  # exact: "some" does not accept "all", nor "most" "all"
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


@dataclass(frozen=True)
class Ratio:
    """A ratio of speeds (ours ÷ a peer's: above 1 is ours faster) and the bounds the rounds' spread allows."""

    value: float
    low: float
    high: float
    spread_stored: bool = False

    def __float__(self):
        return self.value

    @classmethod
    def unmeasured(cls, value):
        """A ratio whose record stores no spread: the band ``NO_SPREAD_BAND`` around it."""
        value = float(value)
        return cls(value, value / (1 + NO_SPREAD_BAND), value * (1 + NO_SPREAD_BAND), False)

    @property
    def side(self):
        """"above 1" when even the lower bound clears 1, "below 1" when even the upper bound is under 1, else
        "level"."""
        return "above 1" if self.low > 1 else "below 1" if self.high < 1 else "level"


def _ratio(value):
    return value if isinstance(value, Ratio) else Ratio.unmeasured(value)


def speed_ratio(row, peer, key="ms"):
    """How much faster ``row`` ran than ``peer`` (two rows of one record timing the same work): ``peer[key] ÷
    row[key]``, with bounds from both rows' stored spreads (``<key>_spread``), or ``NO_SPREAD_BAND`` without."""
    value = float(peer[key]) / float(row[key])
    mine, theirs = row.get(f"{key}_spread"), peer.get(f"{key}_spread")
    if not (mine and theirs):
        return Ratio.unmeasured(value)
    return Ratio(value, theirs["min"] / mine["max"], theirs["max"] / mine["min"], True)


def _fmt(x):
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def claim_count(label, outcomes, *, cases="cases", says=None, name_exceptions=5):
    """Count the cases where something holds: "``label`` in k of n ``cases``".

    ``outcomes``: booleans, or a mapping case → boolean (then up to ``name_exceptions`` of the cases
    where it fails are named, when few do). ``says``: "all", "most" (more than half, not all), "some" (at
    least one, at most half), or "none"; checked against the count exactly. A label that compares speeds
    is refused: ``claim_versus`` counts those.
    """
    if any(word in label for word in SPEED_WORDS):
        raise ValueError(f"{label!r} compares speeds: count it with claim_versus, which sees the noise")
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
    return _settle(text, verdict, says, {"all", "most", "some", "none"})


def claim_ratio(label, ratios, *, target=None, says=None, unit="×", near=0.05):
    """The range of some ratios (or other values): "``label`` 0.76–0.79×", and a ``target`` if given.

    With a target (values at least ``target`` meet it), the verdict is "met" (every value), "met in
    k of n", or "not met" (none); ``says`` ("met", "not met", "partly met") is checked against it.
    Without a target, the verdict is "above 1" or "below 1" when every value's bound clears 1 on that side
    (a ``Ratio``'s own bounds, or ``NO_SPREAD_BAND`` around a plain number), "level" when none does, else
    "mixed"; ``says="near 1"`` holds when every value is within ``near`` of 1 (a change within noise).
    """
    items = list(ratios.values()) if isinstance(ratios, Mapping) else list(ratios)
    values = _values(items, "ratios")
    lo, hi = min(values), max(values)
    span = f"{_fmt(lo)}{unit}" if _fmt(lo) == _fmt(hi) else f"{_fmt(lo)}–{_fmt(hi)}{unit}"
    text = f"{label} {span}"
    if target is None:
        bounded = [_ratio(v) for v in items]
        sides = {r.side for r in bounded}
        verdict = sides.pop() if len(sides) == 1 else "mixed"
        if says in ("above 1", "below 1", "level", "mixed"):  # a comparison: show how far the noise reaches
            text += (f" (lower bound {_fmt(min(r.low for r in bounded))})" if verdict == "above 1" else
                     f" (upper bound {_fmt(max(r.high for r in bounded))})" if verdict == "below 1" else
                     " (level: within the spread)" if verdict == "level" else
                     f" (bounds {_fmt(min(r.low for r in bounded))}–{_fmt(max(r.high for r in bounded))})")
        if says == "near 1" and max(abs(lo - 1), abs(hi - 1)) <= near:
            verdict = "near 1"
        if says == "near 1":
            text += f" (near 1: within ±{near:.0%})"
        return _settle(text, verdict, says, {"above 1", "below 1", "level", "mixed", "near 1"})
    target = float(target)
    met = sum(v >= target for v in values)
    verdict = "met" if met == len(values) else "not met" if met == 0 else "partly met"
    shown = "met" if verdict == "met" else "not met" if verdict == "not met" else f"met in {met} of {len(values)}"
    text += f", target {_fmt(target)}{unit}: {shown}"
    return _settle(text, verdict, says, {"met", "not met", "partly met"})


def claim_versus(label, ratios, *, cases="cases", says=None, name_exceptions=5):
    """Ours against a peer, case by case, beyond the noise: "``label``: ahead in a, level in l, behind in b of n".

    ``ratios``: ours ÷ the peer's speed per case (a mapping case → ``Ratio`` or number; above 1 is ours
    faster). A case is ahead when its lower bound clears 1, behind when its upper bound is under 1, level
    otherwise (``Ratio.side``). The verdict is "ahead", "level" or "behind" (every case), "ahead or level"
    or "behind or level" (both occur, the third does not), or "mixed"; ``says`` is checked against it.
    """
    items = list(ratios.items()) if isinstance(ratios, Mapping) else list(enumerate(ratios))
    if not items:
        raise ValueError("ratios is empty: a comparison needs at least one case")
    word = {"above 1": "ahead", "level": "level", "below 1": "behind"}
    sides = {case: word[_ratio(r).side] for case, r in items}
    count = {w: sum(side == w for side in sides.values()) for w in ("ahead", "level", "behind")}
    present = [w for w in ("ahead", "level", "behind") if count[w]]
    verdict = (present[0] if len(present) == 1 else f"{present[0]} or {present[1]}"
               if len(present) == 2 and "level" in present else "mixed")
    if verdict.startswith("level or "):
        verdict = f"{verdict[9:]} or level"
    text = (f"{label}: ahead in {count['ahead']}, level in {count['level']}, behind in {count['behind']} "
            f"of {len(items)} {cases}")
    if isinstance(ratios, Mapping):
        for w in ("behind", "level"):
            named = [str(case) for case, side in sides.items() if side == w]
            if 0 < len(named) <= name_exceptions and count[w] < len(items):
                text += f" ({w}: " + ", ".join(named) + ")"
    if not all(isinstance(r, Ratio) and r.spread_stored for _, r in items):
        text += f" [±{NO_SPREAD_BAND:.0%} where no spread is stored]"
    return _settle(text, verdict, says, {"ahead", "level", "behind", "ahead or level", "behind or level", "mixed"})


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
    from ..core.labels import CUDNN, FA2, FA4, OURS
    from .bench import FIGURES, load_record

    def paired(rows, keys, peer, mode=None):
        """ours ÷ ``peer``'s speed per case, with the bounds the rows' spreads allow (``speed_ratio``)."""
        by = {}
        for r in rows:
            if mode is None or r.get("mode") == mode:
                by[(r["impl"],) + tuple(r[k] for k in keys)] = r
        return {k[1:]: speed_ratio(by[k], by[(peer,) + k[1:]]) for k in by if k[0] == OURS and (peer,) + k[1:] in by}

    keys = ("seq", "dim", "dtype", "causal")
    fwd = load_record("ch07_forward_vs_peers_h100")["results"]
    bwd = load_record("ch08_backward_vs_peers_h100")["results"]
    fa2_f, cudnn_f = paired(fwd, keys, FA2), paired(fwd, keys, CUDNN)
    fa2_b, cudnn_b = paired(bwd, keys, FA2, "bwd"), paired(bwd, keys, CUDNN, "bwd")
    forward_cases = "cases (S 1k–16k, D 64/128, fp16/bf16, causal or not)"
    lines = [
        "- " + _quiet(claim_versus, "chapter 07's forward against FlashAttention-2", list(fa2_f.values()),
                      cases=forward_cases) + ";",
        "- " + _quiet(claim_versus, "chapter 07's forward against cuDNN", list(cudnn_f.values()), cases=forward_cases)
        + ";",
        "- " + _quiet(claim_ratio, f"chapter 08's backward over {len(fa2_b)} cases: ÷ FlashAttention-2",
                      fa2_b.values()) + ", " + _quiet(claim_ratio, "÷ cuDNN", cudnn_b.values()) + ";",
        "- " + _quiet(claim_versus, "chapter 08's backward against cuDNN", list(cudnn_b.values())) + ";",
    ]
    fa4_f, fa4_b = paired(fwd, keys, FA4), paired(bwd, keys, FA4, "bwd")
    if fa4_f:
        lines.append("- " + _quiet(claim_versus, "chapter 07's forward against FlashAttention-4", list(fa4_f.values()),
                                   cases=forward_cases) + ";")
    if fa4_b:
        lines.append("- " + _quiet(claim_ratio, f"chapter 08's backward over {len(fa4_b)} cases: ÷ FlashAttention-4",
                                   fa4_b.values()) + ", " + _quiet(claim_versus, "against it", list(fa4_b.values()))
                     + ";")
    gpt_oss = load_record("ch06_gpt_oss_h200")["results"]
    by_layer = {(r["impl"], r["mode"], r["dim"], r["window"]): r for r in gpt_oss}
    lines.append("- " + _quiet(claim_versus, "chapter 06's gpt-oss layers on an H200 (D 64/128, full causal or a "
                               "128-key window; forward and backward) against FlashAttention-4",
                               [speed_ratio(r, by_layer[(FA4,) + k[1:]]) for k, r in by_layer.items()
                                if k[0] == OURS and (FA4,) + k[1:] in by_layer], cases="layer passes") + ";")
    from .benchmarks.ch12_fp8 import CUDNN_FP8, OURS_FP8, OURS_FP8_KERNEL

    fp8 = {(r["seq"], r["causal"], r["impl"]): r for r in load_record("ch12_fp8_h200")["results"]["rows"]}
    fp8_cases = sorted({k[:2] for k in fp8})
    seqs = sorted({seq for seq, _ in fp8_cases})
    fp8_over_bf16 = [fp8[c + (OURS_FP8_KERNEL,)]["tflops"] / fp8[c + (OURS,)]["tflops"] for c in fp8_cases]
    against_cudnn = [speed_ratio(fp8[c + (OURS_FP8_KERNEL,)], fp8[c + (CUDNN_FP8,)]) for c in fp8_cases]
    public_against_bf16 = [speed_ratio(fp8[c + (OURS_FP8,)], fp8[c + (OURS,)]) for c in fp8_cases]
    lines.append("- " + _quiet(claim_ratio, f"chapter 12's FP8 kernel on an H200 (D=128, S {seqs[0] // 1024}k–"
                               f"{seqs[-1] // 1024}k, causal or not): its TFLOP/s ÷ the bf16 forward's", fp8_over_bf16,
                               target=1.5) + ", " + _quiet(claim_versus, "against cuDNN's FP8 SDPA", against_cudnn)
                 + "; " + _quiet(claim_versus, "its public call, producer step included, against the bf16 forward",
                                 public_against_bf16) + ";")
    from .benchmarks.ch11_flex import TORCH_FLEX, TORCH_FLEX_FA4

    flex = {(r["case"], r["impl"], r["mode"]): r for r in load_record("ch11_flex_h200")["results"]}
    for torch_flex, backend in ((TORCH_FLEX, "its Triton backend"), (TORCH_FLEX_FA4, "FlashAttention-4's kernels")):
        for mode, direction in (("fwd", "forward"), ("bwd", "backward")):
            lines.append("- " + _quiet(claim_versus, f"chapter 11's flex_attention on an H200 (five modifiers, "
                                       f"S = 8k, D = 128), {direction}, against PyTorch's FlexAttention on {backend}",
                                       [speed_ratio(r, flex[(case, torch_flex, mode)]) for (case, impl, m), r
                                        in flex.items() if impl == OURS and m == mode
                                        and (case, torch_flex, mode) in flex]) + ";")
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
    fastest_peer = [min((p for p in peers_d if all(p[k] == r[k] for k in same)), key=lambda p: p["ms"], default=None)
                    for r in ours_d]
    lines.append("- " + _quiet(claim_versus,
                               "chapter 09's decoding kernel against the fastest of SDPA's decoding forms",
                               [speed_ratio(r, p) for r, p in zip(ours_d, fastest_peer) if p is not None],
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
                               ["order changes" in t for t in timings], cases="records in `figures/`") + ";")
    spreads = [_stores_spread(load_record(p.stem)["results"]) for p in sorted(FIGURES.glob("*.json"))]
    lines.append("- " + _quiet(claim_count, "records that store each implementation's spread over rounds (min, median, "
                               f"max; without it a ratio's bounds are ±{NO_SPREAD_BAND:.0%}: `measure/claims.py`)",
                               spreads, cases="records in `figures/`") + ".")
    return "\n".join(lines)


def _stores_spread(results):
    """Whether a record's results hold a stored spread (a ``…_spread`` key) anywhere."""
    if isinstance(results, dict):
        return any(k.endswith("_spread") or _stores_spread(v) for k, v in results.items())
    return isinstance(results, list) and any(_stores_spread(v) for v in results)


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

