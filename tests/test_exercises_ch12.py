"""Chapter 12's exercises: each solution passes its checker, each mutant fails with its diagnosis in one line, and
the learner's edition (solutions stripped) says "not written yet". The solutions are read from the notebook's .py;
the mutants are checked two at a time in worker processes (one kernel compilation each, about two seconds)."""

import pytest
from exercise_harness import (
    assert_blank_says_not_written_yet,
    assert_diagnosed,
    assert_passes,
    exercise_source,
    load,
    mutant_verdicts,
)
from exercise_mutants_fp8 import EXERCISES, MUTANTS


@pytest.fixture(scope="module")
def verdicts():
    return mutant_verdicts("exercise_mutants_fp8")


@pytest.mark.parametrize("key", EXERCISES)
def test_solution_passes(key, capsys):
    exercise = EXERCISES[key]
    assert_passes(exercise, exercise_source(exercise), "solution", capsys)


@pytest.mark.parametrize("key", EXERCISES)
def test_blank_says_not_written_yet(key):
    assert_blank_says_not_written_yet(EXERCISES[key])


@pytest.mark.parametrize("index", range(len(MUTANTS)), ids=[f"{m.exercise}: {m.name}" for m in MUTANTS])
def test_mutant_gets_its_diagnosis(index, verdicts):
    assert_diagnosed(MUTANTS[index], verdicts[index])


def test_every_exercise_has_mutants():
    assert {m.exercise for m in MUTANTS} == set(EXERCISES)


def test_solution_lowers_for_the_h100():
    """The skeleton with its solution also lowers for sm_90a (float32 tiles: this checks the TileLang, not FP8)."""
    import tilelang
    from tilelang import tvm

    exercise = EXERCISES["ch12_fp8_forward"]
    prim_func = load(exercise, exercise_source(exercise), "cuda")(1, 4, 256, 256, 64, causal=True, block_M=64,
                                                                   block_N=64, target="cuda")
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        assert "__global__" in tilelang.lower(prim_func).kernel_source
