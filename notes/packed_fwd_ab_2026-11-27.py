"""Issue 27, ninth session: the packed forward storing O by TMA where a tile is all its sequence's.

A/B on the H100 for chapter 09's record batch (64k tokens in 18 sequences of 221-6892, H=16, D=128, fp16):
``flash_varlen_fwd_persistent_kernel`` at the packed default config (128 × 128, ping-pong, one block per SM) with
``o_by_tma`` off (every row from registers) and on, called as ``flash_attention_varlen`` calls it (work list made
on the device per call), against our dense forward on equal lengths. O and LSE of every sequence and head checked
against float64 first; interleaved rounds (time_side_by_side), three blocks, TFLOP/s ratio to the dense kernel.

    python notes/packed_fwd_ab_2026-11-27.py OUT.json
"""
import json
import sys

import torch

from course_utils import flash_attention
from course_utils.api.inputs import sink_logits
from course_utils.api.varlen_api import VARLEN_PERSISTENT_CONFIG as CONFIG
from course_utils.checking.validation import check_forward, varlen_references
from course_utils.kernels.flash_varlen import flash_varlen_fwd_persistent_kernel, varlen_pair_list
from course_utils.kernels.tiles import compile_kernel
from course_utils.measure.bench import attention_flops, time_side_by_side
from course_utils.measure.benchmarks.ch09_varlen_decode import VARLEN_SHAPE, _equal_lengths, varlen_lengths
from course_utils.measure.benchmarks.common import in_parallel

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
ctas = torch.cuda.get_device_properties(0).multi_processor_count
logits = sink_logits(None, heads, q.device)
jobs = [(causal, tma) for causal in (True, False) for tma in (False, True)]


def build(job):
    causal, tma = job
    func = flash_varlen_fwd_persistent_kernel(heads, dim, causal=causal, dtype="float16", block_M=CONFIG.block_M,
                                              block_N=CONFIG.block_N, num_stages=CONFIG.num_stages,
                                              threads=CONFIG.threads, pingpong=CONFIG.pingpong, num_ctas=ctas,
                                              o_by_tma=tma)
    return compile_kernel(func, out_idx=[8, 9], target="cuda", dtype="float16")


kernels = dict(zip(jobs, in_parallel(build, jobs)))
rows = []
for causal in (True, False):
    fns, refs = {}, varlen_references(q, k, v, cu, cu, causal=causal)
    for tma in (False, True):
        def call(kernel=kernels[causal, tma]):
            pairs, count = varlen_pair_list(cu, cu, heads, CONFIG.block_M, longest)
            return kernel(q, k, v, cu, cu, pairs, count, logits)
        name = "O by TMA (full tiles)" if tma else "O from registers"
        out, lse = call()
        check_forward(q, k, v, out, lse, refs=refs, name=f"causal={causal} {name}")
        fns[name] = call
    del refs
    fns["dense"] = lambda causal=causal: flash_attention(dq, dk, dv, causal=causal)
    work = sum(attention_flops(1, heads, n, n, dim, causal=causal) for n in lengths)
    dense_work = attention_flops(dense_batch, heads, dense_seq, dense_seq, dim, causal=causal)
    for block in range(3):
        ms = time_side_by_side(fns, warmup=3, rounds=4, rep=5)
        ratios = " ".join(f"{n}={ms['dense'] / t * work / dense_work:.3f}" for n, t in ms.items() if n != "dense")
        print(f"causal={causal} block {block}: " + " ".join(f"{n}={t:.3f}" for n, t in ms.items())
              + f" | ÷dense {ratios}", flush=True)
        rows.append(dict(causal=causal, block=block, ms=ms))
        json.dump(dict(lengths=lengths, dense=[dense_batch, dense_seq], rows=rows), open(out_path, "w"), indent=1)
