"""Device call for chapter 08 (issue #15), one part per process so that a CUDA error in one part cannot
poison the others. Run from a folder holding course_utils/ (a copy in the checkout's .gpu/hbwd/):

    python3 notes/hopper_backward_gpu_call.py ablation      # ablation record, then the tiling it picks
    python3 notes/hopper_backward_gpu_call.py precompile    # every kernel of the parts below, in parallel
    python3 notes/hopper_backward_gpu_call.py features | final | deterministic

``ablation`` rewrites HOPPER_BACKWARD_CONFIGS in this copy's course_utils/api/attention.py with the fastest
validated tiling per (head dim, mask), so every later process (and the notebook) runs the same kernel.
Records go to figures/ and to $OUT.
"""

import json
import os
import re
import shutil
import sys
import time

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
WORKERS = 14

import course_utils as cu  # noqa: E402
from course_utils.measure.benchmarks import common  # noqa: E402

common.in_parallel.__defaults__ = (WORKERS,)  # compiles are CPU-bound: use the machine's 16 cores

from course_utils import attention  # noqa: E402
from course_utils.api.attention import BackwardConfig, backward_kernels, forward_kernel  # noqa: E402
from course_utils.measure.bench import save_record  # noqa: E402
from course_utils.measure.benchmarks import CH08_SEQS, RECORDS, backward_ablation, comparison_shapes  # noqa: E402



def keep(name, results, notes=None):
    save_record(name, results, notes=notes)
    shutil.copy(cu.bench.FIGURES / f"{name}.json", OUT)
    print(f"[{time.time() - T0:5.0f} s] saved {name}", flush=True)


def pick_tilings(rows):
    """The fastest validated shipped-form tiling per (D, causal) -> BackwardConfig."""
    from course_utils.kernels.versions.flash_bwd_hopper_versions import VERSIONS

    by_number = {v.number: v for v in VERSIONS}
    shipped_form = {v.number for v in VERSIONS if v.shipped_code}
    chosen = {}
    for dim in (128, 64):
        for causal in (False, True):
            cands = [r for r in rows if r.get("version") in shipped_form and r["dim"] == dim and r["causal"] == causal
                     and r.get("error") is None and r.get("tflops")]
            if not cands:
                continue
            best = max(cands, key=lambda r: r["tflops"])
            block_M, block_N = by_number[best["version"]].tiling(dim, causal)
            chosen[dim, causal] = BackwardConfig(block_M, block_N, 2, 256, kernel="flash_bwd_hopper")
            print(f"D={dim} causal={causal}: {block_M} x {block_N} (version {best['version']}, "
                  f"{best['tflops']:.0f} TFLOP/s; candidates " +
                  ", ".join(f"v{r['version']} {r['tflops']:.0f}" for r in cands) + ")", flush=True)
    return chosen


def patch_attention(chosen):
    """Write the chosen tilings into this copy's HOPPER_BACKWARD_CONFIGS."""
    path = os.path.join(os.path.dirname(attention.__file__), "attention.py")
    text = open(path).read()
    for (dim, causal), c in chosen.items():
        pattern = rf"\({dim}, {causal}\): BackwardConfig\(\d+, \d+, 2, 256, kernel=\"flash_bwd_hopper\"\)"
        new = f'({dim}, {causal}): BackwardConfig({c.block_M}, {c.block_N}, 2, 256, kernel="flash_bwd_hopper")'
        text, n = re.subn(pattern, new, text)
        assert n == 1, (dim, causal)
    open(path, "w").write(text)
    with open(os.path.join(OUT, "chosen_configs.json"), "w") as f:
        json.dump({f"{d},{c}": v._asdict() for (d, c), v in chosen.items()}, f)


def final_shapes():
    return comparison_shapes(seq_lens=CH08_SEQS, dim=128) + comparison_shapes(seq_lens=CH08_SEQS, dim=64)


def precompile():
    import torch

    from course_utils.measure.benchmarks.ch08_hopper_backward import FEATURE_CASES, feature_inputs

    jobs = [(shape, torch.float16, causal, None, False, False) for shape in final_shapes() for causal in (False, True)]
    jobs += [(shape, torch.float16, causal, None, True, False) for causal in (False, True)
             for shape in comparison_shapes(seq_lens=(4096,), dim=128) + comparison_shapes(seq_lens=(4096,), dim=64)]
    jobs += [(shape, torch.bfloat16, causal, None, False, False) for shape in final_shapes() for causal in (False, True)]

    def build(job):
        shape, dtype, causal, _, deterministic, _ = job
        q = torch.empty(shape["batch"], shape["heads"], shape["seq"], shape["dim"], device="cuda", dtype=dtype)
        forward_kernel(q, q, causal=causal)
        backward_kernels(q, q, causal=causal, deterministic=deterministic)

    def build_feature(job):
        name, deterministic = job
        q, k, _, sinks, options = feature_inputs(FEATURE_CASES[name])
        forward_kernel(q, k, has_sinks=sinks is not None, **options)
        backward_kernels(q, k, deterministic=deterministic, **options)

    def run(job):
        try:
            (build_feature if isinstance(job[0], str) else build)(job)
        except Exception as exc:
            print("precompile failed:", job[:3], type(exc).__name__, str(exc).strip().splitlines()[-1][:200], flush=True)

    feature_jobs = [(name, det) for name in FEATURE_CASES for det in (False, True)]
    common.in_parallel(run, feature_jobs + jobs)  # features, fp16, deterministic, bf16
    print(f"[{time.time() - T0:5.0f} s] precompiled {len(feature_jobs) + len(jobs)} configurations", flush=True)


part = sys.argv[1]
print(f"== {part}", flush=True)
if part == "ablation":
    rows = backward_ablation()
    keep("ch08_backward_ablation_h100", rows)
    patch_attention(pick_tilings(rows))
elif part == "precompile":
    precompile()
elif part == "features":
    keep("ch08_feature_checks_h100", RECORDS["ch08_feature_checks_h100"]())
elif part == "final":  # RECORDS["ch08_backward_vs_peers_h100"], saved after each dtype
    from course_utils.measure.benchmarks.ch05_backward import backward_vs_peers

    rows = []
    for dtype in ("float16", "bfloat16"):
        rows += backward_vs_peers(shapes=final_shapes(), dtypes=(dtype,), modes=("bwd",))
        keep("ch08_backward_vs_peers_h100", rows)
elif part == "deterministic":
    keep("ch08_deterministic_h100", RECORDS["ch08_deterministic_h100"]())
print(f"[{time.time() - T0:5.0f} s] {part} done", flush=True)
