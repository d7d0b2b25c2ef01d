"""Which of today's config knobs moves our Hopper kernels toward FlashAttention-4.

    python -m course_utils.measure.benchmarks.fa4_levers --out DIR            # on an H100/H200
    python -m course_utils.measure.benchmarks.fa4_levers --out DIR --compile-only   # no GPU: lower + ptxas
    python -m course_utils.measure.benchmarks.fa4_levers --out DIR --only bwd --variants dq_per_warpgroup  # one A/B

Times the backward (and the forward where it trails) under variants of the shipped ``BackwardConfig`` /
``ForwardConfig`` that exist as fields today (block sizes, stages, warpgroups and kernels, the two consumer
warpgroups' split of dQ, dK/dV by TMA, the longest-first causal order, the per-warpgroup dQ handoff), beside the
shipped default, cuDNN (SDPA's cuDNN backend) and FlashAttention-4 where ``flash-attn-4`` is importable. bf16,
B·S = 16k tokens, H·D = 2048; D = 64 causal at S = 2k, 4k, 8k, D = 64 without a mask at S = 4k (the backward
only) and D = 128 at S = 4k, causal and not. ``--variants`` keeps only the named variants beside the shipped
config (and the peers), for one A/B.

Every variant is first checked against the float64 reference (``checking.validation``: every head, the
FlashAttention criterion) on a small problem (B = 2, H = 4, S = 1024) with the same config; a variant that
fails to compile, or is wrong, is a row with its ``error`` and is not timed. Our kernels run through the public
``flash_attention`` (``config=`` / ``backward_config=``), so they pay the same autograd path as the peers.
Backward-only times keep the forward graph (``common.backward_timer``). Calls take turns in changing orders
(``bench.time_side_by_side``); the JSON keeps each time's spread over rounds.

A backward variant whose registers run out is recorded as such: the public API's quiet fallback to 64-row
query blocks (``attention._compile_main``) is switched off here so a row is always the config it names.
``--compile-only`` (no GPU needed) lowers every variant at every timed shape for sm_90a and, with nvcc, reports
ptxas's registers and spills. It cannot see a tiling whose dynamic shared memory exceeds the SM's 227 KiB: that
fails only at launch (``3 stages`` at D = 64 and the 128 × 176 forward do), which the GPU run records as "failed to
run". One run on an H200 (both directions, FA4 installed, kernels cached from an earlier call) took 55 s; the
record is ``figures/fa4_levers_h200.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch

from ...api import attention as attention_api
from ...api.attention import (
    HOPPER_BACKWARD_CONFIGS,
    ForwardConfig,
    attention_backward,
    backward_kernels,
    flash_attention,
    forward_kernel,
    hopper_forward_config,
)

__all__ = ["CASES", "Variant", "VARIANTS", "DQ_PER_WARPGROUP", "keep_variants", "variants_for", "shipped_config",
           "check_variant", "compile_only", "measure", "main"]

DTYPE = "bfloat16"
TOKENS, HIDDEN = 16384, 2048
CHECK_SHAPE = dict(batch=2, heads=4, seq=1024)  # the small problem every variant is checked on first


class Case(NamedTuple):
    direction: str  # "bwd" or "fwd"
    dim: int
    causal: bool
    seqs: tuple


# The cases furthest behind FlashAttention-4 on the H100: backward 0.85 at D = 64 causal, 0.90-0.91 at
# D = 128 S = 4k; forward at D = 64 (S = 8k-16k) and D = 128 S = 4k (0.91 without a mask).
CASES = (
    Case("bwd", 64, True, (2048, 4096, 8192)),
    Case("bwd", 128, True, (4096,)),
    Case("bwd", 128, False, (4096,)),
    Case("bwd", 64, False, (4096,)),  # for the per-warpgroup dQ handoff, which every backward config tries
    Case("fwd", 64, True, (2048, 4096, 8192)),
    Case("fwd", 128, True, (4096,)),
    Case("fwd", 128, False, (4096,)),
)


class Variant(NamedTuple):
    label: str
    why: str
    make: object  # shipped config -> the variant's config


def _bwd(**changes):
    return lambda shipped: shipped._replace(**changes)


def _fwd(config):
    return lambda shipped: config


# FlashAttention-4's dQ handoff (docs/fa4_sm90.md, section 3), without its writer warp: each consumer warpgroup
# stages its own box of dQ, meets only its own 128 threads and adds that box by TMA; tried on every backward case.
DQ_PER_WARPGROUP = Variant("dq_per_warpgroup", "each warpgroup stages and reduce-adds its own box of dQ after a "
                           "128-thread barrier of its own: no 256-thread barrier for dQ (FA4's per-warpgroup "
                           "handoff, no writer warp)", _bwd(dq_per_warpgroup=True))


# Per (direction, dim, causal): the variants beside the shipped config. Each is one knob that exists today, chosen
# for what FlashAttention-4's SM90 kernels do differently (flash_attn/cute/interface.py's _tile_size_*_sm90) or for
# a shipped choice of another case that this case does not make. The shipped config is always row 0.
VARIANTS = {
    ("bwd", 64, True): (
        Variant("longest_first", "LPT causal order (FA3/FA4 schedule causal tiles longest first); shipped only at "
                "D=128 causal", _bwd(longest_first=True)),
        Variant("dkdv_by_tma", "dK/dV written through smem by TMA, as at D=128 (FA4 stores dK/dV by TMA)",
                _bwd(dkdv_by_tma=True)),
        Variant("longest_first+dkdv_by_tma", "D=128 causal's two extra choices together",
                _bwd(longest_first=True, dkdv_by_tma=True)),
        Variant("64x128 (dQ square)", "64 query rows per step: more query steps, smaller dS/dQ tiles; dQ's row "
                "split needs 128 rows", _bwd(block_M=64, policies=None)),
        Variant("3 stages", "Q/dO/LSE/Δ three stages deep (D=64 tiles leave shared memory for it)",
                _bwd(num_stages=3)),
        DQ_PER_WARPGROUP,
    ),
    ("bwd", 64, False): (
        DQ_PER_WARPGROUP,
    ),
    ("bwd", 128, True): (
        Variant("64x128 (FA4 tile)", "FA4/FA3 tile for D=128 causal: 64 query rows per step", _bwd(block_M=64)),
        Variant("no longest_first", "the LPT order off: what it is worth at 4k", _bwd(longest_first=False)),
        DQ_PER_WARPGROUP,
    ),
    ("bwd", 128, False): (
        Variant("64x128", "64 query rows per step (FA4 uses 80 here, as we ship)", _bwd(block_M=64)),
        Variant("no dkdv_by_tma", "dK/dV stored from registers", _bwd(dkdv_by_tma=False)),
        DQ_PER_WARPGROUP,
    ),
    ("fwd", 64, True): (
        Variant("persistent 192x128 pp (FA4 tile)", "FA4's D<=64 forward tile (192x128, 3 consumer warpgroups, "
                "also causal) in our persistent kernel with ping-pong",
                _fwd(ForwardConfig(192, 128, 2, 384, kernel="flash_fwd_hopper_persistent", pingpong=True))),
        Variant("persistent 128x128 pp", "D=128's tiling at D=64",
                _fwd(ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True))),
        Variant("one warpgroup, 2 blocks/SM", "the shipped kernel with one block less per SM (more registers)",
                _fwd(ForwardConfig(64, 128, 2, 128, kernel="flash_fwd_hopper_one_warpgroup", blocks_per_sm=2))),
    ),
    ("fwd", 128, True): (
        Variant("rotated 128x128 pp (not persistent)", "chapter 07's non-persistent kernel: one block per tile",
                _fwd(ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper", pingpong=True))),
    ),
    ("fwd", 128, False): (
        Variant("rotated 128x128 pp (not persistent)", "chapter 07's non-persistent kernel: one block per tile",
                _fwd(ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper", pingpong=True))),
        Variant("persistent 128x176 pp (FA3 C++ tile)", "FA3's C++ D=128 non-causal tile (FA4 Python uses 128x128)",
                _fwd(ForwardConfig(128, 176, 2, 256, kernel="flash_fwd_hopper_persistent", pingpong=True))),
    ),
}


def keep_variants(labels):
    """Keep only the variants named in ``labels`` (beside the shipped config) in ``VARIANTS``, for one A/B; an
    unknown label is an error."""
    global VARIANTS
    known = {v.label for vs in VARIANTS.values() for v in vs}
    if set(labels) - known:
        raise SystemExit(f"unknown variants {sorted(set(labels) - known)}; known: {sorted(known)}")
    VARIANTS = {key: tuple(v for v in vs if v.label in labels) for key, vs in VARIANTS.items()}


def shipped_config(direction, dim, causal, seq):
    """The config ``flash_attention`` ships on Hopper for this case (without asking the GPU)."""
    if direction == "bwd":
        return HOPPER_BACKWARD_CONFIGS[dim, causal]
    return hopper_forward_config(dim, causal, seq_len=seq)


def variants_for(case, seq):
    """[(label, why, config)] for ``case`` at ``seq``: the shipped config first, then each variant that differs."""
    shipped = shipped_config(case.direction, case.dim, case.causal, seq)
    rows = [("shipped", "the default flash_attention picks on Hopper", shipped)]
    for v in VARIANTS[case.direction, case.dim, case.causal]:
        config = v.make(shipped)
        if config != shipped and all(config != c for _, _, c in rows):
            rows.append((v.label, v.why, config))
    return rows


def _shape(dim, seq):
    return dict(batch=max(1, TOKENS // seq), heads=HIDDEN // dim, seq=seq, dim=dim)


def _config_dict(config):
    d = config._asdict()
    if d.get("policies") is not None:
        d["policies"] = list(d["policies"])
    d["type"] = type(config).__name__
    return d


def _failure(exc):
    lines = str(exc).strip().splitlines() or [""]
    last = next((line for line in reversed(lines) if line.strip()), "")
    return f"{type(exc).__name__}: {last.strip()[:200]}"


# ---------------------------------------------------------------------------------------------------------------
# No GPU: lower every variant for sm_90a, then ptxas.

def _row_for(direction, config):
    from ...api.registry import backward_row, forward_row

    row = backward_row(config) if direction == "bwd" else forward_row(config)
    if row.per_device is not None:  # num_ctas: one persistent block per SM; an H100 SXM has 132
        row = dataclasses.replace(row, per_device=lambda: dict(num_ctas=132))
    return row


def _lower_one(direction, dim, causal, seq, config, ptxas=True):
    """Lower one variant at one shape for sm_90a (and run ptxas on it): a result dict."""
    import tilelang

    from ...core.problem import AttentionProblem
    from ...core.source import cuda_source, ptxas_report

    shape = _shape(dim, seq)
    problem = AttentionProblem(heads=shape["heads"], heads_kv=shape["heads"], dim=dim, dtype=DTYPE, target="cuda",
                               sm_scale=dim ** -0.5, causal=causal, batch=shape["batch"], seq_q=seq, seq_k=seq)
    row = _row_for(direction, config)
    start = time.perf_counter()
    result = dict(lowered=False, ptxas=None, error=None)
    try:
        pass_configs = dict(row.pass_configs, **{tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
        source = cuda_source(row.build(problem, config), pass_configs=pass_configs)
        result["lowered"] = True
        if ptxas:
            report = ptxas_report(source)
            result["ptxas"] = None if report is None else [line for line in report if "registers" in line
                                                            or "spill" in line or "C75" in line]
    except Exception as exc:
        result["error"] = _failure(exc)
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def compile_only(cases=CASES, ptxas=True, workers=8):
    """Lower every variant at every timed shape for sm_90a (no GPU) and report ptxas's registers and spills."""
    from .common import in_parallel

    jobs = [(case.direction, case.dim, case.causal, seq, label, config)
            for case in cases for seq in case.seqs for label, _, config in variants_for(case, seq)]
    results = in_parallel(lambda j: _lower_one(*j[:4], j[5], ptxas=ptxas), jobs, workers=workers)
    rows = []
    for (direction, dim, causal, seq, label, config), result in zip(jobs, results):
        rows.append(dict(direction=direction, dim=dim, causal=causal, seq=seq, variant=label,
                         config=_config_dict(config), **result))
        regs = "; ".join(line.split(": ", 1)[-1] for line in (result["ptxas"] or []))
        status = "FAILED " + result["error"] if result["error"] else ("lowered" + (f" | {regs}" if regs else ""))
        print(f"{direction} D={dim} causal={causal!s:5} S={seq:>5} {label:38} {status}", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# On the GPU.

def _inputs(shape, seed=0):
    from .common import random_inputs

    return random_inputs(shape, getattr(torch, DTYPE), seed=seed)


def check_variant(direction, dim, causal, config):
    """Run ``config`` once on the small problem and check it against the float64 reference (raises if wrong);
    returns the errors ({quantity: {"err", "allowed"}})."""
    from ...checking.validation import check_backward, check_forward

    q, k, v = _inputs(dict(CHECK_SHAPE, dim=dim), seed=1)
    name = f"{direction} D={dim} causal={causal} {config}"
    if direction == "fwd":
        out, lse = flash_attention(q, k, v, causal=causal, config=config, return_lse=True)
        torch.cuda.synchronize()
        return check_forward(q, k, v, out, lse, causal=causal, quiet=True, name=name)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    d_out = torch.randn_like(out)
    grads = attention_backward(q, k, v, out, lse, d_out, causal=causal, config=config)[:3]
    torch.cuda.synchronize()
    return check_backward(q, k, v, d_out, grads, causal=causal, quiet=True, name=name)


def _compile(direction, dim, causal, seq, config):
    from .common import empty_query

    q = empty_query(_shape(dim, seq), DTYPE)
    if direction == "fwd":
        forward_kernel(q, q, causal=causal, config=config)
    else:
        forward_kernel(q, q, causal=causal)  # the forward whose graph the timed backward keeps
        backward_kernels(q, q, causal=causal, config=config)


def _timed(direction, causal, config, q, k, v):
    """The function timed for one of our variants (through the public API, like the peers)."""
    from .common import backward_timer

    if direction == "bwd":
        return backward_timer(lambda a, b, c: flash_attention(a, b, c, causal=causal, backward_config=config),
                              q, k, v)[0]

    def run():
        with torch.no_grad():
            return flash_attention(q, k, v, causal=causal, config=config)
    return run


def measure(cases=CASES, workers=8):
    """Every case: compile all variants in parallel, check each on the small problem, time the good ones beside
    cuDNN and FlashAttention-4. Returns the rows of the record."""
    from ...checking.checks import CheckFailed
    from ...core.labels import CUDNN, FA4
    from ..bench import attention_flops, tflops, time_side_by_side
    from .common import SDPA_PEERS, backward_timer, flash_attention_4, in_parallel, sdpa

    attention_api._registers_ran_out = lambda exc: False  # a variant is its config or a failure, never a fallback
    for case in cases:  # the table above is what the GPU ships
        for seq in case.seqs:
            default = (attention_api.default_backward_config("cuda", case.dim, case.causal) if case.direction == "bwd"
                       else attention_api.default_forward_config("cuda", case.dim, case.causal, seq_len=seq))
            assert default == shipped_config(case.direction, case.dim, case.causal, seq), (case, seq, default)
    fa4 = flash_attention_4()
    t0 = time.perf_counter()
    configs = {(c.direction, c.dim, c.causal, config) for c in cases for s in c.seqs for _, _, config in
               variants_for(c, s)}
    jobs = [("check", d, dim, causal, CHECK_SHAPE["seq"], config) for d, dim, causal, config in configs]
    jobs += [("time", c.direction, c.dim, c.causal, s, config) for c in cases for s in c.seqs
             for _, _, config in variants_for(c, s)]

    def build(job):
        _, direction, dim, causal, seq, config = job
        try:
            if job[0] == "check":  # the small problem's kernels (the backward's check also runs the forward)
                q = torch.empty(CHECK_SHAPE["batch"], CHECK_SHAPE["heads"], seq, dim, device="cuda",
                                dtype=getattr(torch, DTYPE))
                if direction == "fwd":
                    forward_kernel(q, q, causal=causal, config=config)
                else:
                    forward_kernel(q, q, causal=causal)
                    backward_kernels(q, q, causal=causal, config=config)
            else:
                _compile(direction, dim, causal, seq, config)
            return None
        except Exception as exc:
            return _failure(exc)

    build_errors = dict(zip([(j[0], j[1], j[2], j[3], j[4], j[5]) for j in jobs], in_parallel(build, jobs, workers)))
    print(f"compiled {len(jobs)} kernels ({len(configs)} configs) in {time.perf_counter() - t0:.0f} s", flush=True)

    checks = {}
    for direction, dim, causal, config in configs:
        error = build_errors["check", direction, dim, causal, CHECK_SHAPE["seq"], config]
        errors = None
        if error is None:
            try:
                errors = check_variant(direction, dim, causal, config)
            except CheckFailed as exc:  # a wrong variant is a row, not the end of the run
                error = "wrong: " + _failure(exc)
            except Exception as exc:  # so is one that cannot run (e.g. too much shared memory at launch)
                error = "failed to run: " + _failure(exc)
        checks[direction, dim, causal, config] = (errors, error)
    print(f"checked in {time.perf_counter() - t0:.0f} s", flush=True)

    rows = []
    for case in cases:
        for seq in case.seqs:
            shape = _shape(case.dim, seq)
            q, k, v = _inputs(shape)
            fns, meta = {}, {}
            for label, why, config in variants_for(case, seq):
                errors, error = checks[case.direction, case.dim, case.causal, config]
                error = error or build_errors["time", case.direction, case.dim, case.causal, seq, config]
                base = dict(direction=case.direction, causal=case.causal, dtype=DTYPE, impl=label,
                            why=why, config=_config_dict(config), check_shape=CHECK_SHAPE, errors=errors, **shape)
                if error is not None:
                    rows.append(dict(base, error=error))
                    print(f"{case.direction} D={case.dim} causal={case.causal!s:5} S={seq:>5} {label:38} "
                          f"not timed: {error}", flush=True)
                    continue
                try:
                    fns[label] = _timed(case.direction, case.causal, config, q, k, v)
                    fns[label]()
                except Exception as exc:
                    rows.append(dict(base, error="run: " + _failure(exc)))
                    continue
                meta[label] = base
            peers = {CUDNN: lambda a, b, c: sdpa(a, b, c, case.causal, SDPA_PEERS[CUDNN])}
            if fa4 is not None:
                peers[FA4] = lambda a, b, c: fa4(a, b, c, case.causal)
            for name, peer in peers.items():
                try:
                    if case.direction == "bwd":
                        fns[name] = backward_timer(peer, q, k, v)[0]
                    else:
                        fns[name] = (lambda p=peer, a=q, b=k, c=v: p(a, b, c))
                    fns[name]()
                    meta[name] = dict(direction=case.direction, causal=case.causal, dtype=DTYPE,
                                      impl=name, peer=True, **shape)
                except Exception as exc:
                    fns.pop(name, None)
                    rows.append(dict(direction=case.direction, causal=case.causal, dtype=DTYPE,
                                     impl=name, peer=True, error="run: " + _failure(exc), **shape))
            torch.cuda.synchronize()
            times = time_side_by_side(fns)
            flops = attention_flops(shape["batch"], shape["heads"], seq, seq, case.dim, causal=case.causal,
                                    mode=case.direction)
            for name, ms in times.items():
                row = dict(meta[name], ms=ms, tflops=tflops(flops, ms), error=None)
                for peer, key in ((FA4, "speed_vs_fa4"), (CUDNN, "speed_vs_cudnn")):
                    if peer in times:
                        row[key] = float(times[peer]) / float(ms)  # above 1: faster than the peer
                if "shipped" in times:
                    row["speed_vs_shipped"] = float(times["shipped"]) / float(ms)
                rows.append(row)
            del q, k, v, fns
            torch.cuda.empty_cache()
            print(f"timed {case.direction} D={case.dim} causal={case.causal} S={seq} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def print_table(rows):
    """One line per (case, implementation): TFLOP/s and speed ratios (above 1: faster than the named one)."""
    print(f"\n{'dir':3} {'D':>3} {'causal':6} {'S':>5}  {'implementation':38} {'ms':>7} {'TFLOP/s':>7} "
          f"{'÷FA4':>6} {'÷cuDNN':>6} {'÷shipped':>8}")
    for r in rows:
        head = f"{r['direction']:3} {r['dim']:>3} {r['causal']!s:6} {r['seq']:>5}  {r['impl'][:38]:38}"
        if r.get("error"):
            print(f"{head} {r['error'][:90]}")
            continue

        def ratio(key):
            return f"{r[key]:.3f}" if key in r else "   -"
        print(f"{head} {float(r['ms']):7.3f} {r['tflops']:7.0f} {ratio('speed_vs_fa4'):>6} "
              f"{ratio('speed_vs_cudnn'):>6} {ratio('speed_vs_shipped'):>8}")


def _write(out_dir, name, results, timing, notes):
    from ...core.device import machine_info
    from ..bench import with_spreads

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"name": name, "machine": machine_info(), "timing": timing, "notes": notes,
              "results": with_spreads(results)}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSON record")
    parser.add_argument("--compile-only", action="store_true", help="no GPU: lower for sm_90a and run ptxas")
    parser.add_argument("--no-ptxas", action="store_true", help="with --compile-only: lower only")
    parser.add_argument("--only", default=None, help="comma-separated directions to run (bwd,fwd)")
    parser.add_argument("--workers", type=int, default=8, help="parallel compiles")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant labels to keep beside the shipped config (e.g. dq_per_warpgroup)")
    args = parser.parse_args(argv)
    if args.variants is not None:
        keep_variants(args.variants.split(","))
    cases = CASES if args.only is None else tuple(c for c in CASES if c.direction in args.only.split(","))
    start = time.perf_counter()
    if args.compile_only:
        rows = compile_only(cases, ptxas=not args.no_ptxas, workers=args.workers)
        _write(args.out, "fa4_levers_compile", rows, "nothing timed: sm_90a lowering and ptxas on the CPU",
               f"{time.perf_counter() - start:.0f} s")
        return rows
    from ..bench import TIMING_METHOD

    rows = measure(cases, workers=args.workers)
    print_table(rows)
    _write(args.out, "fa4_levers", rows, TIMING_METHOD,
           "bf16, B·S = 16k, H·D = 2048; ours through flash_attention(config=/backward_config=); every variant "
           f"checked against float64 first on B={CHECK_SHAPE['batch']} H={CHECK_SHAPE['heads']} "
           f"S={CHECK_SHAPE['seq']}; run took {time.perf_counter() - start:.0f} s")
    return rows


if __name__ == "__main__":
    main()
