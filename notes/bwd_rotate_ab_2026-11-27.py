"""2026-11-27 (tenth session), device call R1: the Hopper backward with each key block's query loop rotated
(``rotate_queries``: key block kb starts kb query blocks in and wraps) against the shipped config, fp16 and bf16,
D = 128 and 64, without a mask at S = 2k, 8k, 16k, and causal D = 128 fp16 at 4k and 16k.

Prediction: without a mask every key block of a head visits query block 0, 1, 2... in lockstep, so the blocks of a
head running together (up to 128 at S = 16k, 8 at 1k) reduce-add into the same dQ tile at the same time; rotated,
each adds into a different tile. If that contention is what makes our backward fall from 0.97x cuDNN at 1k to
0.84x at 16k, the rotation gains most at 16k and nothing at 1k-2k. Three blocks of interleaved rounds per case;
gradients compared with the shipped kernel's (they differ only in the order of the float32 dQ additions).

Outcome (call R1, H100): -2.2…+3.8%, no pattern without a mask; -4.7…-10.5% causal. The prediction failed, so
the knob was taken out of the kernel again; to re-run this script, put back into ``flash_bwd_hopper_kernel``'s
loop a keyword ``rotate_queries`` and, before the plain branch,
    elif rotate_queries:
        qb = offset + first + (step - first + kb) % (end - first)
        head = by"""
import itertools
import json
import sys

import torch

from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS, flash_attention
from course_utils.kernels.versions import flash_bwd_hopper_versions as bv
from course_utils.measure.bench import attention_flops, tflops, time_side_by_side
from course_utils.measure.benchmarks.common import comparison_shapes, in_parallel, random_inputs

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rotate.json"


def version(dim, causal, rotate):
    c = HOPPER_BACKWARD_CONFIGS[dim, causal]
    knobs = dict(block_M=c.block_M, dv_under_ds=c.dv_under_ds, policies=c.policies, dkdv_by_tma=c.dkdv_by_tma,
                 longest_first=c.longest_first, rotate_queries=rotate)
    return bv._backward(30, f"rotate={rotate}", "", knobs={"all": knobs}, kept=False)


cases = [(dim, dtype, seq, False) for dim, dtype, seq in
         itertools.product((128, 64), ("float16", "bfloat16"), (2048, 8192, 16384))]
cases += [(128, "float16", seq, True) for seq in (4096, 16384)]
jobs = [(case, rotate) for case in cases for rotate in (False, True)]


def build(job):
    (dim, dtype, seq, causal), rotate = job
    shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
    return version(dim, causal, rotate).build(shape["batch"], shape["heads"], seq, dim, causal=causal, dtype=dtype)


kernels = dict(zip(jobs, in_parallel(build, jobs, workers=16)))
rows = []
for case in cases:
    dim, dtype, seq, causal = case
    shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
    q, k, v = random_inputs(shape, getattr(torch, dtype))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    d_out = torch.randn_like(out)
    fns = {r: (lambda kern=kernels[case, r]: kern(q, k, v, out, lse, d_out)) for r in (False, True)}
    base, rot = fns[False](), fns[True]()
    diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(rot, base))
    ms = {r: [] for r in fns}
    for _ in range(3):
        for r, t in time_side_by_side(fns, rounds=6).items():
            ms[r].append(t)
    flops = attention_flops(shape["batch"], shape["heads"], seq, seq, dim, causal=causal, mode="bwd")
    gains = [ms[False][i] / ms[True][i] - 1 for i in range(3)]
    rows.append(dict(dim=dim, dtype=dtype, seq=seq, causal=causal, ms={str(r): t for r, t in ms.items()},
                     gains=gains, rel_diff=diff, tflops={str(r): tflops(flops, min(t)) for r, t in ms.items()}))
    print(f"D={dim} {dtype} {'causal' if causal else 'full'} S={seq:>5}: shipped {rows[-1]['tflops']['False']:.0f}"
          f" rotated {rows[-1]['tflops']['True']:.0f} TFLOP/s; gain {' '.join(f'{x:+.1%}' for x in gains)};"
          f" max rel diff {diff:.1e}", flush=True)
    json.dump(rows, open(OUT, "w"))
