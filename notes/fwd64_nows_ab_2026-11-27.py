"""Fourteenth session's A/B (issue 26): D=64 short forward without warp specialisation (python ... OUT.json).

cuDNN's D=64 forward is named ``..._64x128x64_4x1x1_cga1x1x1_...``: 64-row tiles, four warps. Our shipped short tiling
(D64_SHORT_FORWARD_CONFIGS) is one consumer warpgroup *plus TileLang's producer warpgroup* per block, two or three
blocks per SM; the producer's warpgroup caps the launch at 128 or 80 registers a thread. The question: does a block of
one warpgroup and no producer (chapter 07's rotated loop compiled with TL_DISABLE_WARP_SPECIALIZED: its loads become
cp.async issued by the same threads, 156 registers, so three blocks of 72 KiB fit an SM) close the last 2-4%?
Candidates (rotated loop, 128 threads, no WS): 64x128 two stages; 64x64 two stages (more blocks per SM).
Cases: B*S = 16k, H = 32, D = 64; 1k and 2k, causal and not, fp16 and bf16. O and LSE of every batch element and head
checked against float64 before timing; timed beside the shipped default and SDPA's cuDNN and FA2 backends in
changing orders (bench.round_orders), three blocks; ratios are cuDNN's time / each one's.
"""
import sys
import time

import tilelang

sys.path.insert(0, "notes")
from device_ab import forward_variants_against_peers, machine  # noqa: E402

from course_utils.kernels.flash_fwd_hopper import flash_fwd_hopper_kernel  # noqa: E402
from course_utils.kernels.tiles import attention_launcher, compile_kernel  # noqa: E402

out_path = sys.argv[1]
result = dict(machine=machine(), F=[], errors={})
t0 = time.time()
NO_WS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
VARIANTS = {"noWS 64x128 2st": (64, 128, 2), "noWS 64x64 2st": (64, 64, 2)}
CASES = [(s, c, d) for d in ("float16", "bfloat16") for s in (1024, 2048) for c in (True, False)]


def compile_variant(q, seq, causal, dtype, name):
    bm, bn, st = VARIANTS[name]
    func = flash_fwd_hopper_kernel(q.shape[0], 32, seq, seq, 64, causal=causal, dtype=dtype, block_M=bm, block_N=bn,
                                   num_stages=st, threads=128)
    return attention_launcher(compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype, pass_configs=NO_WS))


forward_variants_against_peers(CASES, VARIANTS, compile_variant, heads=32, dim=64, result=result, out_path=out_path,
                               t0=t0)
print(f"done {time.time() - t0:.0f}s", flush=True)
