"""Issue 27, ninth session: the packed backward with the dense kernel's newer BackwardConfig fields.

``python notes/packed_bwd_ab_2026-11-27.py OUT.json [fields|order]``: "order" (call N7) times only the causal
shipped config against it launched longest first within each sequence.

A/B on the H100 for chapter 09's record batch (64k tokens in 128-8k, H=16, D=128, fp16): the packed
backward with version 9's step (the default before this session) against dv_under_ds, + dkdv_by_tma,
+ longest_first (causal), and our dense backward on equal lengths, all through flash_attention_varlen's public
call with backward_config=..., each checked on every sequence and head against the float64 reference first;
interleaved rounds (time_side_by_side), three blocks, the ratio to the dense kernel per block. In call N2
longest_first was the kernel's first version of it: key block 0 of all (sequence, head) pairs first.
"""
import json
import sys
import time

import torch

from course_utils import flash_attention
from course_utils.api.attention import backward_kernels
from course_utils.api.varlen_api import VARLEN_HOPPER_BACKWARD_CONFIGS, flash_attention_varlen, varlen_kernels
from course_utils.checking.validation import check_backward, varlen_references
from course_utils.measure.bench import attention_flops, time_side_by_side
from course_utils.measure.benchmarks.ch09_varlen_decode import VARLEN_SHAPE, _equal_lengths, varlen_lengths
from course_utils.measure.benchmarks.common import backward_timer, in_parallel

out_path = sys.argv[1]
sh = VARLEN_SHAPE
heads, dim = sh["heads"], sh["dim"]
lengths = varlen_lengths(sh["tokens"], sh["shortest"], sh["longest"])
cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
total, longest = sum(lengths), max(lengths)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
dense_batch, dense_seq = _equal_lengths(lengths)
dq, dk, dv = (torch.randn(dense_batch, heads, dense_seq, dim, device="cuda", dtype=torch.float16, generator=g)
              for _ in range(3))


PART = sys.argv[2] if len(sys.argv) > 2 else "fields"  # "fields" (call N2) or "order" (call N7)


def variants_for(causal):
    if PART == "order":  # the shipped packed config, and the same launched as the dense longest_first does
        shipped = VARLEN_HOPPER_BACKWARD_CONFIGS[dim, causal]
        return {"shipped (dv_under_ds+tma)": shipped, "+ longest_first per sequence":
                shipped._replace(longest_first=True)}
    base = VARLEN_HOPPER_BACKWARD_CONFIGS[dim, causal]._replace(dv_under_ds=False, dkdv_by_tma=False,
                                                                longest_first=False)
    variants = {"plain step (version 9's)": base, "dv_under_ds": base._replace(dv_under_ds=True),
                "dv_under_ds+tma": base._replace(dv_under_ds=True, dkdv_by_tma=True)}
    if causal:
        variants["dv_under_ds+tma+longest_first"] = base._replace(dv_under_ds=True, dkdv_by_tma=True,
                                                                  longest_first=True)
        variants["longest_first"] = base._replace(longest_first=True)
    return variants


t0 = time.time()  # every kernel compiled first, in threads (TileLang compiles release the GIL)
CAUSAL = (True,) if PART == "order" else (True, False)
jobs = [(causal, c) for causal in CAUSAL for c in variants_for(causal).values()]
in_parallel(lambda job: varlen_kernels(q, k, causal=job[0], backward_config=job[1]), jobs)
in_parallel(lambda causal: backward_kernels(dq, dk, causal=causal), CAUSAL)
print(f"compiled {len(jobs)} packed backward configurations ({time.time() - t0:.0f} s)", flush=True)
rows = []
for causal in CAUSAL:
    variants = variants_for(causal)
    fns, refs = {}, None
    for name, config in variants.items():
        def attn(q_, k_, v_, c=config, causal=causal):
            return flash_attention_varlen(q_, k_, v_, cu, cu, longest, longest, causal=causal, backward_config=c)
        t0 = time.time()
        grad_fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
        refs = refs or varlen_references(q, k, v, cu, cu, d_out=d_out, causal=causal)
        errors = check_backward(q, k, v, d_out, grad_fn(), refs=refs, quiet=True, name=name)
        print(f"causal={causal} {name}: checked ({time.time() - t0:.0f} s)", flush=True)
        fns[name] = grad_fn
    del refs
    fns["dense"] = backward_timer(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal), dq, dk, dv)[0]
    work = sum(attention_flops(1, heads, n, n, dim, causal=causal) for n in lengths)
    dense_work = attention_flops(dense_batch, heads, dense_seq, dense_seq, dim, causal=causal)
    for block in range(3):
        ms = time_side_by_side(fns, warmup=3, rounds=4, rep=5)
        line = " ".join(f"{n}={t:.3f}" for n, t in ms.items())
        ratios = " ".join(f"{n}={ms['dense'] / t * work / dense_work:.3f}" for n, t in ms.items() if n != "dense")
        print(f"causal={causal} block {block}: {line} | ÷dense {ratios}", flush=True)
        rows.append(dict(causal=causal, block=block, ms=ms))
        json.dump(dict(lengths=lengths, dense=[dense_batch, dense_seq], rows=rows), open(out_path, "w"), indent=1)
