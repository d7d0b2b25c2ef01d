"""Run on the H100 from the repository root (PYTHONPATH=.): the one-key-window race of the atomic Hopper
backward. Each case three times: O/LSE from the default and the rotated forward, then the atomic kernel
from the reference's O/LSE (twice); every gradient's error / its allowed bound ("!!" when over).

Historical (2026-11-23): written while `backward_kernels` routed window 1 to the deterministic kernels. That
routing is gone since the race was found (shared-memory reuse in the unrolled one-step loop, fixed with
TL_DISABLE_SHARED_MEMORY_REUSE; notes/hopper_backward.md); the atomic kernel is now the default for every window."""
import time

import torch

from course_utils import flash_attention
from course_utils.api.attention import ForwardConfig, attention_backward, backward_kernels, forward_kernel
from course_utils.measure.benchmarks.ch08_hopper_backward import feature_inputs
from course_utils.measure.benchmarks.common import in_parallel
from course_utils.checking.validation import references


def atomic_backward(q, k, v, out, lse, d_out, **opts):
    """``attention_backward`` with the atomic Hopper kernel itself, bypassing backward_kernels' one-key-window
    fallback (the kernels it would choose are swapped for the atomic ones)."""
    from unittest import mock

    from course_utils import attention
    pr = attention._problem(q, k, causal=opts.get("causal", False), window_size=opts.get("window_size"),
                            sm_scale=None)
    kernels = attention._compiled_backward(pr, attention.default_backward_config("cuda", q.shape[-1], True), False)
    with mock.patch.object(attention, "backward_kernels", lambda *args, **kwargs: kernels):
        return attention_backward(q, k, v, out, lse, d_out, **opts)[:3]

def errs(q, k, v, d_out, grads, refs, opts, sinks):
    out = []
    for i, name in enumerate(("dQ", "dK", "dV")):
        g, r, lo = grads[i].double(), refs["grads"][i], refs["grads_low"][i].double()
        e, b = (g - r).abs().max().item(), (lo - r).abs().max().item()
        out.append(f"{name} {e:.1e}/{3*b+1e-5:.1e}{'!!' if e > 3*b+1e-5 else ''}")
    return " ".join(out)

cases = {}
cases["ch06 GQA window 1"] = dict(batch=2, heads=8, heads_kv=2, seq=1000, dim=64, window_size=1, causal=True)
for w in (2, 16, 64, 100):
    cases[f"ch06 GQA window {w}"] = dict(batch=2, heads=8, heads_kv=2, seq=1000, dim=64, window_size=w, causal=True)
cases["MHA 8 window 1"] = dict(batch=2, heads=8, heads_kv=8, seq=1000, dim=64, window_size=1, causal=True)
cases["GQA window 1 D128"] = dict(batch=2, heads=8, heads_kv=2, seq=1024, dim=128, window_size=1, causal=True)
def build(job):
    q, k, _, _, opts = feature_inputs(cases[job[0]])
    if job[1] == "rotated":
        forward_kernel(q, k, config=ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"), **opts)
    elif job[1] == "default":
        forward_kernel(q, k, **opts)
    elif job[1] == "nondet":
        from course_utils.api.attention import _compiled_backward, _problem, default_backward_config
        _compiled_backward(_problem(q, k, causal=opts.get("causal", False), window_size=opts.get("window_size"),
                                    sm_scale=None), default_backward_config("cuda", q.shape[-1], True), False)
    else:
        backward_kernels(q, k, **opts)
t0 = time.time()
in_parallel(build, [(n, j) for n in cases for j in ("rotated", "default", "public", "nondet")], workers=12)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)
for _rep in range(3):
  for name, case in cases.items():
    q, k, v, sinks, opts = feature_inputs(case)
    d_out = torch.randn_like(q)
    refs = references(q, k, v, d_out=d_out, **opts)
    ro, rl = refs["out"].to(q.dtype), refs["lse"].float()
    for det in (False,):
        line = []
        for label, fwd in (("default", None), ("rotated", ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"))):
            try:
                out, lse = flash_attention(q, k, v, config=fwd, return_lse=True, **opts)
                fe = (out.double() - refs["out"]).abs().max().item()
                le = (lse.double() - refs["lse"].double()).nan_to_num(0).abs().max().item()
                g = attention_backward(q, k, v, out, lse, d_out, **opts)
                line.append(f"[{label}: O {fe:.1e} LSE {le:.1e} | {errs(q, k, v, d_out, g, refs, opts, sinks)}]")
            except Exception as exc:
                line.append(f"[{label}: {type(exc).__name__} {str(exc)[:100]}]")
        g = atomic_backward(q, k, v, ro, rl, d_out, **opts)
        line.append(f"[ref O/LSE: {errs(q, k, v, d_out, g, refs, opts, sinks)}]")
        g2 = atomic_backward(q, k, v, ro, rl, d_out, **opts)
        line.append(f"[again: {errs(q, k, v, d_out, g2, refs, opts, sinks)}]")
        print(f"{name:26} det={det!s:5} " + " ".join(line), flush=True)
