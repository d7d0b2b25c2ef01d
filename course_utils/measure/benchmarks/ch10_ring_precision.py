"""What sending the ring's sums in 16 bits costs in accuracy, on the CPU (no kernel, no process group).

The lean ring (``course_utils.api.ring``) keeps the running O and the travelling dK/dV sums in the
input dtype, where the first version kept them in float32. This module measures the difference at
sizes and world sizes the gloo tests cannot reach: every block's exact (float64) contribution is
rounded to the input dtype as a kernel's output is, then the contributions are summed the way each
version sums them, and the result is compared with the float64 reference by the course's
FlashAttention criterion (error ≤ ERROR_FACTOR × the error of PyTorch's attention in the input
dtype + ERROR_SLACK).

* O: float32 running sum rounded once ("float32") vs running O rounded after each merge ("dtype").
* dQ: each call's dQ rounded then summed in float32 (the first version) vs one float32 sum, rounded
  once (the lean ring: the kernels add into one float32 accumulator).
* dK, dV: rounded contributions summed in float32 and rounded once vs summed in the dtype, rounded
  after every addition (the lean ring: the sums travel in the dtype).

``python -m course_utils.measure.benchmarks.ch10_ring_precision`` prints err / allowed for each.
"""

from __future__ import annotations

import json
import math
import sys

import torch

from ...checking.checks import ERROR_FACTOR, ERROR_SLACK
from ...checking.validation import references
from ...core.reference import visibility_mask

__all__ = ["accumulation_errors", "main"]


def _rd(x, dtype):
    return x.to(dtype).double()


def accumulation_errors(world, *, seq=2048, heads=2, dim=64, dtype=torch.bfloat16, causal=False, seed=0):
    """{quantity: {scheme: err / allowed}} for a contiguous split over ``world`` ranks (see the module)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(1, heads, seq, dim, generator=g).to(dtype) for _ in range(4))
    refs = references(q, k, v, d_out=d_out, causal=causal)
    names = ("dQ", "dK", "dV")
    reference = {"O": refs["out"], **dict(zip(names, refs["grads"][:3]))}
    low = {"O": refs["out_low"], **dict(zip(names, refs["grads_low"][:3]))}
    qd, kd, vd, dod = (t.double() for t in (q, k, v, d_out))
    scale = 1 / math.sqrt(dim)
    scores = qd @ kd.transpose(-1, -2) * scale
    scores = scores.masked_fill(~visibility_mask(seq, seq, causal=causal), float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    p = torch.exp(scores - lse)
    out = p @ vd
    d_s = p * (dod @ vd.transpose(-1, -2) - (dod * out).sum(-1, keepdim=True))
    part = seq // world
    shard = [slice(r * part, (r + 1) * part) for r in range(world)]
    result = {name: {} for name in ("O", *names)}
    # O: rank r merges the blocks of sources r, r−1, … (the lap's order)
    o_f32, o_low = torch.empty_like(out), torch.empty_like(out)
    for r in range(world):
        acc32 = acc_low = lse_acc = None
        for step in range(world):
            cols = shard[(r - step) % world]
            s_b = scores[:, :, shard[r], cols]
            lse_b = torch.logsumexp(s_b, -1, keepdim=True)
            if torch.isinf(lse_b).all():
                continue
            o_b = _rd(torch.nan_to_num(torch.exp(s_b - lse_b)) @ vd[:, :, cols], dtype)
            if acc32 is None:
                acc32, acc_low, lse_acc = o_b, o_b, lse_b
                continue
            total = torch.logaddexp(lse_acc, lse_b)
            w_old, w_new = torch.exp(lse_acc - total), torch.nan_to_num(torch.exp(lse_b - total))
            acc32 = (acc32 * w_old + o_b * w_new).float().double()
            acc_low = _rd(acc_low * w_old + o_b * w_new, dtype)
            lse_acc = total
        o_f32[:, :, shard[r]], o_low[:, :, shard[r]] = _rd(acc32, dtype), acc_low
    grads = {name: {"float32": torch.zeros_like(out), "dtype": torch.zeros_like(out)} for name in names}
    for r in range(world):  # dQ of rank r: one contribution per source
        parts = [d_s[:, :, shard[r], shard[s]] @ kd[:, :, shard[s]] * scale for s in range(world)]
        grads["dQ"]["float32"][:, :, shard[r]] = _rd(sum(_rd(x, dtype) for x in parts), dtype)
        grads["dQ"]["dtype"][:, :, shard[r]] = _rd(sum(parts), dtype)
    for s in range(world):  # dK, dV of source s: contributions of ranks s, s+1, … in the lap's order
        order = [(s + step) % world for step in range(world)]
        for name, fn in (("dK", lambda r: d_s[:, :, shard[r], shard[s]].transpose(-1, -2) @ qd[:, :, shard[r]] * scale),
                         ("dV", lambda r: p[:, :, shard[r], shard[s]].transpose(-1, -2) @ dod[:, :, shard[r]])):
            contributions = [_rd(fn(r), dtype) for r in order]
            grads[name]["float32"][:, :, shard[s]] = _rd(sum(contributions), dtype)
            running = contributions[0]
            for c in contributions[1:]:
                running = _rd(running + c, dtype)
            grads[name]["dtype"][:, :, shard[s]] = running

    def ratio(x, name):
        err = float((x - reference[name]).abs().max())
        base = float((low[name].double() - reference[name]).abs().max())
        return round(err / (ERROR_FACTOR * base + ERROR_SLACK), 4)

    result["O"] = {"float32": ratio(o_f32, "O"), "dtype": ratio(o_low, "O")}
    for name in names:
        result[name] = {scheme: ratio(x, name) for scheme, x in grads[name].items()}
    return result


def main(argv=None):
    torch.set_num_threads(1)
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            for world in (2, 4, 8):
                errors = accumulation_errors(world, dtype=dtype, causal=causal)
                rows.append(dict(dtype=str(dtype).replace("torch.", ""), causal=causal, world=world, **errors))
                print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
