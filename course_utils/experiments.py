"""The GPU measurements behind the course's records (each returns plain, JSON-ready results).

Notebooks call these through ``bench.measured(name, fn)``; on a CPU machine the stored records
are shown instead. Every function times all implementations it compares in the same process,
on the same inputs, so the numbers are side by side.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention import ForwardConfig, _compiled_forward, flash_attention
from .bench import attention_flops, tflops, time_cuda
from .checks import check_close
from .reference import attention_reference

__all__ = ["RECORDS", "naive_attention", "SDPA_PEERS", "comparison_shapes", "forward_vs_peers",
           "naive_vs_sdpa", "forward_config_sweep"]

SDPA_PEERS = {
    "FlashAttention-2 (SDPA flash)": SDPBackend.FLASH_ATTENTION,
    "cuDNN (SDPA cudnn)": SDPBackend.CUDNN_ATTENTION,
}


def naive_attention(q, k, v, causal=False):
    """Textbook attention in PyTorch: materialises the S×S score matrix in HBM."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def comparison_shapes(seq_lens=(512, 1024, 2048, 4096, 8192, 16384), dim=128, tokens=16384, hidden=2048):
    """The usual comparison shapes: B·S = 16k tokens and H·D = 2048."""
    return [dict(batch=max(1, tokens // s), heads=hidden // dim, seq=s, dim=dim) for s in seq_lens]


def _inputs(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    size = (shape["batch"], shape["heads"], shape["seq"], shape["dim"])
    return [torch.randn(size, device="cuda", dtype=dtype, generator=g) for _ in range(3)]


def _validate_slice(out, q, k, v, causal):
    """Check one (batch, head) slice of ``out`` against the float64 reference, printing the error."""
    ref = attention_reference(q[:1, :1], k[:1, :1], v[:1, :1], causal=causal)
    return check_close(out[:1, :1], ref, f"O[0,0] S={q.shape[2]} causal={causal}", quiet=True)


def forward_vs_peers(shapes=None, dtypes=("float16",), causal_options=(False, True), config=None,
                     include_naive_up_to=4096):
    """TFLOP/s of our forward, SDPA's FlashAttention-2 and cuDNN backends (and naive PyTorch)."""
    rows = []
    for shape, dtype_name, causal in itertools.product(shapes or comparison_shapes(), dtypes, causal_options):
        dtype = getattr(torch, dtype_name)
        q, k, v = _inputs(shape, dtype)
        flops = attention_flops(shape["batch"], shape["heads"], shape["seq"], shape["seq"], shape["dim"],
                                causal=causal)
        ours = lambda: flash_attention(q, k, v, causal=causal, config=config)  # noqa: E731
        err = _validate_slice(ours(), q, k, v, causal)
        impls = {"TileLang (ours)": ours}
        for name, backend in SDPA_PEERS.items():
            impls[name] = lambda backend=backend: _sdpa(q, k, v, causal, backend)
        if shape["seq"] <= include_naive_up_to:
            impls["naive PyTorch"] = lambda: naive_attention(q, k, v, causal)
        for impl, fn in impls.items():
            ms = time_cuda(fn)
            rows.append(dict(impl=impl, dtype=dtype_name, causal=causal, ms=ms, tflops=tflops(flops, ms),
                             max_abs_err=err if impl == "TileLang (ours)" else None, **shape))
        print(f"{dtype_name} causal={causal!s:5} S={shape['seq']:>5}: " + ", ".join(
            f"{r['impl'].split()[0]} {r['tflops']:.0f}" for r in rows[-len(impls):]))
    return rows


def _sdpa(q, k, v, causal, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def naive_vs_sdpa(seq_lens=(256, 512, 1024, 2048, 4096, 8192), batch=4, heads=16, dim=64):
    """Time and peak memory of naive attention vs SDPA (FlashAttention-2 backend), fp16."""
    rows = []
    for seq in seq_lens:
        q, k, v = _inputs(dict(batch=batch, heads=heads, seq=seq, dim=dim), torch.float16)
        flops = attention_flops(batch, heads, seq, seq, dim)
        for impl, fn in {"naive PyTorch": lambda: naive_attention(q, k, v),
                         "SDPA flash": lambda: _sdpa(q, k, v, False, SDPBackend.FLASH_ATTENTION)}.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            ms = time_cuda(fn)
            rows.append(dict(impl=impl, seq=seq, batch=batch, heads=heads, dim=dim, ms=ms,
                             tflops=tflops(flops, ms), peak_extra_bytes=peak))
        print(f"S={seq}: " + ", ".join(f"{r['impl']} {r['ms']:.3f} ms" for r in rows[-2:]))
    return rows


def forward_config_sweep(shape=None, dtype_name="float16", causal_options=(False, True),
                         block_Ms=(64, 128), block_Ns=(64, 128), stages=(1, 2, 3), threads=(128, 256),
                         overlap=(False,), configs=None):
    """TFLOP/s of every tiling in the grid, or of ``configs`` (compiled in parallel, timed one by one)."""
    from tqdm.auto import tqdm

    shape = shape or comparison_shapes(seq_lens=(4096,))[0]
    dims = (shape["batch"], shape["heads"], shape["heads"], shape["seq"], shape["seq"], shape["dim"])
    configs = configs or [ForwardConfig(*c) for c in itertools.product(block_Ms, block_Ns, stages, threads, overlap)]
    jobs = list(itertools.product(configs, causal_options))

    def build(job):
        config, causal = job
        try:
            _compiled_forward(*dims, dtype_name, causal, None, False, 1 / math.sqrt(shape["dim"]), config, "cuda")
            return None
        except Exception as exc:  # a tiling can exceed shared memory or registers
            return f"{type(exc).__name__}: {str(exc).splitlines()[-1][:120]}"

    with ThreadPoolExecutor(8) as pool:
        errors = list(tqdm(pool.map(build, jobs), total=len(jobs), desc="compiling"))
    dtype = getattr(torch, dtype_name)
    q, k, v = _inputs(shape, dtype)
    rows = []
    for (config, causal), error in tqdm(list(zip(jobs, errors)), desc="timing"):
        row = dict(config._asdict(), causal=causal, dtype=dtype_name, **shape)
        if error is None:
            fn = lambda: flash_attention(q, k, v, causal=causal, config=config)  # noqa: E731
            try:
                row["max_abs_err"] = _validate_slice(fn(), q, k, v, causal)
                ms = time_cuda(fn, rep=20)
                row.update(ms=ms, tflops=tflops(attention_flops(*dims[:2], *dims[3:], causal=causal), ms))
            except Exception as exc:
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        row["error"] = error
        rows.append(row)
    return rows


def swizzle_ablation(shape=None, dtype_name="float16"):
    """Forward TFLOP/s with swizzled vs plain row-major shared-memory tiles.

    Hopper's wgmma reads operands only in swizzled layouts, so the comparison uses the Ampere code
    path (sm_80: cp.async, ldmatrix, mma.sync), where TileLang accepts both; the native sm_90a
    kernel is timed alongside for scale. One pipeline stage throughout (see the sm_80 causal bug
    in the notes).
    """
    from .flash_fwd import flash_fwd_kernel
    from .tiles import compile_kernel

    shape = shape or comparison_shapes(seq_lens=(4096,))[0]
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    dtype = getattr(torch, dtype_name)
    q, k, v = _inputs(shape, dtype)
    no_sinks = torch.full((h,), float("-inf"), device="cuda")
    rows = []
    for arch, linear, causal in itertools.product(("sm_80", None), (False, True), (False, True)):
        if arch is None and linear:
            continue  # wgmma rejects row-major operand tiles
        func = flash_fwd_kernel(b, h, s, s, d, causal=causal, dtype=dtype_name, num_stages=1,
                                target="cuda", linear_smem=linear)
        kernel = compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype_name, arch=arch)
        fn = lambda: kernel(q, k, v, no_sinks)  # noqa: E731
        err = _validate_slice(fn()[0], q, k, v, causal)
        ms = time_cuda(fn)
        rows.append(dict(arch=arch or "sm_90a (native)", smem="row-major" if linear else "swizzled",
                         causal=causal, ms=ms, tflops=tflops(attention_flops(b, h, s, s, d, causal=causal), ms),
                         max_abs_err=err, dtype=dtype_name, **shape))
        print(rows[-1]["arch"], rows[-1]["smem"], causal, f"{rows[-1]['tflops']:.0f} TFLOP/s")
    return rows


# The records the notebooks show, by name: ``measured(name, RECORDS[name])`` in a notebook, or
# ``python -m course_utils.experiments NAME ...`` on a GPU machine to refresh them in one go.
RECORDS = {
    "ch01_naive_vs_sdpa_h100": naive_vs_sdpa,
    "ch03_forward_vs_peers_h100": forward_vs_peers,
    "ch04_forward_sweep_h100": forward_config_sweep,
    "ch04_swizzle_h100": swizzle_ablation,
    "ch04_forward_final_h100": lambda: forward_vs_peers(
        shapes=comparison_shapes(dim=64) + comparison_shapes(dim=128), dtypes=("float16", "bfloat16"),
        include_naive_up_to=0),
}

if __name__ == "__main__":
    import sys

    from .bench import save_record

    for name in sys.argv[1:] or RECORDS:
        print(f"== {name}")
        save_record(name, RECORDS[name]())
