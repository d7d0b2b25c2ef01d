"""A/B of the persistent flex forward's tile orders at chapter 11's record shape (an H100 or H200).

    python -m course_utils.measure.benchmarks.flex_order_ab --out DIR             # on an sm_90 GPU
    python -m course_utils.measure.benchmarks.flex_order_ab --out DIR --cases documents

Three forwards of ``flex_forward``, chosen by ``FlexConfig.fwd_kernel``: chapter 07's rotated loop ("rotated"), its
persistent kernel in the causal mask's folded order ("persistent") and the same kernel taking the block mask's rows
longest first ("persistent_sorted", ``BlockMask.rows_by_cost``); and ``flex_attention``'s own choice ("hopper").
Masks: the record's documents, causal and prefix-LM cases (``ch11_flex.flex_cases``; B = 2, H = 16, S = 8192,
D = 128, bf16). Every variant is first checked on every head against the float64 reference
(``checking.validation.check_forward``: the FlashAttention criterion); a variant that fails is recorded with its
error and not timed. Calls take turns in changing orders (``bench.time_side_by_side``); the JSON
(``DIR/flex_order_ab.json``) keeps each time's spread over rounds and the ratio of each variant to the rotated loop.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ...api.flex import (
    cached_plan,
    create_block_mask,
    default_flex_config,
    flex_forward,
    flex_forward_kernel,
    flex_forward_row,
)
from ...checking.flex_reference import flex_references
from ...checking.validation import check_forward
from ..bench import machine_info, time_side_by_side, with_spreads
from .ch11_flex import FLEX_SHAPE, flex_cases
from .common import in_parallel, random_inputs

__all__ = ["VARIANTS", "CASES", "order_ab"]

VARIANTS = ("rotated", "persistent", "persistent_sorted", "hopper")  # FlexConfig.fwd_kernel values
CASES = ("documents", "causal", "prefix-LM")


def order_ab(cases=CASES, shape=None, dtype=torch.bfloat16, rounds=6):
    """{case: {"rows": {variant: FLEX row}, "ms": {variant: Timing}, "errors": {...}, "vs_rotated": {...}}}."""
    sh = dict(shape or FLEX_SHAPE)
    b, h, s, d = sh["batch"], sh["heads"], sh["seq"], sh["dim"]
    specs = {c: spec for c, spec in flex_cases(sh, "cuda").items() if c in cases}
    q0 = torch.empty(b, h, s, d, dtype=dtype, device="cuda")
    masks, jobs = {}, []
    for case, (score_mod, mask_mod, mask_b, _, _) in specs.items():
        masks[case] = create_block_mask(mask_mod, mask_b, None, s, s, device="cuda")
        plan = cached_plan(score_mod, mask_mod)
        for variant in VARIANTS:
            config = default_flex_config("cuda", masks[case].block)._replace(fwd_kernel=variant)
            jobs.append((plan, masks[case], config))
    in_parallel(lambda job: flex_forward_kernel(q0, q0, job[0], job[1], 1.0 / math.sqrt(d), job[2]), jobs)
    results = {}
    for case, (score_mod, mask_mod, _, _, note) in specs.items():
        bm, plan = masks[case], cached_plan(score_mod, mask_mod)
        q, k, v = random_inputs(sh, dtype)
        refs = flex_references(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
        fns, rows, errors = {}, {}, {}
        for variant in VARIANTS:
            config = default_flex_config("cuda", bm.block)._replace(fwd_kernel=variant)
            rows[variant] = flex_forward_row(q, k, bm, 1.0 / math.sqrt(d), config)

            def forward(config=config):
                return flex_forward(q, k, v, plan, bm, 1.0 / math.sqrt(d), config=config)

            try:
                out, lse = forward()
                errors[variant] = check_forward(q, k, v, out, lse, refs=refs, name=f"{case}, {variant}", quiet=True)
            except Exception as exc:  # noqa: BLE001  (a wrong or failing variant is a row, not timed)
                errors[variant] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                continue
            fns[variant] = lambda f=forward: f()[0]
        del refs
        ms = time_side_by_side(fns, rounds=rounds)
        base = ms.get("rotated")
        results[case] = {"note": note, "rows": rows, "ms": ms, "errors": errors, "skipped": bm.fraction_skipped(),
                         "vs_rotated": {v: round(base / t, 4) for v, t in ms.items()} if base else {}}
        print(f"{case:10} " + ", ".join(f"{v} {t:.4f} ms ({rows[v]})" for v, t in ms.items()), flush=True)
        torch.cuda.empty_cache()
    return {"shape": dict(sh, dtype=str(dtype).removeprefix("torch.")), "cases": results}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    start = time.time()
    results = order_ab(args.cases, rounds=args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"name": "flex_order_ab", "machine": machine_info(), "seconds": round(time.time() - start, 1),
              "results": with_spreads(results)}
    (args.out / "flex_order_ab.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / 'flex_order_ab.json'} in {record['seconds']} s")


if __name__ == "__main__":
    main()
