"""Issue 26: which kernels cuDNN and FlashAttention-2 (through SDPA) and ours launch, and how long each takes,
at the cases where ours trails (torch.profiler, CUDA activity; one device call). The kernel names carry cuDNN's
tile shapes; the per-kernel times split our backward into its preprocess, main kernel and dQ cast.

Run: python peer_kernels_2026-11-27.py OUT.json
"""
import json
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from course_utils import flash_attention
from course_utils.core.labels import CUDNN, FA2
from course_utils.measure.benchmarks.common import SDPA_PEERS, random_inputs, sdpa

CASES = [("bfloat16", 128, False, 4096), ("bfloat16", 128, False, 16384), ("float16", 128, False, 8192),
         ("bfloat16", 64, True, 16384), ("float16", 64, True, 1024), ("float16", 64, False, 1024)]


def kernels(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    count = defaultdict(int)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            count[e.name] += 1
    return [dict(kernel=n[:200], us_per_call=total[n] / reps, launches_per_call=count[n] / reps)
            for n in sorted(total, key=total.get, reverse=True)]


def precompile():
    from course_utils import backward_kernels, forward_kernel
    from course_utils.measure.benchmarks.common import empty_query, in_parallel

    def build(case):
        dtype, dim, causal, seq = case
        q = empty_query(dict(batch=max(1, 16384 // seq), heads=2048 // dim, seq=seq, dim=dim), dtype)
        forward_kernel(q, q, causal=causal)
        backward_kernels(q, q, causal=causal)
    in_parallel(build, CASES)


def main(path):
    precompile()
    rows = []
    for dtype, dim, causal, seq in CASES:
        shape = dict(batch=max(1, 16384 // seq), heads=2048 // dim, seq=seq, dim=dim)
        q, k, v = (t.requires_grad_() for t in random_inputs(shape, getattr(torch, dtype)))
        impls = {"ours": lambda: flash_attention(q, k, v, causal=causal),
                 CUDNN: lambda: sdpa(q, k, v, causal, SDPA_PEERS[CUDNN]),
                 FA2: lambda: sdpa(q, k, v, causal, SDPA_PEERS[FA2])}
        for name, attn in impls.items():
            out = attn()
            d_out = torch.randn_like(out)
            for mode, fn in (("fwd", lambda: attn()),
                             ("bwd", lambda: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True))):
                with torch.no_grad() if mode == "fwd" else torch.enable_grad():
                    ks = kernels(fn)
                case = f"{dtype} D{dim} {'causal' if causal else 'full'} S={seq}"
                rows.append(dict(case=case, impl=name, mode=mode, kernels=ks))
                line = "; ".join(f"{r['kernel'][:110]} {r['us_per_call']:.0f}us×{r['launches_per_call']:.0f}"
                                 for r in ks[:4])
                print(f"{case} {name} {mode}: {line}", flush=True)
        with open(path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           cudnn=torch.backends.cudnn.version(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
