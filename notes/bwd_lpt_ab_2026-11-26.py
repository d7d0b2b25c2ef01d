"""2026-11-26 (eighth session), device call L: the causal backward with key blocks launched longest first across
a group of heads (``heads_per_wave_group``, FlashAttention-3's LPT order) against the shipped order (each head's key
blocks in turn), at the shipped configs (D=128: version 20; D=64: version 18), fp16 and bf16, S = 2k-16k; three
blocks of interleaved rounds per case; gradients compared with the shipped kernel's. Writes $OUT/lpt.json."""
import itertools
import json
import os

import torch

from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS, flash_attention
from course_utils.kernels.versions import flash_bwd_hopper_versions as bv
from course_utils.measure.bench import attention_flops, tflops, time_side_by_side
from course_utils.measure.benchmarks.common import comparison_shapes, in_parallel, random_inputs

OUT = os.environ.get("OUT", "/tmp")


def l2_group(heads, seq, dim, budget=32 << 20):
    """The most heads (a divisor of ``heads``) whose Q and dO fit ``budget`` bytes."""
    return max(g for g in range(1, heads + 1) if heads % g == 0 and g * seq * dim * 2 * 2 <= budget)


def version(dim, group):
    c = HOPPER_BACKWARD_CONFIGS[dim, True]
    knobs = dict(block_M=c.block_M, dv_under_ds=c.dv_under_ds, policies=c.policies, dkdv_by_tma=c.dkdv_by_tma)
    if group is not None:
        knobs["heads_per_wave_group"] = group
    return bv._backward(30, f"G={group}", "", knobs={"all": knobs}, kept=False)


cases = list(itertools.product((128, 64), ("float16", "bfloat16"), (2048, 4096, 8192, 16384)))
jobs = []
for dim, dtype, seq in cases:
    heads = comparison_shapes(seq_lens=(seq,), dim=dim)[0]["heads"]
    for g in dict.fromkeys((None, heads, l2_group(heads, seq, dim))):
        jobs.append(((dim, dtype, seq), g))


def build(job):
    (dim, dtype, seq), g = job
    shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
    return version(dim, g).build(shape["batch"], shape["heads"], seq, dim, causal=True, dtype=dtype)


kernels = dict(zip(jobs, in_parallel(build, jobs, workers=16)))
rows = []
for case in cases:
    dim, dtype, seq = case
    shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
    q, k, v = random_inputs(shape, getattr(torch, dtype))
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    d_out = torch.randn_like(out)
    groups = [g for (c, g) in jobs if c == case]
    fns = {g: (lambda kern=kernels[case, g]: kern(q, k, v, out, lse, d_out)) for g in groups}
    base = fns[None]()
    diffs = {str(g): max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                         for a, b in zip(fns[g](), base)) for g in groups}
    ms = {g: [] for g in groups}
    for _ in range(3):
        for g, t in time_side_by_side(fns, rounds=6).items():
            ms[g].append(t)
    flops = attention_flops(shape["batch"], shape["heads"], seq, seq, dim, causal=True, mode="bwd")
    gains = {str(g): [ms[None][i] / ms[g][i] - 1 for i in range(3)] for g in groups if g is not None}
    rows.append(dict(dim=dim, dtype=dtype, seq=seq, heads=shape["heads"], ms={str(g): t for g, t in ms.items()},
                     gains=gains, rel_diff=diffs, tflops={str(g): tflops(flops, min(t)) for g, t in ms.items()}))
    print(f"D={dim} {dtype} causal S={seq:>5}: shipped {rows[-1]['tflops']['None']:.0f} TFLOP/s; "
          + "; ".join(f"G={g}: {' '.join(f'{x:+.1%}' for x in gs)}" for g, gs in gains.items())
          + f"; max rel diff {max(diffs.values()):.1e}", flush=True)
    json.dump(rows, open(f"{OUT}/lpt.json", "w"))
