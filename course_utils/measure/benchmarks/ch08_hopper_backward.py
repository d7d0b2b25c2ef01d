"""Chapter 08: the Hopper backward's ablation, the deterministic mode's cost, and its feature checks.

The final comparison over S, D, dtype and mask is chapter 05's ``backward_vs_peers`` run on the
default backward, which on an H100 is chapter 08's kernel.
"""

import itertools

import torch

from ...api.attention import backward_kernels, flash_attention, forward_kernel
from ...checking.validation import check_backward, references
from ...core.labels import CUDNN, FA2
from ...kernels.versions.flash_bwd_hopper_versions import SHIPPED_VERSION, versions_for
from ..bench import attention_flops, tflops, time_side_by_side
from .common import (
    SDPA_PEERS,
    AblationCase,
    ablation,
    backward_timer,
    comparison_shapes,
    empty_query,
    in_parallel,
    peer_attentions,
    random_inputs,
    sdpa,
)

__all__ = ["backward_ablation", "deterministic_cost", "FEATURE_CASES", "feature_checks", "TIMING_ORDERS",
           "timing_order"]


def backward_ablation(dims=(128, 64), dtype_name="float16", causal_options=(False, True), seq=4096, versions=None):
    """TFLOP/s of every version's whole backward (preprocess, main, postprocess), each checked on every
    head against the float64 reference, timed side by side with FlashAttention-2 and cuDNN
    (``common.ablation``)."""
    dtype = getattr(torch, dtype_name)

    def prepare(shape, causal):
        q, k, v = random_inputs(shape, dtype)
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        d_out = torch.randn_like(out)
        refs = references(q, k, v, d_out=d_out, causal=causal)

        def check(backward, name):
            grads = backward(q, k, v, out, lse, d_out)
            return check_backward(q, k, v, d_out, grads, causal=causal, refs=refs, quiet=True, name=name)

        peers = {name: backward_timer(peer, q, k, v)[0] for name, peer in peer_attentions(causal).items()}
        return AblationCase(check, lambda backward: (lambda: backward(q, k, v, out, lse, d_out)), peers)

    return ablation(itertools.product(dims, causal_options),
                    versions_for if versions is None else (lambda causal, dim: versions), prepare,
                    mode="bwd", dtype_name=dtype_name, seq=seq)


# What the order of the turns does (docs/timing.md): the records' order before 2026-11-27, its
# reverse, ours and cuDNN alone both ways, and the changing order (``bench.round_orders``) the records use now.
TIMING_ORDERS = {"fixed: ours, FA2, cuDNN": (("ours", "FA2", "cuDNN"), False),
                 "fixed: cuDNN, FA2, ours": (("cuDNN", "FA2", "ours"), False),
                 "fixed: ours, cuDNN": (("ours", "cuDNN"), False),
                 "fixed: cuDNN, ours": (("cuDNN", "ours"), False),
                 "changing (the records' method)": (("ours", "FA2", "cuDNN"), True)}


def timing_order(cases=(("bfloat16", 128, False, 16384), ("float16", 128, False, 8192),
                        ("bfloat16", 64, True, 16384), ("float16", 128, False, 4096))):
    """cuDNN's backward time ÷ ours (above 1: ours faster) when the calls take turns in each of ``TIMING_ORDERS``.

    Under attention the H100 runs at its power cap, so its clock depends on what ran just before; a kernel
    timed right after FlashAttention-2 (half the tensor-core rate, less power) starts faster.
    """
    jobs = [(dtype, comparison_shapes(seq_lens=(seq,), dim=dim)[0], causal) for dtype, dim, causal, seq in cases]

    def build(job):
        dtype, shape, causal = job
        q = empty_query(shape, dtype)
        forward_kernel(q, q, causal=causal)
        backward_kernels(q, q, causal=causal)

    in_parallel(build, jobs)
    rows = []
    for dtype, shape, causal in jobs:
        q, k, v = random_inputs(shape, getattr(torch, dtype))
        attns = {"ours": lambda a, b, c: flash_attention(a, b, c, causal=causal)}
        attns.update({short: (lambda a, b, c, b_=SDPA_PEERS[name]: sdpa(a, b, c, causal, b_))
                      for short, name in (("FA2", FA2), ("cuDNN", CUDNN))})
        fns = {name: backward_timer(attn, q, k, v)[0] for name, attn in attns.items()}
        for label, (order, balanced) in TIMING_ORDERS.items():
            ms = time_side_by_side({name: fns[name] for name in order}, balanced=balanced)
            rows.append(dict(dtype=dtype, causal=causal, order=label, ms=ms, cudnn_over_ours=ms["cuDNN"] / ms["ours"],
                             **shape))
            print(f"{dtype} D={shape['dim']} causal={causal!s:5} S={shape['seq']:>5} {label:32}: cuDNN ÷ ours "
                  f"{rows[-1]['cudnn_over_ours']:.3f}", flush=True)
    return rows


def deterministic_cost(dims=(128, 64), causal_options=(False, True), seq=4096, dtype_name="float16", repeats=3):
    """The deterministic backward against the default one: time, and whether repeated runs on the same
    inputs give bitwise-identical gradients (the default's dQ atomics land in a different order each run)."""
    rows = []
    for dim, causal in itertools.product(dims, causal_options):
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        q, k, v = random_inputs(shape, getattr(torch, dtype_name))
        refs = None
        timers = {}
        for deterministic in (False, True):
            attn = lambda q_, k_, v_, det=deterministic: flash_attention(q_, k_, v_, causal=causal,  # noqa: E731
                                                                        deterministic=det)
            grad_fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
            runs = [grad_fn() for _ in range(repeats)]
            refs = refs or references(q, k, v, d_out=d_out, causal=causal)
            errors = check_backward(q, k, v, d_out, runs[0], causal=causal, refs=refs, quiet=True,
                                    name=f"deterministic={deterministic}")
            spread = max(float((r[0].float() - runs[0][0].float()).abs().max()) for r in runs[1:])
            identical = all(all(torch.equal(x, y) for x, y in zip(r, runs[0])) for r in runs[1:])
            timers[deterministic] = grad_fn
            rows.append(dict(deterministic=deterministic, causal=causal, dtype=dtype_name, errors=errors,
                             bitwise_identical=identical, dq_max_run_to_run=spread, repeats=repeats, **shape))
        flops = attention_flops(b, h, s, s, d, causal=causal, mode="bwd")
        times = time_side_by_side({det: fn for det, fn in timers.items()})
        for row in rows[-2:]:
            row.update(ms=times[row["deterministic"]], tflops=tflops(flops, times[row["deterministic"]]))
            print(f"D={d} causal={causal!s:5} deterministic={row['deterministic']!s:5} {row['tflops']:6.0f} TFLOP/s, "
                  f"bitwise identical over {repeats} runs: {row['bitwise_identical']}, "
                  f"dQ run-to-run max diff {row['dq_max_run_to_run']:.2e}")
    return rows


# What chapter 05/06's backward covers, at sizes that check quickly on the H100.
FEATURE_CASES = {
    "plain D=128": dict(dim=128),
    "causal D=64": dict(dim=64, causal=True),
    "GQA 8/2 causal": dict(heads=8, heads_kv=2, causal=True),
    "window 128": dict(dim=64, window_size=128),
    "one-key window": dict(dim=64, window_size=1, seq=1000),
    "sinks, GQA, window, bf16": dict(heads=8, heads_kv=2, dim=64, window_size=100, sinks=True, dtype="bfloat16"),
    "ragged causal S=1000": dict(seq=1000, causal=True),
    "ragged S=1000 bf16": dict(seq=1000, dtype="bfloat16"),
    "S_q=500, S_k=1000 causal": dict(seq=500, seq_k=1000, causal=True),
    "S_q=1000, S_k=700 causal": dict(seq=1000, seq_k=700, causal=True),
}


def feature_inputs(case, seed=0):
    """(q, k, v, sinks or None, options) for one of ``FEATURE_CASES``."""
    c = dict(batch=2, heads=4, heads_kv=None, seq=1024, seq_k=None, dim=128, causal=False, window_size=None,
             sinks=False, dtype="float16")
    c.update(case)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, c["dtype"])
    hkv, sk = c["heads_kv"] or c["heads"], c["seq_k"] or c["seq"]
    q = torch.randn(c["batch"], c["heads"], c["seq"], c["dim"], device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(c["batch"], hkv, sk, c["dim"], device="cuda", dtype=dtype, generator=g) for _ in range(2))
    sinks = torch.randn(c["heads"], device="cuda", generator=g) if c["sinks"] else None
    return q, k, v, sinks, dict(causal=c["causal"], window_size=c["window_size"])


def feature_checks(cases=None, deterministic_options=(False, True)):
    """Every feature of the backward, in both modes, checked on every head (dQ, dK, dV and dsinks)."""
    rows = []
    cases = cases or FEATURE_CASES

    def build(job):
        q, k, _, sinks, options = feature_inputs(cases[job[0]])
        forward_kernel(q, k, has_sinks=sinks is not None, **options)
        backward_kernels(q, k, deterministic=job[1], **options)

    in_parallel(build, list(itertools.product(cases, deterministic_options)))
    for name, case in cases.items():
        q, k, v, sinks, options = feature_inputs(case)
        for deterministic in deterministic_options:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([sinks.detach().requires_grad_()]
                                                                        if sinks is not None else [])
            try:
                out = flash_attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None,
                                      deterministic=deterministic, **options)
                d_out = torch.randn_like(out)
                grads = torch.autograd.grad(out, leaves, d_out)
                errors = check_backward(q, k, v, d_out, grads, sinks=sinks, quiet=True, **options,
                                        name=f"{name} deterministic={deterministic}")
                error = None
            except Exception as exc:  # recorded, so one broken case does not hide the others
                errors, error = None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            rows.append(dict(case=name, deterministic=deterministic, errors=errors, error=error, **case))
            print(f"{'✗' if error else '✓'} {name:28} deterministic={deterministic!s:5} " +
                  (error or ", ".join(f"{k} {v['err']:.1e}" for k, v in errors.items() if not k.endswith("_low"))))
    return rows


def self_check():
    """``python -m course_utils.check flash_bwd_hopper``: on an H100 every feature in both modes, then the backward
    against the peers at S = 4k; elsewhere what needs no GPU: the shipped kernel's ptxas report."""
    from ...api.attention import HOPPER_BACKWARD_CONFIGS, is_hopper

    if not is_hopper():
        from ...core.source import cuda_source, ptxas_report
        from ...kernels.flash_bwd_hopper import FA3_TILING, PASS_CONFIGS, flash_bwd_hopper_kernel

        for (dim, masked), config in HOPPER_BACKWARD_CONFIGS.items():
            func = flash_bwd_hopper_kernel(4, 2048 // dim, 4096, 4096, dim, causal=masked,
                                           tiling=FA3_TILING._replace(block_M=config.block_M, block_N=config.block_N))
            report = ptxas_report(cuda_source(func, pass_configs=PASS_CONFIGS))
            print(f"D={dim} masked={masked} {config.block_M}x{config.block_N}:",
                  "nvcc not installed" if report is None else
                  "; ".join(line.split(": ", 1)[-1] for line in report if "spill" in line or "registers" in line
                            or "C75" in line))
        return
    feature_checks()
    backward_ablation(versions=[v for v in versions_for(True) if v.number in (1, SHIPPED_VERSION)])
