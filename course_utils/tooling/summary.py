"""The headline table of the README, generated from the stored H100 records.

    python -m course_utils.tooling.summary      # prints the markdown table

tests/test_readme.py checks that the README shows exactly this table, so the README's numbers
can only come from the records.
"""

from ..core.labels import FA4, OURS, PEERS
from ..measure.bench import load_record


def _pick(rows, impl, causal, seq=4096, dim=128, dtype="float16", optional=False):
    """The TFLOP/s of one row (backward records also time fwd+bwd: their "bwd" rows are the backward); with
    ``optional``, None where the record has no such row (FlashAttention-4 in records measured without it)."""
    found = [r for r in rows if r["impl"] == impl and r["causal"] == causal and r["seq"] == seq
             and r["dim"] == dim and r["dtype"] == dtype and r.get("mode", "bwd") in ("fwd", "bwd")]
    if optional and not found:
        return None
    (row,) = found
    return row["tflops"]


def headline_table():
    lines = ["| pass (fp16, B=4, H=16, S=4096, D=128) | ours TFLOP/s | FlashAttention-2 | cuDNN | FlashAttention-4 "
             "| ours ÷ FA2 | ours ÷ cuDNN | ours ÷ FA4 |",
             "|---|---|---|---|---|---|---|---|"]
    sources, fa4_versions = [], set()
    for label, name in (("forward (ch07 kernel, Hopper)", "ch07_forward_vs_peers_h100"),
                        ("forward (ch04 kernel)", "ch04_forward_final_h100"),
                        ("backward (ch08 kernel, Hopper)", "ch08_backward_vs_peers_h100"),
                        ("backward (ch05 kernel)", "ch05_backward_vs_peers_h100")):
        record = load_record(name)
        for causal in (False, True):
            ours = _pick(record["results"], OURS, causal)
            fa2, cudnn = (_pick(record["results"], p, causal) for p in PEERS)
            fa4 = _pick(record["results"], FA4, causal, optional=True)
            fa4_cells = ("–", "–") if fa4 is None else (f"{fa4:.0f}", f"{ours / fa4:.2f}×")
            if fa4 is not None:
                fa4_versions.add(record["machine"]["flash_attn_4"])
            lines.append(f"| {label}, {'causal' if causal else 'non-causal'} | {ours:.0f} | {fa2:.0f} | {cudnn:.0f} "
                         f"| {fa4_cells[0]} | {ours / fa2:.2f}× | {ours / cudnn:.2f}× | {fa4_cells[1]} |")
        m = record["machine"]
        timing = record.get("timing") or ""
        timing = ("synchronised after each call" if not timing else
                  "calls back to back, in changing orders" if "order changes" in timing else "calls back to back")
        sources.append(f"`figures/{name}.json` ({m['gpu']}, {m['date']}, {timing})")
    m = record["machine"]
    lines.append("")
    lines.append(f"Measured side by side in one run per record: {', '.join(sources)}; torch {m['torch']}, "
                 f"tilelang {m['tilelang']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, driver {m['driver']}. "
                 "FLOPs: forward 4·B·H·S²·D, backward 2.5× forward, both halved for causal. FlashAttention-4 is "
                 f"`flash-attn-4` {', '.join(sorted(fa4_versions))}, timed where a record was measured with it "
                 "installed (– elsewhere).")
    return "\n".join(lines)


if __name__ == "__main__":
    print(headline_table())
