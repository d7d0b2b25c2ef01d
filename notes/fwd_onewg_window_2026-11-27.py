"""Seventeenth session, third A/B (issue 26): the one-warpgroup forward with gpt-oss's sliding window.

gpt-oss attention (64 query heads, 8 K/V heads, sinks, bf16, D = 64, a 128-key window on every other layer). The
window at D = 64 runs two warpgroups of the persistent kernel (128 x 128, ping-pong); does one warpgroup per block
(64 query rows, three or four blocks per SM) do better, with 128- or 64-key tiles? A window's tile sees only 2-4
key blocks, so the tile's edges weigh most. Every candidate checked on every head (O and LSE against float64);
three blocks of rounds in changing orders; ratios are the shipped kernel's time / each one's.
    python notes/fwd_onewg_window_2026-11-27.py OUT.json
"""
import sys
import time

import torch

sys.path.insert(0, "notes")
from device_ab import blocks, compile_jobs, forward_checked, machine, save  # noqa: E402

from course_utils import flash_attention  # noqa: E402
from course_utils.kernels.flash_fwd_hopper_one_warpgroup import flash_fwd_hopper_one_warpgroup_kernel  # noqa: E402
from course_utils.kernels.tiles import attention_launcher, compile_kernel  # noqa: E402

out_path = sys.argv[1]
result = dict(machine=machine(), F=[], errors={})
t0 = time.time()
VARIANTS = {"1wg 64x128 2st 3/SM": dict(block_N=128, num_stages=2, blocks_per_sm=3),
            "1wg 64x64 3st 3/SM": dict(block_N=64, num_stages=3, blocks_per_sm=3),
            "1wg 64x64 2st 4/SM": dict(block_N=64, num_stages=2, blocks_per_sm=4)}
CASES = [(1, 4096, 128), (4, 4096, 128), (1, 16384, 128), (2, 8192, 1024)]  # (batch, seq, window)
inputs, kernels = {}, {}
for b, s, w in CASES:
    g = torch.Generator(device="cuda").manual_seed(s + b)
    q = torch.randn(b, 64, s, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(b, 8, s, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    inputs[b, s, w] = (q, k, v, torch.randn(64, device="cuda", generator=g))


def build(job):
    (b, s, w), name = job
    q, k, v, sinks = inputs[b, s, w]
    try:
        if name == "shipped":
            flash_attention(q, k, v, causal=True, window_size=w, sinks=sinks)
        else:
            func = flash_fwd_hopper_one_warpgroup_kernel(b, 64, s, s, 64, heads_kv=8, causal=True, window_size=w,
                                                         has_sinks=True, dtype="bfloat16", **VARIANTS[name])
            kernels[job] = attention_launcher(compile_kernel(func, out_idx=[4, 5], target="cuda", dtype="bfloat16"))
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[-1][:160]}"


jobs = [(c, n) for c in CASES for n in ("shipped", *VARIANTS)]
compile_jobs(build, jobs, result["errors"], t0)
for case in CASES:
    q, k, v, sinks = inputs[case]
    fns = {"shipped": lambda q=q, k=k, v=v, s=sinks, w=case[2]: flash_attention(q, k, v, causal=True, window_size=w,
                                                                                sinks=s)}
    for name in VARIANTS:
        launch = kernels.get((case, name))
        if launch is None:
            continue
        out, lse = launch(q, k, v, sinks)
        if not forward_checked(result["errors"], (case, name), q, k, v, out, lse, causal=True, window_size=case[2],
                               sinks=sinks, name=f"gpt-oss B={case[0]} S={case[1]} window={case[2]} {name}"):
            continue
        fns[name] = lambda launch=launch, q=q, k=k, v=v, s=sinks: launch(q, k, v, s)
    result["F"] += blocks(fns, label=f"gpt-oss B={case[0]} S={case[1]} window={case[2]}", base="shipped")
    save(out_path, **result)
print(f"done {time.time() - t0:.0f}s", flush=True)
