"""Issue #26 on the H100, from the repository root (PYTHONPATH=.): one part per process.

    python notes/hopper_bwd_f26.py race      # the one-key-window race: TileLang's shared-memory reuse on / off
    python notes/hopper_bwd_f26.py backward  # S=4k: default, deterministic, versions 9/14, cuDNN, FA2
    python notes/hopper_bwd_f26.py forward   # D=64 short causal forward: the configs chapter 07 can choose

Timing: triton.testing.do_bench (L2 flushed before every call, median), implementations taking turns
over 3 rounds, median of the rounds. Every timed result is first checked on every head with the course's
criterion (check_backward / check_forward against the float64 reference). Prints one line per result and
writes JSON to $OUT (or /tmp).
"""
import itertools
import json
import os
import statistics
import sys
import time

import tilelang
import torch

try:
    import triton.testing
except ImportError:  # the CPU machine: lets the module be imported for a check
    triton = None

from course_utils import attention, flash_attention
from course_utils.api.attention import ForwardConfig, forward_kernel
from course_utils.measure.bench import attention_flops, tflops
from course_utils.measure.benchmarks.common import (
    SDPA_PEERS,
    backward_timer,
    comparison_shapes,
    in_parallel,
    random_inputs,
    sdpa,
)
from course_utils.kernels.flash_bwd_hopper import PASS_CONFIGS as FIXED
from course_utils.checking.validation import check_backward, check_forward, references

OUT = os.environ.get("OUT", "/tmp")
REUSE_ON = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}  # the PASS_CONFIGS before the fix


def bench(impls, rounds=3):
    """Median over rounds of do_bench's median (L2 flushed before each call), implementations interleaved."""
    for fn in impls.values():
        fn()
    torch.cuda.synchronize()
    samples = {k: [] for k in impls}
    for _ in range(rounds):
        for k, fn in impls.items():
            samples[k].append(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    return {k: statistics.median(v) for k, v in samples.items()}


def dump(name, rows):
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       cudnn=torch.backends.cudnn.version(), tilelang=tilelang.__version__,
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       timing="triton.testing.do_bench median, L2 flushed, 3 interleaved rounds", rows=rows), f,
                  indent=1)


# ---------------------------------------------------------------------------------------------- race
RACE_CASES = {  # (batch, heads, heads_kv, seq, dim, causal, window)
    "ch06 GQA 8/2 S=1000 D=64 w=1": (2, 8, 2, 1000, 64, True, 1),
    "MHA S=1000 D=64 w=1": (2, 8, 8, 1000, 64, True, 1),
    "GQA S=1000 D=64 w=2": (2, 8, 2, 1000, 64, True, 2),
    "GQA S=1000 D=64 w=3": (2, 8, 2, 1000, 64, True, 3),
    "GQA S=1024 D=128 w=1": (2, 8, 2, 1024, 128, True, 1),
    "S=100 D=64 non-causal": (4, 8, 8, 100, 64, False, None),
    "S=128 D=64 causal": (4, 8, 8, 128, 64, True, None),
    "S=64 D=128 non-causal": (4, 8, 8, 64, 128, False, None),
    "S=64 D=128 w=2": (4, 8, 8, 64, 128, True, 2),
    "tiny S=128 D=64 w=1": (1, 2, 2, 128, 64, True, 1),
}


def race():
    runs = int(os.environ.get("RACE_RUNS", "30"))
    rows = []
    for reuse in (True, False):
        attention._compiled_backward.cache_clear()
        attention.HOPPER_BACKWARD_PASS_CONFIGS = REUSE_ON if reuse else FIXED
        inputs = {}
        for name, (b, h, hkv, s, d, causal, w) in RACE_CASES.items():
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g)
            k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
            inputs[name] = (q, k, v, dict(causal=causal, window_size=w))
        in_parallel(lambda n: attention.backward_kernels(inputs[n][0], inputs[n][1], **inputs[n][3]), list(inputs),
                    workers=10)
        for name, (q, k, v, opts) in inputs.items():
            d_out = torch.randn_like(q)
            refs = references(q, k, v, d_out=d_out, **opts)
            out, lse = flash_attention(q, k, v, return_lse=True, **opts)
            wrong, worst = 0, {}
            for _ in range(runs):
                grads = attention.attention_backward(q, k, v, out, lse, d_out, **opts)[:3]
                try:
                    errs = check_backward(q, k, v, d_out, grads, refs=refs, quiet=True, **opts)
                except Exception:
                    wrong += 1
                    errs = {n: {"err": float((g.double() - r).abs().max())} for n, g, r in
                            zip(("dQ", "dK", "dV"), grads, refs["grads"])}
                for n, e in errs.items():
                    worst[n] = max(worst.get(n, 0.0), e["err"])
            rows.append(dict(case=name, shared_memory_reuse=reuse, runs=runs, wrong_runs=wrong, worst=worst))
            print(f"reuse={reuse!s:5} {name:32} wrong {wrong:2}/{runs}  max err " +
                  " ".join(f"{n} {e:.1e}" for n, e in worst.items()), flush=True)
    dump("race.json", rows)


# ------------------------------------------------------------------------------------------ backward
def backward(seq=4096):
    from course_utils.kernels.versions.flash_bwd_hopper_versions import VERSIONS

    v9, v14 = VERSIONS[8], VERSIONS[13]
    assert (v9.number, v14.number) == (9, 14)
    cases = list(itertools.product(("float16", "bfloat16"), (128, 64), (False, True)))

    def build(job):
        dtype, dim, causal, what = job
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        b, h = shape["batch"], shape["heads"]
        q = torch.empty(b, h, seq, dim, device="cuda", dtype=getattr(torch, dtype))
        try:
            if what == "default":
                forward_kernel(q, q, causal=causal)
                return attention.backward_kernels(q, q, causal=causal)
            if what == "deterministic":
                return attention.backward_kernels(q, q, causal=causal, deterministic=True)
            return {"v9": v9, "v14": v14}[what].build(b, h, seq, dim, causal=causal, dtype=dtype)
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:160]}"

    jobs = [(*c, w) for c in cases for w in ("default", "deterministic", "v9", "v14")]
    t0 = time.time()
    built = dict(zip(jobs, in_parallel(build, jobs, workers=14)))
    print(f"compiled {len(jobs)} jobs in {time.time() - t0:.0f} s", flush=True)
    rows = []
    for dtype, dim, causal in cases:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        b, h = shape["batch"], shape["heads"]
        q, k, v = random_inputs(shape, getattr(torch, dtype))
        impls, errors = {}, {}
        for det in (False, True):
            name = "deterministic" if det else "default"
            fn, (ql, kl, vl, d_out) = backward_timer(
                lambda a, b_, c, det=det: flash_attention(a, b_, c, causal=causal, deterministic=det), q, k, v)
            refs = references(q, k, v, d_out=d_out, causal=causal)
            try:
                errors[name] = check_backward(q, k, v, d_out, fn(), causal=causal, refs=refs, quiet=True, name=name)
                impls[name] = fn
            except Exception as exc:
                errors[name] = f"FAILED {str(exc)[:200]}"
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        for name in ("v9", "v14"):
            bw = built[dtype, dim, causal, name]
            if isinstance(bw, str):
                errors[name] = bw
                continue
            try:
                errors[name] = check_backward(q, k, v, d_out, bw(q, k, v, out, lse, d_out), causal=causal, refs=refs,
                                              quiet=True, name=name)
                impls[name] = lambda bw=bw: bw(q, k, v, out, lse, d_out)
            except Exception as exc:
                errors[name] = f"FAILED {str(exc)[:200]}"
        del refs
        for name, backend in SDPA_PEERS.items():
            impls[name] = backward_timer(lambda a, b_, c, be=backend: sdpa(a, b_, c, causal, be), q, k, v)[0]
        flops = attention_flops(b, h, seq, seq, dim, causal=causal, mode="bwd")
        times = bench(impls)
        cudnn = [t for n, t in times.items() if "cuDNN" in n or "cudnn" in n.lower()][0]
        line = []
        for name, ms in times.items():
            rows.append(dict(impl=name, dtype=dtype, dim=dim, causal=causal, seq=seq, batch=b, heads=h, ms=ms,
                             tflops=tflops(flops, ms), vs_cudnn=cudnn / ms, errors=errors.get(name)))
            line.append(f"{name.split()[0]} {tflops(flops, ms):.0f} ({cudnn / ms:.2f})")
        failed = {n: e for n, e in errors.items() if isinstance(e, str)}
        err_ratio = {n: max(x["err"] / x["allowed"] for x in e.values()) for n, e in errors.items()
                     if not isinstance(e, str)}
        print(f"{dtype:8} D={dim:3} causal={causal!s:5} " + ", ".join(line) +
              " | err/allowed " + " ".join(f"{n} {r:.2f}" for n, r in err_ratio.items()) +
              (f" | {failed}" if failed else ""), flush=True)
    dump("backward.json", rows)


# ------------------------------------------------------------------------------------------- forward
def forward(cases=None, names=None, record="forward.json"):
    P = "flash_fwd_hopper_persistent"
    configs = {
        "persistent 192x128 3WG pp": ForwardConfig(192, 128, 2, 384, kernel=P, pingpong=True),
        "persistent 128x128 2WG pp": ForwardConfig(128, 128, 2, 256, kernel=P, pingpong=True),
        "persistent 128x128 2WG": ForwardConfig(128, 128, 2, 256, kernel=P),
        "persistent 128x192 2WG pp": ForwardConfig(128, 192, 2, 256, kernel=P, pingpong=True),
        "persistent 192x128 3WG": ForwardConfig(192, 128, 2, 384, kernel=P),
        "rotated 128x128": ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"),
        "rotated 128x192 pp": ForwardConfig(128, 192, 2, 256, kernel="flash_fwd_hopper", pingpong=True),
        "rotated 128x128 pp": ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper", pingpong=True),
    }
    if names:
        configs = {n: c for n, c in configs.items() if n in names}
    cases = cases or [(dt, s, c) for dt in ("float16", "bfloat16") for s, c in
                      ((1024, True), (2048, True), (3072, True), (4096, True), (1024, False), (2048, False),
                       (8192, True))]

    def build(job):
        dt, s, causal, name = job
        shape = comparison_shapes(seq_lens=(s,), dim=64)[0]
        q = torch.empty(shape["batch"], shape["heads"], s, 64, device="cuda", dtype=getattr(torch, dt))
        try:
            forward_kernel(q, q, causal=causal, config=configs[name])
            if name == next(iter(configs)):
                forward_kernel(q, q, causal=causal)
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]}"

    jobs = [(*c, n) for c in cases for n in configs]
    t0 = time.time()
    built = dict(zip(jobs, in_parallel(build, jobs, workers=14)))
    print(f"compiled {len(jobs)} jobs in {time.time() - t0:.0f} s", flush=True)
    rows = []
    for dt, s, causal in cases:
        shape = comparison_shapes(seq_lens=(s,), dim=64)[0]
        q, k, v = random_inputs(shape, getattr(torch, dt))
        refs = references(q, k, v, causal=causal)
        impls, errors = {}, {}
        default = attention.default_forward_config("cuda", 64, causal, seq_len=s)
        impls["default"] = lambda: flash_attention(q, k, v, causal=causal)
        for name, cfg in configs.items():
            if built[dt, s, causal, name]:
                errors[name] = built[dt, s, causal, name]
                continue
            out, lse = flash_attention(q, k, v, causal=causal, config=cfg, return_lse=True)
            try:
                errors[name] = check_forward(q, k, v, out, lse, causal=causal, refs=refs, quiet=True, name=name)
                impls[name] = lambda cfg=cfg: flash_attention(q, k, v, causal=causal, config=cfg)
            except Exception as exc:
                errors[name] = f"FAILED {str(exc)[:160]}"
        del refs
        for name, backend in SDPA_PEERS.items():
            impls[name] = lambda backend=backend: sdpa(q, k, v, causal, backend)
        flops = attention_flops(shape["batch"], shape["heads"], s, s, 64, causal=causal)
        times = bench(impls)
        cudnn = [t for n, t in times.items() if "cudnn" in n.lower()][0]
        for name, ms in times.items():
            rows.append(dict(impl=name, dtype=dt, seq=s, causal=causal, batch=shape["batch"], ms=ms,
                             tflops=tflops(flops, ms), vs_cudnn=cudnn / ms,
                             config=(default if name == "default" else configs.get(name, name)).__repr__(),
                             errors=errors.get(name)))
        print(f"{dt:8} S={s:5} causal={causal!s:5} default={tuple(default)[:2]},{default.threads}: " + ", ".join(
            f"{n.replace('persistent', 'P').replace('rotated', 'R')} {cudnn / ms:.2f}" for n, ms in times.items()),
            flush=True)
        bad = {n: e for n, e in errors.items() if isinstance(e, str)}
        if bad:
            print("   not run:", bad, flush=True)
    dump(record, rows)


def threshold():
    """Where three consumer warpgroups start to win with the causal mask (D = 64), and the new default."""
    forward(cases=[(dt, s, True) for dt in ("float16", "bfloat16") for s in (2048, 2560, 2816, 3072)],
            names=("persistent 192x128 3WG pp", "persistent 128x128 2WG pp"), record="threshold.json")


# ------------------------------------------------------------------------------------------ overhead
def overhead(seq=4096):
    """Why the public backward measured below version 9's whole backward (same main kernel) when not causal:
    the same problem timed as autograd, as attention_backward, as the main kernel alone (shipped PASS_CONFIGS
    and the reuse-on ones before the fix), and version 9's pieces."""
    from course_utils.kernels.flash_bwd_hopper import flash_bwd_hopper_kernel
    from course_utils.kernels.versions.flash_bwd_hopper_versions import VERSIONS
    from course_utils.kernels.tiles import compile_kernel

    cases = [("float16", 128, False), ("float16", 64, False), ("bfloat16", 64, False), ("float16", 64, True)]
    rows = []
    for dtype, dim, causal in cases:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        b, h = shape["batch"], shape["heads"]
        q, k, v = random_inputs(shape, getattr(torch, dtype))
        cfg = attention.default_backward_config("cuda", dim, causal)

        def main(configs, cfg=cfg, b=b, h=h, dim=dim, causal=causal, dtype=dtype):
            f = flash_bwd_hopper_kernel(b, h, seq, seq, dim, causal=causal, dtype=dtype, block_M=cfg.block_M,
                                        block_N=cfg.block_N)
            return compile_kernel(f, out_idx=[], target="cuda", dtype=dtype, pass_configs=configs)

        mains = dict(zip(("fixed", "reuse on"), in_parallel(main, [FIXED, REUSE_ON], workers=2)))
        v9 = VERSIONS[8].build(b, h, seq, dim, causal=causal, dtype=dtype)
        fn, (_, _, _, d_out) = backward_timer(lambda a, b_, c: flash_attention(a, b_, c, causal=causal), q, k, v)
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        kern = attention.backward_kernels(q, k, causal=causal)
        delta = kern.preprocess(out, d_out)
        acc = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        impls = {
            "autograd (public)": fn,
            "attention_backward": lambda: attention.attention_backward(q, k, v, out, lse, d_out, causal=causal),
            "version 9 whole": lambda: v9(q, k, v, out, lse, d_out),
            "main kernel (cached, fixed)": lambda: kern.main(q, k, v, d_out, lse, delta, acc, dk, dv),
            "main kernel fixed": lambda: mains["fixed"](q, k, v, d_out, lse, delta, acc, dk, dv),
            "main kernel reuse on": lambda: mains["reuse on"](q, k, v, d_out, lse, delta, acc, dk, dv),
            "preprocess": lambda: kern.preprocess(out, d_out),
            "postprocess dQ": lambda: kern.postprocess_dq(acc),
            "zeros dQ_acc": lambda: torch.zeros(q.shape, dtype=torch.float32, device="cuda"),
        }
        times = bench(impls)
        flops = attention_flops(b, h, seq, seq, dim, causal=causal, mode="bwd")
        for name, ms in times.items():
            rows.append(dict(impl=name, dtype=dtype, dim=dim, causal=causal, seq=seq, ms=ms, tflops=tflops(flops, ms)))
        print(f"{dtype:8} D={dim:3} causal={causal!s:5} " + ", ".join(f"{n} {ms * 1e3:.0f}us" for n, ms in
                                                                      times.items()), flush=True)
    dump("overhead.json", rows)


# ------------------------------------------------------------------------------------------- compare
def compare(seq=4096):
    """Is the public path's main kernel, built as ``backward`` builds it (threads compiling the default and
    deterministic kernels and version 9 at once), the kernel PASS_CONFIGS lowers to? Source and time."""
    import re

    from course_utils.kernels.flash_bwd_hopper import flash_bwd_hopper_kernel
    from course_utils.kernels.versions.flash_bwd_hopper_versions import VERSIONS
    from course_utils.core.source import cuda_source

    cases = [("float16", 128, False), ("float16", 64, False)]
    jobs = [(*c, w) for c in cases for w in ("default", "deterministic", "v9")]

    def build(job):
        dtype, dim, causal, what = job
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        q = torch.empty(shape["batch"], shape["heads"], seq, dim, device="cuda", dtype=getattr(torch, dtype))
        if what == "v9":
            return VERSIONS[8].build(shape["batch"], shape["heads"], seq, dim, causal=causal, dtype=dtype)
        if what == "default":
            forward_kernel(q, q, causal=causal)
        return attention.backward_kernels(q, q, causal=causal, deterministic=what == "deterministic")

    built = dict(zip(jobs, in_parallel(build, jobs, workers=14)))
    for dtype, dim, causal in cases:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        b, h = shape["batch"], shape["heads"]
        cfg = attention.default_backward_config("cuda", dim, causal)
        kern = built[dtype, dim, causal, "default"]
        src = kern.main.get_kernel_source()
        ref = cuda_source(flash_bwd_hopper_kernel(b, h, seq, seq, dim, heads_kv=h, causal=causal, dtype=dtype,
                                                  sm_scale=1 / dim ** 0.5, block_M=cfg.block_M, block_N=cfg.block_N),
                          pass_configs=FIXED)
        offs = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)", src)
        print(f"D={dim}: compiled == lowered with PASS_CONFIGS: {src == ref}; barriers "
              f"{src.count('__sync_thread_partial')} vs {ref.count('__sync_thread_partial')}; offsets {offs}",
              flush=True)
        q, k, v = random_inputs(shape, getattr(torch, dtype))
        fn, (_, _, _, d_out) = backward_timer(lambda a, b_, c: flash_attention(a, b_, c, causal=causal), q, k, v)
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        v9 = built[dtype, dim, causal, "v9"]
        delta = kern.preprocess(out, d_out)
        acc = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        impls = {"autograd (public)": fn, "version 9 whole": lambda: v9(q, k, v, out, lse, d_out),
                 "main kernel": lambda: kern.main(q, k, v, d_out, lse, delta, acc, dk, dv),
                 "attention_backward": lambda: attention.attention_backward(q, k, v, out, lse, d_out, causal=causal)}
        times = bench(impls)
        print(f"{dtype} D={dim} causal={causal}: " + ", ".join(f"{n} {ms * 1e3:.0f}us" for n, ms in times.items()),
              flush=True)


def racecheck():
    """One small window-1 backward (run under compute-sanitizer); REUSE=1 builds it as before the fix."""
    reuse = os.environ.get("REUSE") == "1"
    attention.HOPPER_BACKWARD_PASS_CONFIGS = REUSE_ON if reuse else FIXED
    b, h, hkv, s, d, causal, w = RACE_CASES["tiny S=128 D=64 w=1"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    out, lse = flash_attention(q, k, v, causal=causal, window_size=w, return_lse=True)
    grads = attention.attention_backward(q, k, v, out, lse, torch.randn_like(q), causal=causal, window_size=w)
    torch.cuda.synchronize()
    print(f"reuse={reuse}: |dQ|max {grads[0].abs().max().item():.2e} |dK|max {grads[1].abs().max().item():.2e}")


if __name__ == "__main__":
    parts = {"compare": compare, "threshold": threshold, "overhead": overhead, "racecheck": racecheck, "race": race,
             "backward": backward,
             "forward": forward}
    parts[sys.argv[1]]()
