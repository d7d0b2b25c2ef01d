"""Device call 1 of issue #16: every candidate forward, checked on every head, timed side by side with FA2/cuDNN.

(In the call that ran, a launch failure was not caught: 128 × 192 at D = 128 asks for 256 KB of shared
memory, the worker died, the watchdog restarted it three times and the timed cases never ran. Fixed
since; the ablation record of the same call measured the candidates at S = 4k.)

    python tools/hfwd_candidates.py OUTDIR            # the watchdog: runs the worker, skips a kernel that hangs
    python tools/hfwd_candidates.py OUTDIR --worker   # the worker (resumes from OUTDIR/results.jsonl)

A kernel with a wrong barrier protocol hangs instead of failing; the watchdog kills a worker that
makes no progress for STALL seconds and restarts it without the kernel it was running.
"""

import json
import os
import signal
import subprocess
import sys
import time

STALL = 60
OUT = sys.argv[1]
PROGRESS, RESULTS = os.path.join(OUT, "progress.log"), os.path.join(OUT, "results.jsonl")


def candidates():
    from course_utils.attention import HOPPER_FORWARD_CONFIGS
    from course_utils.flash_fwd_hopper import flash_fwd_hopper_kernel as rot
    from course_utils.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel as pers
    from course_utils.flash_fwd_hopper_versions import flash_fwd_hopper_persistent_variant as pvar

    def base(dim, causal):
        c = HOPPER_FORWARD_CONFIGS[dim, causal]
        return rot, dict(block_M=c.block_M, block_N=c.block_N, threads=c.threads, pingpong=c.pingpong)

    c = {
        "base": (None, base, (64, 128)),
        "rot3wg_192x128": (rot, dict(block_M=192, block_N=128, threads=384), (64,)),
        "P128x128": (pers, dict(block_M=128, block_N=128, threads=256), (64, 128)),
        "P128x128_pp": (pers, dict(block_M=128, block_N=128, threads=256, pingpong=True), (64, 128)),
        "P128x128_ds": (pvar, dict(block_M=128, block_N=128, threads=256, deferred_row_sum=True), (64, 128)),
        "P128x128_unfolded": (pvar, dict(block_M=128, block_N=128, threads=256, folded=False), (64, 128)),
        "P128x192": (pers, dict(block_M=128, block_N=192, threads=256), (64, 128)),
        "P192x128": (pers, dict(block_M=192, block_N=128, threads=384), (64,)),
        "P192x128_pp": (pers, dict(block_M=192, block_N=128, threads=384, pingpong=True), (64,)),
        "P192x128_ds": (pvar, dict(block_M=192, block_N=128, threads=384, deferred_row_sum=True), (64,)),
        "P192x128_pp_ds": (pvar, dict(block_M=192, block_N=128, threads=384, pingpong=True, deferred_row_sum=True),
                           (64,)),
        "P192x128_fma4": (pvar, dict(block_M=192, block_N=128, threads=384, fma_exp2_every=4), (64,)),
        "P192x128_fma2": (pvar, dict(block_M=192, block_N=128, threads=384, fma_exp2_every=2), (64,)),
        "P128x128_fma4": (pvar, dict(block_M=128, block_N=128, threads=256, fma_exp2_every=4), (64, 128)),
    }
    return c


CASES = [(dim, seq, causal) for dim in (128, 64) for seq in (1024, 4096, 16384) for causal in (False, True)]
# Correctness only: GQA + sinks + windows (gpt-oss), ragged, S_q != S_k, one-key windows, bf16.
EDGE = [
    dict(name="gpt-oss w128", b=1, h=64, hkv=8, sq=2048, sk=2048, dim=64, causal=True, window=128, sinks=True,
         dtype="bfloat16"),
    dict(name="gpt-oss full", b=1, h=64, hkv=8, sq=2048, sk=2048, dim=64, causal=True, window=None, sinks=True,
         dtype="bfloat16"),
    dict(name="ragged causal", b=2, h=4, hkv=4, sq=1000, sk=1000, dim=128, causal=True, window=None, sinks=False,
         dtype="float16"),
    dict(name="ragged D64", b=2, h=4, hkv=4, sq=1000, sk=1000, dim=64, causal=False, window=None, sinks=False,
         dtype="float16"),
    dict(name="Sq<Sk causal", b=1, h=4, hkv=2, sq=500, sk=1300, dim=128, causal=True, window=None, sinks=False,
         dtype="float16"),
    dict(name="Sq>Sk causal", b=1, h=4, hkv=4, sq=1300, sk=500, dim=64, causal=True, window=None, sinks=True,
         dtype="float16"),
    dict(name="window 1", b=1, h=4, hkv=4, sq=777, sk=777, dim=64, causal=True, window=1, sinks=False,
         dtype="float16"),
    dict(name="tiny", b=1, h=1, hkv=1, sq=64, sk=64, dim=128, causal=False, window=None, sinks=False,
         dtype="float16"),
]


def log(msg):
    with open(PROGRESS, "a") as f:
        f.write(msg + "\n")


def emit(row):
    with open(RESULTS, "a") as f:
        f.write(json.dumps(row) + "\n")


def worker(exclude):
    import torch

    from course_utils.bench import attention_flops, tflops, time_side_by_side
    from course_utils.benchmarks.common import SDPA_PEERS, comparison_shapes, in_parallel, random_inputs, sdpa
    from course_utils.tiles import compile_kernel
    from course_utils.validation import check_forward, references

    done = set()
    if os.path.exists(RESULTS):
        for line in open(RESULTS):
            r = json.loads(line)
            done.add(r["key"])
    cands = {k: v for k, v in candidates().items() if k not in exclude}

    def spec(name, dim, causal):
        factory, knobs, dims = cands[name]
        if dim not in dims:
            return None
        if factory is None:
            factory, knobs = knobs(dim, causal)
        return factory, knobs

    jobs = []  # (key, candidate, (factory, knobs), problem, causal, dtype, edge)
    for dim, seq, causal in CASES:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        for name in cands:
            s = spec(name, dim, causal)
            if s and f"time {name} {dim} {seq} {causal}" not in done:
                jobs.append(((name, dim, seq, causal), name, s, shape, causal, "float16", None))
    for e in EDGE:
        for name in cands:
            s = spec(name, e["dim"], e["causal"]) if name != "base" else None
            if s and f"edge {name} {e['name']}" not in done:
                jobs.append(((name, e["name"]), name, s, None, e["causal"], e["dtype"], e))

    def build(job):
        _, name, (factory, knobs), shape, causal, dtype, edge = job
        try:
            if edge is None:
                func = factory(shape["batch"], shape["heads"], shape["seq"], shape["seq"], shape["dim"],
                               causal=causal, dtype=dtype, **knobs)
            else:
                func = factory(edge["b"], edge["h"], edge["sq"], edge["sk"], edge["dim"], heads_kv=edge["hkv"],
                               causal=causal, window_size=edge["window"], has_sinks=edge["sinks"], dtype=dtype,
                               **knobs)
            return compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"

    log("worker start")
    t0 = time.time()
    kernels = dict(zip([j[0] for j in jobs], in_parallel(build, jobs, workers=16)))
    log(f"compiled {len(jobs)} in {time.time() - t0:.0f}s")
    print(f"compiled {len(jobs)} kernels in {time.time() - t0:.0f}s", flush=True)

    # Edge cases first: correctness only.
    for e in EDGE:
        g = torch.Generator(device="cuda").manual_seed(1)
        dt = getattr(torch, e["dtype"])
        q = torch.randn(e["b"], e["h"], e["sq"], e["dim"], device="cuda", dtype=dt, generator=g)
        k, v = (torch.randn(e["b"], e["hkv"], e["sk"], e["dim"], device="cuda", dtype=dt, generator=g) for _ in range(2))
        sinks = torch.randn(e["h"], device="cuda", generator=g) if e["sinks"] else None
        sink_logits = sinks if sinks is not None else torch.full((e["h"],), float("-inf"), device="cuda")
        refs = None
        for name in cands:
            kern = kernels.get((name, e["name"]))
            if kern is None:
                continue
            row = dict(key=f"edge {name} {e['name']}", kind="edge", cand=name, case=e["name"])
            if isinstance(kern, str):
                row["error"] = kern
            else:
                log(f"start {name} edge {e['name']}")
                try:  # a launch can fail (e.g. more shared memory than an SM has): record it, go on
                    out, lse = kern(q, k, v, sink_logits)
                    torch.cuda.synchronize()
                    log(f"ran {name} edge {e['name']}")
                    refs = refs or references(q, k, v, causal=e["causal"], window_size=e["window"], sinks=sinks)
                    row["errors"] = check_forward(q, k, v, out, lse, causal=e["causal"], window_size=e["window"],
                                                  sinks=sinks, refs=refs, quiet=True, name=name)
                    row["ok"] = True
                except Exception as exc:
                    row["ok"] = False
                    row["error"] = str(exc)[:300]
            emit(row)
            print("edge", row["case"], name, "ok" if row.get("ok") else row.get("error"), flush=True)

    for dim, seq, causal in CASES:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        q, k, v = random_inputs(shape, torch.float16)
        no_sinks = torch.full((shape["heads"],), float("-inf"), device="cuda")
        refs = None
        impls, rows = {}, {}
        for name in cands:
            kern = kernels.get((name, dim, seq, causal))
            if kern is None:
                continue
            row = dict(key=f"time {name} {dim} {seq} {causal}", kind="time", cand=name, dim=dim, seq=seq,
                       causal=causal)
            rows[name] = row
            if isinstance(kern, str):
                row["error"] = kern
                continue
            log(f"start {name} {dim} {seq} {causal}")
            try:  # a launch can fail (e.g. more shared memory than an SM has): record it, go on
                out, lse = kern(q, k, v, no_sinks)
                torch.cuda.synchronize()
                log(f"ran {name} {dim} {seq} {causal}")
                refs = refs or references(q, k, v, causal=causal)
                row["errors"] = check_forward(q, k, v, out, lse, causal=causal, refs=refs, quiet=True, name=name)
                impls[name] = lambda kern=kern: kern(q, k, v, no_sinks)
            except Exception as exc:
                row["error"] = str(exc)[:300]
        del refs
        for name, backend in SDPA_PEERS.items():
            impls[name] = lambda backend=backend: sdpa(q, k, v, causal, backend)
        log(f"start timing {dim} {seq} {causal} " + " ".join(impls))
        times = time_side_by_side(impls)
        log(f"timed {dim} {seq} {causal}")
        flops = attention_flops(shape["batch"], shape["heads"], seq, seq, dim, causal=causal)
        peers = {}
        for name, ms in times.items():
            if name in rows:
                rows[name].update(ms=ms, tflops=tflops(flops, ms))
            else:
                peers[name] = dict(ms=ms, tflops=tflops(flops, ms))
        cudnn = [v["tflops"] for n, v in peers.items() if "cuDNN" in n][0]
        for name, row in rows.items():
            row["peers"] = peers
            if "tflops" in row:
                row["vs_cudnn"] = row["tflops"] / cudnn
            emit(row)
        print(f"D={dim} S={seq} causal={causal}: " + ", ".join(
            f"{n} {r.get('tflops', 0):.0f} ({r.get('vs_cudnn', 0):.2f})" for n, r in rows.items())
            + " | " + ", ".join(f"{n.split()[0]} {v['tflops']:.0f}" for n, v in peers.items()), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    log("worker done")


def watchdog():
    os.makedirs(OUT, exist_ok=True)
    exclude = []
    t_start = time.time()
    for attempt in range(6):
        cmd = [sys.executable, __file__, OUT, "--worker", *exclude]
        proc = subprocess.Popen(cmd, start_new_session=True)
        last_size, last_change = -1, time.time()
        while proc.poll() is None:
            time.sleep(2)
            size = os.path.getsize(PROGRESS) if os.path.exists(PROGRESS) else 0
            if size != last_size:
                last_size, last_change = size, time.time()
            # Compiles can take long; a stall counts only once the worker has said it compiled.
            text = open(PROGRESS).read() if os.path.exists(PROGRESS) else ""
            compiled = "compiled" in text[text.rfind("worker start"):] if "worker start" in text else False
            if compiled and time.time() - last_change > STALL:
                lines = open(PROGRESS).read().splitlines()
                last = [ln for ln in lines if ln.startswith("start ")][-1]
                hung = last.split()[1]
                print(f"!! worker stalled on: {last}; excluding {hung}", flush=True)
                log(f"HUNG {last}")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if hung == "timing":
                    hung = None
                if hung:
                    exclude.append(hung)
                break
        else:
            print(f"worker exited with {proc.returncode} after {time.time() - t_start:.0f}s", flush=True)
            if proc.returncode == 0:
                break
    print("excluded (hung):", exclude, flush=True)
    summary()


def summary():
    """One line per case: every candidate's TFLOP/s and its ratio to cuDNN; edge-case failures."""
    if not os.path.exists(RESULTS):
        return
    rows = [json.loads(line) for line in open(RESULTS)]
    bad = [r for r in rows if r["kind"] == "edge" and not r.get("ok")]
    print(f"edge cases: {sum(r['kind'] == 'edge' for r in rows)} run, failures: "
          + ("; ".join(f"{r['cand']} {r['case']}: {r.get('error', '')[:80]}" for r in bad) or "none"))
    cases = sorted({(r["dim"], r["seq"], r["causal"]) for r in rows if r["kind"] == "time"}, key=lambda c: (-c[0], c[1], c[2]))
    for dim, seq, causal in cases:
        sel = [r for r in rows if r["kind"] == "time" and (r["dim"], r["seq"], r["causal"]) == (dim, seq, causal)]
        peers = next((r["peers"] for r in sel if "peers" in r), {})
        print(f"D={dim} S={seq} {'C' if causal else 'N'} | " + " ".join(f"{n.split()[0]}={v['tflops']:.0f}" for n, v in peers.items())
              + " | " + " ".join(f"{r['cand']}={r['tflops']:.0f}({r['vs_cudnn']:.2f})" if "tflops" in r
                                 else f"{r['cand']}=ERR" for r in sel))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1:])
    else:
        watchdog()
