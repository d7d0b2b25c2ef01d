"""Eighteenth session: does the one-warpgroup forward's fix (2582b2e: its refill guards read n from a register, so
TileLang lowers every window) cost GPU time? ch06_gpt_oss_h100 re-measured after it put the D = 64 window-128 layer's
forward at 0.072 ms a call (0.059 in the record before), on a host whose backward calls also took longer.
Kernel before (as it was at a250cee; the run of 2026-11-27 imported a copy of it, since removed: this script now
reads it from git, so run it from a checkout with that commit) and after, on gpt-oss's window layer (bf16, B = 1,
64/8 heads, S = 4096, D = 64, window 128, sinks) and its full-causal layer: outputs compared bitwise, then each
launched through the same FFI launcher 200 times back to back per round (CUDA events; the launches outrun the GPU,
so this is the GPU's time), four rounds in alternating order, medians.
    python notes/owg_guard_ab_2026-11-27.py
"""
import statistics
import subprocess
import types

import torch

from course_utils.kernels.flash_fwd_hopper_one_warpgroup import flash_fwd_hopper_one_warpgroup_kernel as after
from course_utils.kernels.tiles import attention_launcher, compile_kernel
from course_utils.measure.benchmarks.ch06_gpt_oss import GPT_OSS_SHAPE, gpt_oss_inputs

KERNEL = "course_utils/kernels/flash_fwd_hopper_one_warpgroup.py"
old = types.ModuleType("course_utils.kernels.one_warpgroup_at_a250cee")
old.__package__ = "course_utils.kernels"  # its relative imports resolve to today's flash_pieces and persistent kernel
exec(compile(subprocess.check_output(["git", "show", f"a250cee:{KERNEL}"], text=True), KERNEL, "exec"), old.__dict__)
before = old.flash_fwd_hopper_one_warpgroup_kernel


def per_call_ms(launch, args, n=200):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        launch(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


for window in (128, None):
    q, k, v, sinks = gpt_oss_inputs(GPT_OSS_SHAPE)
    shape = (1, 64, 4096, 4096, 64)
    launches = {name: attention_launcher(compile_kernel(factory(*shape, heads_kv=8, causal=True, window_size=window,
                                                                has_sinks=True, dtype="bfloat16"),
                                                        out_idx=[4, 5], target="cuda", dtype="bfloat16"))
                for name, factory in (("before", before), ("after", after))}
    outs = {name: launch(q, k, v, sinks) for name, launch in launches.items()}
    same = all(torch.equal(a, b) for a, b in zip(outs["before"], outs["after"]))
    times = {name: [] for name in launches}
    for r in range(4):
        for name in (list(launches) if r % 2 == 0 else list(launches)[::-1]):
            per_call_ms(launches[name], (q, k, v, sinks), n=20)
            times[name].append(per_call_ms(launches[name], (q, k, v, sinks)))
    print(f"window={window}: outputs bitwise equal: {same}; " + ", ".join(
        f"{name} {statistics.median(t) * 1e3:.1f} µs" for name, t in times.items()), flush=True)
