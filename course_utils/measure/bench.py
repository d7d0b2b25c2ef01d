"""Timing, FLOP counting and stored benchmark records.

FLOP convention (the one FlashAttention papers use): a forward pass costs 4·B·H·S_q·S_k·D
(two matmuls of 2·M·N·K each); causal masking halves it; a sliding window counts exactly the
visible (query, key) pairs; the backward costs 2.5× the forward (five matmuls instead of two).

Every speed number the course shows is a *record*: a JSON file under ``figures/`` holding the
measurements together with the machine, the software versions and the date. On a GPU machine
with ``COURSE_REFRESH_RECORDS=1`` (the headless runner sets it) a notebook re-measures and
rewrites its records; everywhere else it loads the stored ones and says where they came from.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

from ..core.device import HAS_GPU, machine_info
from ..core.reference import visibility_mask

__all__ = [
    "FIGURES", "attention_flops", "time_cuda", "time_side_by_side", "round_orders", "tflops", "save_record",
    "load_record", "measured", "stored_record", "refreshing", "TIMING_METHOD", "H100_MATMUL_TFLOPS", "H100_SFU_TFLOPS",
    "Timing", "with_spreads",
]

FIGURES = Path(__file__).resolve().parents[2] / "figures"  # the repository's (this file is course_utils/measure/…)

# H100 SXM5 throughputs as quoted by FlashAttention-3 (Shah et al., 2024): dense fp16 matmul on the
# tensor cores, and special functions (exp2) on the SFUs.
H100_MATMUL_TFLOPS = 989
H100_SFU_TFLOPS = 3.9


def attention_flops(batch, heads, seq_q, seq_k, dim, *, causal=False, window_size=None, mode="fwd"):
    """Floating-point operations of attention under the course's convention (see module doc)."""
    if mode not in ("fwd", "bwd", "fwd+bwd"):
        raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd+bwd'; got {mode!r}")
    if window_size is not None:
        pairs = int(visibility_mask(seq_q, seq_k, causal=True, window_size=window_size).sum())
    else:
        pairs = seq_q * seq_k * (0.5 if causal else 1.0)
    fwd = 4.0 * batch * heads * pairs * dim
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd+bwd": 3.5 * fwd}[mode]


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


# How the records' times are taken. Records without a "timing" field (measured before
# 2026-11-22 16:30 UTC) synchronised after every call, which also counts the Python launch overhead.
TIMING_METHOD = ("median of per-call CUDA-event times; calls issued back to back (one synchronisation "
                 "per batch), so the host's launch overhead overlaps the previous call as in a real model; "
                 "implementations take turns in rounds whose order changes (rotations, every other one reversed), "
                 "so none always follows the same one")


def _samples(fn, rep):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def time_cuda(fn, *, warmup=5, rep=30, rounds=5):
    """Median milliseconds of ``fn()`` on the GPU (see ``TIMING_METHOD``), as a ``Timing`` whose rounds are
    ``rounds`` consecutive batches of the ``rep`` calls."""
    if not HAS_GPU:
        raise RuntimeError("time_cuda needs a CUDA GPU; on the CPU the notebooks show stored records")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_round = max(1, rep // rounds)
    batches = [_samples(fn, per_round) for _ in range(max(1, rep // per_round))]
    return Timing(statistics.median([t for b in batches for t in b]), [statistics.median(b) for b in batches])


class Timing(float):
    """Median milliseconds of one implementation, carrying the medians of each round it ran in.

    It is a float (the median over every call, what the records have always stored), so code that
    computes TFLOP/s or ratios from it is unchanged; ``spread`` is the min, median and max of the
    per-round medians, which ``save_record`` stores beside it (``with_spreads``) so that a claim can
    tell a difference from the noise between rounds (``measure.claims``).
    """

    def __new__(cls, median, round_medians):
        obj = super().__new__(cls, median)
        obj.round_medians = tuple(float(m) for m in round_medians)
        return obj

    def __getnewargs__(self):  # pickles (ring attention gathers timings across processes)
        return float(self), self.round_medians

    @property
    def spread(self):
        rounds = self.round_medians or (float(self),)
        return {"min": min(rounds), "median": statistics.median(rounds), "max": max(rounds), "rounds": len(rounds)}


def with_spreads(results):
    """``results`` with a ``<key>_spread`` entry beside every ``Timing`` (or dict of ``Timing``s) it holds.

    ``{"impl": ..., "ms": Timing}`` gains ``"ms_spread": {"min", "median", "max", "rounds"}``;
    ``{"ms": {"ring": Timing, ...}}`` gains ``"ms_spread": {"ring": {...}, ...}``.
    """
    if isinstance(results, list):
        return [with_spreads(r) for r in results]
    if not isinstance(results, dict):
        return results
    out = {}
    for key, value in results.items():
        if isinstance(value, Timing):
            out[key] = value
            out[f"{key}_spread"] = value.spread
        elif isinstance(value, dict) and any(isinstance(v, Timing) for v in value.values()):
            out[key] = dict(value)
            out[f"{key}_spread"] = {k: v.spread for k, v in value.items() if isinstance(v, Timing)}
        else:
            out[key] = with_spreads(value)
    return out


def round_orders(names, rounds):
    """The order of each of ``rounds`` rounds: rotations of ``names``, every other one reversed.

    Each name runs right after each of its neighbours as often as before it; with three names, six
    rounds are the six orders. Why it matters: under attention the H100 runs at its 700 W power cap,
    and a kernel timed right after a slower, cooler one (FlashAttention-2) starts at a higher clock.
    The fixed order (ours, FlashAttention-2, cuDNN) put our backward 2–9% lower against cuDNN than
    timing the two alone did, at S = 4k-16k (chapter 08, section 7).
    """
    names = list(names)
    orders = []
    for r in range(rounds):
        shift = (r // 2) % len(names)
        order = names[shift:] + names[:shift]
        orders.append(order[::-1] if r % 2 else order)
    return orders


def time_side_by_side(fns, *, warmup=5, rounds=6, rep=8, balanced=True):
    """Median milliseconds of each function in ``fns`` (a dict), timed in interleaved rounds: a ``Timing``
    each, which also carries the median of every round (the spread a record stores).

    Taking turns spreads clock and temperature drift over every implementation alike, so their
    ratios are steadier than when each is timed in one block; the turns change order from round
    to round (``round_orders``), so no implementation always inherits the same predecessor's clock.
    ``balanced=False`` keeps the dict's order in every round (the records' method before
    2026-11-27, kept to measure what the order does: chapter 08's ``timing_order``).
    """
    if not HAS_GPU:
        raise RuntimeError("time_side_by_side needs a CUDA GPU")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in fns}
    round_medians = {name: [] for name in fns}
    for order in round_orders(fns, rounds) if balanced else [list(fns)] * rounds:
        for name in order:
            times = _samples(fns[name], rep)
            samples[name] += times
            round_medians[name].append(statistics.median(times))
    return {name: Timing(statistics.median(times), round_medians[name]) for name, times in samples.items()}


def refreshing(name=None):
    """True when this run should re-measure GPU records (``name``'s, where given) instead of loading the stored
    ones. ``COURSE_REFRESH_RECORDS`` is "1" for every record, or a comma-separated list of record names."""
    wanted = os.environ.get("COURSE_REFRESH_RECORDS", "")
    if not HAS_GPU or not wanted:
        return False
    return wanted == "1" or name in wanted.split(",")


def save_record(name, results, *, notes=None, timing=TIMING_METHOD):
    """Write ``figures/<name>.json`` with the results and the machine they were measured on (``timing``: how its
    times were taken; a record that times nothing says so). Every ``Timing`` in ``results`` gets its spread over
    rounds stored beside it (``with_spreads``)."""
    record = {"name": name, "machine": machine_info(), "timing": timing, "notes": notes,
              "results": with_spreads(results)}
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / f"{name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_record(name):
    path = FIGURES / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no stored record {path.name}; run the notebook on a GPU with "
                                "COURSE_REFRESH_RECORDS=1 to measure it")
    return json.loads(path.read_text())


def measured(name, measure, *, notes=None, pending_ok=False):
    """Re-measure with ``measure()`` when refreshing on a GPU, else load the stored record.

    Prints where the numbers come from, so a reader always knows the device and date. With
    ``pending_ok``, a record that has never been measured gives None (and says so) instead of an
    error: the chapter then shows that the measurement is pending, never a number.
    """
    if refreshing(name):
        record = save_record(name, measure(), notes=notes)
        origin = "measured now"
    elif pending_ok:
        return stored_record(name)
    else:
        record = load_record(name)
        origin = "stored record"
    _announce(name, record, origin)
    return record


def _announce(name, record, origin):
    m = record["machine"]
    gpus = f"{m['gpu_count']}× " if m.get("gpu_count", 1) > 1 else ""
    print(f"[{origin}: {name}] {gpus}{m.get('gpu', m.get('cpu'))}, torch {m['torch']}, "
          f"tilelang {m['tilelang']}, CUDA {m.get('cuda')}, {m['date']}")


def stored_record(name, *, needs=None):
    """The stored record ``name``, announced like ``measured``'s, or None (said so) when there is none
    yet. For records another machine must measure (several GPUs): a notebook never re-measures them.
    ``needs``: what measuring it takes, when that is more than running its benchmark (a kernel not written yet)."""
    try:
        record = load_record(name)
    except FileNotFoundError:
        needs = needs or f"python -m course_utils.measure.benchmarks {name}"
        print(f"[no stored record: {name}] it has not been measured yet; on the GPU it needs: {needs}")
        return None
    _announce(name, record, "stored record")
    return record
