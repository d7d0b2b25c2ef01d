"""2026-11-26 (eighth session), device call I: version 20 (dV under dSᵀ + dK/dV by TMA store) against the shipped
version 9 at D=128 over S = 2k-16k, fp16 and bf16, causal and not, in alternated rounds (timing; each variant's
gradients compared with version 9's, which chapter 08's record checks against float64). Writes $OUT/ab.json."""
import itertools
import json
import os

import torch

from course_utils.api.attention import flash_attention
from course_utils.kernels.versions import flash_bwd_hopper_versions as bv
from course_utils.measure.bench import attention_flops, tflops, time_side_by_side
from course_utils.measure.benchmarks.common import comparison_shapes, in_parallel, random_inputs

OUT = os.environ.get("OUT", "/tmp")
v9 = next(v for v in bv.VERSIONS if v.number == 9)
v20 = bv._backward(20, "v14 + v19", "dV under dSᵀ and the TMA epilogue",
                   knobs={"all": dict(dv_under_ds=True, store_dkdv=bv.dkdv_through_shared), **bv._FA3_TILES}, kept=False)
cases = list(itertools.product(("float16", "bfloat16"), (False, True), (2048, 4096, 8192, 16384)))
jobs = [(c, v) for c in cases for v in (v9, v20)]


def build(job):
    (dtype, causal, seq), version = job
    shape = comparison_shapes(seq_lens=(seq,), dim=128)[0]
    return version.build(shape["batch"], shape["heads"], seq, 128, causal=causal, dtype=dtype)


kernels = dict(zip([(c, v.number) for c, v in jobs], in_parallel(build, jobs, workers=16)))
rows = []
for case in cases:
    dtype, causal, seq = case
    shape = comparison_shapes(seq_lens=(seq,), dim=128)[0]
    q, k, v = random_inputs(shape, getattr(torch, dtype))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    d_out = torch.randn_like(out)
    g9 = kernels[case, 9](q, k, v, out, lse, d_out)
    g20 = kernels[case, 20](q, k, v, out, lse, d_out)
    diff = [float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(g20, g9)]
    fns = {n: (lambda kern=kernels[case, n]: kern(q, k, v, out, lse, d_out)) for n in (9, 20)}
    ms = {n: [] for n in fns}
    for _ in range(3):  # three blocks of interleaved rounds: the block-to-block drift shows in the spread
        for n, t in time_side_by_side(fns, rounds=6).items():
            ms[n].append(t)
    flops = attention_flops(shape["batch"], shape["heads"], seq, seq, 128, causal=causal, mode="bwd")
    gains = [ms[9][i] / ms[20][i] - 1 for i in range(3)]
    rows.append(dict(dtype=dtype, causal=causal, seq=seq, ms=ms, rel_diff_vs_v9=diff, gains=gains,
                     tflops={n: tflops(flops, min(t)) for n, t in ms.items()}))
    print(f"{dtype} causal={causal!s:5} S={seq:>5}: v9 {rows[-1]['tflops'][9]:.0f} v20 {rows[-1]['tflops'][20]:.0f} "
          f"TFLOP/s; gain per block {' '.join(f'{g:+.1%}' for g in gains)}; max rel diff {max(diff):.1e}",
          flush=True)
    json.dump(rows, open(f"{OUT}/ab.json", "w"))
