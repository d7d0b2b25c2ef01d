"""What every benchmark shares: the usual shapes, random inputs, the SDPA peers, compiling ahead of
timing, a runner for tiling sweeps and one for the ablations (chapter 07's forward, chapter 08's backward)."""

import itertools
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...core.labels import CUDNN, FA2, FA4
from ..bench import attention_flops, tflops, time_side_by_side

__all__ = ["SDPA_PEERS", "sdpa", "flash_attention_4", "quiet_flash_attention_4_compiles", "peer_attentions",
           "comparison_shapes", "random_inputs", "empty_query", "in_parallel", "sweep", "backward_timer",
           "AblationCase", "ablation"]

SDPA_PEERS = {FA2: SDPBackend.FLASH_ATTENTION, CUDNN: SDPBackend.CUDNN_ATTENTION}


def sdpa(q, k, v, causal, backend):
    """PyTorch's scaled_dot_product_attention, forced onto one backend."""
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def flash_attention_4():
    """FlashAttention-4's ``flash_attn_func`` taking q, k, v as [B, H, S, D] like SDPA, or None where
    ``flash-attn-4`` is not installed. Its own layout is [B, S, H, D]; the transposes are views (it keeps
    any strides whose last is 1), so nothing is copied inside what is timed.

    ``window`` is the course's (each query sees its last ``window`` keys, itself included), which is
    FlashAttention's ``window_size=(window - 1, 0)``; ``sinks`` are gpt-oss's logits, its ``learnable_sink``.
    """
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    quiet_flash_attention_4_compiles()

    def attention(q, k, v, causal, window=None, sinks=None):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                              window_size=(None, None) if window is None else (window - 1, 0), learnable_sink=sinks)
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return attention


def quiet_flash_attention_4_compiles():
    """FlashAttention-4 4.0.0b36's CuTe DSL warns at each first compile that an argument (``aux_data``) cannot
    be a JIT argument: noise about the peer's own build, printed into notebooks with its install path."""
    warnings.filterwarnings("ignore", message=r"Argument aux_data \(position \d+\) cannot be converted to a "
                                              r"JitArgument")


def peer_attentions(causal):
    """The fast peers a user can install, each as ``f(q, k, v)`` on [B, H, S, D]: SDPA's FlashAttention-2
    and cuDNN backends, and FlashAttention-4 where it is installed."""
    peers = {name: (lambda q, k, v, b=backend: sdpa(q, k, v, causal, b)) for name, backend in SDPA_PEERS.items()}
    fa4 = flash_attention_4()
    if fa4 is not None:
        peers[FA4] = lambda q, k, v: fa4(q, k, v, causal)
    return peers


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


class AblationCase(NamedTuple):
    """One (shape, mask) of an ablation, as one direction runs it: ``check(kernel, name)`` runs a built
    version once and returns its errors against the reference; ``run(kernel)`` is what is timed;
    ``peers`` the SDPA backends' timed functions on the same inputs."""

    check: object
    run: object
    peers: dict


def _failure(exc, line=-1):
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[line][:160]}"


def ablation(cases, versions_for, prepare, *, mode, dtype_name="float16", seq=4096):
    """Every version of an ablation at every (head dim, causal) of ``cases``: checked on every head, then
    timed side by side with FlashAttention-2 and cuDNN. One runner for both directions.

    ``versions_for(causal, dim)``: the versions (``kernels.versions.Version``) timed in a case; every one
    is compiled first, in parallel. ``prepare(shape, causal)`` -> ``AblationCase``: the direction's inputs,
    check and peers. ``mode``: "fwd" or "bwd" (the FLOP count). A version that fails to build or
    to check is a row with its ``error``, not the end of the run.
    """
    rows = []
    cases = list(cases)
    jobs = [(dim, causal, v) for dim, causal in cases for v in versions_for(causal, dim)]

    def build(job):
        dim, causal, version = job
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        try:
            return version.build(shape["batch"], shape["heads"], seq, dim, causal=causal, dtype=dtype_name), None
        except Exception as exc:  # a variant can run out of registers or shared memory
            return None, _failure(exc)

    built = dict(zip([(d, c, v.number) for d, c, v in jobs], in_parallel(build, jobs)))
    for dim, causal in cases:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
        case = prepare(shape, causal)
        impls, errors, versions = {}, {}, {}
        for version in versions_for(causal, dim):
            (kernel, error), label = built[dim, causal, version.number], version.label
            if error is None:
                try:
                    errors[label] = case.check(kernel, f"version {version.number}")
                except Exception as exc:  # a wrong variant is a row of the record
                    error = _failure(exc, 0)
            if error is not None:
                rows.append(dict(impl=label, version=version.number, kept=version.kept, causal=causal,
                                 dtype=dtype_name, error=error, **shape))
                print(f"D={d} causal={causal!s:5} {label:60} failed: {error}")
                continue
            impls[label], versions[label] = case.run(kernel), version
        impls.update(case.peers)
        del case  # the references are not needed while timing
        flops = attention_flops(b, h, s, s, d, causal=causal, mode=mode)
        for impl, ms in time_side_by_side(impls).items():
            version = versions.get(impl)
            rows.append(dict(impl=impl, causal=causal, dtype=dtype_name, ms=ms, tflops=tflops(flops, ms),
                             errors=errors.get(impl), version=version and version.number,
                             kept=version and version.kept, error=None, **shape))
            print(f"D={d} causal={causal!s:5} {impl:60} {rows[-1]['tflops']:6.0f} TFLOP/s")
    return rows
