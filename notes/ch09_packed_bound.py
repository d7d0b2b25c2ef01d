"""Chapter 09, issue 27: how much of the packed/dense gap is structural (CPU only, no GPU).

For the record's batch (varlen_lengths(65536, 128, 8192), seed 0; H = 16, D = 128) and the dense
batches it is compared with (16 × 4096, and the record's FLOP-matched 12 × 5376): the fraction of
tile FLOPs that are useful (pairs counted, tiles × block_M × block_N visited), and the makespan of the
blocks on 132 SMs in units of one 128×128 tile, against the perfectly balanced Σ / 132.

Block costs: tiles + ``overhead`` (a non-persistent block's prologue/epilogue, in tiles); the hardware
is modelled as handing blocks out in launch order to the first free SM (greedy list scheduling).
"""
import heapq
import json
import sys

sys.path.insert(0, ".")
from course_utils.measure.benchmarks.ch09_varlen_decode import _equal_lengths, varlen_lengths  # noqa: E402

SMS, H = 132, 16


def cdiv(a, b):
    return -(-a // b)


def fwd_blocks(n, bm, bn, causal):
    """Tiles visited by each query block of a sequence of n (q = k lengths), in query-block order."""
    nkb = cdiv(n, bn)
    return [min(nkb, cdiv((qb + 1) * bm, bn)) if causal else nkb for qb in range(cdiv(n, bm))]


def bwd_blocks(n, bm, bn, causal):
    """Query-block steps of each key block (backward), in key-block order."""
    nqb = cdiv(n, bm)
    return [nqb - ((kb * bn) // bm if causal else 0) for kb in range(cdiv(n, bn))]


def useful_pairs(n, causal):
    return n * (n + 1) // 2 if causal else n * n


def greedy(costs, sms=SMS):
    """Makespan of blocks given to the first free SM, in order."""
    heap = [0.0] * sms
    for c in costs:
        t = heapq.heappop(heap)
        heapq.heappush(heap, t + c)
    return max(heap)


def analyse(lengths, bm, bn, causal, kind, overhead, schedule):
    blocks = fwd_blocks if kind == "fwd" else bwd_blocks
    per_seq = [blocks(n, bm, bn, causal) for n in lengths]
    tiles = sum(sum(b) for b in per_seq) * H
    useful = sum(useful_pairs(n, causal) for n in lengths) * H
    # Tile work in 128×128 units.
    unit = bm * bn / (128 * 128)
    costs = []
    if schedule == "grid":  # blockIdx.x = slot (heaviest first for a causal forward), then head, then sequence
        longest = max(len(b) for b in per_seq)
        for b in per_seq:
            for _h in range(H):
                for slot in range(longest):
                    if kind == "fwd" and causal:
                        idx = len(b) - 1 - slot
                    else:
                        idx = slot
                    costs.append((b[idx] + overhead) * unit if 0 <= idx < len(b) else 0.02)  # idle block: ~free
    elif schedule == "list":  # heaviest first
        costs = sorted(((c + overhead) * unit for b in per_seq for c in b for _h in range(H)), reverse=True)
    elif schedule == "persistent":  # one block per SM, LPT over the heaviest-first list, no per-block overhead
        costs = sorted((c * unit for b in per_seq for c in b for _h in range(H)), reverse=True)
    span = greedy(costs)
    ideal = sum(costs) / SMS
    return dict(tiles=tiles, useful_fraction=useful / (tiles * bm * bn), blocks=sum(len(b) for b in per_seq) * H,
                waves=sum(len(b) for b in per_seq) * H / SMS, makespan=span, ideal=ideal, balance=ideal / span,
                useful_tiles=useful / (128 * 128), useful_per_makespan=useful / (128 * 128) / (span * SMS))


def main():
    lengths = varlen_lengths(65536, 128, 8192)
    eb, es = _equal_lengths(lengths)
    out = dict(lengths=lengths, batches={})
    cases = [("fwd", 128, 128), ("bwd", 64, 128)]
    for causal in (True, False):
        for kind, bm, bn in cases:
            dense_bm = bm if kind == "fwd" or causal else 80  # chapter 08: 80 × 128 non-causal, 64 × 128 causal
            rows = {
                "packed grid": analyse(lengths, bm, bn, causal, kind, 1, "grid"),
                "packed list": analyse(lengths, bm, bn, causal, kind, 1, "list"),
                "packed persistent": analyse(lengths, bm, bn, causal, kind, 0, "persistent"),
                "dense 16×4096": analyse([4096] * 16, dense_bm, bn, causal, kind, 0 if kind == "fwd" else 1,
                                         "persistent" if kind == "fwd" else "grid"),
                f"dense {eb}×{es}": analyse([es] * eb, dense_bm, bn, causal, kind, 0 if kind == "fwd" else 1,
                                           "persistent" if kind == "fwd" else "grid"),
            }
            key = f"{kind} {'causal' if causal else 'full'}"
            out["batches"][key] = rows
            print(f"\n{key}: (block {bm}×{bn}; dense backward {dense_bm}×{bn})")
            print(f"  {'':22s} {'useful/tile':>11s} {'blocks':>7s} {'waves':>6s} {'balance':>8s} "
                  f"{'useful work / (makespan·SMs)':>28s}")
            for name, r in rows.items():
                print(f"  {name:22s} {r['useful_fraction']:11.3f} {r['blocks']:7d} {r['waves']:6.1f} "
                      f"{r['balance']:8.3f} {r['useful_per_makespan']:28.3f}")
    json.dump(out, open("notes/ch09_packed_bound.json", "w"), indent=1)


if __name__ == "__main__":
    main()
