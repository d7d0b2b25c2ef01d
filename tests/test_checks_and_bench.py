"""check_close must fail when it should; FLOP counts follow the stated convention."""

import pytest
import torch

from course_utils import CheckFailed, attention_flops, check_close
from course_utils.exercises import ExerciseIncomplete, ExerciseWrong, check_exercise
from course_utils.measure.bench import load_record


def test_check_close_passes_and_reports(capsys):
    x = torch.randn(10)
    check_close(x + 1e-7, x, "tiny error")
    assert "✓ tiny error" in capsys.readouterr().out


@pytest.mark.parametrize("actual", [
    lambda x: x + 1e-2,                               # too far for float32
    lambda x: torch.where(x > 0, float("nan"), x),   # NaN never passes
    lambda x: x[:-1],                                # wrong shape
    lambda x: torch.where(x > 0, float("inf"), x),   # infinities must match
])
def test_check_close_fails_loudly(actual):
    x = torch.randn(64)
    with pytest.raises(CheckFailed, match="✗"):
        check_close(actual(x), x, "wrong")


def test_check_close_tolerance_depends_on_dtype():
    x = torch.randn(64)
    check_close((x + 2e-3).half(), x, "fp16 within fp16 tolerance")
    with pytest.raises(CheckFailed):
        check_close(x + 2e-3, x, "same error in float32")


def test_flops_convention():
    full = attention_flops(1, 16, 4096, 4096, 128)
    assert full == 4 * 16 * 4096 ** 2 * 128
    assert attention_flops(1, 16, 4096, 4096, 128, causal=True) == full / 2
    assert attention_flops(1, 16, 4096, 4096, 128, mode="bwd") == 2.5 * full
    # A window of W sees W keys per query, minus the triangle at the start.
    w, s = 128, 1024
    pairs = sum(min(i + 1, w) for i in range(s))
    assert attention_flops(2, 4, s, s, 64, window_size=w) == 4 * 2 * 4 * pairs * 64
    with pytest.raises(ValueError):
        attention_flops(1, 1, 8, 8, 8, mode="sideways")


def test_stored_records_name_their_machine():
    for name in ("ch01_naive_vs_sdpa_h100", "ch03_forward_vs_peers_h100", "ch05_backward_vs_peers_h100"):
        machine = load_record(name)["machine"]
        assert "H100" in machine["gpu"] and machine["tilelang"] == "0.1.15" and machine["date"]


def test_exercise_checker_messages():
    ref = lambda x: x * 2  # noqa: E731
    check_exercise("double", ref, ref, [(torch.ones(3),)])
    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        check_exercise("double", lambda x: (_ for _ in ()).throw(NotImplementedError), ref, [(torch.ones(3),)])
    with pytest.raises(ExerciseWrong, match="off by up to"):
        check_exercise("double", lambda x: x * 3, ref, [(torch.ones(3),)])
    with pytest.raises(ExerciseWrong, match="returned None"):
        check_exercise("double", lambda x: None, ref, [(torch.ones(3),)])


@pytest.mark.parametrize("count", [2, 3, 4])
def test_round_orders_give_every_implementation_every_predecessor(count):
    """Under the H100's power cap a kernel timed right after a cooler one gets a higher clock: no
    implementation may always follow the same one (docs/timing.md)."""
    from collections import Counter

    from course_utils.measure.bench import round_orders
    names = "ABCD"[:count]
    orders = round_orders(names, 6 if count == 3 else 2 * count)
    assert all(sorted(order) == list(names) for order in orders)
    if count == 3:
        assert len({tuple(o) for o in orders}) == 6  # the six orders of three
    before = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    for a, b in before:  # whoever precedes whom in some round also follows it as often
        assert before[a, b] == before[b, a], (a, b, before)
    firsts = Counter(order[0] for order in orders)
    assert set(firsts) == set(names)


def test_time_side_by_side_times_in_the_changing_orders(monkeypatch):
    """The timing loop runs the rounds in ``round_orders``' orders (a fixed order would fail here)."""
    import course_utils.measure.bench as bench
    calls = []
    monkeypatch.setattr(bench, "HAS_GPU", True)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench, "_samples", lambda fn, rep: calls.append(fn()) or [1.0] * rep)
    fns = {name: (lambda n=name: n) for name in ("ours", "FA2", "cuDNN")}
    ms = bench.time_side_by_side(fns, warmup=0, rounds=6, rep=2)
    assert ms == {"ours": 1.0, "FA2": 1.0, "cuDNN": 1.0}
    assert [calls[i:i + 3] for i in range(0, 18, 3)] == bench.round_orders(fns, 6)
