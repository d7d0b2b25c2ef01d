"""Chapter 05: the backward kernels, a tiling sweep and the comparison with SDPA's backends.

Each implementation is timed on ``torch.autograd.grad`` of its own forward (the backward alone),
and on a whole training step of attention (forward, then backward). Our gradients are checked on
every head before they are timed.
"""

import itertools

import torch

from ...api.attention import BackwardConfig, backward_kernels, default_backward_config, flash_attention
from ...checking.validation import check_backward, references
from ...core.labels import OURS
from ..bench import attention_flops, tflops, time_cuda, time_side_by_side
from .common import backward_timer, comparison_shapes, empty_query, in_parallel, peer_attentions, random_inputs, sweep

__all__ = ["backward_config_sweep", "backward_vs_peers"]


def _validate(attn, q, k, v, causal, refs=None, name=""):
    """Gradients of ``attn`` on (q, k, v) checked against the float64 reference; returns the errors."""
    grad_fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
    refs = refs or references(q, k, v, d_out=d_out, causal=causal)
    return check_backward(q, k, v, d_out, grad_fn(), causal=causal, refs=refs, name=name, quiet=True), refs


def backward_config_sweep(shape=None, dtype_name="float16", causal_options=(False, True),
                          block_Ms=(32, 64, 128), block_Ns=(64, 128), stages=(1, 2), threads=(128, 256)):
    """TFLOP/s of the backward for every tiling in the grid (forward at its default tiling)."""
    shape = shape or comparison_shapes(seq_lens=(4096,))[0]
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    configs = [BackwardConfig(*c) for c in itertools.product(block_Ms, block_Ns, stages, threads)]
    q, k, v = random_inputs(shape, getattr(torch, dtype_name))
    refs = {}

    def compile_one(config, causal):
        backward_kernels(q, k, causal=causal, config=config)

    def time_one(config, causal):
        attn = lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal, backward_config=config)  # noqa: E731
        errors, refs[causal] = _validate(attn, q, k, v, causal, refs.get(causal))
        ms = time_cuda(backward_timer(attn, q, k, v)[0], rep=20)
        return dict(errors=errors, ms=ms, dtype=dtype_name, **shape,
                    tflops=tflops(attention_flops(b, h, s, s, d, causal=causal, mode="bwd"), ms))

    return sweep(configs, causal_options, compile_one, time_one)


def _training_step(attn, q, k, v, seed=1):
    """A function running one forward and one backward of ``attn`` (what a training step does)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    generator = torch.Generator(device=q.device).manual_seed(seed)
    d_out = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=generator)
    return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), d_out)


def backward_vs_peers(shapes=None, dtypes=("float16",), causal_options=(False, True), config=None,
                      modes=("bwd", "fwd+bwd")):
    """Backward and forward+backward TFLOP/s of ours vs SDPA's FlashAttention-2 and cuDNN (and FlashAttention-4
    where it is installed), side by side.

    Ours is ``flash_attention`` as it runs by default (``config`` sets the backward tiling only).
    ``modes``: what is timed, the backward alone ("bwd") and a whole training step ("fwd+bwd").
    """
    rows = []
    jobs = list(itertools.product(shapes or comparison_shapes(), dtypes, causal_options))

    def build(job):
        shape, dtype_name, causal = job
        q = empty_query(shape, dtype_name)
        flash_attention(q, q, q, causal=causal)  # compiles the forward
        backward_kernels(q, q, causal=causal, config=config)

    in_parallel(build, jobs)
    for shape, dtype_name, causal in jobs:
        q, k, v = random_inputs(shape, getattr(torch, dtype_name))
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        attns = {OURS: lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal, backward_config=config)}
        attns.update(peer_attentions(causal))
        errors, _ = _validate(attns[OURS], q, k, v, causal, name=f"S={s} causal={causal}")
        timers = {"bwd": lambda a: backward_timer(a, q, k, v)[0], "fwd+bwd": lambda a: _training_step(a, q, k, v)}
        for mode, make in ((mode, timers[mode]) for mode in modes):
            flops = attention_flops(b, h, s, s, d, causal=causal, mode=mode)
            for impl, ms in time_side_by_side({impl: make(attn) for impl, attn in attns.items()}).items():
                rows.append(dict(impl=impl, mode=mode, dtype=dtype_name, causal=causal, ms=ms,
                                 tflops=tflops(flops, ms), **shape))
                if impl == OURS:
                    used = config or default_backward_config("cuda", d, causal)
                    rows[-1].update(errors=errors, config=used._asdict())
            print(f"{mode} {dtype_name} D={d} causal={causal!s:5} S={s:>5}: " + ", ".join(
                f"{r['impl'].split()[0]} {r['tflops']:.0f}" for r in rows[-len(attns):]))
    return rows
