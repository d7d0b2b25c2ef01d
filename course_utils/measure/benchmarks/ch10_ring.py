"""Chapter 10: ring attention on two GPUs (NCCL) against the single-GPU kernel, in one run.

On a machine with two GPUs (``nvidia-h200-x2``)::

    python -m course_utils.measure.benchmarks.ch10_ring             # writes figures/ch10_ring_attention_h200x2.json
    python -m course_utils.measure.benchmarks.ch10_ring --dry-run   # the same code path on 2 CPU processes (gloo), tiny
    python -m course_utils.measure.benchmarks.ch10_ring --world 4   # four GPUs: figures/ch10_ring_attention_4gpus.json

First every kernel of the run is compiled in worker processes (TileLang's lowering holds the GIL,
so threads would take turns); then two processes, one per GPU, joined by NCCL, load them from
TileLang's disk cache and measure. Rank 0 writes what has been measured after every case, so a
failure or the time limit loses only the case in progress. In order:

1. **Check** ring attention on both GPUs at S = 8k against the float64 reference on every head
   (O, dQ, dK, dV by the FlashAttention criterion): causal zigzag, causal contiguous, and
   non-causal GQA; each next to the single-GPU kernel's own errors.
2. **Time** forward + backward (one training step of attention) for S = 32k, 64k, 128k, causal
   (zigzag) and not (contiguous), bfloat16 then float16, side by side in interleaved rounds, CUDA
   events, calls back to back, median: the single-GPU kernel on each GPU (and SDPA's
   FlashAttention-2 and cuDNN on one GPU, bfloat16), ``ring_attention`` on both, and the ring's
   parts: the whole lap, its compute alone (``NoComm``: same kernels, no transfers) and its
   communication alone (``compute=False``: same transfers, no kernels). Hidden fraction of the
   communication = (comm + compute − total) / comm. Peak memory per token gives the largest S that
   would fit (an estimate: memory grows linearly with S in every configuration here). The ring's O
   and gradients at each timed size are compared with the single-GPU kernel's.
3. **Profile** one steady-state lap (forward + backward, after two unprofiled ones) at S = 64k,
   causal zigzag, bfloat16, with torch.profiler; keep the kernels' start and end times on rank 0
   (the timeline picture) and the hidden fraction of the communication: the NCCL kernels' time
   during which a compute kernel ran on the other stream, over the NCCL kernels' time.

Before all that (it needs no compiled kernel and an empty GPU), **memory**: the longest S whose
forward + backward fits one GPU, and each rank's part of the ring, causal zigzag, D = 128,
bfloat16, MHA 16:16 and GQA 64:8: doubling from 256k, then bisecting to 1/64. Each try runs the
real forward and backward with stub kernels that only allocate their outputs (the same allocations,
no compute, no kernel compiled per S), and the ring's part with NoComm (the same buffers as RingComm,
so a rank that runs out of memory leaves no partner waiting); the peaks per GPU at one common S
(one GPU's longest) give the ratio the issue targets (≤ 0.55). The method's check: the stub peaks
at the longest timed S (128k) next to the real kernels' peaks of the timed rows ("peak_bytes"). A
real run at the longest S is not made: forward + backward there takes minutes (quadratic in S).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ...api.attention import backward_kernels, flash_attention, forward_kernel
from ...api.ring import (
    NoComm,
    RingComm,
    default_backward_chunks,
    kernel_shapes,
    ring_attention,
    ring_backward,
    ring_forward,
    shard_sequence,
    unshard_sequence,
)
from ...checking.validation import check_backward, check_forward, references
from ...core.labels import CUDNN, FA2, OURS
from ..bench import TIMING_METHOD, attention_flops, round_orders, save_record, tflops, time_side_by_side
from .common import SDPA_PEERS, sdpa

RECORD = "ch10_ring_attention_h200x2"
# ``--world 4``: the same measurement on four GPUs, in its own records (bfloat16, the main cases, no peers, no
# one-lap variant, no profile: the question is how the ring scales).
RECORD_4 = "ch10_ring_attention_4gpus"
# ``--memory-only``: the memory search alone (no compile, no timing), in its own record, so that a short device
# call can answer the memory question without replacing the timed record.
MEMORY_RECORD = "ch10_ring_memory_h200x2"
MEMORY_RECORD_4 = "ch10_ring_memory_4gpus"
MEMORY_ONLY_TIMING = "none: peak allocations of one forward + backward (torch.cuda.max_memory_allocated), nothing timed"
WORLD = 2  # the default; --world 4 runs on four
SEQS = (32768, 65536, 131072)
SHAPE = dict(batch=1, heads=16, dim=128)  # H·D = 2048, like the other chapters' records
CHECK_SEQ = 8192
CASES = ((True, "zigzag"), (False, "contiguous"))  # (causal, layout)
# Measured for the first dtype only, without SDPA's backends: the imbalance of the contiguous split.
EXTRA_CASES = ((True, "contiguous"),)
DTYPES = ("bfloat16", "float16")
# ``ring_attention`` runs its backward in pieces of the heads by default on long shards (``default_backward_chunks``).
# Checked at BACKWARD_CHUNKS pieces; the first dtype's main cases and the memory search also measure the one-lap
# backward (``backward_chunks=1``) beside the default.
BACKWARD_CHUNKS = 8
PROFILE_CASE = dict(dtype="bfloat16", causal=True, layout="zigzag", seq=65536)
# The launcher's own limit: start no new case after this many seconds, stop the processes after
# HARD_LIMIT_S (a machine that allows 600 s a command, including unpacking the packages and importing).
TIME_BUDGET_S = 380
HARD_LIMIT_S = 470
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "GLOO_SOCKET_IFNAME": "lo"}  # gloo: ring_attention's input check (ring.host_group), one host
DRY = dict(seqs=(64, 128), check_seq=64, shape=dict(batch=1, heads=4, dim=16), dtypes=("float32",),
           profile=dict(dtype="float32", causal=True, layout="zigzag", seq=64),
           memory_cases=(("MHA 4:4", 4, 4), ("GQA 8:2", 8, 2)), memory_start=2048, backward_chunks=2)

__all__ = ["RECORD", "RECORD_4", "MEMORY_RECORD", "record_names", "SEQS", "SHAPE", "LABELS", "ring_vs_one_gpu",
           "timeline_spans", "memory_record", "main"]

# The keys of a row's "ms" and "tflops", and what each measured.
PEER_KEYS = {FA2: "fa2_one_gpu", CUDNN: "cudnn_one_gpu"}
LABELS = {"one_gpu": f"{OURS}, one GPU", "fa2_one_gpu": f"{FA2}, one GPU", "cudnn_one_gpu": f"{CUDNN}, one GPU",
          "ring": "ring_attention, on the ring's GPUs (the record's world)",
          "ring_one_lap": "ring_attention(backward_chunks=1), on the ring's GPUs",
          "ring_lap": "the ring's lap (forward + backward pieces)",
          "ring_compute": "the lap's compute alone (no transfers)",
          "ring_comm": "the lap's communication alone (no kernels)"}


# --- helpers that run on every rank ----------------------------------------------------------------

class _Rank:
    """This process: rank, device, the run's options and its results (written by rank 0)."""

    def __init__(self, rank, folder, options):
        self.rank, self.folder, self.options = rank, folder, options
        self.dry = options["dry_run"]
        self.device = torch.device("cpu") if self.dry else torch.device("cuda", rank)
        self.start = time.time()
        self.world = options["world"]
        self.results = {"world": self.world, "shape": options["shape"], "check": [], "rows": [], "compile": {},
                        "timeline": None, "errors": []}

    def log(self, message):
        print(f"[rank {self.rank} {time.time() - self.start:6.1f}s] {message}", flush=True)

    def save(self):
        if self.rank == 0:
            path = os.path.join(self.folder, "results.json")
            with open(path + ".tmp", "w") as f:
                json.dump(self.results, f)
            os.replace(path + ".tmp", path)

    def failed(self, where):
        text = f"{where}: {traceback.format_exc(limit=6)}"
        self.log(text)
        self.results["errors"].append(text[-2000:])
        self.save()

    def sync(self):
        if not self.dry:
            torch.cuda.synchronize()
        dist.barrier()

    def gather(self, value):
        everyone = [None] * self.world
        dist.all_gather_object(everyone, value)
        return everyone


def _inputs(options, seq, dtype, device, heads_kv=None, seed=0):
    shape = options["shape"]
    b, h, d = shape["batch"], shape["heads"], shape["dim"]
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, h, seq, d, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(b, heads_kv or h, seq, d, device=device, dtype=dtype, generator=g) for _ in range(2))
    d_out = torch.randn(b, h, seq, d, device=device, dtype=dtype, generator=g)
    return q, k, v, d_out


def _training_step(attn, q, k, v, d_out):
    """A function running forward then backward of ``attn``; returns (O, dQ, dK, dV)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        out = attn(*leaves)
        return (out.detach(), *torch.autograd.grad(out, leaves, d_out))

    return step


def _lap(q, k, v, d_out, comm, *, compute=True, **options):
    """ring_forward then ring_backward, the pieces ring_attention runs (no input check, no autograd)."""
    def lap():
        out, lse = ring_forward(q, k, v, comm, compute=compute, **options)
        return (out, *ring_backward(q, k, v, out, lse, d_out, comm, compute=compute, **options))

    return lap


def _shards(world, rank, layout, tensors):
    return [shard_sequence(t, world, rank, layout).contiguous() for t in tensors]


def _gather_sequence(local, layout):
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return unshard_sequence(parts, layout)


def _time_side_by_side(me, fns, rounds, rep):
    """Median ms of each function, in interleaved rounds (CUDA events on the GPU, the wall clock on the
    CPU), the warm-up already done; every rank runs the same functions in the same orders
    (``round_orders`` depends on the names and the round count only)."""
    me.sync()
    if not me.dry:
        return time_side_by_side(fns, warmup=0, rounds=rounds, rep=rep)
    samples = {name: [] for name in fns}
    for order in round_orders(fns, rounds):
        for name in order:
            for _ in range(rep):
                t0 = time.perf_counter()
                fns[name]()
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def _warm_call(me, fn):
    """Call ``fn`` once (the warm-up); returns its result and the peak memory it used above what was
    allocated before (None on the CPU)."""
    me.sync()
    if me.dry:
        return fn(), None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


def _max_diff(a, b):
    return float((a.float() - b.float()).abs().max())


# --- the phases --------------------------------------------------------------------------------

def _check_cases(heads, chunks):
    """(causal, layout, H_kv or None for MHA, backward_chunks or None for the default) of the checks against the
    float64 reference."""
    return ((True, "zigzag", None, None), (True, "zigzag", None, chunks), (True, "contiguous", None, None),
            (False, "contiguous", max(1, heads // 4), None))


def _check(me):
    """Ring attention on both devices vs the float64 reference at a moderate size, every head."""
    seq = me.options["check_seq"]
    dtype = getattr(torch, me.options["dtypes"][0])
    heads = me.options["shape"]["heads"]
    for causal, layout, heads_kv, chunks in _check_cases(heads, me.options["backward_chunks"]):
        name = (f"S={seq} {'causal' if causal else 'non-causal'} {layout} H_kv={heads_kv or heads}"
                + (f" backward_chunks={chunks}" if chunks else ""))
        try:
            q, k, v, d_out = _inputs(me.options, seq, dtype, me.device, heads_kv)
            local = _shards(me.world, me.rank, layout, (q, k, v, d_out))
            ring = _training_step(lambda q_, k_, v_: ring_attention(q_, k_, v_, causal=causal, layout=layout,
                                                                    backward_chunks=chunks), *local)()
            gathered = [_gather_sequence(t, layout) for t in ring]
            row = dict(name=name, seq=seq, causal=causal, layout=layout, heads_kv=heads_kv or heads,
                       dtype=me.options["dtypes"][0], backward_chunks=chunks)
            if me.rank == 0:
                one = _training_step(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal), q, k, v, d_out)()
                refs = references(q, k, v, d_out=d_out, causal=causal)
                for label, (out, *grads) in (("ring", gathered), ("one_gpu", one)):
                    errors = check_forward(q, k, v, out, causal=causal, refs=refs, name=f"{label} {name}")
                    errors.update(check_backward(q, k, v, d_out, grads, causal=causal, refs=refs,
                                                 name=f"{label} {name}"))
                    row[f"{label}_errors"] = errors
                row["ring_vs_one_gpu"] = {n: _max_diff(a, b) for n, a, b in zip(("O", "dQ", "dK", "dV"), gathered, one)}
                me.results["check"].append(row)
                me.save()
            del q, k, v, d_out, local, ring, gathered
        except Exception:  # noqa: BLE001 (recorded; the run goes on)
            me.failed(f"check {name}")
        me.sync()


def _timed_cases(options):
    """(dtype, causal, layout, S) of every timed case, in run order: each dtype's main cases (and the first
    dtype's extra ones), each at every S."""
    for dtype in options["dtypes"]:
        for causal, layout in CASES + (options["extra_cases"] if dtype == options["dtypes"][0] else ()):
            for seq in options["seqs"]:
                yield dtype, causal, layout, seq


def _one_lap_case(options, dtype, causal, layout):
    """Whether a timed case also times ``backward_chunks=1`` beside the default: the first dtype's main cases."""
    return options["one_lap"] and dtype == options["dtypes"][0] and (causal, layout) in CASES


def _problems(options):
    """Every distinct attention problem (the shapes a kernel is compiled for) of the run, in run order:
    the checks, then each dtype's single-GPU and ring cases."""
    shape, world = options["shape"], options["world"]
    b, h, d = shape["batch"], shape["heads"], shape["dim"]
    problems = []

    def keep(problem):
        if problem not in problems:
            problems.append(problem)

    def add(dtype, causal, seq_q, seq_k=None, heads_kv=None):
        keep((b, h, heads_kv or h, seq_q, seq_k or seq_q, d, dtype, causal))

    def add_ring(dtype, causal, layout, seq, heads_kv=None, chunks=None):
        chunks = chunks or default_backward_chunks(heads_kv or h, seq // world)
        for rows_q, rows_k, block_causal in kernel_shapes(world, seq // world, causal=causal, layout=layout):
            add(dtype, block_causal, rows_q, rows_k, heads_kv)
            if chunks > 1:  # the backward's laps over pieces of the heads (head_pieces: one batch element)
                keep((1, h // chunks, (heads_kv or h) // chunks, rows_q, rows_k, d, dtype, block_causal))
            if rows_q < seq // world:  # the backward's per-head calls
                keep((1, 1, 1, rows_q, rows_k, d, dtype, block_causal))

    check_dtype, seq = options["dtypes"][0], options["check_seq"]
    for causal, layout, heads_kv, chunks in _check_cases(h, options["backward_chunks"]):
        add(check_dtype, causal, seq, heads_kv=heads_kv)
        add_ring(check_dtype, causal, layout, seq, heads_kv, chunks)
    for dtype, causal, layout, seq in _timed_cases(options):  # the default's pieces, and one lap where timed
        add(dtype, causal, seq)
        add_ring(dtype, causal, layout, seq)
        if _one_lap_case(options, dtype, causal, layout):
            add_ring(dtype, causal, layout, seq, chunks=1)
    return problems


def _compile_problem(problem, device="cuda"):
    """Compile (or load from TileLang's disk cache) the forward and backward kernels of one problem."""
    b, h, h_kv, seq_q, seq_k, d, dtype, causal = problem
    t0 = time.time()
    try:
        q = torch.empty(b, h, seq_q, d, device=device, dtype=getattr(torch, dtype))
        k = torch.empty(b, h_kv, seq_k, d, device=device, dtype=getattr(torch, dtype))
        forward_kernel(q, k, causal=causal)
        backward_kernels(q, k, causal=causal)
    except Exception as exc:  # noqa: BLE001 (reported; the case that needs it will fail and say why)
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return round(time.time() - t0, 2)


def _precompile(options):
    """Compile every problem's kernels in worker processes (TileLang's lowering holds the GIL, so
    threads would take turns); the ranks then load them from TileLang's disk cache."""
    from concurrent.futures import ProcessPoolExecutor

    import torch.multiprocessing as mp

    problems = _problems(options)
    workers = 2 if options["dry_run"] else max(2, min(12, (os.cpu_count() or 4) - 4))
    device = "cpu" if options["dry_run"] else "cuda"
    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        results = list(pool.map(_compile_problem, problems, [device] * len(problems)))
    print(f"compiled {len(problems)} problems in {time.time() - t0:.0f} s with {workers} processes", flush=True)
    return {"problems": len(problems), "workers": workers, "seconds": round(time.time() - t0, 1),
            "failed": {str(p): r for p, r in zip(problems, results) if isinstance(r, str)}}


def _load_kernels(me):
    """Fill this rank's in-memory kernel caches from the disk cache (compiling what is missing)."""
    t0 = time.time()
    failed = [r for r in (_compile_problem(p, me.device) for p in _problems(me.options)) if isinstance(r, str)]
    me.results["compile"][f"rank{me.rank}_load_s"] = round(time.time() - t0, 1)
    me.log(f"kernels loaded in {time.time() - t0:.1f} s ({len(failed)} failed)")
    me.save()


def _case(me, dtype_name, causal, layout, seq, peers=True, one_lap=False):
    """Time one (dtype, mask, layout, S): one GPU, the ring, the ring's parts; memory; agreement."""
    shape = me.options["shape"]
    dtype = getattr(torch, dtype_name)
    q, k, v, d_out = _inputs(me.options, seq, dtype, me.device)
    local = _shards(me.world, me.rank, layout, (q, k, v, d_out))
    comm = RingComm()
    opts = dict(causal=causal, layout=layout)
    row = dict(dtype=dtype_name, causal=causal, layout=layout, seq=seq, **shape)
    # Each GPU on its own first: a failure here (memory) must not leave the other rank waiting in a
    # collective, so a failed function is dropped on its rank only.
    alone = {"one_gpu": _training_step(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal), q, k, v, d_out)}
    if peers and not me.dry:
        for label, backend in SDPA_PEERS.items():
            alone[PEER_KEYS[label]] = _training_step(lambda q_, k_, v_, b_=backend: sdpa(q_, k_, v_, causal, b_),
                                                     q, k, v, d_out)
    fns, peaks, one = {}, {}, None
    for name, fn in alone.items():
        try:
            result, peaks[name] = _warm_call(me, fn)
            fns[name] = fn
            one = result if name == "one_gpu" else one
        except Exception:  # noqa: BLE001
            me.failed(f"{name} {dtype_name} causal={causal} S={seq} (rank {me.rank})")
            if not me.dry:
                torch.cuda.empty_cache()
    ring_fns = {"ring": _training_step(lambda q_, k_, v_: ring_attention(q_, k_, v_, **opts), *local)}
    row["backward_chunks"] = default_backward_chunks(shape["heads"], seq // me.world)  # the default's
    if one_lap:
        ring_fns["ring_one_lap"] = _training_step(
            lambda q_, k_, v_: ring_attention(q_, k_, v_, backward_chunks=1, **opts), *local)
    ring_fns.update({
        "ring_lap": _lap(*local, comm, **opts),
        "ring_compute": _lap(*local, NoComm(comm.rank, comm.world), **opts),
        "ring_comm": _lap(*local, comm, compute=False, **opts),
    })
    gathered = {}
    for name, fn in ring_fns.items():
        result, peaks[name] = _warm_call(me, fn)
        if name in ("ring", "ring_one_lap"):
            gathered[name] = [_gather_sequence(t, layout) for t in result]
    fns.update(ring_fns)
    if one is not None:
        names = ("O", "dQ", "dK", "dV")
        for name, results in gathered.items():
            row[f"{name}_vs_one_gpu"] = {n: _max_diff(a, b) for n, a, b in zip(names, results, one)}
        row["one_gpu_max_abs"] = {n: float(t.float().abs().max()) for n, t in zip(names, one)}
    del gathered, one, result
    rounds, rep = (2, 2) if seq >= 131072 else (3, 2) if seq >= 65536 else (3, 3)
    ms_all = me.gather(_time_side_by_side(me, fns, rounds, rep))
    # What PyTorch could use on each GPU: the free memory plus what its allocator holds.
    free_all = me.gather(None if me.dry else torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved())
    flops = attention_flops(shape["batch"], shape["heads"], seq, seq, shape["dim"], causal=causal, mode="fwd+bwd")
    # The ring waits for its slowest rank; one GPU: rank 0's (every rank's is in ms_per_rank).
    ms = {name: max(r[name] for r in ms_all) for name in ring_fns}
    ms.update({name: t for name, t in ms_all[0].items() if name in alone})
    row.update(ms=ms, ms_per_rank=ms_all)
    row["tflops"] = {name: tflops(flops, t) for name, t in ms.items() if name in ("ring", "ring_one_lap", *alone)}
    comm_ms, compute_ms, total_ms = ms["ring_comm"], ms["ring_compute"], ms["ring_lap"]
    row["hidden_fraction"] = (comm_ms + compute_ms - total_ms) / comm_ms if comm_ms > 0 else None
    row["speedup"] = ms["one_gpu"] / ms["ring"] if "one_gpu" in ms else None
    if one_lap:
        row["speedup_one_lap"] = ms["one_gpu"] / ms["ring_one_lap"] if "one_gpu" in ms else None
    if not me.dry:
        # Peak above what was allocated before the call, plus the inputs q, k, v, dO (a shard of them for the ring).
        mem = {name: peaks[name] + (4 if name == "one_gpu" else 4 / me.world) * q.numel() * q.element_size()
               for name in ("one_gpu", "ring", "ring_one_lap") if peaks.get(name) is not None}
        row["peak_bytes"] = mem
        row["bytes_per_token"] = {name: m / seq for name, m in mem.items()}  # per GPU, per token of the sequence
        for name in ("ring", "ring_one_lap"):  # the target: ≤ 0.55
            if name in mem and "one_gpu" in mem:
                row[f"{name}_over_one_gpu_peak"] = mem[name] / mem["one_gpu"]
        capacity = min(free_all)
        row["largest_seq_estimate"] = {name: int(capacity / (m / seq)) // 4096 * 4096 for name, m in mem.items()}
        row["gpu_memory_bytes"] = capacity
    me.results["rows"].append(row)
    me.save()
    me.log(f"{dtype_name} causal={causal} {layout} S={seq}: one GPU {ms.get('one_gpu', float('nan')):.1f} ms, ring "
           f"{ms['ring']:.1f} ms (×{row['speedup'] or float('nan'):.2f}); lap {total_ms:.1f} = compute "
           f"{compute_ms:.1f} + comm {comm_ms:.2f} → hidden {row['hidden_fraction']}"
           + (f"; backward_chunks=1: ring {ms['ring_one_lap']:.1f} ms" if one_lap else ""))


def _profile(me):
    """One lap (forward + backward) under torch.profiler; rank 0 keeps its kernels' times."""
    p = me.options["profile"]
    q, k, v, d_out = _inputs(me.options, p["seq"], getattr(torch, p["dtype"]), me.device)
    local = _shards(me.world, me.rank, p["layout"], (q, k, v, d_out))
    lap = _lap(*local, RingComm(), causal=p["causal"], layout=p["layout"])
    for _ in range(2):  # steady state: kernels loaded, allocator warm, NCCL's channels set up
        lap()
    me.sync()
    activities = [ProfilerActivity.CPU] + ([] if me.dry else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        lap()
        me.sync()
    if me.rank == 0:
        path = os.path.join(me.folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        spans = timeline_spans(events)
        # The share of the NCCL kernels' time during which a compute kernel ran on another stream.
        spans["hidden_fraction"] = spans["overlap_ms"] / spans["comm_ms"] if spans["comm_ms"] else None
        me.results["timeline"] = dict(p, **spans)
        me.save()
        os.remove(path)


def timeline_spans(events, *, gap_us=20.0):
    """Summarise a chrome trace's GPU kernels: for each stream, spans of back-to-back kernels of one kind.

    Kinds: "communication" (NCCL kernels), "attention" (the course's TileLang kernels), "merge and
    sums" (PyTorch's own kernels). Kernels of one kind on one stream closer than ``gap_us`` are one
    span. Returns {"spans": [[stream, kind, start_ms, end_ms], ...] (times from the first kernel),
    "busy_ms": {kind: summed kernel time}, "overlap_ms": the communication kernels' time during which
    a compute kernel ran on another stream, "comm_ms": the communication kernels' total time}.
    """
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if not kernels:
        return {"spans": [], "busy_ms": {}, "overlap_ms": 0.0, "comm_ms": 0.0}
    t0 = min(e["ts"] for e in kernels)

    def kind(name):
        lower = name.lower()
        if "nccl" in lower:
            return "communication"
        return "merge and sums" if ("at::" in name or "elementwise" in lower or "reduce" in lower) else "attention"

    intervals = sorted(((e.get("args", {}).get("stream", 0), kind(e["name"]), e["ts"] - t0, e["ts"] - t0 + e["dur"])
                        for e in kernels), key=lambda x: (x[0], x[2]))
    spans, busy = [], {}
    for stream, what, start, end in intervals:
        busy[what] = busy.get(what, 0.0) + (end - start) / 1e3
        if spans and spans[-1][0] == stream and spans[-1][1] == what and start - spans[-1][3] * 1e3 <= gap_us:
            spans[-1][3] = max(spans[-1][3], end / 1e3)
        else:
            spans.append([stream, what, start / 1e3, end / 1e3])
    comm = [(st, s, e) for st, w, s, e in intervals if w == "communication"]
    overlap = 0.0
    for st, s, e in comm:
        covered = sorted((max(s, cs), min(e, ce)) for cst, w, cs, ce in intervals
                         if w != "communication" and cst != st and cs < e and ce > s)
        edge = s
        for a, b in covered:  # the union of the compute kernels running during this NCCL kernel
            if b > edge:
                overlap += b - max(a, edge)
                edge = b
    return {"spans": [[int(st), w, round(s, 4), round(e, 4)] for st, w, s, e in spans],
            "busy_ms": {w: round(t, 4) for w, t in busy.items()}, "overlap_ms": round(overlap / 1e3, 4),
            "comm_ms": round(sum(e - s for _, s, e in comm) / 1e3, 4)}


# --- the longest sequence that fits (memory) ---------------------------------------------------

def memory_record(world=WORLD):
    """The newer of the two stored records holding the memory search (``results.memory``) on ``world`` GPUs:
    the full run's or a ``--memory-only`` run's; None if neither does."""
    from ..bench import load_record

    records = []
    for name in record_names(world):
        try:
            records.append(load_record(name))
        except FileNotFoundError:
            continue
    records = [r for r in records if r["results"].get("memory")]
    return max(records, key=lambda r: r["machine"]["date"], default=None)


# (name, heads, heads_kv) of the memory search: causal zigzag, D = 128, bfloat16.
MEMORY_CASES = (("MHA 16:16", 16, 16), ("GQA 64:8", 64, 8))
MEMORY_START = 262144  # the search's first S (doubled until it does not fit, then bisected)
DRY_MEMORY_BUDGET = 24 << 20  # dry run: a CPU "device" of this many bytes (the measured allocations)


class _StubKernels:
    """While active, every attention kernel of the course is replaced by one that only allocates its
    outputs (same shapes and dtypes, nothing computed): the allocations of a forward + backward are
    those of the real kernels (TileLang's kernels allocate nothing else), without compiling a kernel
    for every S the search tries. ``flash_attention`` keeps a plan per signature, holding the kernel it found;
    the plans are dropped on the way in and out, so no stub outlives the block (a later real call at an S
    the search tried would otherwise run the stub)."""

    def __enter__(self):
        from ...api import attention

        self.module, self.saved = attention, (attention._compiled_forward, attention._compiled_backward)
        attention._PLANS.clear()

        def forward(problem, config):
            return lambda q, k, v, sinks: (torch.empty_like(q),
                                           torch.empty(q.shape[:3], dtype=torch.float32, device=q.device))

        def backward(problem, config, deterministic=False):
            def post(acc):
                return torch.empty(acc.shape, dtype=getattr(torch, problem.dtype), device=acc.device)

            return attention.BackwardKernels(
                preprocess=lambda o, d_o: torch.empty(o.shape[:3], dtype=torch.float32, device=o.device),
                main=lambda *tensors: None, postprocess_dq=post,
                postprocess_dkv=post if problem.heads_kv != problem.heads else None)

        attention._compiled_forward, attention._compiled_backward = forward, backward
        return self

    def __exit__(self, *exc):
        self.module._compiled_forward, self.module._compiled_backward = self.saved
        self.module._PLANS.clear()


def _trial(me, which, seq, heads, heads_kv, dtype):
    """Forward + backward of one GPU's attention (``which`` = "one_gpu", the whole sequence) or of this
    rank's part of the ring (``"ring"``: its zigzag shard, NoComm: the same buffers as RingComm, no
    partner needed, so a rank that runs out of memory leaves no other rank waiting; the default
    ``backward_chunks``; ``"ring_one_lap"``: the same with ``backward_chunks=1``) at ``seq``.
    Returns the peak bytes it held (inputs included), or None if it did not fit."""
    from ...api.ring import _RingAttention

    shape = dict(me.options["memory_shape"], heads=heads)
    length = seq if which == "one_gpu" else seq // me.world
    b, d = shape["batch"], shape["dim"]

    def run():
        q, d_out = (torch.empty(b, heads, length, d, device=me.device, dtype=dtype) for _ in range(2))
        k, v = (torch.empty(b, heads_kv, length, d, device=me.device, dtype=dtype) for _ in range(2))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        if which == "one_gpu":
            out = flash_attention(*leaves, causal=True)
        else:
            chunks = 1 if which == "ring_one_lap" else None
            out = _RingAttention.apply(*leaves, NoComm(me.rank, me.world), True, None, "zigzag", chunks)
        torch.autograd.grad(out, leaves, d_out)

    if me.dry:
        from ...api.ring import _allocations

        _, _, peak = _allocations(run)
        return peak if peak <= DRY_MEMORY_BUDGET else None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    try:
        run()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()
    return torch.cuda.max_memory_allocated() - before


def longest_fitting(fits, start, granule, *, rel_step=1 / 64):
    """The longest S (a multiple of ``granule``) with ``fits(S)`` true: double from ``start`` until it
    fails, then bisect until the gap is below ``rel_step`` of S (or one granule). ``fits(S)`` returns
    a value (kept) or None. Returns (S, its value, the S tried in order)."""
    tried, lo, lo_value, hi = [], None, None, None
    seq = start
    while hi is None:
        value = fits(seq)
        tried.append(seq)
        if value is None:
            hi = seq
        else:
            lo, lo_value, seq = seq, value, seq * 2
    if lo is None:  # even the start does not fit: halve
        while lo is None and hi > granule:
            seq = max(granule, hi // 2 // granule * granule)
            value = fits(seq)
            tried.append(seq)
            lo, lo_value, hi = (seq, value, hi) if value is not None else (None, None, seq)
        if lo is None:
            return None, None, tried
    while hi - lo > max(granule, int(lo * rel_step)):
        seq = (lo + hi) // 2 // granule * granule
        if seq <= lo:
            break
        value = fits(seq)
        tried.append(seq)
        lo, lo_value, hi = (seq, value, hi) if value is not None else (lo, lo_value, seq)
    return lo, lo_value, tried


def _memory_search(me):
    """The longest S that runs forward + backward on one GPU and on the ring (each rank its own part,
    the smaller of the two ranks' answers; by default and with ``backward_chunks=1``), causal zigzag,
    D = 128, bfloat16, MHA and GQA; the peaks per GPU at the ring's and one GPU's S; the ratios of
    peaks at one common S."""
    kinds = ("one_gpu", "ring", "ring_one_lap")
    dtype = getattr(torch, me.options["memory_dtype"])
    granule = 2 * me.world * 256  # zigzag halves of whole kernel tiles
    found = []
    for name, heads, heads_kv in me.options["memory_cases"]:
        row = dict(name=name, heads=heads, heads_kv=heads_kv, dtype=me.options["memory_dtype"], causal=True,
                   layout="zigzag", method="allocations of the real forward + backward with stub kernels "
                   "(no compute), each rank alone (NoComm, the RingComm buffers)",
                   backward_chunks="default_backward_chunks(H_kv, S_local) (8 at these S); one lap: 1")
        with _StubKernels():
            for which in kinds:
                seq, peak, tried = longest_fitting(lambda s, w=which: _trial(me, w, s, heads, heads_kv, dtype),
                                                   me.options["memory_start"], granule)
                everyone = me.gather((seq, peak))
                row[f"{which}_longest_seq"] = min(s for s, _ in everyone) if all(s for s, _ in everyone) else None
                row[f"{which}_peak_bytes_per_rank"] = [p for _, p in everyone]
                row[f"{which}_tried"] = tried
            # The method's check: at the longest timed S the stub peaks are compared (by the reader, in
            # the record) with the real kernels' peaks that the timed rows store ("peak_bytes").
            timed = max(me.options["seqs"])
            row["stub_peak_at_timed_seq"] = dict(seq=timed, **{
                w: me.gather(_trial(me, w, timed, heads, heads_kv, dtype)) for w in kinds})
            common = row["one_gpu_longest_seq"]
            if common:
                common = common // granule * granule
                peaks = me.gather({w: _trial(me, w, common, heads, heads_kv, dtype) for w in kinds})
                row["common_seq"], row["peak_at_common_seq"] = common, peaks
                for ring_kind in kinds[1:] if peaks[0]["one_gpu"] else ():  # the slower rank's peak
                    row[f"{ring_kind}_over_one_gpu_peak"] = max(p[ring_kind] or 0 for p in peaks) / peaks[0]["one_gpu"]
        for ring_kind in kinds[1:]:
            if row["one_gpu_longest_seq"] and row[f"{ring_kind}_longest_seq"]:
                row[f"{ring_kind}_over_one_gpu_longest"] = row[f"{ring_kind}_longest_seq"] / row["one_gpu_longest_seq"]
        me.log(_memory_line(row))
        found.append(row)
        me.results["memory"] = found
        me.save()
    return found


def _memory_line(row):
    """One memory search row in words (the rank's log and the summary)."""
    nan = float("nan")
    return (f"memory {row['name']}: longest S one GPU {row['one_gpu_longest_seq']}, ring {row['ring_longest_seq']} "
            f"(×{row.get('ring_over_one_gpu_longest', nan):.2f}); ring/one-GPU peak at S={row.get('common_seq')}: "
            f"{row.get('ring_over_one_gpu_peak', nan):.3f}; "
            f"backward_chunks=1: ring {row.get('ring_one_lap_longest_seq')} "
            f"(×{row.get('ring_one_lap_over_one_gpu_longest', nan):.2f}), peak ratio "
            f"{row.get('ring_one_lap_over_one_gpu_peak', nan):.3f}")


def _rank_main(rank, folder, options):
    os.environ.update(NCCL_ENV)
    me = _Rank(rank, folder, options)
    timeout = datetime.timedelta(seconds=180)
    if me.dry:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=me.world,
                                timeout=timeout)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{folder}/store", rank=rank, world_size=me.world,
                                timeout=timeout, device_id=me.device)
    try:
        me.results["devices"] = me.gather("cpu" if me.dry else torch.cuda.get_device_name(rank))
        me.log(f"joined: {me.results['devices']}")
        try:  # first: it needs no compiled kernel, and an empty GPU
            _memory_search(me)
        except Exception:  # noqa: BLE001
            me.failed("memory search")
        me.sync()
        if options.get("memory_only"):
            return
        _load_kernels(me)
        _check(me)
        me.log("checked")
        for dtype, causal, layout, seq in _timed_cases(options):
            late = me.gather(time.time() > options["stop_at"])
            if any(late):
                me.results["rows"].append(dict(dtype=dtype, causal=causal, layout=layout, seq=seq,
                                               skipped="time budget"))
                continue
            try:
                # SDPA's backends once, in the first dtype (bfloat16), for the main cases
                peers = (causal, layout) in CASES and dtype == options["dtypes"][0] and options["peers"]
                one_lap = _one_lap_case(options, dtype, causal, layout)
                _case(me, dtype, causal, layout, seq, peers=peers, one_lap=one_lap)
            except Exception:  # noqa: BLE001
                me.failed(f"case {dtype} causal={causal} {layout} S={seq}")
            if not me.dry:
                torch.cuda.empty_cache()
            me.sync()
        try:
            if options["profile"]:
                _profile(me)
        except Exception:  # noqa: BLE001
            me.failed("profile")
        me.sync()
    finally:
        me.results["elapsed_s"] = round(time.time() - me.start, 1)
        me.save()
        dist.destroy_process_group()


# --- the launcher ------------------------------------------------------------------------------

def record_names(world=WORLD):
    """(the timed record, the memory-only record) of a run on ``world`` GPUs (2 or 4)."""
    if world not in (2, 4):
        raise ValueError(f"ch10_ring runs on 2 or 4 GPUs; got world={world!r}")
    return (RECORD, MEMORY_RECORD) if world == 2 else (RECORD_4, MEMORY_RECORD_4)


def ring_vs_one_gpu(*, dry_run=False, budget_s=TIME_BUDGET_S, hard_limit_s=HARD_LIMIT_S, memory_only=False,
                    world=WORLD):
    """Run the measurement on ``world`` processes (GPUs, or CPU processes with ``dry_run``);
    returns the results (what was measured, if something failed or ran out of time). ``memory_only``:
    the longest S and the peaks per GPU only (stub kernels: nothing compiled, nothing timed)."""
    import torch.multiprocessing as mp

    record_names(world)
    if not dry_run and torch.cuda.device_count() < world:
        raise RuntimeError(f"ch10_ring on {world} GPUs; this machine has {torch.cuda.device_count()}")
    started = time.time()
    options = dict(dry_run=dry_run, stop_at=started + budget_s, seqs=SEQS, check_seq=CHECK_SEQ, shape=SHAPE,
                   dtypes=DTYPES, profile=PROFILE_CASE, memory_cases=MEMORY_CASES, memory_start=MEMORY_START,
                   memory_dtype="bfloat16", memory_shape=dict(batch=1, dim=128), memory_only=memory_only,
                   backward_chunks=BACKWARD_CHUNKS, world=world, extra_cases=EXTRA_CASES, peers=True, one_lap=True)
    if world != 2:  # how the ring scales: the main cases in the first dtype, nothing beside them, up to 256k
        options.update(dtypes=DTYPES[:1], profile=None, extra_cases=(), peers=False, one_lap=False,
                       seqs=SEQS + (2 * SEQS[-1],))
    if dry_run:
        options.update(seqs=DRY["seqs"], check_seq=DRY["check_seq"], shape=DRY["shape"], dtypes=DRY["dtypes"],
                       profile=DRY["profile"] if options["profile"] else None, memory_cases=DRY["memory_cases"],
                       memory_start=DRY["memory_start"], memory_dtype="float32", memory_shape=dict(batch=1, dim=16),
                       backward_chunks=DRY["backward_chunks"])
    os.environ.update(NCCL_ENV)
    try:
        compile_report = {"skipped": "memory only"} if memory_only else _precompile(options)
    except Exception:  # noqa: BLE001 (the ranks then compile what they need themselves)
        traceback.print_exc()
        compile_report = {"error": traceback.format_exc(limit=4)[-1500:]}
    with tempfile.TemporaryDirectory(prefix="ch10-") as folder:
        context = mp.start_processes(_rank_main, args=(folder, options), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = started + hard_limit_s
        try:
            while not context.join(timeout=5):
                if time.time() > deadline:
                    print(f"!! stopping the ranks after {hard_limit_s} s", flush=True)
                    for process in context.processes:
                        if process.is_alive():
                            process.terminate()
                    break
        except Exception:  # noqa: BLE001 (a rank died: keep what it wrote)
            traceback.print_exc()
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
        path = os.path.join(folder, "results.json")
        results = json.load(open(path)) if os.path.exists(path) else {"errors": ["rank 0 wrote nothing"]}
    results.setdefault("compile", {})["precompile"] = compile_report
    results["gpu_count"] = torch.cuda.device_count()
    results["labels"] = LABELS
    results["nccl_env"] = NCCL_ENV
    results["method"] = ("fwd+bwd of attention (one training step); " +
                         ("CPU processes (dry run)" if dry_run else "CUDA events") +
                         "; rounds interleave every implementation; ring times are the slower rank's")
    return results


def _summary(results):
    for row in results.get("check", []):
        worst = max(e["err"] / e["allowed"] for e in row["ring_errors"].values())
        print(f"check {row['name']}: ring used {worst:.0%} of its allowed error")
    print(f"{'dtype':>9} {'mask':>18} {'S':>7} {'1 GPU ms':>9} {'ring ms':>8} {'speed-up':>8} {'hidden':>7}")
    for row in results.get("rows", []):
        mask = f"{'causal' if row['causal'] else 'full'} {row['layout']}"
        if "ms" not in row:
            print(f"{row['dtype']:>9} {mask:>18} {row['seq']:>7}  {row.get('skipped', 'failed')}")
            continue
        one, hidden, speedup = row["ms"].get("one_gpu"), row["hidden_fraction"], row["speedup"]
        print(f"{row['dtype']:>9} {mask:>18} {row['seq']:>7} {'–' if one is None else f'{one:.1f}':>9} "
              f"{row['ms']['ring']:>8.1f} {'–' if speedup is None else f'{speedup:.2f}':>8} "
              f"{'–' if hidden is None else f'{hidden:.0%}':>7}"
              + (f"  one lap ×{row['speedup_one_lap']:.2f}" if row.get("speedup_one_lap") else ""))
    for row in results.get("memory") or []:
        print(_memory_line(row))
    timeline = results.get("timeline") or {}
    if timeline.get("hidden_fraction") is not None:
        print(f"profiled lap (S={timeline['seq']}): {timeline['overlap_ms']:.2f} of {timeline['comm_ms']:.2f} ms of "
              f"NCCL kernels under compute: hidden {timeline['hidden_fraction']:.0%}")
    for error in results.get("errors", []):
        print("error:", error.splitlines()[0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU processes (gloo), tiny sizes, no record")
    parser.add_argument("--world", type=int, default=WORLD, help="GPUs (processes) of the ring: 2 or 4")
    parser.add_argument("--out", help="also copy the record (JSON) into this folder")
    parser.add_argument("--memory-only", action="store_true",
                        help=f"the memory search alone, into {MEMORY_RECORD} (stub kernels: no compile, no timing)")
    args = parser.parse_args(argv)
    results = ring_vs_one_gpu(dry_run=args.dry_run, memory_only=args.memory_only, world=args.world)
    _summary(results)
    if args.dry_run:
        print(json.dumps(results)[:2000])
        return results
    timed_name, memory_name = record_names(args.world)
    name, how, timing = ((memory_name, " (--memory-only)", MEMORY_ONLY_TIMING) if args.memory_only
                         else (timed_name, "", TIMING_METHOD))
    record = save_record(name, results, timing=timing, notes=f"{args.world} GPUs of one host, NCCL ({NCCL_ENV}); see "
                         f"course_utils/measure/benchmarks/ch10_ring.py{how}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(record, f, indent=1)
    return results


if __name__ == "__main__":
    # Through the package, so that the functions sent to the worker processes name this module, not __main__.
    from course_utils.measure.benchmarks import ch10_ring

    ch10_ring.main(sys.argv[1:])
