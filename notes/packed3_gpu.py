"""Issue 27, packed causal forward: orders of the persistent forward's device-built pair list (one device call).

    python notes/packed3_gpu.py OUT_DIR     # driver: compile, then check + time, each in a subprocess with a timeout

The persistent packed kernel walks whatever ``Pairs`` it is given, so every order below runs the same compiled
kernel: only the list differs. Each order's O and LSE are checked on every head against the float64 reference
(varlen_references) before any timing; then the kernel with each list, the default API call (which builds the
list on the device each call), and our dense kernel at 16 x 4096 are timed with triton's do_bench (L2 flushed),
taking turns in 3 rounds. Batch: varlen_lengths(65536, 128, 8192), H=16, D=128, fp16.
"""
import json
import os
import subprocess
import sys
import time

H, D = 16, 128


def orders(cu, block_M, max_len):
    """Candidate pair lists (pairs int32 [n, 3], count [1]) on the device."""
    import torch

    from course_utils.kernels.flash_varlen import varlen_pair_list
    pairs, count = varlen_pair_list(cu, cu, H, block_M, max_len)
    n = int(count)
    real = pairs[:n].long()
    lengths = (cu[1:] - cu[:-1]).long()
    n_qb = (lengths[real[:, 0]] + block_M - 1) // block_M
    single = (n_qb - 1 - real[:, 2]) == real[:, 2]  # the middle block of an odd count: one tile, not two

    def pack(rows):
        out = pairs.clone()
        out[:n] = rows.to(torch.int32)
        return out.contiguous(), count

    result = {"default (longest seq first)": (pairs, count)}
    # Exact LPT: a lone middle tile costs half a pair, so it moves behind the full pairs of its length.
    cost = (n_qb + 1) * torch.where(single, 1, 2)
    result["exact LPT (pair cost)"] = pack(real[torch.argsort(-cost, stable=True)])
    # Heads interleaved: same sequences, j outer and head inner (the 132 blocks share one j across heads).
    key = real[:, 2] * H + real[:, 1]
    seq_rank = torch.empty_like(lengths)
    seq_rank[torch.argsort(-lengths, stable=True)] = torch.arange(len(lengths), device=cu.device)
    key = seq_rank[real[:, 0]] * (H * (max_len // block_M + 2)) + key
    result["heads interleaved"] = pack(real[torch.argsort(key, stable=True)])
    result["shortest seq first (control)"] = pack(real.flip(0))
    return result


def check_and_time(out_dir):
    import torch
    import triton
    import triton.testing

    from course_utils.api.attention import flash_attention
    from course_utils.api.varlen_api import VARLEN_PERSISTENT_CONFIG, flash_attention_varlen, varlen_kernels
    from course_utils.checking.validation import check_forward, references, varlen_references
    from course_utils.measure.bench import attention_flops, tflops
    from course_utils.measure.benchmarks.ch09_varlen_decode import varlen_lengths

    lengths = varlen_lengths(65536, 128, 8192)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    dq, dk, dv = (torch.randn(16, H, 4096, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    sinks = torch.full((H,), float("-inf"), device="cuda")
    rows = []
    for causal in (True, False):
        fwd, _ = varlen_kernels(q, k, causal=causal)
        cands = orders(cu, VARLEN_PERSISTENT_CONFIG.block_M, longest)
        refs = varlen_references(q, k, v, cu, cu, causal=causal)
        errors, fns = {}, {}
        for name, (pairs, count) in cands.items():
            out, lse = fwd(q, k, v, cu, cu, pairs, count, sinks)
            errors[name] = check_forward(q, k, v, out, lse, refs=refs, quiet=True, name=name)
            fns[name] = lambda p=pairs, c=count: fwd(q, k, v, cu, cu, p, c, sinks)
        api = lambda: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal)  # noqa: E731
        errors["API default"] = check_forward(q, k, v, *api_lse(api, q, k, v, cu, longest, causal), refs=refs,
                                              quiet=True, name="API")
        fns["API default"] = api
        del refs
        r = references(dq, dk, dv, causal=causal)
        errors["dense 16x4096"] = check_forward(dq, dk, dv, flash_attention(dq, dk, dv, causal=causal), refs=r,
                                                quiet=True, name="dense")
        del r
        fns["dense 16x4096"] = lambda: flash_attention(dq, dk, dv, causal=causal)
        torch.cuda.synchronize()
        print(f"causal={causal}: every candidate checked on every head", flush=True)
        samples = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                samples[name].append(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
        for name, s in samples.items():
            ms = sorted(s)[1]
            flops = (attention_flops(16, H, 4096, 4096, D, causal=causal) if name.startswith("dense") else
                     sum(attention_flops(1, H, n, n, D, causal=causal) for n in lengths))
            rows.append(dict(impl=name, causal=causal, ms=ms, rounds_ms=s, tflops=tflops(flops, ms),
                             errors=errors[name]))
            print(f"fwd causal={causal} {name:32s} {ms:7.3f} ms {tflops(flops, ms):6.1f} TFLOP/s "
                  f"(rounds {', '.join(f'{x:.3f}' for x in s)})", flush=True)
    import tilelang
    info = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, tilelang=tilelang.__version__,
                cuda=torch.version.cuda, lengths=lengths, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    print(info, flush=True)
    json.dump(dict(machine=info, results=rows), open(os.path.join(out_dir, "packed3_orders.json"), "w"), indent=1,
              default=str)


def api_lse(api_unused, q, k, v, cu, longest, causal):
    from course_utils.api.varlen_api import flash_attention_varlen
    return flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)


def compile_all():
    import torch

    from course_utils.api.attention import forward_kernel
    from course_utils.api.varlen_api import varlen_kernels
    from course_utils.measure.benchmarks.common import in_parallel
    x = torch.empty(8, H, D, device="cuda", dtype=torch.float16)
    d = torch.empty(16, H, 4096, D, device="cuda", dtype=torch.float16)

    def build(job):
        t = time.time()
        try:
            if job[0] == "varlen":
                varlen_kernels(x, x, causal=job[1])
            else:
                forward_kernel(d, d, causal=job[1])
            return f"compiled {job} {time.time() - t:.0f}s"
        except Exception as exc:  # noqa: BLE001
            return f"FAILED {job}: {type(exc).__name__}: {str(exc)[:300]}"

    for line in in_parallel(build, [(w, c) for w in ("varlen", "dense") for c in (True, False)], workers=4):
        print(line, flush=True)


def run_part(args, timeout):
    t = time.time()
    try:
        done = subprocess.run([sys.executable, "-u", __file__] + args, timeout=timeout, capture_output=True, text=True)
        out, rc = done.stdout + done.stderr[-3000:], done.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out, rc = out + "\nTIMEOUT", "timeout"
    print(f"--- {args[0]} rc={rc} {time.time() - t:.0f}s\n{out}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all()
    elif sys.argv[1] == "measure":
        check_and_time(sys.argv[2])
    else:
        run_part(["compile"], timeout=150)
        run_part(["measure", sys.argv[1]], timeout=200)
