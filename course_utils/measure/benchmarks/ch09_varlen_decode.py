"""Chapter 09: decoding against a KV cache, and packed variable-length batches.

* ``decode_bandwidth``: one decoding step at the gpt-oss attention shape (64 query heads, 8 K/V heads,
  sinks; D = 64 and 128), over batch sizes and context lengths. Decoding is a read of the cache, so
  each time is turned into the bandwidth at which K and V were read, and set against what a plain
  large read (``torch.sum`` over the same bytes) reaches in the same run, and against SDPA's
  backends at a query length of 1 on the same contiguous cache. Our paged cache is timed on the same
  bytes, as shuffled pages.
* ``decode_split_sweep``: the time of one decoding step for every split count, and the one
  ``choose_num_splits`` picks.
* ``varlen_vs_dense``: a packed batch of mixed lengths, forward and backward, against our dense
  kernel on the same number of tokens in equal lengths (chosen so that the FLOPs match too), and
  against SDPA's FlashAttention-2 and cuDNN on the batch padded to its longest sequence.

Every result of ours is checked on every head (and every sequence) against the float64 reference
before it is timed. Ours is timed through the public functions with their defaults, as a user calls
them: ``flash_decode`` reads nothing back to the host (its index checks run only on request), and
picks its split count from shapes; one split is one kernel, more are the split kernel and the merge.
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...api.attention import flash_attention
from ...api.varlen_api import decode_num_splits, flash_attention_varlen, flash_decode
from ...checking.validation import check_backward, check_forward, decode_references, varlen_references
from ...core.labels import CUDNN, FA2, OURS
from ..bench import attention_flops, tflops, time_side_by_side
from .common import backward_timer, in_parallel

__all__ = ["DECODE_SHAPE", "DECODE_BATCHES", "DECODE_CONTEXTS", "PAGE_SIZE", "SUM", "PAGED", "PACKED_LIST",
           "PACKED_GRID", "DENSE_EQUAL", "SDPA_DECODE_PEERS",
           "decode_inputs", "paged_view", "decode_bandwidth", "decode_split_sweep", "VARLEN_SHAPE",
           "varlen_lengths", "varlen_vs_dense", "precompile_ch09"]

DEVICE = "cuda"
DECODE_SHAPE = dict(heads=64, heads_kv=8)  # gpt-oss-120b's attention: 64 query heads share 8 K/V heads
DECODE_BATCHES = (1, 8, 64)
DECODE_CONTEXTS = (1024, 8192, 32768, 131072)
DECODE_DIMS = (64, 128)
PAGE_SIZE = 256
SUM = "torch.sum (plain read)"
PAGED = f"{OURS}, paged"
PACKED_LIST, PACKED_GRID = f"{OURS}, packed (list)", f"{OURS}, packed (grid)"  # the two schedules
DENSE_EQUAL = f"{OURS}, dense equal lengths"
EFFICIENT = "memory-efficient (SDPA)"
MATH = "math (SDPA)"
SDPA_DECODE_PEERS = {FA2: SDPBackend.FLASH_ATTENTION, CUDNN: SDPBackend.CUDNN_ATTENTION,
                     EFFICIENT: SDPBackend.EFFICIENT_ATTENTION, MATH: SDPBackend.MATH}


def decode_inputs(batch, context, dim, dtype=torch.bfloat16, seed=0):
    """q [B, 1, 64, D]; the cache as one tensor kv [2, B, S, 8, D] (K = kv[0], V = kv[1]); sinks; lengths."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    heads, heads_kv = DECODE_SHAPE["heads"], DECODE_SHAPE["heads_kv"]
    kv = torch.randn(2, batch, context, heads_kv, dim, device=DEVICE, dtype=dtype, generator=g)
    q = torch.randn(batch, 1, heads, dim, device=DEVICE, dtype=dtype, generator=g)
    sinks = torch.randn(heads, device=DEVICE, generator=g)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return q, kv, sinks, lengths


def paged_view(kv, page_size=PAGE_SIZE, seed=1):
    """The same bytes as a paged cache: pages [B·S / page_size, page_size, H_kv, D] and a shuffled block table."""
    _, batch, context, heads_kv, dim = kv.shape
    pages = batch * context // page_size
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    table = torch.randperm(pages, device=DEVICE, generator=g).view(batch, context // page_size).to(torch.int32)
    return kv[0].view(pages, page_size, heads_kv, dim), kv[1].view(pages, page_size, heads_kv, dim), table


def _sdpa_decode(q, k, v, backend, fold_group):
    """SDPA on the contiguous cache [B, S, H_kv, D], read in place through a transposed view.

    ``fold_group=False``: a query length of 1 with ``enable_gqa``. ``True``: the query heads of a
    group folded into the query length ([B, H_kv, group, D]), which every backend takes without
    copying K and V (for one new token and no mask it is the same attention).
    """
    batch, _, heads, dim = q.shape
    heads_kv = k.shape[2]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(backend):
        if fold_group:
            out = F.scaled_dot_product_attention(q.view(batch, heads_kv, heads // heads_kv, dim), kt, vt)
            return out.reshape(batch, 1, heads, dim)
        return F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, enable_gqa=True).transpose(1, 2)


def _gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _try(fn):
    """Run ``fn`` once; the error text if it fails (an unsupported layout, out of memory), else None."""
    try:
        fn()
        _sync()
        return None
    except Exception as exc:  # noqa: BLE001 - a peer's refusal is a result to record
        _sync()
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"


def decode_bandwidth(dims=DECODE_DIMS, batches=DECODE_BATCHES, contexts=DECODE_CONTEXTS, page_size=PAGE_SIZE,
                     rounds=4, rep=6, dtype=torch.bfloat16):
    """K/V read bandwidth of one decoding step: ours (contiguous and paged), torch.sum, SDPA's backends."""
    rows = []
    for dim in dims:
        for batch in batches:
            for context in contexts:
                q, kv, sinks, lengths = decode_inputs(batch, context, dim, dtype)
                k, v = kv[0], kv[1]
                k_pages, v_pages, table = paged_view(kv, page_size)
                nbytes = kv.numel() * kv.element_size()
                # Checked on every head of every sequence before timing.
                out, lse = flash_decode(q, k, v, lengths, sinks=sinks, return_lse=True)
                errors = check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths, sinks=sinks),
                                       quiet=True, name=f"B={batch} S={context} D={dim}")
                out_p, lse_p = flash_decode(q, k_pages, v_pages, lengths, block_table=table, sinks=sinks,
                                            return_lse=True)
                errors_p = check_forward(q, k, v, out_p, lse_p, quiet=True, refs=decode_references(
                    q, k_pages, v_pages, lengths, block_table=table, sinks=sinks), name="paged")
                fns = {
                    OURS: lambda: flash_decode(q, k, v, lengths, sinks=sinks),  # its defaults: no check turned off
                    PAGED: lambda: flash_decode(q, k_pages, v_pages, lengths, block_table=table, sinks=sinks),
                    SUM: lambda: torch.sum(kv),
                }
                refused = {}
                for name, backend in SDPA_DECODE_PEERS.items():
                    for fold in (False, True):
                        if name == MATH and not fold:
                            continue  # enable_gqa in the math backend copies K and V to every query head
                        label = f"{name}, {'group folded into q' if fold else 'q_len=1'}"
                        def fn(b_=backend, f_=fold):
                            return _sdpa_decode(q, k, v, b_, f_)
                        error = _try(fn)
                        if error is None:
                            fns[label] = fn
                        else:
                            refused[label] = error
                ms = time_side_by_side(fns, warmup=3, rounds=rounds, rep=rep)
                splits = decode_num_splits(q, k)
                base = dict(dim=dim, batch=batch, context=context, bytes=nbytes, dtype=str(dtype).split(".")[1],
                            splits=splits, kernels=1 if splits == 1 else 2, page_size=page_size, **DECODE_SHAPE)
                for impl, t in ms.items():
                    row = dict(base, impl=impl, ms=t, gbps=_gbps(nbytes, t), fraction_of_sum=ms[SUM] / t,
                               tflops=tflops(attention_flops(batch, DECODE_SHAPE["heads"], 1, context, dim), t))
                    if impl in (OURS, PAGED):
                        row["errors"] = errors if impl == OURS else errors_p
                    rows.append(row)
                for impl, error in refused.items():
                    rows.append(dict(base, impl=impl, error=error))
                best_sdpa = min(t for i, t in ms.items() if i not in (OURS, PAGED, SUM))
                print(f"decode D={dim} B={batch:>2} S={context:>6}: ours {_gbps(nbytes, ms[OURS]):6.0f} GB/s "
                      f"({ms[SUM] / ms[OURS]:.0%} of sum), paged {ms[PAGED] / ms[OURS] - 1:+.1%}, "
                      f"best SDPA {best_sdpa / ms[OURS]:.2f}× ours' time", flush=True)
                del q, kv, k, v, k_pages, v_pages, fns
                _sync()
    return rows


def decode_split_sweep(dim=64, cases=((1, 1024), (8, 1024), (64, 1024), (1, 2048), (8, 2048), (1, 4096), (8, 4096),
                                      (1, 8192), (8, 8192), (1, 32768),
                                      (1, 131072), (8, 32768), (64, 8192)),
                       splits=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128), dtype=torch.bfloat16):
    """Time of one decoding step for each split count, and which one ``choose_num_splits`` picks
    (1 split: the one-kernel path, no merge)."""
    rows = []
    for batch, context in cases:
        q, kv, sinks, lengths = decode_inputs(batch, context, dim, dtype)
        k, v = kv[0], kv[1]
        chosen = decode_num_splits(q, k)
        reference = flash_decode(q, k, v, lengths, sinks=sinks)
        errors = check_forward(q, k, v, reference, refs=decode_references(q, k, v, lengths, sinks=sinks), quiet=True)
        fns = {}
        for s in sorted(set(splits) | {chosen}):
            out = flash_decode(q, k, v, lengths, sinks=sinks, num_splits=s)
            # Every split count computes the same function: the same O up to rounding.
            torch.testing.assert_close(out.float(), reference.float(), atol=2e-2, rtol=2e-2)
            fns[s] = lambda s_=s: flash_decode(q, k, v, lengths, sinks=sinks, num_splits=s_)
        ms = time_side_by_side(fns, warmup=3, rounds=3, rep=6)
        nbytes = kv.numel() * kv.element_size()
        for s, t in ms.items():
            rows.append(dict(dim=dim, batch=batch, context=context, dtype=str(dtype).split(".")[1], splits=s,
                             chosen=s == chosen, ms=t,
                             gbps=_gbps(nbytes, t), errors=errors if s == chosen else None, **DECODE_SHAPE))
        best = min(ms, key=ms.get)
        print(f"splits B={batch} S={context}: chose {chosen} ({_gbps(nbytes, ms[chosen]):.0f} GB/s), best {best} "
              f"({_gbps(nbytes, ms[best]):.0f} GB/s)", flush=True)
        del q, kv, k, v
        _sync()
    return rows


VARLEN_SHAPE = dict(heads=16, dim=128, tokens=65536, shortest=128, longest=8192)


def varlen_lengths(tokens, shortest, longest, seed=0):
    """Sequence lengths drawn uniformly from [shortest, longest] until they hold ``tokens`` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(shortest, longest + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - tokens
    if lengths[-1] < shortest:
        lengths[-2] += lengths.pop()
    return lengths


def _equal_lengths(lengths, multiple=256):
    """Equal lengths with the same tokens and (near) the same FLOPs: L = Σ len² / Σ len, B' = tokens / L."""
    tokens = sum(lengths)
    seq = max(multiple, round(sum(n * n for n in lengths) / tokens / multiple) * multiple)
    return max(1, round(tokens / seq)), seq


def varlen_vs_dense(shape=None, causal_options=(True, False), dtype=torch.float16, schedules=("list", "grid"),
                    modes=("fwd", "bwd")):
    """Forward and backward TFLOP/s of a packed batch (both schedules) vs our dense kernel on equal lengths,
    and vs SDPA's FlashAttention-2 and cuDNN on the batch padded to its longest sequence (causal only:
    padding at the end hides nothing from a causal query of its own sequence). ``modes``: what is checked
    and timed ("fwd", "bwd")."""
    sh = dict(VARLEN_SHAPE, **(shape or {}))
    heads, dim = sh["heads"], sh["dim"]
    lengths = varlen_lengths(sh["tokens"], sh["shortest"], sh["longest"])
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    total, longest = sum(lengths), max(lengths)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, device=DEVICE, dtype=dtype, generator=g) for _ in range(3))
    dense_batch, dense_seq = _equal_lengths(lengths)
    dq, dk, dv = (torch.randn(dense_batch, heads, dense_seq, dim, device=DEVICE, dtype=dtype, generator=g)
                  for _ in range(3))
    padded = torch.zeros(3, len(lengths), heads, longest, dim, device=DEVICE, dtype=dtype)
    for b, n in enumerate(lengths):
        for i, t in enumerate((q, k, v)):
            padded[i, b, :, :n] = t[int(cu[b]):int(cu[b]) + n].transpose(0, 1)
    rows = []
    for causal in causal_options:
        flops = sum(attention_flops(1, heads, n, n, dim, causal=causal) for n in lengths)
        dense_flops = attention_flops(dense_batch, heads, dense_seq, dense_seq, dim, causal=causal)
        varlen = {{"list": PACKED_LIST, "grid": PACKED_GRID}[s]: (lambda q_, k_, v_, s_=s: flash_attention_varlen(
            q_, k_, v_, cu, cu, longest, longest, causal=causal, schedule=s_)) for s in schedules}
        # Checked on every sequence and head, forward and backward, before timing (backward_timer's d_out
        # is the same for every implementation: one set of references serves both schedules).
        errors, refs = {}, None
        for (name, attn), schedule in zip(varlen.items(), schedules):
            out, lse = flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=causal, schedule=schedule,
                                              return_lse=True)
            d_out = None
            if "bwd" in modes:
                grad_fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
            refs = refs or varlen_references(q, k, v, cu, cu, d_out=d_out, causal=causal)
            errors[name] = check_forward(q, k, v, out, lse, refs=refs, quiet=True, name=name)
            if "bwd" in modes:
                errors[name].update(check_backward(q, k, v, d_out, grad_fn(), refs=refs, quiet=True, name=name))
        del refs
        for mode in modes:
            fns = {}
            for name, attn in varlen.items():
                fns[name] = (lambda a=attn: a(q, k, v)) if mode == "fwd" else backward_timer(attn, q, k, v)[0]
            dense = lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal)  # noqa: E731
            fns[DENSE_EQUAL] = ((lambda: dense(dq, dk, dv)) if mode == "fwd"
                                                   else backward_timer(dense, dq, dk, dv)[0])
            if causal:
                for peer, backend in ((FA2, SDPBackend.FLASH_ATTENTION), (CUDNN, SDPBackend.CUDNN_ATTENTION)):
                    def attn(q_, k_, v_, b_=backend):
                        with sdpa_kernel(b_):
                            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
                    fns[f"{peer}, padded"] = ((lambda a=attn: a(*padded)) if mode == "fwd"
                                              else backward_timer(attn, *padded)[0])
            ms = time_side_by_side(fns, warmup=3, rounds=4, rep=5)
            scale = 2.5 if mode == "bwd" else 1.0
            for impl, t in ms.items():
                work = dense_flops if "dense" in impl else flops
                rows.append(dict(impl=impl, mode=mode, causal=causal, ms=t, tflops=tflops(work * scale, t),
                                 useful_flops=work * scale, heads=heads, dim=dim, dtype=str(dtype).split(".")[1],
                                 lengths=lengths, dense_batch=dense_batch, dense_seq=dense_seq,
                                 errors=errors.get(impl)))
            line = ", ".join(f"{r['impl'].replace(OURS, 'ours')} {r['tflops']:.0f}" for r in rows[-len(ms):])
            print(f"varlen {mode} causal={causal}: {line}", flush=True)
    return rows


def precompile_ch09():
    """Compile every kernel the chapter 09 records use, in parallel threads (TileLang compiles release the GIL)."""
    jobs = []
    for dim in DECODE_DIMS:
        q = torch.empty(1, 1, DECODE_SHAPE["heads"], dim, device=DEVICE, dtype=torch.bfloat16)
        cache = torch.empty(1, PAGE_SIZE, DECODE_SHAPE["heads_kv"], dim, device=DEVICE, dtype=torch.bfloat16)
        table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
        jobs += [("decode", q, cache, None), ("decode", q, cache, table)]
    x = torch.empty(8, VARLEN_SHAPE["heads"], VARLEN_SHAPE["dim"], device=DEVICE, dtype=torch.float16)
    for causal in (True, False):
        for schedule in ("list", "grid"):
            jobs.append(("varlen", x, causal, schedule))
        jobs.append(("dense", torch.empty(1, VARLEN_SHAPE["heads"], 256, VARLEN_SHAPE["dim"], device=DEVICE,
                                          dtype=torch.float16), causal, None))

    def build(job):
        from ...api.attention import backward_kernels, forward_kernel
        from ...api.varlen_api import _varlen_small_kernels, decode_kernels, decode_single_kernel, varlen_kernels

        kind = job[0]
        if kind == "decode":
            decode_kernels(job[1], job[2], block_table=job[3], merge_allocates=False)  # what flash_decode runs
            decode_single_kernel(job[1], job[2], block_table=job[3])
        elif kind == "varlen":
            varlen_kernels(job[1], job[1], causal=job[2], schedule=job[3])
            _varlen_small_kernels(job[1].shape[-1], "float16", "cuda")
        else:
            forward_kernel(job[1], job[1], causal=job[2])
            backward_kernels(job[1], job[1], causal=job[2])

    in_parallel(build, jobs)
    print(f"compiled {len(jobs)} chapter 09 kernel sets", flush=True)
