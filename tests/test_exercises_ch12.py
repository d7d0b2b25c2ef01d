"""Chapter 12's exercises: each solution passes its checker, each mutant fails with its diagnosis in one line, and
the learner's edition (solutions stripped) says "not written yet". The solutions are read from the notebook's .py;
the mutants are checked two at a time in worker processes (one kernel compilation each, about two seconds)."""

from exercise_harness import exercise_source, exercise_tests, load
from exercise_mutants_fp8 import EXERCISES

# Solutions, learner's editions and mutants of exercise_mutants_fp8.py (exercise_harness.py).
globals().update(exercise_tests("exercise_mutants_fp8"))


def test_solution_lowers_for_the_h100():
    """The skeleton with its solution also lowers for sm_90a (float32 tiles: this checks the TileLang, not FP8)."""
    import tilelang
    from tilelang import tvm

    exercise = EXERCISES["ch12_fp8_forward"]
    prim_func = load(exercise, exercise_source(exercise), "cuda")(1, 4, 256, 256, 64, causal=True, block_M=64,
                                                                   block_N=64, target="cuda")
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert "__global__" in tilelang.lower(prim_func).kernel_source
