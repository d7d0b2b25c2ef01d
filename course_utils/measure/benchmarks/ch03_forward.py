"""Chapters 03, 04 and 07: the forward kernels against SDPA's FlashAttention-2 and cuDNN backends,
and tiling sweeps. Every kernel is checked on every head before it is timed."""

import itertools

import torch

from ...api.attention import ForwardConfig, default_forward_config, flash_attention, forward_kernel
from ...checking.validation import check_forward, references
from ...core.labels import NAIVE, OURS
from ..bench import attention_flops, tflops, time_cuda, time_side_by_side
from .ch01_naive import naive_attention
from .common import comparison_shapes, empty_query, in_parallel, peer_attentions, random_inputs, sweep

__all__ = ["forward_vs_peers", "forward_config_sweep"]


def _config_for(config, shape, causal):
    if config is not None:
        return ForwardConfig(*config)
    return default_forward_config("cuda", shape["dim"], causal, seq_len=shape["seq"])


def forward_vs_peers(shapes=None, dtypes=("float16",), causal_options=(False, True), config=None,
                     include_naive_up_to=4096):
    """TFLOP/s of our forward (``config``, else the default kernel), FA2, cuDNN, FA4 where installed (and naive
    PyTorch)."""
    rows = []
    jobs = list(itertools.product(shapes or comparison_shapes(), dtypes, causal_options))

    def build(job):
        shape, dtype_name, causal = job
        q = empty_query(shape, dtype_name)
        forward_kernel(q, q, causal=causal, config=_config_for(config, shape, causal))

    in_parallel(build, jobs)
    for shape, dtype_name, causal in jobs:
        q, k, v = random_inputs(shape, getattr(torch, dtype_name))
        flops = attention_flops(shape["batch"], shape["heads"], shape["seq"], shape["seq"], shape["dim"],
                                causal=causal)
        used = _config_for(config, shape, causal)
        ours = lambda: flash_attention(q, k, v, causal=causal, config=used)  # noqa: E731
        out, lse = flash_attention(q, k, v, causal=causal, config=used, return_lse=True)
        errors = check_forward(q, k, v, out, lse, causal=causal, name=f"S={shape['seq']} causal={causal}", quiet=True)
        impls = {OURS: ours}
        for name, peer in peer_attentions(causal).items():
            impls[name] = lambda peer=peer: peer(q, k, v)
        if shape["seq"] <= include_naive_up_to:
            impls[NAIVE] = lambda: naive_attention(q, k, v, causal)
        for impl, ms in time_side_by_side(impls).items():
            rows.append(dict(impl=impl, dtype=dtype_name, causal=causal, ms=ms, tflops=tflops(flops, ms), **shape))
            if impl == OURS:
                rows[-1].update(errors=errors, config=used._asdict())
        print(f"{dtype_name} D={shape['dim']} causal={causal!s:5} S={shape['seq']:>5}: " + ", ".join(
            f"{r['impl'].split()[0]} {r['tflops']:.0f}" for r in rows[-len(impls):]))
    return rows


def forward_config_sweep(shape=None, dtype_name="float16", causal_options=(False, True),
                         block_Ms=(64, 128), block_Ns=(64, 128), stages=(1, 2, 3), threads=(128, 256),
                         configs=None):
    """TFLOP/s of every forward tiling in the grid, or of ``configs``, each checked before it is timed."""
    shape = shape or comparison_shapes(seq_lens=(4096,))[0]
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    configs = configs or [ForwardConfig(*c) for c in itertools.product(block_Ms, block_Ns, stages, threads)]
    q, k, v = random_inputs(shape, getattr(torch, dtype_name))
    refs = {causal: references(q, k, v, causal=causal) for causal in causal_options}

    def compile_one(config, causal):
        forward_kernel(q, k, causal=causal, config=config)

    def time_one(config, causal):
        out, lse = flash_attention(q, k, v, causal=causal, config=config, return_lse=True)
        errors = check_forward(q, k, v, out, lse, causal=causal, refs=refs[causal], quiet=True)
        ms = time_cuda(lambda: flash_attention(q, k, v, causal=causal, config=config), rep=20)
        return dict(errors=errors, ms=ms, tflops=tflops(attention_flops(b, h, s, s, d, causal=causal), ms),
                    dtype=dtype_name, **shape)

    return sweep(configs, causal_options, compile_one, time_one)
