"""Chapter 07: the Hopper forward's ablation (``flash_fwd_hopper_versions``) and its tiling sweep."""

import torch

from ..attention import ForwardConfig
from ..bench import attention_flops, tflops, time_side_by_side
from ..flash_fwd_hopper_versions import versions_for
from ..validation import check_forward, references
from .ch03_forward import forward_config_sweep
from .common import SDPA_PEERS, comparison_shapes, in_parallel, random_inputs, sdpa

__all__ = ["forward_ablation", "hopper_tiling_sweep"]


def forward_ablation(dims=(128, 64), dtype_name="float16", causal_options=(False, True)):
    """TFLOP/s of every version of the ablation, each checked on every head, timed side by side with
    FlashAttention-2 and cuDNN."""
    rows = []
    for dim in dims:
        shape = comparison_shapes(seq_lens=(4096,), dim=dim)[0]
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        q, k, v = random_inputs(shape, getattr(torch, dtype_name))
        no_sinks = torch.full((h,), float("-inf"), device="cuda")
        for causal in causal_options:
            versions = versions_for(causal)
            kernels = in_parallel(lambda ver: ver.build(b, h, s, d, causal=causal, dtype=dtype_name), versions)
            refs = references(q, k, v, causal=causal)
            impls, errors = {}, {}
            for version, kernel in zip(versions, kernels):
                impls[version.label] = lambda kernel=kernel: kernel(q, k, v, no_sinks)
                out, lse = impls[version.label]()
                errors[version.label] = check_forward(q, k, v, out, lse, causal=causal, refs=refs, quiet=True,
                                                      name=f"version {version.number}")
            for name, backend in SDPA_PEERS.items():
                impls[name] = lambda backend=backend: sdpa(q, k, v, causal, backend)
            flops = attention_flops(b, h, s, s, d, causal=causal)
            numbers = {v.label: v.number for v in versions}
            for impl, ms in time_side_by_side(impls).items():
                rows.append(dict(impl=impl, causal=causal, dtype=dtype_name, ms=ms, tflops=tflops(flops, ms),
                                 errors=errors.get(impl), version=numbers.get(impl), **shape))
                print(f"D={d} causal={causal!s:5} {impl:55} {rows[-1]['tflops']:6.0f} TFLOP/s")
    return rows


def hopper_tiling_sweep():
    """Chapter 07's kernel at D = 128 and 64 with wider key blocks and ping-pong."""
    rows = []
    for dim, tilings in ((128, [(128, False), (176, False), (192, False)]),
                         (64, [(128, False), (192, False), (128, True), (192, True)])):
        configs = [ForwardConfig(128, n, 2, 256, kernel="flash_fwd_hopper", pingpong=pp) for n, pp in tilings]
        rows += forward_config_sweep(shape=comparison_shapes(seq_lens=(4096,), dim=dim)[0], configs=configs)
    return rows
