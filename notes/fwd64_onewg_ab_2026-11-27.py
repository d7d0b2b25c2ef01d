"""Seventeenth session's A/B (issue 26): the D = 64 short forward with one warpgroup that issues its own TMA loads.

Candidates: ``notes/onewg_kernel.py`` (one block per 64-row query tile, 128 threads, no producer warpgroup, TMA
from one elected thread; 154 registers, no spills, ptxas sm_90a). Against the shipped default (one consumer plus a
producer warpgroup per block, two or three blocks per SM) and SDPA's cuDNN and FA2 backends. Cases: B*S = 16k,
H = 32, D = 64; 1k and 2k, causal and not, fp16 and bf16, and 4k causal fp16. O and LSE of every batch element and
head checked against float64 before timing; three blocks of rounds in changing orders; ratios are cuDNN's time /
each one's.   python notes/fwd64_onewg_ab_2026-11-27.py OUT.json
"""
import sys
import time

import torch

sys.path.insert(0, "notes")
from device_ab import blocks, compile_jobs, forward_checked, machine, save  # noqa: E402
from onewg_kernel import flash_fwd_one_warpgroup_kernel  # noqa: E402

from course_utils import flash_attention  # noqa: E402
from course_utils.kernels.tiles import attention_launcher, compile_kernel  # noqa: E402
from course_utils.measure.benchmarks.common import CUDNN, FA2, SDPA_PEERS, sdpa  # noqa: E402

out_path = sys.argv[1]
result = dict(machine=machine(), F=[], errors={})
t0 = time.time()
VARIANTS = {"1wg 64x128 2st 3/SM": dict(block_N=128, num_stages=2, blocks_per_sm=3, o_in_q=True),
            "1wg 64x128 3st 2/SM": dict(block_N=128, num_stages=3, blocks_per_sm=2, o_in_q=False),
            "1wg 64x64 3st 3/SM": dict(block_N=64, num_stages=3, blocks_per_sm=3, o_in_q=True),
            "1wg 64x64 2st 4/SM": dict(block_N=64, num_stages=2, blocks_per_sm=4, o_in_q=True)}
CASES = [(s, c, d) for d in ("float16", "bfloat16") for s in (1024, 2048) for c in (True, False)]
CASES.append((4096, True, "float16"))

inputs = {}
for seq, _, dtype in CASES:
    g = torch.Generator(device="cuda").manual_seed(seq)
    inputs[seq, dtype] = [torch.randn(16384 // seq, 32, seq, 64, device="cuda", dtype=getattr(torch, dtype),
                                      generator=g) for _ in range(3)]
kernels = {}


def build(job):
    seq, causal, dtype, name = job
    q, k, v = inputs[seq, dtype]
    try:
        if name == "shipped":
            flash_attention(q, k, v, causal=causal)
        else:
            func = flash_fwd_one_warpgroup_kernel(q.shape[0], 32, seq, seq, 64, causal=causal, dtype=dtype,
                                                  **VARIANTS[name])
            kernels[job] = attention_launcher(compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype))
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[-1][:160]}"


jobs = list(dict.fromkeys((s, c, d, n) for s, c, d in CASES for n in ("shipped", *VARIANTS)))
compile_jobs(build, jobs, result["errors"], t0)
sinks = torch.zeros(32, device="cuda", dtype=torch.float32)
for seq, causal, dtype in CASES:
    q, k, v = inputs[seq, dtype]
    fns = {"shipped": lambda causal=causal: flash_attention(q, k, v, causal=causal)}
    for name in VARIANTS:
        launch = kernels.get((seq, causal, dtype, name))
        if launch is None:
            continue
        out, lse = launch(q, k, v, sinks)
        if not forward_checked(result["errors"], (seq, causal, dtype, name), q, k, v, out, lse, causal=causal,
                               name=f"{dtype} D64 {seq} causal={causal} {name}"):
            continue  # a failing variant is reported and not timed
        fns[name] = lambda launch=launch: launch(q, k, v, sinks)
    for peer in (CUDNN, FA2):
        fns[peer] = lambda causal=causal, peer=peer: sdpa(q, k, v, causal, SDPA_PEERS[peer])
    result["F"] += blocks(fns, label=f"{dtype} D64 S={seq} causal={causal}", base=CUDNN)
    save(out_path, **result)
print(f"done {time.time() - t0:.0f}s", flush=True)
