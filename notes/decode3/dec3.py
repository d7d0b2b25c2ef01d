"""Issue 27, helper decode3: kv_heads_per_block candidates for flash_decode against the current default,
SDPA cuDNN / FA2 and torch.sum, at chapter 09's decode shapes (one device call's parts, run by run1.sh).

A candidate is a DecodeConfig override; its calls go through flash_decode's own plan (_decode_plan with
decode_config patched while the plan is made), then the same launch code as flash_decode. Every candidate
is checked on every head against the float64 reference at every shape before it is timed; time_side_by_side
is the record's method (calls back to back, implementations taking turns). Rows go to $OUT/<part>.jsonl.
"""
import functools
import json
import os
import sys
import time

import torch

import course_utils.api.varlen_api as va
import course_utils.kernels.flash_decode as fd
from course_utils.api.varlen_api import flash_decode
from course_utils.checking.validation import check_forward, decode_references
from course_utils.measure.bench import time_side_by_side
from course_utils.measure.benchmarks.ch09_varlen_decode import _sdpa_decode, decode_inputs, paged_view
from torch.nn.attention import SDPBackend

OUT = os.environ.get("OUT", "/tmp")
CUDNN, FA2 = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION
# Call 1: hpb1 (the default then), hpb2, hpb4. Call 2 (the default is 128 // D heads per block): hpb1 (the
# old default at D=64), "s6n32" (the new default's heads per block with 32-key tiles, six stages).
CANDIDATES = {"hpb1": dict(kv_heads_per_block=1), "hpb2": dict(kv_heads_per_block=2),
              "hpb4": dict(kv_heads_per_block=4), "s6n32": dict(kv_heads_per_block=None, block_N=32, num_stages=6)}
CALL = int(os.environ.get("DEC3_CALL", "1"))
_plain_config = fd.decode_config


def emit(part, row):
    row = dict(row, device=torch.cuda.get_device_name())
    with open(os.path.join(OUT, f"{part}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def candidates_for(dim):
    if CALL == 2:
        return ["hpb1", "s6n32"] if dim == 64 else ["s6n32"]
    return [c for c in CANDIDATES if not (dim == 128 and c == "hpb4")]


@functools.lru_cache(maxsize=None)
def _config_fn(name):
    opts = dict(CANDIDATES[name])
    hpb = opts.pop("kv_heads_per_block")

    def cfg(target, heads, heads_kv, dim, seq_new, page_size=None):
        return _plain_config(target, heads, heads_kv, dim, seq_new, page_size, kv_heads_per_block=hpb)._replace(**opts)
    return cfg


def make_runner(name, q, k, v, lengths, table, sinks, num_splits=None):
    """flash_decode's body with the plan made under candidate ``name``'s config (and ``num_splits``, None: the
    default's)."""
    va.decode_config = _config_fn(name)
    try:
        plan = va._decode_plan(q, k, v, lengths, table, False, None, None, sinks, num_splits, None)
    finally:
        va.decode_config = _plain_config
    tab = plan.no_table if table is None else table

    def run(return_lse=False):
        out = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
        if plan.merge is None:
            plan.launch(q, k, v, tab, lengths, sinks, out, lse)
        else:
            o_part = torch.empty(plan.part_shape, dtype=torch.float32, device=plan.device)
            lse_part = torch.empty(plan.part_shape[:-1], dtype=torch.float32, device=plan.device)
            plan.launch(q, k, v, tab, lengths, o_part, lse_part)
            plan.merge(o_part, lse_part, sinks, out, lse)
        return (out, lse) if return_lse else out
    return run, plan.splits


def precompile():
    from course_utils.measure.benchmarks.common import in_parallel
    jobs = []
    for dim in (64, 128):
        for name in candidates_for(dim):
            for paged in (False, True):
                for single in (True, False):
                    jobs.append((name, dim, paged, single))

    def build(job):
        name, dim, paged, single = job
        q = torch.empty(1, 1, 64, dim, device="cuda", dtype=torch.bfloat16)
        cache = torch.empty(1, 256, 8, dim, device="cuda", dtype=torch.bfloat16)
        pr = va.AttentionProblem.decode(q, cache, page_size=256 if paged else None, causal=False, window_size=None,
                                        sm_scale=None)
        config = _config_fn(name)("cuda", 64, 8, dim, 1, 256 if paged else None)
        (va._decode_single if single else va._decode_split)(pr, config)
        if not single:
            va._decode_merge(64, dim, 1, pr.dtype, "cuda", False)
    if CALL == 2:
        from course_utils.measure.benchmarks.ch09_varlen_decode import precompile_ch09  # the public defaults
        precompile_ch09()
    t0 = time.time()
    in_parallel(build, jobs, workers=16)
    print(f"precompiled {len(jobs)} in {time.time() - t0:.0f} s on {torch.cuda.get_device_name()}", flush=True)


def check():
    """Paged and contiguous, one split and several, every candidate, against the reference on every head."""
    for dim in (64, 128):
        for batch, context in ((1, 32768), (8, 8192), (64, 1024)):
            q, kv, sinks, lengths = decode_inputs(batch, context, dim)
            lengths = torch.randint(1, context + 1, (batch,), device="cuda", dtype=torch.int32,
                                    generator=torch.Generator(device="cuda").manual_seed(3))
            k, v = kv[0], kv[1]
            kp, vp, table = paged_view(kv)
            refs = {"contiguous": decode_references(q, k, v, lengths, sinks=sinks),  # call 1 checked paged
                    "paged": decode_references(q, kp, vp, lengths, block_table=table, sinks=sinks)}  # against these
            for name in ["default"] + candidates_for(dim):
                for layout, (kc, vc, tb) in (("contiguous", (k, v, None)), ("paged", (kp, vp, table))):
                    if name == "default":
                        run = functools.partial(flash_decode, q, kc, vc, lengths, block_table=tb, sinks=sinks)
                        splits = va.decode_num_splits(q, kc, block_table=tb)
                    else:
                        run, splits = make_runner(name, q, kc, vc, lengths, tb, sinks)
                    out, lse = run(return_lse=True)
                    try:
                        err = check_forward(q, k, v, out, lse, refs=refs[layout], quiet=True, name=f"{name} {layout}")
                    except Exception as exc:  # noqa: BLE001 - a failed check is the result
                        err = f"FAILED: {exc}"[:400]
                    emit("check", dict(dim=dim, batch=batch, context=context, cand=name, layout=layout,
                                       splits=splits, errors=err))
            del q, kv, k, v, kp, vp, refs
            torch.cuda.empty_cache()


def bench(dim, batches, contexts):
    for batch in batches:
        for context in contexts:
            q, kv, sinks, lengths = decode_inputs(batch, context, dim)
            k, v = kv[0], kv[1]
            nbytes = kv.numel() * kv.element_size()
            refs = decode_references(q, k, v, lengths, sinks=sinks)
            fns, errors, splits = {}, {}, {}
            out, lse = flash_decode(q, k, v, lengths, sinks=sinks, return_lse=True)
            errors["default"] = check_forward(q, k, v, out, lse, refs=refs, quiet=True, name="default")
            fns["default"] = lambda: flash_decode(q, k, v, lengths, sinks=sinks)
            splits["default"] = va.decode_num_splits(q, k)
            if CALL == 2:
                kp, vp, table = paged_view(kv)
                out, lse = flash_decode(q, kp, vp, lengths, block_table=table, sinks=sinks, return_lse=True)
                errors["default, paged"] = check_forward(q, k, v, out, lse, quiet=True, name="paged", refs=decode_references(
                    q, kp, vp, lengths, block_table=table, sinks=sinks))
                fns["default, paged"] = lambda: flash_decode(q, kp, vp, lengths, block_table=table, sinks=sinks)
                splits["default, paged"] = va.decode_num_splits(q, kp, block_table=table)
            for name in candidates_for(dim):
                run, splits[name] = make_runner(name, q, k, v, lengths, None, sinks)
                out, lse = run(return_lse=True)
                try:
                    errors[name] = check_forward(q, k, v, out, lse, refs=refs, quiet=True, name=name)
                    fns[name] = run
                except Exception as exc:  # noqa: BLE001 - a failed candidate is not timed
                    errors[name] = f"FAILED: {exc}"[:400]
            del refs, out, lse
            for label, backend, fold in (("cuDNN q_len=1", CUDNN, False), ("cuDNN folded", CUDNN, True),
                                         ("FA2 q_len=1", FA2, False), ("FA2 folded", FA2, True)):
                fns[label] = (lambda b_=backend, f_=fold: _sdpa_decode(q, k, v, b_, f_))
            fns["torch.sum"] = lambda: torch.sum(kv)
            ms = time_side_by_side(fns, warmup=3, rounds=4, rep=6)
            cudnn = min(ms["cuDNN q_len=1"], ms["cuDNN folded"])
            for n, t in ms.items():
                emit("bench", dict(dim=dim, batch=batch, context=context, bytes=nbytes, impl=n, us=t * 1e3,
                                   gbps=nbytes / t / 1e6, vs_cudnn=cudnn / t, of_sum=ms["torch.sum"] / t,
                                   splits=splits.get(n), errors=errors.get(n)))
            line = " ".join(f"{n}={cudnn / ms[n]:.3f}" for n in ms if n in errors)
            print(f"SUMMARY D={dim} B={batch} S={context}: ours/cuDNN {line}; sum/cuDNN {cudnn / ms['torch.sum']:.3f}",
                  flush=True)
            del q, kv, k, v, fns
            kp = vp = None
            torch.cuda.empty_cache()


def main(argv):
    torch.backends.cuda.matmul.allow_tf32 = False
    part = argv[1]
    if part == "precompile":
        precompile()
    elif part == "check":
        check()
    elif part == "bench":
        bench(int(argv[2]), [int(x) for x in argv[3].split(",")], [int(x) for x in argv[4].split(",")])


if __name__ == "__main__":
    main(sys.argv)
