"""The exercises of chapters 04 and 07–10 that run the learner's code: each solution passes its checker,
each mutant fails with its diagnosis in one line, each correct variant passes, and the learner's edition
(solutions stripped) says "not written yet" in one line. The solutions are read from the notebooks' .py
sources; the mutants are checked in worker processes (two at a time, or one beside each pytest-xdist worker on
two cores).
"""

import importlib
import re
import shutil

import pytest
from exercise_harness import NOTEBOOKS, exercise_source, exercise_tests, load
from exercise_mutants_speed_and_scale import EXERCISES

from course_utils.exercises.common import ExerciseIncomplete


def _why_unchecked_here(mutant):
    """A mutant that only ptxas sees needs nvcc, which a machine without the CUDA toolkit lacks."""
    if mutant.diagnosis.startswith("ptxas") and shutil.which("nvcc") is None:
        return "only ptxas sees this mutant, and nvcc is not installed here"
    return None


# Solutions, learner's editions, mutants and correct variants of exercise_mutants_speed_and_scale.py.
globals().update(exercise_tests("exercise_mutants_speed_and_scale", why_mutant_is_skipped=_why_unchecked_here))


# Lines of ptxas's report (CUDA 13) as the Hopper exercises' mutants produce them, and one the course's kernels avoid.
_PTXAS = {
    "C7513": "ptxas info    : (C7513) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             "non wgmma instructions defining input registers of a wgmma between start and end of the pipeline stage "
             "in the function 'kernel_kernel'",
    "C7514": "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
             "stage in the function 'kernel_kernel'",
    "C7517": "ptxas info    : (C7517) warpgroup.wait is injected in around line 2900 by compiler to allow use of "
             "registers defined by GMMA in function 'kernel_kernel'",
    "C7512": "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
             "insufficient register resources for the function 'kernel_kernel'",
}
_CLEAN = ["ptxas info    : Function properties for kernel_kernel",
          "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
          "ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem"]


@pytest.mark.parametrize("code, cause", [("C7513", "register operand of a wgmma"),
                                         ("C7514", "accumulator is read or changed"), ("C7517", "inject a wait"),
                                         ("C7512", "more registers than a thread has")])
def test_ptxas_hazards_are_named(code, cause):
    from course_utils.exercises.late_tools import ptxas_problem

    assert ptxas_problem(_CLEAN) is None
    problem = ptxas_problem([_PTXAS[code], *_CLEAN])
    assert problem and code in problem and cause in problem, problem
    spilled = ptxas_problem([_CLEAN[0], "24 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads"])
    assert spilled and "spills registers" in spilled


@pytest.mark.parametrize("chapter", ["04", "07", "08", "09", "10"])
def test_every_exercise_has_hints(chapter):
    """Every solution cell is tagged ex-<letter> (the tiered help reads it) and its chapter's HINTS has two tiers."""
    module = importlib.import_module(f"course_utils.exercises.ch{chapter}")
    (notebook,) = NOTEBOOKS.glob(f"{chapter}_*.py")
    text = notebook.read_text()
    tags = re.findall(r'tags=\["solution", "ex-(\w)"\]', text)
    assert tags and len(tags) == text.count('tags=["solution"') and len(set(tags)) == len(tags)
    assert set(module.HINTS) == set(tags) and all(len(module.HINTS[tag]) == 2 for tag in tags)


# A GPU-sized configuration of each TileLang skeleton: it must lower for the H100 and the A100 too (no GPU needed).
_GPU_CONFIGS = {
    "ch09_merge_kernel": ((64, 4, 128), {}),
    "ch09_paged_lookup": ((4, 16, 64, 256, 128, 64), {}),
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("key", _GPU_CONFIGS)
def test_solution_lowers_for_the_gpu(key, arch):
    import tilelang
    from tilelang import tvm

    exercise = EXERCISES[key]
    args, kwargs = _GPU_CONFIGS[key]
    prim_func = load(exercise, exercise_source(exercise), "cuda")(*args, **kwargs, target="cuda")
    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        assert "__global__" in tilelang.lower(prim_func).kernel_source


def test_timing_cell_without_gpu_shows_the_course_record(capsys):
    """Chapter 03's timing cell on a machine without a GPU: the stored record of the course's
    kernel, its rows checked, and one line saying what the learner's kernel would be timed against."""
    from course_utils.exercises import timing

    if timing.HAS_GPU:
        pytest.skip("on a GPU the cell compiles and times the learner's kernel")
    record = timing.time_your_forward(None, record="ch03_forward_vs_peers_h100")
    out = capsys.readouterr().out
    assert record["results"]
    assert "TileLang (ours)" in out and "TFLOP/s" in out and "On a GPU this cell compiles your kernel" in out


def test_training_timing_cell_without_gpu_shows_the_course_record(capsys):
    """Chapter 05's timing cell after the capstone, without a GPU: the record's forward+backward rows only (no
    backward-alone row), and one line saying what the learner's training step would be timed against."""
    from course_utils.exercises import timing

    if timing.HAS_GPU:
        pytest.skip("on a GPU the cell compiles and times the learner's kernels")
    record = timing.time_your_training(None, record="ch05_backward_vs_peers_h100")
    out = capsys.readouterr().out
    assert any(r.get("mode") == "fwd+bwd" for r in record["results"])
    assert "of mode fwd+bwd" in out and "TileLang (ours)" in out and "TFLOP/s" in out
    assert "one training step (forward, then backward)" in out


def test_capstone_compiles_for_the_device_it_is_called_with():
    """ch05.compiled builds nothing until called, then for the C backend on CPU tensors (GPU tiles only on CUDA)."""
    import torch

    from course_utils.exercises import ch05

    built = []

    def factory(batch, seq, *, block_M=16, target=None):
        built.append((target, block_M))
        raise NotImplementedError

    run = ch05.compiled(factory, 1, 8, out_idx=[1])
    assert built == []
    with pytest.raises(ExerciseIncomplete):
        run(torch.zeros(8))
    with pytest.raises(ExerciseIncomplete):  # what a call with CUDA tensors builds (no GPU needed to build)
        ch05._compile(factory, (1, 8), (1,), {}, "cuda")
    with pytest.raises(ExerciseIncomplete):  # tiles the call gives are kept
        ch05._compile(factory, (1, 8), (1,), {"block_M": 32}, "cuda")
    assert built == [("c", 16), ("cuda", 64), ("cuda", 32)]
