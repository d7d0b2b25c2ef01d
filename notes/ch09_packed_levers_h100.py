"""Issue 27, packed batches: the levers measured side by side on one GPU (one device call).

    python notes/ch09_packed_levers_h100.py OUT_DIR      # the driver: every part in its own subprocess

Parts: (1) compile every kernel in parallel threads; (2) probe each packed variant alone, in a subprocess
with a timeout (a hang or a fault loses that variant only): a ragged small batch (lengths 1, 127, 128,
129, 0, 300, 1000 and q ≠ k lengths) against the float64 reference, forward and backward, and a NaN in
one sequence that must reach no other; (3) the record's batch (varlen_lengths(65536, 128, 8192), H=16,
D=128, fp16): every variant checked on every head against the float64 reference (O, LSE, dQ, dK, dV),
then timed with triton's do_bench (L2 flushed), the implementations taking turns in 3 rounds; our dense
kernel at 16 × 4096 and at the record's FLOP-matched 12 × 5376 in the same rounds.
"""
import json
import os
import subprocess
import sys
import time

VARIANTS = {  # name: (forward config, backward config, schedule); None: the default
    "packed default": (None, None, None),
    "fwd rotated 128x128": (("ForwardConfig", (128, 128, 2, 256, "flash_fwd_hopper")), None, None),
    "fwd persistent pp": (("ForwardConfig", (128, 128, 2, 256, "flash_fwd_hopper_persistent", True)), None, None),
    "fwd persistent": (("ForwardConfig", (128, 128, 2, 256, "flash_fwd_hopper_persistent", False)), None, None),
    "bwd list (ch05)": (None, None, "list"),
    "bwd hopper grid": (None, "hopper", "grid"),
    "bwd hopper list": (None, "hopper", "list"),
}
FWD_VARIANTS = ("packed default", "fwd rotated 128x128", "fwd persistent pp", "fwd persistent")
BWD_VARIANTS = ("packed default", "bwd list (ch05)", "bwd hopper grid", "bwd hopper list")


def configs(name, causal):
    from course_utils.api.attention import ForwardConfig
    from course_utils.api.varlen_api import VARLEN_HOPPER_BACKWARD_CONFIGS
    fwd, bwd, schedule = VARIANTS[name]
    fwd = None if fwd is None else ForwardConfig(*fwd[1])
    bwd = VARLEN_HOPPER_BACKWARD_CONFIGS[causal] if bwd == "hopper" else None
    return dict(config=fwd, backward_config=bwd, schedule=schedule)


def packed(name, causal, cu, max_len):
    from course_utils.api.varlen_api import flash_attention_varlen
    kw = configs(name, causal)
    return lambda q, k, v, **extra: flash_attention_varlen(q, k, v, cu[0], cu[1], max_len[0], max_len[1],
                                                           causal=causal, **kw, **extra)


def precompile():
    import torch

    from course_utils.api.attention import backward_kernels, forward_kernel
    from course_utils.api.varlen_api import _varlen_small_kernels, varlen_kernels
    from course_utils.measure.benchmarks.common import in_parallel
    x = torch.empty(8, 16, 128, device="cuda", dtype=torch.float16)
    jobs = [("varlen", name, causal) for name in VARIANTS for causal in (True, False)]
    jobs += [("dense", shape, causal) for shape in ((16, 4096), (12, 5376)) for causal in (True, False)]

    def build(job):
        t = time.time()
        try:
            if job[0] == "varlen":
                varlen_kernels(x, x, causal=job[2], **configs(job[1], job[2]))
                _varlen_small_kernels(128, "float16", "cuda")
            else:
                d = torch.empty(job[1][0], 16, job[1][1], 128, device="cuda", dtype=torch.float16)
                forward_kernel(d, d, causal=job[2])
                backward_kernels(d, d, causal=job[2])
            return f"compiled {job} {time.time() - t:.0f}s"
        except Exception as exc:  # noqa: BLE001
            return f"FAILED {job}: {type(exc).__name__}: {str(exc)[:300]}"

    for line in in_parallel(build, jobs, workers=16):
        print(line, flush=True)


def probe(names):
    """Each variant on small ragged batches against the reference, and the NaN isolation."""
    import torch

    from course_utils.checking.validation import check_backward, check_forward, varlen_references
    torch.manual_seed(0)
    cases = [((1, 127, 128, 129, 0, 300, 1000), None), ((200, 5, 384, 77), (260, 5, 1, 500))]
    for name in names:
        print(f"probing {name}", flush=True)
        for causal in (True, False):
            for lq, lk in cases:
                lk = lk or lq
                cu = [torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
                      for n in (lq, lk)]
                q = torch.randn(sum(lq), 16, 128, device="cuda", dtype=torch.float16)
                k, v = (torch.randn(sum(lk), 16, 128, device="cuda", dtype=torch.float16) for _ in range(2))
                d_out = torch.randn_like(q)
                attn = packed(name, causal, cu, (max(lq), max(lk)))
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                out, lse = attn(qg, kg, vg, return_lse=True)
                grads = torch.autograd.grad(out, (qg, kg, vg), d_out)
                refs = varlen_references(q, k, v, cu[0], cu[1], d_out=d_out, causal=causal)
                check_forward(q, k, v, out, lse, refs=refs, quiet=True, name=f"{name} {lq}")
                check_backward(q, k, v, d_out, grads, refs=refs, quiet=True, name=f"{name} {lq}")
                torch.cuda.synchronize()
        # NaN in sequence 1 (every tensor) reaches no other sequence.
        lens = (300, 129, 1000, 77)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v, d_out = (torch.randn(sum(lens), 16, 128, device="cuda", dtype=torch.float16) for _ in range(4))
        for causal in (True, False):
            attn = packed(name, causal, (cu, cu), (max(lens), max(lens)))
            results = []
            for poison in (False, True):
                ts = [t.clone() for t in (q, k, v, d_out)]
                if poison:
                    for t in ts:
                        t[300:429] = float("nan")
                qg, kg, vg = (t.requires_grad_() for t in ts[:3])
                out = attn(qg, kg, vg)
                results.append([out.detach()] + list(torch.autograd.grad(out, (qg, kg, vg), ts[3])))
            others = torch.ones(sum(lens), dtype=torch.bool, device="cuda")
            others[300:429] = False
            for what, a, b in zip(("O", "dQ", "dK", "dV"), *results):
                a, b = a[others].float(), b[others].float()
                if not torch.isfinite(b).all():
                    raise AssertionError(f"{name} causal={causal}: NaN in sequence 1 reached another's {what}")
                if what == "dQ":
                    torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)
                elif not torch.equal(a, b):
                    raise AssertionError(f"{name} causal={causal}: NaN in sequence 1 changed another's {what}")
        torch.cuda.synchronize()
        print(f"ok {name}", flush=True)


def measure(names, out_dir):
    import torch
    import triton.testing

    from course_utils.api.attention import flash_attention
    from course_utils.checking.validation import check_backward, check_forward, references, varlen_references
    from course_utils.measure.bench import attention_flops, tflops
    from course_utils.measure.benchmarks.ch09_varlen_decode import varlen_lengths
    from course_utils.measure.benchmarks.common import backward_timer

    lengths = varlen_lengths(65536, 128, 8192)
    heads, dim = 16, 128
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    dense_inputs = {shape: [torch.randn(shape[0], heads, shape[1], dim, device="cuda", dtype=torch.float16,
                                        generator=g) for _ in range(3)] for shape in ((16, 4096), (12, 5376))}
    rows = []
    for causal in (True, False):
        fns = {"fwd": {}, "bwd": {}}
        errors = {}
        refs = None
        for name in names:
            attn = packed(name, causal, (cu, cu), (longest, longest))
            grad_fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
            out, lse = attn(q, k, v, return_lse=True)
            refs = refs or varlen_references(q, k, v, cu, cu, d_out=d_out, causal=causal)
            errors[name] = check_forward(q, k, v, out, lse, refs=refs, quiet=True, name=name)
            errors[name].update(check_backward(q, k, v, d_out, grad_fn(), refs=refs, quiet=True, name=name))
            if name in FWD_VARIANTS:
                fns["fwd"][name] = lambda a=attn: a(q, k, v)
            if name in BWD_VARIANTS:
                fns["bwd"][name] = grad_fn
        del refs
        for shape, (dq, dk, dv) in dense_inputs.items():
            label = f"dense {shape[0]}x{shape[1]}"
            dense = lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal)  # noqa: E731
            grad_fn, (_, _, _, d_out) = backward_timer(dense, dq, dk, dv)
            out = dense(dq, dk, dv)
            r = references(dq, dk, dv, d_out=d_out, causal=causal)
            errors[label] = check_forward(dq, dk, dv, out, refs=r, quiet=True, name=label)
            errors[label].update(check_backward(dq, dk, dv, d_out, grad_fn(), refs=r, quiet=True, name=label))
            del r
            fns["fwd"][label] = lambda d=dense, a=(dq, dk, dv): d(*a)
            fns["bwd"][label] = grad_fn
        torch.cuda.synchronize()
        print(f"causal={causal}: every variant checked on every head", flush=True)
        for mode, table in fns.items():
            samples = {name: [] for name in table}
            for _ in range(3):
                for name, fn in table.items():
                    samples[name].append(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
            for name, s in samples.items():
                ms = sorted(s)[1]
                if name.startswith("dense"):
                    b, n = (int(x) for x in name.split()[1].split("x"))
                    flops = attention_flops(b, heads, n, n, dim, causal=causal)
                else:
                    flops = sum(attention_flops(1, heads, n, n, dim, causal=causal) for n in lengths)
                flops *= 2.5 if mode == "bwd" else 1.0
                rows.append(dict(impl=name, mode=mode, causal=causal, ms=ms, rounds_ms=s, tflops=tflops(flops, ms),
                                 errors=errors.get(name)))
                print(f"{mode} causal={causal} {name:24s} {ms:7.3f} ms {tflops(flops, ms):6.1f} TFLOP/s "
                      f"(rounds {', '.join(f'{x:.3f}' for x in s)})", flush=True)
    import triton
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, lengths=lengths,
                sms=torch.cuda.get_device_properties(0).multi_processor_count)
    import tilelang
    info["tilelang"] = tilelang.__version__
    json.dump(dict(machine=info, results=rows), open(os.path.join(out_dir, "ch09_packed_levers.json"), "w"), indent=1)


def run_part(args, timeout):
    t = time.time()
    try:
        done = subprocess.run([sys.executable, "-u", __file__] + args, timeout=timeout, capture_output=True, text=True)
        out, rc = done.stdout + done.stderr[-3000:], done.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out, rc = out + "\nTIMEOUT", "timeout"
    print(f"--- {args[0]} rc={rc} {time.time() - t:.0f}s\n{out}", flush=True)
    return out, rc


def driver(out_dir, budget):
    start = time.time()
    run_part(["compile"], timeout=170)
    remaining, passed = list(VARIANTS), []
    while remaining and time.time() - start < budget - 150:
        out, rc = run_part(["probe"] + remaining, timeout=60)
        ok = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("ok ")]
        passed += ok
        tried = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("probing ")]
        failed = [n for n in tried if n not in ok]
        print(f"probe: ok {ok}, failed {failed}", flush=True)
        remaining = [n for n in remaining if n not in tried]
    left = budget - (time.time() - start)
    run_part(["measure", out_dir] + passed, timeout=max(30, left - 10))


if __name__ == "__main__":
    part = sys.argv[1]
    if part == "compile":
        precompile()
    elif part == "probe":
        probe(sys.argv[2:])
    elif part == "measure":
        measure(sys.argv[3:], sys.argv[2])
    else:
        driver(part, float(os.environ.get("BUDGET_S", "340")))
