"""Shared pieces of the course's device A/B scripts (notes/*_ab_*.py), so each script holds only its question.

``machine()`` says what ran; ``packed_batch(lengths, ...)`` makes a packed batch's cu_seqlens and inputs;
``blocks(fns, ...)`` times interleaved rounds in several blocks and prints each block's milliseconds and the ratios
to a baseline; ``compile_jobs(build, jobs, ...)`` compiles in threads and keeps the failures; ``forward_checked(...)``
checks a forward on every batch element and head, recording a failure instead of raising; ``save(path, **parts)``
rewrites one JSON file after every part, so a call cut off by its time limit still returns what it measured.
``forward_variants_against_peers(...)`` is the forward A/B of several scripts: the shipped ``flash_attention``,
compiled variants (each checked first) and SDPA's cuDNN and FA2 on B·S = 16k tokens.
``gpu_and_host_ms(call)`` is one call's milliseconds back to back (CUDA events) and on the host alone (issued without
a sync).
"""
import itertools
import json
import time

import torch

from course_utils.measure.bench import time_side_by_side


def machine():
    import tilelang
    p = torch.cuda.get_device_properties(0)
    return dict(gpu=p.name, sms=p.multi_processor_count, torch=torch.__version__, tilelang=tilelang.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def gpu_and_host_ms(call, n=50):
    """(CUDA-event ms a call over ``n`` calls back to back, host ms a call issuing ``n`` calls without a sync), after
    five warm-up calls."""
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        call()
    end.record()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, host


def packed_batch(lengths, heads, dim, generator, dtype=torch.float16):
    """(cu_seqlens int32, longest length, q, k, v [total, heads, dim]) on the GPU, inputs standard normal."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=dtype, generator=generator) for _ in range(3))
    return cu, max(lengths), q, k, v


def blocks(fns, *, label, base, work=None, n_blocks=3, rounds=4, rep=5, warmup=3):
    """Time ``fns`` (name -> callable) in ``n_blocks`` blocks of interleaved rounds; ratios are base's time ÷ each
    one's (above 1: faster than base), scaled by ``work[name] / work[base]`` when the work differs."""
    rows = []
    for block in range(n_blocks):
        ms = time_side_by_side(fns, warmup=warmup, rounds=rounds, rep=rep)
        scale = {n: (work[n] / work[base]) if work else 1.0 for n in ms}
        ratio = {n: ms[base] / t * scale[n] for n, t in ms.items()}
        print(f"{label} block {block}: " + " ".join(f"{n}={t:.4f}" for n, t in ms.items()) + f" | ÷{base} "
              + " ".join(f"{n}={r:.3f}" for n, r in ratio.items() if n != base), flush=True)
        rows.append(dict(label=label, block=block, ms=ms, ratio_to_base=ratio))
    return rows


def compile_jobs(build, jobs, errors, t0):
    """Run ``build(job)`` for every job in threads (each returns None or an error text); the failures go into
    ``errors`` (keyed by ``str(job)``) and are printed with the time since ``t0``."""
    from course_utils.measure.benchmarks.common import in_parallel

    errors.update({str(j): e for j, e in zip(jobs, in_parallel(build, jobs)) if e})
    print(f"compiled {time.time() - t0:.0f}s", errors, flush=True)


def forward_checked(errors, key, q, k, v, out, lse, *, name, step=2, **options):
    """O and LSE of every batch element and head against float64, ``step`` batch elements at a time (float64
    memory). A failure is recorded in ``errors[str(key)]`` and printed; returns whether every check passed."""
    from course_utils.checking.validation import CheckFailed, check_forward

    try:
        for b in range(0, q.shape[0], step):
            rows = slice(b, b + step)
            check_forward(q[rows], k[rows], v[rows], out[rows], lse[rows], name=f"{name} b={b}", quiet=b > 0,
                          **options)
        return True
    except CheckFailed as exc:
        errors[str(key)] = f"check failed: {str(exc)[:300]}"
        print("CHECK FAILED", *key, str(exc)[:300], flush=True)
        return False


def save(path, **parts):
    with open(path, "w") as f:
        json.dump(parts, f, indent=1)


def forward_variants_against_peers(cases, variants, compile_variant, *, heads, dim, result, out_path, t0,
                                   key_suffix=()):
    """For each (seq, causal, dtype) of ``cases``, inputs of B·S = 16384 tokens ([16384 // seq, heads, seq, dim]):
    the shipped ``flash_attention`` and each of ``variants`` (a name per variant), compiled in threads by
    ``compile_variant(q, seq, causal, dtype, name) -> launcher``; a variant that fails to compile, or fails the
    float64 check on every batch element and head, is recorded in ``result["errors"]`` (keyed by (seq, causal,
    dtype, name) + ``key_suffix``) and not timed. The rest, with SDPA's cuDNN and FA2, are timed in ``blocks``
    against cuDNN into ``result["F"]``, saved to ``out_path`` after each case."""
    from course_utils import flash_attention
    from course_utils.measure.benchmarks.common import CUDNN, FA2, SDPA_PEERS, sdpa

    inputs, kernels = {}, {}
    for seq, _, dtype in cases:
        g = torch.Generator(device="cuda").manual_seed(seq)
        inputs[seq, dtype] = [torch.randn(16384 // seq, heads, seq, dim, device="cuda", dtype=getattr(torch, dtype),
                                          generator=g) for _ in range(3)]

    def build(job):
        seq, causal, dtype, name = job
        q, k, v = inputs[seq, dtype]
        try:
            if name == "shipped":
                flash_attention(q, k, v, causal=causal)
            else:
                kernels[job] = compile_variant(q, seq, causal, dtype, name)
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[-1][:160]}"

    jobs = list(dict.fromkeys((s, c, d, n) for s, c, d in cases for n in ("shipped", *variants)))
    compile_jobs(build, jobs, result["errors"], t0)
    sinks = torch.zeros(heads, device="cuda", dtype=torch.float32)
    for seq, causal, dtype in cases:
        q, k, v = inputs[seq, dtype]
        fns = {"shipped": lambda causal=causal: flash_attention(q, k, v, causal=causal)}
        for name in variants:
            launch = kernels.get((seq, causal, dtype, name))
            if launch is None:
                continue
            out, lse = launch(q, k, v, sinks)
            if not forward_checked(result["errors"], (seq, causal, dtype, name) + tuple(key_suffix), q, k, v, out,
                                   lse, causal=causal, name=f"{dtype} D{dim} {seq} causal={causal} {name}"):
                continue  # a failing variant is reported and not timed
            fns[name] = lambda launch=launch: launch(q, k, v, sinks)
        for peer in (CUDNN, FA2):
            fns[peer] = lambda causal=causal, peer=peer: sdpa(q, k, v, causal, SDPA_PEERS[peer])
        result["F"] += blocks(fns, label=f"{dtype} D{dim} S={seq} causal={causal}", base=CUDNN)
        save(out_path, **result)
