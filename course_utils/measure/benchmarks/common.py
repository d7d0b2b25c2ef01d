"""What every benchmark shares: the usual shapes, random inputs, the SDPA peers, compiling ahead of
timing, and a runner for tiling sweeps."""

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...core.labels import CUDNN, FA2

__all__ = ["SDPA_PEERS", "sdpa", "comparison_shapes", "random_inputs", "empty_query", "in_parallel", "sweep",
           "backward_timer"]

SDPA_PEERS = {FA2: SDPBackend.FLASH_ATTENTION, CUDNN: SDPBackend.CUDNN_ATTENTION}


def sdpa(q, k, v, causal, backend):
    """PyTorch's scaled_dot_product_attention, forced onto one backend."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def comparison_shapes(seq_lens=(512, 1024, 2048, 4096, 8192, 16384), dim=128, tokens=16384, hidden=2048):
    """The usual comparison shapes: B·S = 16k tokens and H·D = 2048."""
    return [dict(batch=max(1, tokens // s), heads=hidden // dim, seq=s, dim=dim) for s in seq_lens]


def random_inputs(shape, dtype, seed=0):
    """Q, K, V of ``shape`` (a dict with batch, heads, seq, dim) on the GPU, standard normal."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    size = (shape["batch"], shape["heads"], shape["seq"], shape["dim"])
    return [torch.randn(size, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def empty_query(shape, dtype_name):
    """An uninitialised q of ``shape`` on the GPU: enough to compile the kernels for that shape."""
    size = (shape["batch"], shape["heads"], shape["seq"], shape["dim"])
    return torch.empty(size, device="cuda", dtype=getattr(torch, dtype_name))


def in_parallel(fn, jobs, workers=8):
    """``[fn(job) for job in jobs]``, run in threads: TileLang compiles release the GIL."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, jobs))


def sweep(configs, causal_options, compile_one, time_one):
    """Compile every (config, causal) job in parallel, then validate and time them one by one."""
    from tqdm.auto import tqdm

    jobs = list(itertools.product(configs, causal_options))

    def build(job):
        try:
            compile_one(*job)
            return None
        except Exception as exc:  # a tiling can exceed shared memory or registers
            return f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]}"

    with ThreadPoolExecutor(8) as pool:
        errors = list(tqdm(pool.map(build, jobs), total=len(jobs), desc="compiling"))
    rows = []
    for (config, causal), error in tqdm(list(zip(jobs, errors)), desc="timing"):
        row = dict(config._asdict(), causal=causal)
        if error is None:
            try:
                row.update(time_one(config, causal))
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]}"
        row["error"] = error
        rows.append(row)
    return rows


def backward_timer(attn, q, k, v, seed=1):
    """A function timing only the backward of ``attn(q, k, v)`` (the forward graph is kept)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v)
    d_out = torch.randn(out.shape, device=out.device, dtype=out.dtype,
                        generator=torch.Generator(device=out.device).manual_seed(seed))
    return (lambda: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)), (q, k, v, d_out)
