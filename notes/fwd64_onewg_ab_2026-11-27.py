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

sys.path.insert(0, "notes")
from device_ab import forward_variants_against_peers, machine  # noqa: E402
from onewg_kernel import flash_fwd_one_warpgroup_kernel  # noqa: E402

from course_utils.kernels.tiles import attention_launcher, compile_kernel  # noqa: E402

out_path = sys.argv[1]
result = dict(machine=machine(), F=[], errors={})
t0 = time.time()
VARIANTS = {"1wg 64x128 2st 3/SM": dict(block_N=128, num_stages=2, blocks_per_sm=3, o_in_q=True),
            "1wg 64x128 3st 2/SM": dict(block_N=128, num_stages=3, blocks_per_sm=2, o_in_q=False),
            "1wg 64x64 3st 3/SM": dict(block_N=64, num_stages=3, blocks_per_sm=3, o_in_q=True),
            "1wg 64x64 2st 4/SM": dict(block_N=64, num_stages=2, blocks_per_sm=4, o_in_q=True)}
CASES = [(s, c, d) for d in ("float16", "bfloat16") for s in (1024, 2048) for c in (True, False)]
CASES.append((4096, True, "float16"))


def compile_variant(q, seq, causal, dtype, name):
    func = flash_fwd_one_warpgroup_kernel(q.shape[0], 32, seq, seq, 64, causal=causal, dtype=dtype, **VARIANTS[name])
    return attention_launcher(compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype))


forward_variants_against_peers(CASES, VARIANTS, compile_variant, heads=32, dim=64, result=result, out_path=out_path,
                               t0=t0)
print(f"done {time.time() - t0:.0f}s", flush=True)
