"""One device call for chapter 08 (issue #15): features, ablation, tiling pick, deterministic cost,
final comparison. Each part is guarded by the time left; every record is written to $OUT as soon as
it exists. Run from a folder holding course_utils/ (copied into /work/main/.gpu/hbwd/)."""

import json
import os
import shutil
import sys
import time
import traceback

T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "500"))
OUT = os.environ.get("OUT", "/tmp/out")
PARTS = sys.argv[1:] or ["features", "ablation", "deterministic", "final"]

import torch  # noqa: E402

import course_utils as cu  # noqa: E402
from course_utils import attention  # noqa: E402
from course_utils.attention import BackwardConfig  # noqa: E402
from course_utils.bench import save_record  # noqa: E402
from course_utils.benchmarks import CH08_SEQS, RECORDS, backward_ablation, comparison_shapes  # noqa: E402
from course_utils.benchmarks.ch05_backward import backward_vs_peers  # noqa: E402


def left():
    return BUDGET - (time.time() - T0)


def keep(name, results, notes=None):
    save_record(name, results, notes=notes)
    shutil.copy(cu.bench.FIGURES / f"{name}.json", OUT)
    print(f"[{time.time() - T0:5.0f} s] saved {name}", flush=True)


print(cu.describe_machine() if hasattr(cu, "describe_machine") else "", flush=True)
print("torch", torch.__version__, "| parts", PARTS, flush=True)

if "features" in PARTS:
    try:
        keep("ch08_feature_checks_h100", RECORDS["ch08_feature_checks_h100"]())
    except Exception:
        traceback.print_exc()

ablation = None
if "ablation" in PARTS:
    try:
        ablation = backward_ablation()
        keep("ch08_backward_ablation_h100", ablation)
    except Exception:
        traceback.print_exc()

# The tiling of the final comparison: the fastest validated shipped-form version per (D, causal).
SHIPPED_FORM = {9, 10, 16}
if ablation:
    from course_utils.flash_bwd_hopper_versions import VERSIONS
    by_number = {v.number: v for v in VERSIONS}
    for dim in (128, 64):
        for causal in (False, True):
            rows = [r for r in ablation if r.get("version") in SHIPPED_FORM and r["dim"] == dim
                    and r["causal"] == causal and r.get("error") is None and "tflops" in r]
            if rows:
                best = max(rows, key=lambda r: r["tflops"])
                block_M, block_N = by_number[best["version"]].tiling(dim, causal)
                attention.HOPPER_BACKWARD_CONFIGS[dim, causal] = BackwardConfig(block_M, block_N, 2, 256,
                                                                                kernel="flash_bwd_hopper")
                print(f"D={dim} causal={causal}: tiling {block_M} x {block_N} (version {best['version']}, "
                      f"{best['tflops']:.0f} TFLOP/s)", flush=True)
    print({str(k): v._asdict() for k, v in attention.HOPPER_BACKWARD_CONFIGS.items()}, flush=True)
    with open(os.path.join(OUT, "chosen_configs.json"), "w") as f:
        json.dump({str(k): v._asdict() for k, v in attention.HOPPER_BACKWARD_CONFIGS.items()}, f)

if "deterministic" in PARTS and left() > 120:
    try:
        keep("ch08_deterministic_h100", RECORDS["ch08_deterministic_h100"]())
    except Exception:
        traceback.print_exc()

if "final" in PARTS:
    rows = []
    for dim in (128, 64):
        if left() < 150:
            print(f"skipping the final comparison at D={dim}: {left():.0f} s left", flush=True)
            continue
        try:
            rows += backward_vs_peers(shapes=comparison_shapes(seq_lens=CH08_SEQS, dim=dim),
                                      dtypes=("float16", "bfloat16"))
            keep("ch08_backward_vs_peers_h100", rows)
        except Exception:
            traceback.print_exc()
print(f"done in {time.time() - T0:.0f} s", flush=True)
