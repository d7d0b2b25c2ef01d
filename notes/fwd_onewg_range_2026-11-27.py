"""Seventeenth session, second A/B (issue 26): where the one-warpgroup forward (notes/onewg_kernel.py) wins.

Part "edges": the D = 64 candidate (64 x 128, 2 stages, 3 blocks per SM) checked against float64 on every head on
the shapes that exercise its masks and loads: gpt-oss heads (64 query, 8 K/V) with sinks and a 128-key window,
ragged causal S = 1000, S_q < S_k and S_q > S_k causal, a non-causal ragged S = 777, and D = 128 candidates on
the first two. Part "d64": B*S = 16k, H = 32, D = 64, S = 4k-16k (where the shipped kernel is three warpgroups).
Part "d128": B*S = 16k, H = 16, D = 128, S = 1k-4k, one-warpgroup tilings that fit D = 128.
Every timed candidate checked first; three blocks of rounds in changing orders; ratios are cuDNN's time / each.
    python notes/fwd_onewg_range_2026-11-27.py OUT.json [edges,d64,d128]
"""
import sys
import time

import torch

sys.path.insert(0, "notes")
from device_ab import forward_checked, forward_variants_against_peers, machine, save  # noqa: E402
from onewg_kernel import flash_fwd_one_warpgroup_kernel  # noqa: E402

from course_utils.kernels.tiles import attention_launcher, compile_kernel  # noqa: E402

out_path = sys.argv[1]
parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["edges", "d64", "d128"]
result = dict(machine=machine(), F=[], edges=[], errors={})
t0 = time.time()
D64 = {"1wg 64x128 2st 3/SM": dict(block_N=128, num_stages=2, blocks_per_sm=3, o_in_q=True)}
D128 = {"1wg 64x64 2st 2/SM": dict(block_N=64, num_stages=2, blocks_per_sm=2, o_in_q=True),
        "1wg 64x64 3st 2/SM": dict(block_N=64, num_stages=3, blocks_per_sm=2, o_in_q=True),
        "1wg 64x128 2st 1/SM": dict(block_N=128, num_stages=2, blocks_per_sm=1, o_in_q=True)}


def compiled(b, h, sq, sk, d, dtype, tiling, **opts):
    func = flash_fwd_one_warpgroup_kernel(b, h, sq, sk, d, dtype=dtype, **opts, **tiling)
    return attention_launcher(compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype))


if "edges" in parts:
    EDGES = [("gpt-oss window sinks", 2, 64, 8, 1000, 1000, 64, dict(causal=True, window_size=128, has_sinks=True)),
             ("gpt-oss full sinks", 2, 64, 8, 2048, 2048, 64, dict(causal=True, has_sinks=True)),
             ("ragged causal", 3, 8, 8, 1000, 1000, 64, dict(causal=True)),
             ("ragged", 3, 8, 8, 777, 777, 64, dict(causal=False)),
             ("S_q < S_k causal", 2, 8, 8, 300, 1000, 64, dict(causal=True)),
             ("S_q > S_k causal", 2, 8, 8, 1000, 300, 64, dict(causal=True)),
             ("one key window", 2, 8, 8, 512, 512, 64, dict(causal=True, window_size=1))]
    jobs = [(e, n, t) for e in EDGES for n, t in D64.items()]
    jobs += [(e, n, t) for e in EDGES[:3] for n, t in D128.items()]
    for (label, b, h, hkv, sq, sk, d, opts), name, tiling in jobs:
        d = 128 if name in D128 else d
        g = torch.Generator(device="cuda").manual_seed(sq + sk)
        q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.float16, generator=g)
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
        sinks = torch.randn(h, device="cuda", generator=g) if opts.get("has_sinks") else torch.zeros(h, device="cuda")
        try:
            launch = compiled(b, h, sq, sk, d, "float16", tiling, heads_kv=hkv, **opts)
            out, lse = launch(q, k, v, sinks)
            ok = forward_checked(result["errors"], (label, name, d), q, k, v, out, lse, name=f"{label} {name} D{d}",
                                 causal=opts["causal"], window_size=opts.get("window_size"),
                                 sinks=sinks if opts.get("has_sinks") else None)
        except Exception as exc:
            ok = False
            result["errors"][str((label, name, d))] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            print("ERROR", label, name, d, str(exc)[-300:], flush=True)
        result["edges"].append(dict(label=label, name=name, dim=d, passed=ok))
        save(out_path, **result)
    print(f"edges done {time.time() - t0:.0f}s", flush=True)


def timed(cases, variants, heads, dim):
    def compile_variant(q, seq, causal, dtype, name):
        return compiled(q.shape[0], heads, seq, seq, dim, dtype, variants[name], causal=causal)

    forward_variants_against_peers(cases, variants, compile_variant, heads=heads, dim=dim, result=result,
                                   out_path=out_path, t0=t0, key_suffix=(dim,))


if "d64" in parts:
    timed([(s, c, d) for s in (4096, 8192, 16384) for c in (False, True) for d in ("float16", "bfloat16")
           if not (s == 4096 and c and d == "float16")], D64, 32, 64)
if "d128" in parts:
    timed([(s, c, d) for s in (1024, 2048, 4096) for c in (False, True) for d in ("float16", "bfloat16")
           if d == "float16" or s == 1024], D128, 16, 128)
print(f"done {time.time() - t0:.0f}s", flush=True)
