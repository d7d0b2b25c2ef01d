"""Issue 26 (bwd3, 2026-11-26): chapter 08's backward levers and the timing method, on one GPU.

    python notes/bwd3/gpu_bwd3.py compile            # every kernel below, in parallel threads
    python notes/bwd3/gpu_bwd3.py main  [SEQ ...]    # check every head, then time under both methods
    python notes/bwd3/gpu_bwd3.py profile            # torch.profiler: per-kernel device times and gaps

"main": per (dtype, D, causal) at B·S = 16k, H·D = 2048: the default backward (public autograd path), the
candidates (BackwardConfig options), the deterministic mode, cuDNN and FlashAttention-2; each of ours checked
on every head against float64 first; then timed (a) as the records time (calls back to back, per-call CUDA
events, ``time_side_by_side``) and (b) with ``triton.testing.do_bench`` (L2 flushed before every call),
implementations taking turns in both. Results: $OUT/bwd3_main_S*.json.
"""
import itertools
import json
import os
import statistics
import sys
import time

import torch
import triton

from course_utils import flash_attention
from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS, backward_kernels, forward_kernel
from course_utils.checking.validation import check_backward, references
from course_utils.core.labels import CUDNN, FA2
from course_utils.measure.bench import attention_flops, tflops, time_side_by_side
from course_utils.measure.benchmarks.common import (SDPA_PEERS, backward_timer, comparison_shapes, empty_query,
                                                    in_parallel, random_inputs, sdpa)

OUT = os.environ.get("OUT", ".")
DQ_ROWS = ("row", "row", "row", "row", "row")  # FlashAttention-3's AtomLayoutMdQ = 2 (D = 64)
DTYPES = ("float16", "bfloat16")
CASES = [(d, c) for d in (128, 64) for c in (False, True)]


SWEEP = os.environ.get("BWD3_SWEEP") == "1"  # call 2: D = 64 only, the default and the dQ-by-rows candidates
if SWEEP:
    CASES = [(64, False), (64, True)]


def candidates(dim, causal):
    """name -> (BackwardConfig or None for the default, deterministic)."""
    base = HOPPER_BACKWARD_CONFIGS[dim, causal]
    if SWEEP:
        return {"default": (None, False), "dq rows": (base._replace(policies=DQ_ROWS), False),
                "dq rows + v14": (base._replace(policies=DQ_ROWS, dv_under_ds=True), False)}
    out = {"default": (None, False), "v14 dv_under_ds": (base._replace(dv_under_ds=True), False)}
    if dim == 64:
        out["dq rows"] = (base._replace(policies=DQ_ROWS), False)
        out["dq rows + v14"] = (base._replace(policies=DQ_ROWS, dv_under_ds=True), False)
    out["deterministic"] = (None, True)
    return out


def machine():
    import tilelang
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), triton=triton.__version__, tilelang=tilelang.__version__,
                date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))


def compile_all(seqs=(4096,)):
    jobs = []
    for dtype, (dim, causal), seq in itertools.product(DTYPES, CASES, seqs):
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        jobs.append(("fwd", dtype, shape, causal, None, False))
        for name, (config, det) in candidates(dim, causal).items():
            jobs.append((name, dtype, shape, causal, config, det))

    def build(job):
        name, dtype, shape, causal, config, det = job
        q = empty_query(shape, dtype)
        t = time.time()
        try:
            if name == "fwd":
                forward_kernel(q, q, causal=causal)
            else:
                backward_kernels(q, q, causal=causal, config=config, deterministic=det)
            return f"{name} {dtype} D{shape['dim']} S{shape['seq']} c={causal}: {time.time() - t:.0f} s"
        except Exception as exc:
            return f"{name} {dtype} D{shape['dim']} c={causal}: FAILED {type(exc).__name__}: {str(exc)[-300:]}"

    t = time.time()
    for line in in_parallel(build, jobs, workers=16):
        print(line, flush=True)
    print(f"compiled {len(jobs)} jobs in {time.time() - t:.0f} s", flush=True)


def do_bench_turns(fns, rounds=3, warmup=25, rep=100):
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            samples[n].append(triton.testing.do_bench(f, warmup=warmup, rep=rep))
    return {n: statistics.median(v) for n, v in samples.items()}


def main(seqs):
    for seq in seqs:
        rows = []
        for dtype_name, (dim, causal) in itertools.product(DTYPES, CASES):
            dtype = getattr(torch, dtype_name)
            shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
            q, k, v = random_inputs(shape, dtype)
            fns, errors = {}, {}
            refs = None
            for name, (config, det) in candidates(dim, causal).items():
                attn = (lambda a, b, c, cfg=config, d=det:  # noqa: E731
                        flash_attention(a, b, c, causal=causal, backward_config=cfg, deterministic=d))
                fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
                if refs is None and seq <= 4096:
                    refs = references(q, k, v, d_out=d_out, causal=causal)
                try:
                    if refs is not None:
                        errors[name] = check_backward(q, k, v, d_out, fn(), causal=causal, refs=refs, quiet=True,
                                                      name=name)
                    fns[name] = fn
                except Exception as exc:  # a wrong candidate is a row, not the end of the run
                    errors[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    print(f"{dtype_name} D{dim} c={causal} {name}: FAILED {errors[name]}", flush=True)
            del refs
            for peer, backend in SDPA_PEERS.items():
                if SWEEP and peer != CUDNN:
                    continue
                fns[peer] = backward_timer(lambda a, b, c, be=backend: sdpa(a, b, c, causal, be), q, k, v)[0]
            torch.cuda.synchronize()
            records = time_side_by_side(fns)
            bench = do_bench_turns(fns, rounds=2 if SWEEP else 3)
            flops = attention_flops(shape["batch"], shape["heads"], seq, seq, dim, causal=causal, mode="bwd")
            for name in fns:
                row = dict(impl=name, dtype=dtype_name, dim=dim, causal=causal, seq=seq, batch=shape["batch"],
                           heads=shape["heads"], records_ms=records[name], do_bench_ms=bench[name],
                           records_tflops=tflops(flops, records[name]), do_bench_tflops=tflops(flops, bench[name]),
                           records_vs_cudnn=records[CUDNN] / records[name], do_bench_vs_cudnn=bench[CUDNN] / bench[name],
                           errors=errors.get(name))
                rows.append(row)
                print(f"S={seq} {dtype_name} D{dim} c={causal!s:5} {name:16} records {records[name]:.3f} ms "
                      f"({row['records_vs_cudnn']:.3f}x cuDNN)  do_bench {bench[name]:.3f} ms "
                      f"({row['do_bench_vs_cudnn']:.3f}x)", flush=True)
            del fns
            torch.cuda.empty_cache()
        json.dump(dict(machine=machine(), rows=rows), open(os.path.join(OUT, f"bwd3_main_S{seq}.json"), "w"), indent=1)


def _short(name):
    for key in ("flash_bwd_hopper", "flash_bwd_preprocess", "flash_bwd_postprocess", "FillFunctor", "spin_kernel",
                "cudnn", "convert", "dot", "sm90", "flash", "elementwise"):
        if key.lower() in name.lower():
            return name[:110]
    return name[:110]


def profile():
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")  # do_bench's L2 flush buffer
    result = dict(machine=machine(), cases=[])
    for dim, causal in ((128, False), (128, True), (64, False)):
        shape = comparison_shapes(seq_lens=(4096,), dim=dim)[0]
        q, k, v = random_inputs(shape, torch.float16)
        fns = {"ours": backward_timer(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v)[0],
               "cudnn": backward_timer(lambda a, b, c: sdpa(a, b, c, causal, SDPA_PEERS[CUDNN]), q, k, v)[0]}
        for fn in fns.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        for name, fn in fns.items():
            for method in ("back_to_back", "flushed"):
                n = 20
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(n)]
                with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
                    for start, end in events:
                        if method == "flushed":
                            cache.zero_()
                        torch.cuda._sleep(100)  # marker: this call's kernels follow
                        start.record()
                        fn()
                        end.record()
                        torch.cuda._sleep(100)  # marker: this call's kernels end
                    torch.cuda.synchronize()
                event_ms = [s.elapsed_time(e) for s, e in events]
                path = os.path.join("/tmp", f"trace_{dim}_{causal}_{name}_{method}.json")
                prof.export_chrome_trace(path)
                trace = json.load(open(path))["traceEvents"]
                gpu = sorted((e for e in trace if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                             key=lambda e: e["ts"])
                markers = [i for i, e in enumerate(gpu) if "spin" in e["name"].lower()]
                calls = []
                for a, b in zip(markers[0::2], markers[1::2]):
                    ks = gpu[a + 1:b]
                    if not ks:
                        continue
                    calls.append(dict(
                        kernels=[(_short(e["name"]), e["cat"], e["dur"]) for e in ks],
                        gaps_us=[ks[j + 1]["ts"] - (ks[j]["ts"] + ks[j]["dur"]) for j in range(len(ks) - 1)],
                        lead_us=ks[0]["ts"] - (gpu[a]["ts"] + gpu[a]["dur"]),
                        span_us=ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]))
                body = calls[2:]  # the first calls may still wait for the host
                per_kernel = {}
                for c in body:
                    for j, (kname, cat, dur) in enumerate(c["kernels"]):
                        per_kernel.setdefault(f"{j}:{kname}", []).append(dur)
                summary = dict(dim=dim, causal=causal, impl=name, method=method, n_calls=len(body),
                               event_ms_median=statistics.median(event_ms[2:]),
                               span_us_median=statistics.median(c["span_us"] for c in body),
                               gaps_us_median_sum=statistics.median(sum(c["gaps_us"]) for c in body),
                               lead_us_median=statistics.median(c["lead_us"] for c in body),
                               kernels_us_median={k: statistics.median(v) for k, v in per_kernel.items()},
                               example_call=body[len(body) // 2] if body else None,
                               n_markers=len(markers), kernel_names=sorted({e["name"][:80] for e in gpu})[:30])
                result["cases"].append(summary)
                print(json.dumps({k: summary[k] for k in ("dim", "causal", "impl", "method", "event_ms_median",
                                                          "span_us_median", "gaps_us_median_sum", "lead_us_median",
                                                          "kernels_us_median")}), flush=True)
        del fns
        torch.cuda.empty_cache()
    json.dump(result, open(os.path.join(OUT, "bwd3_profile.json"), "w"), indent=1)


def methods():
    """Call 2: the two methods alternated in rounds (order swapped every round), per-call event times kept, and
    do_bench's own statistic (mean by default) beside the median; SM clock and power sampled by nvidia-smi."""
    import subprocess
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu",
                            "--format=csv,noheader", "-lms", "50"], stdout=open(os.path.join(OUT, "smi.csv"), "w"))
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    log = []
    for dim, causal in ((128, False), (128, True), (64, False)):
        shape = comparison_shapes(seq_lens=(4096,), dim=dim)[0]
        q, k, v = random_inputs(shape, torch.float16)
        fns = {"ours": backward_timer(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v)[0],
               "cudnn": backward_timer(lambda a, b, c: sdpa(a, b, c, causal, SDPA_PEERS[CUDNN]), q, k, v)[0]}
        for fn in fns.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        for rnd in range(4):
            order = ("back_to_back", "flushed", "do_bench") if rnd % 2 == 0 else ("do_bench", "flushed", "back_to_back")
            for name, fn in fns.items():
                for method in order:
                    t0 = time.time()
                    if method == "do_bench":
                        times = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
                    else:
                        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                                  for _ in range(30)]
                        for start, end in events:
                            if method == "flushed":
                                cache.zero_()
                            start.record()
                            fn()
                            end.record()
                        torch.cuda.synchronize()
                        times = [s.elapsed_time(e) for s, e in events]
                    row = dict(dim=dim, causal=causal, impl=name, method=method, round=rnd, t0=t0, t1=time.time(),
                               median=statistics.median(times), mean=statistics.mean(times), min=min(times),
                               max=max(times), n=len(times), times=times)
                    log.append(row)
                    print(f"D{dim} c={causal!s:5} r{rnd} {name:6} {method:12} median {row['median']:.3f} mean "
                          f"{row['mean']:.3f} min {row['min']:.3f} max {row['max']:.3f} n={row['n']}", flush=True)
        del fns
        torch.cuda.empty_cache()
    smi.terminate()
    json.dump(dict(machine=machine(), rows=log), open(os.path.join(OUT, "bwd3_methods.json"), "w"))


if __name__ == "__main__":
    part = sys.argv[1]
    seqs = [int(s) for s in sys.argv[2:]] or [4096]
    if part == "compile":
        compile_all(seqs)
    elif part == "main":
        main(seqs)
    elif part == "profile":
        profile()
    elif part == "methods":
        methods()
    else:
        raise SystemExit(f"unknown part {part!r}")
