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

import tilelang

from .attention import (TUNED_FORWARD_CONFIG, BackwardConfig, ForwardConfig,
                        _compiled_backward, _compiled_forward, _no_sinks, default_backward_config,
                        default_forward_config, flash_attention)
from .bench import attention_flops, save_record, tflops, time_cuda, time_side_by_side
from .checks import check_close
from .flash_fwd import flash_fwd_kernel
from .flash_fwd_hopper import flash_fwd_hopper_kernel
from .reference import attention_reference
from .tiles import compile_kernel

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


def _precompile(jobs, *, backward=False, fwd_config=None, bwd_config=None):
    """Compile our kernels for every (shape, dtype, causal) job in parallel before timing starts."""
    def build(job):
        shape, dtype_name, causal = job
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        common = (b, h, h, s, s, d, dtype_name, causal, None)
        config = fwd_config or default_forward_config("cuda", d, causal)
        _compiled_forward(*common, False, 1 / math.sqrt(d), config, "cuda")
        if backward:
            _compiled_backward(*common, 1 / math.sqrt(d), bwd_config or default_backward_config("cuda", d), "cuda")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(build, jobs))


def forward_vs_peers(shapes=None, dtypes=("float16",), causal_options=(False, True), config=None,
                     include_naive_up_to=4096):
    """TFLOP/s of our forward, SDPA's FlashAttention-2 and cuDNN backends (and naive PyTorch)."""
    rows = []
    jobs = list(itertools.product(shapes or comparison_shapes(), dtypes, causal_options))
    _precompile(jobs, fwd_config=config)
    for shape, dtype_name, causal in jobs:
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
        for impl, ms in time_side_by_side(impls).items():
            rows.append(dict(impl=impl, dtype=dtype_name, causal=causal, ms=ms, tflops=tflops(flops, ms),
                             max_abs_err=err if impl == "TileLang (ours)" else None, **shape))
            if impl == "TileLang (ours)":
                rows[-1]["config"] = (config or default_forward_config("cuda", shape["dim"], causal))._asdict()
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


def _sweep(configs, causal_options, compile_one, time_one):
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


def forward_config_sweep(shape=None, dtype_name="float16", causal_options=(False, True),
                         block_Ms=(64, 128), block_Ns=(64, 128), stages=(1, 2, 3), threads=(128, 256),
                         configs=None):
    """TFLOP/s of every forward tiling in the grid, or of ``configs``."""
    shape = shape or comparison_shapes(seq_lens=(4096,))[0]
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    configs = configs or [ForwardConfig(*c) for c in itertools.product(block_Ms, block_Ns, stages, threads)]
    q, k, v = _inputs(shape, getattr(torch, dtype_name))

    def compile_one(config, causal):
        _compiled_forward(b, h, h, s, s, d, dtype_name, causal, None, False, 1 / math.sqrt(d), config, "cuda")

    def time_one(config, causal):
        fn = lambda: flash_attention(q, k, v, causal=causal, config=config)  # noqa: E731
        err = _validate_slice(fn(), q, k, v, causal)
        ms = time_cuda(fn, rep=20)
        return dict(max_abs_err=err, ms=ms, tflops=tflops(attention_flops(b, h, s, s, d, causal=causal), ms),
                    dtype=dtype_name, **shape)

    return _sweep(configs, causal_options, compile_one, time_one)


def _backward_timer(attn, q, k, v, seed=1):
    """A function timing only the backward of ``attn(q, k, v)`` (the forward graph is kept)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn(q, k, v)
    d_out = torch.randn(out.shape, device=out.device, dtype=out.dtype,
                        generator=torch.Generator(device=out.device).manual_seed(seed))
    return (lambda: torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)), (q, k, v, d_out)


def _validate_grads_slice(grads, q, k, v, d_out, causal):
    """Check dQ, dK, dV of batch 0 / head 0 against autograd through the float64 reference."""
    q0, k0, v0 = (t[:1, :1].detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q0, k0, v0, causal=causal, compute_dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q0, k0, v0), d_out[:1, :1].double())
    return max(check_close(g[:1, :1], r.to(g.dtype), f"{n} S={q.shape[2]} causal={causal}",
                           dtype=g.dtype, atol=2e-2, rtol=2e-2, quiet=True)
               for n, g, r in zip(("dQ", "dK", "dV"), grads, ref_grads))


def backward_config_sweep(shape=None, dtype_name="float16", causal_options=(False, True),
                          block_Ms=(32, 64, 128), block_Ns=(64, 128), stages=(1, 2), threads=(128, 256)):
    """TFLOP/s of the backward for every tiling in the grid (forward at its default tiling)."""
    shape = shape or comparison_shapes(seq_lens=(4096,))[0]
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    configs = [BackwardConfig(*c) for c in itertools.product(block_Ms, block_Ns, stages, threads)]
    q, k, v = _inputs(shape, getattr(torch, dtype_name))

    def compile_one(config, causal):
        _compiled_backward(b, h, h, s, s, d, dtype_name, causal, None, 1 / math.sqrt(d), config, "cuda")

    def time_one(config, causal):
        fn, (qg, kg, vg, d_out) = _backward_timer(
            lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal, backward_config=config), q, k, v)
        err = _validate_grads_slice(fn(), qg, kg, vg, d_out, causal)
        ms = time_cuda(fn, rep=20)
        return dict(max_abs_err=err, ms=ms, dtype=dtype_name, **shape,
                    tflops=tflops(attention_flops(b, h, s, s, d, causal=causal, mode="bwd"), ms))

    return _sweep(configs, causal_options, compile_one, time_one)


def backward_vs_peers(shapes=None, dtypes=("float16",), causal_options=(False, True), config=None):
    """Backward TFLOP/s of ours vs SDPA's FlashAttention-2 and cuDNN backends, side by side."""
    rows = []
    jobs = list(itertools.product(shapes or comparison_shapes(), dtypes, causal_options))
    _precompile(jobs, backward=True, bwd_config=config)
    for shape, dtype_name, causal in jobs:
        q, k, v = _inputs(shape, getattr(torch, dtype_name))
        flops = attention_flops(shape["batch"], shape["heads"], shape["seq"], shape["seq"], shape["dim"],
                                causal=causal, mode="bwd")
        ours, (qg, kg, vg, d_out) = _backward_timer(
            lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal, backward_config=config), q, k, v)
        err = _validate_grads_slice(ours(), qg, kg, vg, d_out, causal)
        impls = {"TileLang (ours)": ours}
        for name, backend in SDPA_PEERS.items():
            impls[name] = _backward_timer(lambda q_, k_, v_, b_=backend: _sdpa(q_, k_, v_, causal, b_), q, k, v)[0]
        for impl, ms in time_side_by_side(impls).items():
            rows.append(dict(impl=impl, dtype=dtype_name, causal=causal, ms=ms, tflops=tflops(flops, ms),
                             max_abs_err=err if impl == "TileLang (ours)" else None, **shape))
            if impl == "TileLang (ours)":
                rows[-1]["config"] = (config or default_backward_config("cuda", shape["dim"]))._asdict()
        print(f"bwd {dtype_name} D={shape['dim']} causal={causal!s:5} S={shape['seq']:>5}: " + ", ".join(
            f"{r['impl'].split()[0]} {r['tflops']:.0f}" for r in rows[-len(impls):]))
    return rows


GPT_OSS_SHAPE = dict(batch=1, heads=64, heads_kv=8, seq=4096, dim=64, window=128)


def _gpt_oss_inputs(shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, hkv, s, d = (shape[x] for x in ("batch", "heads", "heads_kv", "seq", "dim"))
    q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g)
    return q, k, v, sinks


def gpt_oss_vs_peers(shape=None, dims=(64, 128)):
    """gpt-oss attention (GQA 64/8, sinks, full causal and 128-token window layers), fwd and bwd.

    Peers: the naive PyTorch reference with sinks (float32 math), and SDPA's FlashAttention-2
    and cuDNN backends *without* sinks or windows, on K/V expanded to 64 heads — an upper bound
    of what a sink-free kernel does on the causal layers.
    """
    rows = []
    for dim, window in itertools.product(dims, (None, (shape or GPT_OSS_SHAPE)["window"])):
        sh = dict(shape or GPT_OSS_SHAPE, dim=dim)
        q, k, v, sinks = _gpt_oss_inputs(sh)
        b, h, s = sh["batch"], sh["heads"], sh["seq"]
        flops = attention_flops(b, h, s, s, dim, causal=True, window_size=window)
        impls = {
            "TileLang (ours)": lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=True, window_size=window,
                                                                  sinks=sinks),
            "naive PyTorch": lambda q_, k_, v_: attention_reference(q_, k_, v_, causal=True, window_size=window,
                                                                    sinks=sinks, compute_dtype=torch.float32),
        }
        if window is None:
            group = h // sh["heads_kv"]
            for name, backend in SDPA_PEERS.items():
                impls[name + ", no sinks"] = lambda q_, k_, v_, b_=backend: _sdpa(
                    q_, k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1), True, b_)
        ref = attention_reference(q[:, :8], k[:, :1], v[:, :1], causal=True, window_size=window, sinks=sinks[:8])
        err = check_close(flash_attention(q, k, v, causal=True, window_size=window, sinks=sinks)[:, :8], ref,
                          f"gpt-oss O D={dim} window={window}", quiet=True)
        fwd_ms = time_side_by_side({impl: (lambda a=attn: a(q, k, v)) for impl, attn in impls.items()})
        bwd_ms = time_side_by_side({impl: _backward_timer(attn, q, k, v)[0] for impl, attn in impls.items()})
        for impl in impls:
            for mode, ms in (("fwd", fwd_ms[impl]), ("bwd", bwd_ms[impl])):
                rows.append(dict(sh, impl=impl, mode=mode, window=window, ms=ms,
                                 max_abs_err=err if "ours" in impl else None,
                                 tflops=tflops(flops * (2.5 if mode == "bwd" else 1.0), ms)))
            print(f"gpt-oss D={dim} window={window} {impl}: fwd {rows[-2]['tflops']:.0f}, bwd {rows[-1]['tflops']:.0f}")
    return rows


def gqa_backward_strategies(shape=None):
    """dK/dV for GQA: atomic adds into the shared K/V head vs a per-query-head pass then a sum."""
    sh = dict(shape or GPT_OSS_SHAPE, window=None)  # the full-causal layers
    q, k, v, sinks = _gpt_oss_inputs(sh)
    group = sh["heads"] // sh["heads_kv"]
    b, h, s, d = sh["batch"], sh["heads"], sh["seq"], sh["dim"]

    def split_then_sum(q_, k_, v_):
        k_rep, v_rep = k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1)
        return flash_attention(q_, k_rep, v_rep, causal=True, sinks=sinks)  # autograd sums the repeats

    atomic = lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=True, sinks=sinks)  # noqa: E731
    rows, grads = [], {}
    for name, attn in (("atomic adds", atomic), ("split then sum", split_then_sum)):
        fn, _ = _backward_timer(attn, q, k, v)
        grads[name] = fn()
        ms = time_cuda(fn)
        rows.append(dict(strategy=name, ms=ms, tflops=tflops(attention_flops(b, h, s, s, d, causal=True, mode="bwd"), ms),
                         **sh))
        print(f"GQA backward, {name}: {ms:.3f} ms")
    for n, a, c in zip(("dQ", "dK", "dV"), grads["atomic adds"], grads["split then sum"]):
        check_close(a, c, f"{n}: atomic vs split", atol=2e-2, rtol=2e-2)
    return rows


_NO_TMA_NO_WS = {tilelang.PassConfigKey.TL_DISABLE_TMA_LOWER: True,
                 tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def ablation_steps(causal):
    """Chapter 07's ablation: (label, kernel, kernel options, compile options).

    Each unindented row adds one change to the row above it; indented rows in parentheses are
    variations of the row above them that the final kernel does not keep. "sync" is chapter 03/04's
    kernel, "overlap" chapter 07's. Tiles are 128×128 unless a row says otherwise; 256 consumer threads.
    """
    # TileLang 0.1.15 cannot lower cp.async + causal + 2 stages on sm_90 ("Downcast from tirx.Sub").
    plain_stages = 1 if causal else 2
    steps = [
        ("cp.async loads, no warp specialisation, exact exp2", "sync", dict(num_stages=plain_stages),
         dict(fast_math=False, pass_configs=_NO_TMA_NO_WS)),
        ("+ fast exp2 (ex2.approx)", "sync", dict(num_stages=plain_stages), dict(pass_configs=_NO_TMA_NO_WS)),
        ("+ TMA loads, producer warpgroup, setmaxnreg", "sync", dict(num_stages=2), {}),
        ("  (chapter 04's tuning: 1 stage)", "sync", dict(num_stages=1), {}),
        ("+ softmax overlapped with async wgmma", "overlap", dict(num_stages=2), {}),
        ("  (with 128 × 192 tiles)", "overlap", dict(num_stages=2, block_N=192), {}),
        ("  (with ping-pong between the warpgroups)", "overlap", dict(num_stages=2, pingpong=True), {}),
        ("  (with rescales skipped under 2^8)", "overlap", dict(num_stages=2, rescale_threshold=8.0), {}),
    ]
    if causal:
        steps.append(("  (with light query blocks first)", "overlap", dict(num_stages=2, heavy_first=False), {}))
    return steps


def _compile_step(shape, dtype_name, causal, step):
    _, kernel, knobs, options = step
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    tiling = dict(dict(block_M=128, block_N=128, threads=256), **knobs)
    if kernel == "overlap":
        func = flash_fwd_hopper_kernel(b, h, s, s, d, causal=causal, dtype=dtype_name, **tiling)
    else:
        func = flash_fwd_kernel(b, h, s, s, d, causal=causal, dtype=dtype_name, target="cuda", **tiling)
    return compile_kernel(func, out_idx=[4, 5], target="cuda", dtype=dtype_name, **options)


def forward_ablation(dims=(128, 64), dtype_name="float16", causal_options=(False, True)):
    """TFLOP/s of every ablation step, validated, timed side by side with FlashAttention-2 and cuDNN."""
    rows = []
    for dim in dims:
        shape = comparison_shapes(seq_lens=(4096,), dim=dim)[0]
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        q, k, v = _inputs(shape, getattr(torch, dtype_name))
        no_sinks = _no_sinks(h, q.device)
        for causal in causal_options:
            steps = ablation_steps(causal)
            with ThreadPoolExecutor(8) as pool:
                kernels = list(pool.map(lambda step: _compile_step(shape, dtype_name, causal, step), steps))
            impls, errors = {}, {}
            for (label, *_), kernel in zip(steps, kernels):
                impls[label] = lambda kernel=kernel: kernel(q, k, v, no_sinks)
                errors[label] = _validate_slice(impls[label]()[0], q, k, v, causal)
            for name, backend in SDPA_PEERS.items():
                impls[name] = lambda backend=backend: _sdpa(q, k, v, causal, backend)
            flops = attention_flops(b, h, s, s, d, causal=causal)
            for impl, ms in time_side_by_side(impls).items():
                rows.append(dict(impl=impl, causal=causal, dtype=dtype_name, ms=ms, tflops=tflops(flops, ms),
                                 max_abs_err=errors.get(impl), step=impl in errors, **shape))
                print(f"D={d} causal={causal!s:5} {impl:55} {rows[-1]['tflops']:6.0f} TFLOP/s")
    return rows


# The records the notebooks show, by name: ``measured(name, RECORDS[name])`` in a notebook, or
# ``python -m course_utils.experiments NAME ...`` on a GPU machine to refresh them in one go.
RECORDS = {
    "ch01_naive_vs_sdpa_h100": naive_vs_sdpa,
    "ch03_forward_vs_peers_h100": lambda: forward_vs_peers(config=TUNED_FORWARD_CONFIG),
    "ch04_forward_sweep_h100": forward_config_sweep,
    "ch05_backward_sweep_h100": backward_config_sweep,
    "ch05_backward_vs_peers_h100": lambda: backward_vs_peers(
        shapes=comparison_shapes(dim=64) + comparison_shapes(dim=128)),
    "ch06_gpt_oss_h100": gpt_oss_vs_peers,
    "ch06_gqa_backward_h100": gqa_backward_strategies,
    "ch04_forward_final_h100": lambda: forward_vs_peers(
        shapes=comparison_shapes(dim=64) + comparison_shapes(dim=128), dtypes=("float16", "bfloat16"),
        include_naive_up_to=0, config=TUNED_FORWARD_CONFIG),
    "ch07_forward_ablation_h100": forward_ablation,
    "ch07_overlap_sweep_h100": lambda: [
        row for dim, tilings in ((128, [(128, False), (176, False), (192, False)]),
                                 (64, [(128, False), (192, False), (128, True), (192, True)]))
        for row in forward_config_sweep(
            shape=comparison_shapes(seq_lens=(4096,), dim=dim)[0],
            configs=[ForwardConfig(128, n, 2, 256, overlap=True, pingpong=pp) for n, pp in tilings])],
    "ch07_forward_vs_peers_h100": lambda: forward_vs_peers(
        shapes=comparison_shapes(seq_lens=(1024, 2048, 4096, 8192, 16384), dim=64)
        + comparison_shapes(seq_lens=(1024, 2048, 4096, 8192, 16384), dim=128),
        dtypes=("float16", "bfloat16"), include_naive_up_to=0),
}

if __name__ == "__main__":
    import sys

    for name in sys.argv[1:] or RECORDS:
        print(f"== {name}")
        save_record(name, RECORDS[name]())
