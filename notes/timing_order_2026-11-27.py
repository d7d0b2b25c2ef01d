"""Issue 26: why the record's backward ratio falls at 8k-16k when the kernels' own GPU time does not.

torch.profiler (call T1, notes/h100_2026-11-27d/peer_kernels.json) put the sum of our backward's kernels at or
below cuDNN's in the cases the record has at 0.92-0.95 (bf16 D128 full 16k: 9165 against 9173 µs). The record times
ours, FlashAttention-2 and cuDNN in interleaved rounds of 8 back-to-back calls, always in that order, so cuDNN's
calls follow FA2's, which run at half the tensor-core rate. Prediction if the GPU's clock is power-limited: ours
gains against cuDNN when the order is reversed or FA2 is left out, and the two are level when timed from a cool
idle GPU. nvidia-smi samples clocks and power every 20 ms meanwhile (phase markers printed with wall times).

Run: python timing_order_2026-11-27.py OUT.json
"""
import json
import statistics
import sys
import time

import torch

from course_utils import backward_kernels, flash_attention
from course_utils.core.labels import CUDNN, FA2
from course_utils.measure.bench import time_side_by_side
from course_utils.measure.benchmarks.common import (
    SDPA_PEERS,
    backward_timer,
    empty_query,
    in_parallel,
    random_inputs,
    sdpa,
)

CASES = [("bfloat16", 128, False, 16384), ("float16", 128, False, 8192), ("bfloat16", 64, True, 16384),
         ("float16", 128, False, 4096)]


def shape_of(dim, seq):
    return dict(batch=max(1, 16384 // seq), heads=2048 // dim, seq=seq, dim=dim)


def cold(fns, rounds=6, rest=0.4):
    """Each function's time from an idle GPU: a rest, then one timed call, taking turns."""
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            torch.cuda.synchronize()
            time.sleep(rest)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples[n].append(start.elapsed_time(end))
    return {n: statistics.median(t) for n, t in samples.items()}


def main(path):
    def build(case):
        dtype, dim, causal, seq = case
        q = empty_query(shape_of(dim, seq), dtype)
        flash_attention(q, q, q, causal=causal)
        backward_kernels(q, q, causal=causal)
    in_parallel(build, CASES)
    rows = []
    for dtype, dim, causal, seq in CASES:
        q, k, v = random_inputs(shape_of(dim, seq), getattr(torch, dtype))
        attns = {"ours": lambda a, b, c: flash_attention(a, b, c, causal=causal),
                 FA2: lambda a, b, c: sdpa(a, b, c, causal, SDPA_PEERS[FA2]),
                 CUDNN: lambda a, b, c: sdpa(a, b, c, causal, SDPA_PEERS[CUDNN])}
        fns = {n: backward_timer(a, q, k, v)[0] for n, a in attns.items()}
        case = f"{dtype} D{dim} {'causal' if causal else 'full'} S={seq}"
        orders = {"record order (ours, FA2, cuDNN)": ["ours", FA2, CUDNN],
                  "reversed (cuDNN, FA2, ours)": [CUDNN, FA2, "ours"],
                  "without FA2 (ours, cuDNN)": ["ours", CUDNN],
                  "without FA2 (cuDNN, ours)": [CUDNN, "ours"]}
        for label, order in orders.items():
            print(f"MARK {time.time():.3f} {case} {label}", flush=True)
            ms = time_side_by_side({n: fns[n] for n in order})
            rows.append(dict(case=case, method=label, ms=ms, cudnn_over_ours=ms[CUDNN] / ms["ours"]))
            print(f"{case} | {label}: cuDNN÷ours {ms[CUDNN] / ms['ours']:.3f} (" +
                  ", ".join(f"{n.split()[0]} {t:.3f} ms" for n, t in ms.items()) + ")", flush=True)
        print(f"MARK {time.time():.3f} {case} cold", flush=True)
        ms = cold({n: fns[n] for n in ("ours", CUDNN)})
        rows.append(dict(case=case, method="cold (0.4 s idle before each call)", ms=ms,
                         cudnn_over_ours=ms[CUDNN] / ms["ours"]))
        print(f"{case} | cold: cuDNN÷ours {ms[CUDNN] / ms['ours']:.3f} (" +
              ", ".join(f"{n.split()[0]} {t:.3f} ms" for n, t in ms.items()) + ")", flush=True)
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           cudnn=torch.backends.cudnn.version(), rows=rows), f, indent=1)
        del q, k, v, fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
