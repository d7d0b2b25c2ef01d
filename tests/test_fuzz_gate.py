"""The correctness gate's CPU tier (``python -m course_utils.check --fuzz``), and the gate failing on planted bugs.

The tier draws at least 200 random problems over the public API from a seed that changes from run to run;
a failure prints the seed and one reproducer line per failing problem. ``FUZZ_SEED=N`` repeats a run.
"""

import os
import random
import time

import pytest
import torch

from course_utils.checking import fuzz

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tier runs through the GPU test runner")

CPU_PROBLEMS, CPU_SECONDS = fuzz.default_tier(gpu=False)[:2]


def test_cpu_tier_of_random_problems():
    seed = int(os.environ.get("FUZZ_SEED", random.randrange(2**31)))
    lines = []
    start = time.time()
    problems = fuzz.draw_problems(seed, CPU_PROBLEMS, gpu=False)
    run, failed = fuzz.run_gate(problems, seconds=CPU_SECONDS, out=lines.append)
    report = "\n".join([f"seed {seed} (FUZZ_SEED={seed} repeats this run), {time.time() - start:.0f} s", *lines])
    print(report)
    assert failed == 0, report
    assert run >= CPU_PROBLEMS, f"only {run} of {CPU_PROBLEMS} problems ran within {CPU_SECONDS} s\n{report}"


# One shape that every planted bug below reaches: a window, S_q ≠ S_k, and keys not a multiple of the tile.
# In float32 and in float16 (whose gradients are judged against the larger of two low-precision baselines).
_PLANT_PROBLEMS = [fuzz.Problem(api="dense", batch=1, heads=2, heads_kv=1, seq_q=20, seq_k=37, dim=16, dtype=dtype,
                                causal=True, window=5, seed=seed, score_scale=scale)
                   for dtype, seed, scale in (("float32", 0, 1.0), ("float32", 1, 12.0), ("float16", 2, 12.0))]


@pytest.mark.parametrize("bug", ["window_off_by_one", "skip_ragged_key_block", "unwritten_output", "scaled_dk"])
def test_gate_fails_on_a_planted_bug(bug):
    lines = []
    run, failed = fuzz.run_gate(_PLANT_PROBLEMS, seconds=120, plant_name=bug, out=lines.append)
    assert run == len(_PLANT_PROBLEMS) and failed == run, "\n".join(lines)


# dsinks sums one term per row: its baseline includes the sum taken from the kernel's own O and LSE, which must
# not hide a dsinks 10% off. In float16, with more rows than one tile, causal or not, and a window of 2.
_SINK_PROBLEMS = [fuzz.Problem(api="dense", batch=2, heads=2, heads_kv=1, seq_q=40, seq_k=37, dim=16, dtype="float16",
                               causal=causal, window=window, sinks=True, sink_kind=kind, seed=seed)
                  for seed, (kind, causal, window) in enumerate((("normal", True, None), ("normal", False, None),
                                                                 ("normal", True, 2)))]


def test_gate_fails_on_dsinks_scaled_by_0_9_and_passes_without():
    lines = []
    run, failed = fuzz.run_gate(_SINK_PROBLEMS, seconds=120, plant_name="scaled_dsinks", out=lines.append)
    assert run == len(_SINK_PROBLEMS) and failed == run, "\n".join(lines)
    lines = []
    run, failed = fuzz.run_gate(_SINK_PROBLEMS, seconds=120, out=lines.append)
    assert run == len(_SINK_PROBLEMS) and failed == 0, "\n".join(lines)


def test_the_same_problems_pass_without_a_plant():
    lines = []
    run, failed = fuzz.run_gate(_PLANT_PROBLEMS, seconds=120, out=lines.append)
    assert run == len(_PLANT_PROBLEMS) and failed == 0, "\n".join(lines)


# A correct float32 kernel the gate once failed: 12× scores, so P's exponents reach ~10³ and their float32 rounding
# (the scale folded into exp2) moves dK by 1.1e-5 where float32's plain tolerance allowed 1.0e-5.
_LARGE_EXPONENT = ('{"api": "varlen", "batch": 1, "heads": 4, "heads_kv": 1, "seq_q": 0, "seq_k": 0, "dim": 16, '
                   '"dtype": "float32", "causal": true, "window": 22, "sinks": false, "sm_scale": null, '
                   '"deterministic": false, "page_size": null, "modifier": null, "seed": 1402496592, '
                   '"sink_kind": "normal", "score_scale": 12.0, "lengths_q": [3], "lengths_k": [3]}')


def test_float32_tolerance_grows_with_the_exponents_and_still_catches_a_scaled_gradient():
    problem = fuzz.Problem.parse(_LARGE_EXPONENT)
    lines = []
    assert fuzz.run_gate([problem], seconds=60, out=lines.append) == (1, 0), "\n".join(lines)
    q, k = torch.randn(3, 4, 16) * 12, torch.randn(3, 1, 16) * 12
    ref = torch.randn(3, 1, 16, dtype=torch.float64)
    with pytest.raises(fuzz.CheckFailed):
        fuzz._judge("dK", (ref * 0.999).float(), ref, ref.float(), torch.float32, fuzz.exponent_bound(q, k))


def test_a_failure_line_replays_its_problem():
    problem = fuzz.draw_problems(5, 3, gpu=False)[2]
    assert fuzz.Problem.parse(problem.line().split("--replay ")[1].strip("'")) == problem


# The FP8 forward (CPU tier only): a ragged causal shape with S_q > S_k (rows that see no key), rotated and not, in
# float32 and bfloat16 (its output rounded to the input dtype), one with very large scores.
_FP8_PROBLEMS = [fuzz.Problem(api="fp8", batch=1, heads=4, heads_kv=2, seq_q=37, seq_k=29, dim=16, dtype=dtype,
                              causal=True, modifier=modifier, seed=seed, score_scale=scale)
                 for dtype, modifier, seed, scale in (("float32", None, 0, 1.0), ("bfloat16", "hadamard", 1, 1.0),
                                                      ("float32", "hadamard", 2, 12.0))]


def test_fp8_problems_pass_and_fail_with_p_left_unrounded():
    lines = []
    run, failed = fuzz.run_gate(_FP8_PROBLEMS, seconds=120, out=lines.append)
    assert run == len(_FP8_PROBLEMS) and failed == 0, "\n".join(lines)
    lines = []
    run, failed = fuzz.run_gate(_FP8_PROBLEMS, seconds=120, plant_name="fp8_p_unrounded", out=lines.append)
    assert run == len(_FP8_PROBLEMS) and failed == run, "\n".join(lines)


def test_the_gpu_tier_draws_fp8_problems_the_hopper_kernel_takes():
    from course_utils.api.fp8 import FP8_GPU_HEAD_DIMS

    fp8 = [p for p in fuzz.draw_problems(3, 300, gpu=True) if p.api == "fp8"]
    assert fp8 and all(p.dim in FP8_GPU_HEAD_DIMS and p.window is None and not p.sinks for p in fp8)
