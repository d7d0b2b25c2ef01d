"""2026-11-26 (eighth session), device call H: is the dK/dV epilogue a lever (issue 26)?

Version 19 (dK and dV stored by the copy engine through the K/V tiles' shared memory) against the shipped
versions, alone and combined with each shipped option, checked on every head at S=4k (chapter 08's ablation
runner: float64 reference, peers in the same run), then timed alone at S=16k. Also chapter 09's split
sweep with the new cases (2k and 4k keys) for the one-kernel threshold. Writes JSON to $OUT.
"""
import json
import os
import sys

import torch

from course_utils.kernels.versions import flash_bwd_hopper_versions as bv
from course_utils.measure.bench import attention_flops, tflops, time_side_by_side
from course_utils.measure.benchmarks import ch08_hopper_backward as ch08
from course_utils.measure.benchmarks.ch09_varlen_decode import decode_split_sweep
from course_utils.measure.benchmarks.common import comparison_shapes, random_inputs

OUT = os.environ.get("OUT", "/tmp")
by_number = {v.number: v for v in bv.VERSIONS}
epi = dict(store_dkdv=bv.dkdv_through_shared)
extra = {
    20: bv._backward(20, "v14 + v19", "dV under dSᵀ and the TMA epilogue",
                     knobs={"all": dict(dv_under_ds=True, **epi), **bv._FA3_TILES}, kept=False),
    21: bv._backward(21, "v17 + v19", "D=64 shipped (no mask) with the TMA epilogue",
                     knobs={64: dict(block_M=128, policies=bv.DQ_BY_ROWS, **epi)}, kept=False, dims=(64,)),
    22: bv._backward(22, "v18 + v19", "D=64 causal shipped with the TMA epilogue",
                     knobs={64: dict(block_M=128, policies=bv.DQ_BY_ROWS, dv_under_ds=True, **epi)}, kept=False,
                     dims=(64,)),
}
pick = {(128, False): [9, 14, 19, 20], (128, True): [9, 14, 19, 20], (64, False): [17, 21], (64, True): [18, 22]}


def versions(causal, dim):
    return [by_number.get(n) or extra[n] for n in pick[dim, causal]]


what = sys.argv[1:] or ["splits", "fp16", "bf16", "long"]
if "splits" in what:
    rows = decode_split_sweep(cases=((1, 1024), (8, 1024), (1, 2048), (8, 2048), (1, 4096), (8, 4096), (1, 8192),
                                     (8, 8192)))
    json.dump(rows, open(f"{OUT}/splits.json", "w"))
for dt in ("fp16", "bf16"):
    if dt in what:
        ch08.versions_for = versions  # the runner asks versions_for(causal, dim)
        rows = ch08.backward_ablation(dims=(128, 64), dtype_name={"fp16": "float16", "bf16": "bfloat16"}[dt])
        json.dump(rows, open(f"{OUT}/ablation_{dt}.json", "w"), default=str)
if "long" in what:  # timing only (the float64 reference at 16k is too slow for this call)
    rows = []
    for dim, causal in ((128, False), (128, True)):
        shape = comparison_shapes(seq_lens=(16384,), dim=dim)[0]
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        q, k, v = random_inputs(shape, torch.float16)
        from course_utils.api.attention import flash_attention
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        d_out = torch.randn_like(out)
        fns = {}
        for n in (9, 19, 20):
            ver = by_number.get(n) or extra[n]
            kern = ver.build(b, h, s, d, causal=causal, dtype="float16")
            fns[n] = lambda kern_=kern: kern_(q, k, v, out, lse, d_out)
        ms = time_side_by_side(fns, rounds=6)
        flops = attention_flops(b, h, s, s, d, causal=causal, mode="bwd")
        for n, t in ms.items():
            rows.append(dict(version=n, dim=dim, causal=causal, seq=s, ms=t, tflops=tflops(flops, t)))
            print(f"16k D={dim} causal={causal} v{n}: {tflops(flops, t):.0f} TFLOP/s", flush=True)
    json.dump(rows, open(f"{OUT}/long.json", "w"))
