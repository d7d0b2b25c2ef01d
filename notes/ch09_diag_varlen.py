"""Run on the H100 from the repository root (PYTHONPATH=.). Which chapter 09 varlen kernel hangs or fails on the H100? Each step in its own process with a timeout."""
import subprocess
import sys
import time

import torch

STEPS = [("hopper", False, "list", True), ("hopper", True, "list", True), ("hopper", False, "grid", True),
         ("ch03", False, "list", True), ("ch03", True, "list", True), ("hopper", False, "list", False)]

def config(fwd):
    from course_utils.attention import ForwardConfig
    return None if fwd == "hopper" else ForwardConfig(128, 128, 2, 256)

def inputs(lengths=(1, 127, 128, 129, 0, 300, 1000)):
    torch.manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu, max(lengths)

def run(fwd, bwd, sched, causal):
    from course_utils import flash_attention_varlen
    from course_utils.validation import check_backward, check_forward, varlen_references
    q, k, v, cu, mx = inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    t0 = time.time()
    out, lse = flash_attention_varlen(*leaves, cu, cu, mx, mx, causal=causal, schedule=sched, return_lse=True,
                                      config=config(fwd))
    torch.cuda.synchronize()
    print(f"  forward ran in {time.time() - t0:.2f} s", flush=True)
    d_out = torch.randn_like(out)
    refs = varlen_references(q, k, v, cu, cu, d_out=d_out if bwd else None, causal=causal)
    check_forward(q, k, v, out, lse, refs=refs, name="fwd")
    if bwd:
        t0 = time.time()
        grads = torch.autograd.grad(out, leaves, d_out)
        torch.cuda.synchronize()
        print(f"  backward ran in {time.time() - t0:.2f} s", flush=True)
        check_backward(q, k, v, d_out, grads, refs=refs, name="bwd")

if __name__ == "__main__":
    if len(sys.argv) > 1:
        fwd, bwd, sched, causal = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4] == "1"
        run(fwd, bwd, sched, causal)
        sys.exit(0)
    from course_utils.benchmarks.common import in_parallel
    from course_utils.varlen_api import _varlen_small_kernels, varlen_kernels
    t0 = time.time()
    x = torch.empty(8, 16, 128, device="cuda", dtype=torch.float16)
    in_parallel(lambda s: varlen_kernels(x, x, causal=s[3], schedule=s[2], config=config(s[0])), STEPS, workers=8)
    _varlen_small_kernels(128, "float16", "cuda")
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    for fwd, bwd, sched, causal in STEPS:
        t0 = time.time()
        try:
            args = [sys.executable, __file__, fwd, str(int(bwd)), sched, str(int(causal))]
            r = subprocess.run(args, capture_output=True, text=True, timeout=35)
            tail = (r.stdout + r.stderr).strip().splitlines()[-4:]
            status = "ok" if r.returncode == 0 else f"exit {r.returncode}"
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            status, tail = "TIMEOUT (hang?)", partial.splitlines()[-3:]
        print(f"fwd={fwd:6} bwd={bwd!s:5} {sched:4} causal={causal!s:5}: {status} in {time.time() - t0:.0f} s", flush=True)
        for line in tail:
            print("    " + line[:220], flush=True)
