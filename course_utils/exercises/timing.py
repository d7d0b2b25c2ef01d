"""The learner's kernels timed next to the course's ``flash_attention`` and SDPA's backends.

``time_your_forward(factory, record=...)``: on a GPU, compile the learner's kernel factory (chapter 03
exercise (d)'s signature: ``factory(batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, target)``
returning a float32 ``(Q, K, V, O, LSE)`` prim_func) for CUDA at a real size, check every result against
the float64 reference, then time all of them in one call of ``bench.time_side_by_side``.

``time_your_training(fn, record=...)``: the same for one training step, forward then backward, of the
learner's differentiable attention (chapter 05 exercise (g)'s ``my_flash_attention(q, k, v, causal)``, whose
kernels ``ch05.compiled`` builds for CUDA when it is called with GPU tensors); O and the three gradients of
every implementation are checked first.

Without a GPU, both show the stored record of the course's kernel and say in one line what the learner's
would meet.
"""

import contextlib

import torch

from ..core.device import HAS_GPU
from ..core.labels import OURS
from ..measure.bench import attention_flops, tflops, time_side_by_side
from .common import needs

__all__ = ["time_your_forward", "time_your_training", "TIMED_SHAPE"]

TIMED_SHAPE = dict(batch=4, heads=16, seq=2048, dim=128)  # B·S = 8k tokens; float32 64 × 64 tiles fit shared memory


def _stored(record, *, mode=None, yours="your kernel", timed="it"):
    """The record's fp16 rows (of ``mode``, when given) nearest ``TIMED_SHAPE``, and one line on the GPU run."""
    from ..checking.checks import check_true
    from ..checking.validation import check_stored_errors
    from ..measure.bench import measured
    from ..measure.benchmarks import RECORDS

    rec = measured(record, RECORDS[record])
    rows = [r for r in rec["results"] if r.get("tflops") and r.get("dtype", "float16") == "float16"
            and (mode is None or r.get("mode") == mode)]
    check_true(bool(rows), f"the record {record} has fp16 rows" + (f" of mode {mode}" if mode else ""))
    seq = min({r["seq"] for r in rows}, key=lambda s: abs(s - TIMED_SHAPE["seq"]))
    dim = min({r["dim"] for r in rows}, key=lambda d: abs(d - TIMED_SHAPE["dim"]))
    shown = [r for r in rows if r["seq"] == seq and r["dim"] == dim]
    check_true(bool(shown), f"the record {record} has rows at S={seq}, D={dim}")
    check_stored_errors(shown, f"{record}: the rows shown")
    for r in shown:
        print(f"   {r['impl'][:40]:40} causal={r['causal']!s:5} S={seq:>6} D={dim}: {r['tflops']:4.0f} TFLOP/s")
    print(f"On a GPU this cell compiles {yours} for CUDA and times {timed} at B={TIMED_SHAPE['batch']}, "
          f"H={TIMED_SHAPE['heads']}, S={TIMED_SHAPE['seq']}, D={TIMED_SHAPE['dim']} (float32) next to "
          f"{OURS} (flash_attention, fp16) and SDPA's FlashAttention-2 and cuDNN, each checked first.")
    return rec


def _timed(impls, flops):
    """Time ``impls`` side by side and print each one's milliseconds and TFLOP/s."""
    from ..core.device import machine_info

    info = machine_info()
    ms = time_side_by_side(impls)
    print(f"[timed live: {info.get('gpu')}, {info['date']}] (no record: this run only)")
    for name, t in ms.items():
        print(f"   {name:32} {t:7.3f} ms  {tflops(flops, t):5.0f} TFLOP/s")
    return ms


def time_your_forward(factory, *, record, causal=True, block_M=64, block_N=64):
    """Time the learner's ``factory`` against the course's kernel and SDPA's peers (GPU), or show ``record``."""
    if not HAS_GPU:
        return _stored(record)
    from ..api.attention import flash_attention
    from ..checking.validation import check_forward, references
    from ..kernels.tiles import compile_kernel
    from ..measure.benchmarks.common import SDPA_PEERS, sdpa

    b, h, s, d = (TIMED_SHAPE[key] for key in ("batch", "heads", "seq", "dim"))
    prim_func = factory(b, h, s, s, d, causal=causal, block_M=block_M, block_N=block_N, target="cuda")
    in_dtype = str(prim_func.buffer_map[prim_func.params[0]].dtype)  # float32 (yours), fp16 (the course's stand-in)
    yours = f"your kernel ({in_dtype})"
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))
    qy, ky, vy = (t.to(getattr(torch, in_dtype)) for t in (q, k, v))
    kernel = compile_kernel(prim_func, out_idx=[3, 4], target="cuda", dtype=in_dtype)
    out, lse = kernel(qy, ky, vy)
    refs = references(q, k, v, causal=causal)  # the inputs are fp16 values, exact in float32 too
    # On the tensor cores float32 tiles run as TF32 (fp16's 10-bit mantissa): O is held to the fp16 criterion.
    check_forward(q, k, v, out.to(q.dtype), lse, causal=causal, refs=refs, name=f"{yours}, S={s}, D={d}")
    ours, ours_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    check_forward(q, k, v, ours, ours_lse, causal=causal, refs=refs, name=f"{OURS}, fp16")
    impls = {yours: lambda: kernel(qy, ky, vy), OURS: lambda: flash_attention(q, k, v, causal=causal)}
    for name, backend in SDPA_PEERS.items():
        check_forward(q, k, v, sdpa(q, k, v, causal, backend), causal=causal, refs=refs, name=f"{name}, fp16")
        impls[name] = lambda backend=backend: sdpa(q, k, v, causal, backend)
    return _timed(impls, attention_flops(b, h, s, s, d, causal=causal))


def time_your_training(fn, *, record, causal=True):
    """Time one training step (forward, then backward) of the learner's ``fn(q, k, v, causal) -> O`` against the
    course's ``flash_attention`` and SDPA's peers (GPU: each one's O and gradients checked first), or show
    ``record``'s forward+backward rows."""
    if not HAS_GPU:
        return _stored(record, mode="fwd+bwd", yours="your four kernels (exercises 03 (d), 05 (d)–(f))",
                       timed="one training step (forward, then backward)")
    from ..api.attention import flash_attention
    from ..checking.validation import references
    from ..measure.benchmarks.common import SDPA_PEERS, sdpa

    b, h, s, d = (TIMED_SHAPE[key] for key in ("batch", "heads", "seq", "dim"))
    torch.manual_seed(0)
    q, k, v, d_out = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(4))
    refs = references(q, k, v, d_out=d_out, causal=causal)  # fp16 values, exact in float32 too
    yours = "your kernels (float32)"
    attns = {yours: lambda q_, k_, v_: fn(q_, k_, v_, causal),
             OURS: lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal)}
    for name, backend in SDPA_PEERS.items():
        attns[name] = lambda q_, k_, v_, backend=backend: sdpa(q_, k_, v_, causal, backend)
    steps = {}
    for name, attn in attns.items():
        with needs("my_flash_attention", "exercises 05 (d)–(g)") if name == yours else contextlib.nullcontext():
            steps[name] = _checked_step(name, attn, q, k, v, d_out, refs, causal=causal, float32=name == yours)
    return _timed(steps, attention_flops(b, h, s, s, d, causal=causal, mode="fwd+bwd"))


def _checked_step(name, attn, q, k, v, d_out, refs, *, causal, float32):
    """``attn``'s O and gradients on (q, k, v) checked against ``refs``, then a training step of it to time."""
    from ..checking.validation import check_backward, check_forward
    from ..measure.benchmarks.ch05_backward import _training_step

    dtype = torch.float32 if float32 else q.dtype
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = attn(*leaves)
    grads = torch.autograd.grad(out, leaves, d_out.to(dtype))
    # Float32 tiles run as TF32 on the tensor cores (fp16's 10-bit mantissa): float32 results are held to the
    # fp16 criterion, rounded to fp16 as the others are.
    label = f"{name}, S={q.shape[2]}, D={q.shape[3]}"
    check_forward(q, k, v, out.detach().to(q.dtype), causal=causal, refs=refs, name=label)
    check_backward(q, k, v, d_out, [g.to(q.dtype) for g in grads], causal=causal, refs=refs, name=label)
    return _training_step(attn, *(t.to(dtype) for t in (q, k, v)))
