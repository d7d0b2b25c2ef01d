"""Issue 27, flash_decode host overhead and split rule: one device call's parts (run by run1.sh).

Ours new (this branch) and ours old (main before it, imported as course_utils_old) side by side, with SDPA's
cuDNN and FA2 (both forms the record uses) and torch.sum; every result of ours checked on every head first.
Rows go to $OUT/<part>.jsonl as they are measured (a timeout keeps what was done). Ran (call 2) against
commit c57c1af, whose kernel still had the temporary `interleave` option that `_interleaved` switches on.
"""
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "old"))
OUT = os.environ.get("OUT", "/tmp")

import course_utils_old.api.varlen_api as old_api  # noqa: E402
import torch  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

import course_utils.api.varlen_api as new_api  # noqa: E402
from course_utils.checking.validation import check_forward, decode_references  # noqa: E402
from course_utils.measure.bench import time_side_by_side  # noqa: E402
from course_utils.measure.benchmarks.ch09_varlen_decode import _sdpa_decode, decode_inputs, paged_view  # noqa: E402

new_decode, old_decode = new_api.flash_decode, old_api.flash_decode
CUDNN, FA2 = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION


def emit(part, row):
    with open(os.path.join(OUT, f"{part}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def do_bench_median(fns, rounds=2, warmup=5, rep=25):
    import triton.testing
    samples = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            samples[n].append(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return {n: statistics.median(s) for n, s in samples.items()}


def precompile():
    from course_utils.measure.benchmarks.common import in_parallel
    jobs = []
    for api in (new_api, "interleave", old_api):
        for dim in (64, 128):
            q = torch.empty(1, 1, 64, dim, device="cuda", dtype=torch.bfloat16)
            cache = torch.empty(1, 256, 8, dim, device="cuda", dtype=torch.bfloat16)
            table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
            for t in (None, table):
                jobs.append((api, q, cache, t))

    def build(j):
        if j[0] == "interleave":
            pr, config = new_api._decode_problem(j[1], j[2], j[3], False, None, None)
            return new_api._decode_split(pr, config._replace(interleave=True))
        j[0].decode_kernels(j[1], j[2], block_table=j[3], merge_allocates=False)
        j[0].decode_single_kernel(j[1], j[2], block_table=j[3])

    t0 = time.time()
    in_parallel(build, jobs[:8])
    in_parallel(build, jobs[8:])
    print(f"precompiled in {time.time() - t0:.0f} s; {torch.cuda.get_device_name()}", flush=True)


def host():
    """Host µs per call: perf_counter over 200 calls, no sync inside (the GPU work of a small cache is shorter)."""
    q, kv, sinks, lengths = decode_inputs(1, 1024, 64)
    k, v = kv[0], kv[1]
    kp, vp, table = paged_view(kv)
    fns = {
        "ours new": lambda: new_decode(q, k, v, lengths, sinks=sinks),
        "ours old": lambda: old_decode(q, k, v, lengths, sinks=sinks),
        "ours new, paged": lambda: new_decode(q, kp, vp, lengths, block_table=table, sinks=sinks),
        "ours old, paged": lambda: old_decode(q, kp, vp, lengths, block_table=table, sinks=sinks),
        "ours new, 1 split": lambda: new_decode(q, k, v, lengths, sinks=sinks, num_splits=1),
        "ours old, 1 split": lambda: old_decode(q, k, v, lengths, sinks=sinks, num_splits=1),
        "cuDNN q_len=1": lambda: _sdpa_decode(q, k, v, CUDNN, False),
        "cuDNN folded": lambda: _sdpa_decode(q, k, v, CUDNN, True),
        "FA2 q_len=1": lambda: _sdpa_decode(q, k, v, FA2, False),
        "torch.sum": lambda: torch.sum(kv),
    }
    # The pieces of the one-split call.
    single = new_api.decode_single_kernel(q, k)
    from course_utils.kernels.tiles import launcher
    fast = launcher(single)
    print("launcher gives", type(fast).__module__, type(fast).__name__, "for", type(single.adapter).__name__,
          flush=True)
    out = torch.empty_like(q)
    lse = torch.empty(1, 64, 1, device="cuda")
    tab = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    args = (q, k, v, tab, lengths, sinks, out, lse)
    key_args = (q, k, v, lengths, None, False, None, None, sinks, None, None)
    fns.update({
        "piece: JITKernel call (adapter)": lambda: single(*args),
        "piece: launcher (TVM-FFI main)": lambda: fast(*args),
        "piece: 2 x torch.empty": lambda: (torch.empty((1, 1, 64, 64), dtype=torch.bfloat16, device=q.device),
                                           torch.empty((1, 64, 1), dtype=torch.float32, device=q.device)),
        "piece: _plan_key": lambda: new_api._plan_key(*key_args),
        "piece: sinks.detach().float().contiguous()": lambda: sinks.detach().float().contiguous(),
        "piece: old checks+plan (decode_num_splits)": lambda: old_api.decode_num_splits(q, k),
    })
    res = {n: [] for n in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    for _ in range(5):
        for n, fn in fns.items():
            t = time.perf_counter()
            for _ in range(200):
                fn()
            res[n].append((time.perf_counter() - t) / 200 * 1e6)
            torch.cuda.synchronize()
    for n, s in res.items():
        emit("host", dict(impl=n, host_us_median=statistics.median(s), host_us_min=min(s)))


def bench(dims, batches, contexts):
    for dim in dims:
        for batch in batches:
            for context in contexts:
                one_shape(batch, context, dim)


def one_shape(batch, context, dim):
    q, kv, sinks, lengths = decode_inputs(batch, context, dim)
    k, v = kv[0], kv[1]
    kp, vp, table = paged_view(kv)
    nbytes = kv.numel() * kv.element_size()
    refs = decode_references(q, k, v, lengths, sinks=sinks)
    refs_p = decode_references(q, kp, vp, lengths, block_table=table, sinks=sinks)
    ours = {
        "ours new": (lambda **kw: new_decode(q, k, v, lengths, sinks=sinks, **kw), refs),
        "ours old": (lambda **kw: old_decode(q, k, v, lengths, sinks=sinks, **kw), refs),
        "ours new, paged": (lambda **kw: new_decode(q, kp, vp, lengths, block_table=table, sinks=sinks, **kw), refs_p),
        "ours old, paged": (lambda **kw: old_decode(q, kp, vp, lengths, block_table=table, sinks=sinks, **kw), refs_p),
    }
    errors, fns = {}, {}
    for name, (f, r) in ours.items():
        out, lse = f(return_lse=True)
        try:
            errors[name] = check_forward(q, k, v, out, lse, refs=r, quiet=True, name=f"{name} B={batch} S={context}")
            fns[name] = f
        except Exception as exc:  # noqa: BLE001 - a failed check is a result, and the row is not timed
            errors[name] = f"FAILED: {exc}"[:300]
    del refs, refs_p
    for label, backend, fold in (("cuDNN q_len=1", CUDNN, False), ("cuDNN folded", CUDNN, True),
                                 ("FA2 q_len=1", FA2, False)):
        fns[label] = (lambda b_=backend, f_=fold: _sdpa_decode(q, k, v, b_, f_))
    fns["torch.sum"] = lambda: torch.sum(kv)
    fns = {n: (lambda f=f: f()) for n, f in fns.items()}
    rec = time_side_by_side(fns, warmup=3, rounds=4, rep=6)
    db = do_bench_median(fns)
    splits_new = new_api.decode_num_splits(q, k)
    splits_old = old_api.decode_num_splits(q, k)
    for n in fns:
        emit("bench", dict(dim=dim, batch=batch, context=context, bytes=nbytes, impl=n, record_us=rec[n] * 1e3,
                           do_bench_us=db[n] * 1e3, errors=errors.get(n), splits_new=splits_new,
                           splits_old=splits_old, device=torch.cuda.get_device_name()))
    torch.cuda.empty_cache()


SPLITS = (1, 2, 4, 8, 16, 24, 33, 48, 66, 96, 128)


def _interleaved(on):
    """Switch the new tree's split kernel to interleaved key blocks (split s: blocks s, s + splits, …)."""
    if not hasattr(new_api, "_plain_decode_config"):
        new_api._plain_decode_config = new_api.decode_config
    plain = new_api._plain_decode_config
    new_api.decode_config = (lambda *a: plain(*a)._replace(interleave=True)) if on else plain
    new_api._PLANS.clear()


def sweep(cases):
    for batch, context, dim in cases:
        q, kv, sinks, lengths = decode_inputs(batch, context, dim)
        k, v = kv[0], kv[1]
        kp, vp, table = paged_view(kv)
        layouts = {"contiguous": (k, v, None, False), "paged": (kp, vp, table, False)}
        if batch == 1 and dim == 64:
            ident = torch.arange(table.numel(), device="cuda", dtype=torch.int32).view_as(table)
            layouts["paged, identity table"] = (kp, vp, ident, False)  # the contiguous cache's order, via pages
            if context == 131072:
                layouts["contiguous, K and V apart"] = (k.clone(), v.clone(), None, False)  # not 2^27 B apart
        if dim == 64:
            layouts["contiguous, interleaved splits"] = (k, v, None, True)
            layouts["paged, interleaved splits"] = (kp, vp, table, True)
        for layout, (kc, vc, tb, inter) in layouts.items():
            _interleaved(inter)
            chosen = new_api.decode_num_splits(q, kc, block_table=tb)
            ref = new_decode(q, kc, vc, lengths, block_table=tb, sinks=sinks)
            refs = decode_references(q, kc, vc, lengths, block_table=tb, sinks=sinks)
            check_forward(q, k, v, ref, refs=refs, quiet=True, name=f"sweep {layout}")
            del refs
            fns = {}
            for s in sorted(set(SPLITS) | {chosen}):
                if inter and s == 1:
                    continue
                out = new_decode(q, kc, vc, lengths, block_table=tb, sinks=sinks, num_splits=s)
                torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
                fns[s] = (lambda s_=s: new_decode(q, kc, vc, lengths, block_table=tb, sinks=sinks, num_splits=s_))
            rec = time_side_by_side(fns, warmup=2, rounds=2, rep=6)
            db = do_bench_median(fns, rounds=1, warmup=3, rep=15)
            for s in fns:
                emit("sweep", dict(batch=batch, context=context, dim=dim, layout=layout, splits=s, chosen=s == chosen,
                                   record_us=rec[s] * 1e3, do_bench_us=db[s] * 1e3))
            _interleaved(False)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    part = sys.argv[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    if part == "precompile":
        precompile()
    elif part == "host":
        host()
    elif part == "bench":
        dims = [int(x) for x in sys.argv[2].split(",")]
        batches = [int(x) for x in sys.argv[3].split(",")]
        contexts = [int(x) for x in sys.argv[4].split(",")]
        bench(dims, batches, contexts)
    elif part == "sweep":
        cases = [tuple(int(y) for y in c.split("x")) for c in sys.argv[2].split(",")]
        sweep(cases)
