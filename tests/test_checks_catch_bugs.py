"""Every check that matters can fail: planted bugs at the CPU size, and the criterion itself."""

import pytest
import torch

from course_utils import (
    CheckFailed,
    backward_bugs,
    check_attention_error,
    check_backward,
    check_forward,
    expect_failure,
    flash_attention,
    forward_bugs,
    show_bugs_caught,
)
from course_utils.checking.validation import backward_without_delta, check_stored_errors, references

CASES = {  # (batch, heads, heads_kv, seq, dim, dtype, mask)
    "float32, causal": (2, 2, 2, 40, 16, torch.float32, dict(causal=True)),
    "fp16, GQA + window + sinks": (2, 4, 2, 37, 16, torch.float16, dict(causal=True, window_size=12, sinks=True)),
}


def _problem(batch, heads, heads_kv, seq, dim, dtype, mask):
    q = torch.randn(batch, heads, seq, dim).to(dtype)
    k, v = (torch.randn(batch, heads_kv, seq, dim).to(dtype) for _ in range(2))
    mask = dict(mask)
    sinks = torch.randn(heads) if mask.pop("sinks", False) else None
    return q, k, v, sinks, mask


@pytest.mark.parametrize("case", CASES)
def test_forward_bugs_are_caught(case):
    q, k, v, sinks, mask = _problem(*CASES[case])
    out, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True, **mask)
    refs = references(q, k, v, sinks=sinks, **mask)
    check_forward(q, k, v, out, lse, sinks=sinks, refs=refs, **mask)
    bugs = forward_bugs(out, lse)
    assert set(bugs) == {"O from the wrong head", "O from the wrong batch entry", "LSE off by 1%"}
    show_bugs_caught(lambda o, l: check_forward(q, k, v, o, l, sinks=sinks, refs=refs, quiet=True, **mask), bugs)


@pytest.mark.parametrize("case", CASES)
def test_backward_bugs_are_caught(case):
    q, k, v, sinks, mask = _problem(*CASES[case])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None
                                                                 else [])
    out, lse = flash_attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None, return_lse=True, **mask)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = references(q, k, v, d_out=d_out, sinks=sinks, **mask)
    check_backward(q, k, v, d_out, grads, sinks=sinks, refs=refs, **mask)
    without_delta = backward_without_delta(q, k, v, out.detach(), lse.detach(), d_out, sinks=sinks, **mask)
    bugs = backward_bugs(grads, grads_without_delta=without_delta)
    expected = {"dV × 0.9", "dK × 0.9", "dQ from the wrong head", "Δ dropped"} | ({"dsinks × 0.9"} if sinks is not None
                                                                                 else set())
    assert set(bugs) == expected
    show_bugs_caught(lambda *g: check_backward(q, k, v, d_out, g, sinks=sinks, refs=refs, quiet=True, **mask), bugs)


def test_criterion_allows_a_small_multiple_of_the_low_precision_error():
    exact = torch.linspace(-1, 1, 101, dtype=torch.float64)
    low = exact + 1e-3  # PyTorch in low precision: 1e-3 off
    check_attention_error(exact + 2.9e-3, exact, low, "2.9× the baseline error", quiet=True)
    with pytest.raises(CheckFailed):
        check_attention_error(exact + 3.2e-3, exact, low, "3.2× the baseline error", quiet=True)
    with pytest.raises(CheckFailed, match="NaN"):
        check_attention_error(torch.where(exact > 0.5, float("nan"), exact), exact, low, "NaN", quiet=True)


def test_expect_failure_raises_when_the_check_passes():
    with pytest.raises(CheckFailed, match="could not catch"):
        expect_failure("a bug the check misses", lambda: None)


def test_stored_records_without_validation_fail():
    with pytest.raises(CheckFailed, match="carry no validation"):
        check_stored_errors([dict(impl="TileLang (ours)", ms=1.0)])
    with pytest.raises(CheckFailed, match="exceeds its bound"):
        check_stored_errors([dict(impl="TileLang (ours)", errors={"O": {"err": 2e-3, "allowed": 1e-3}})])
    check_stored_errors([dict(impl="TileLang (ours)", errors={"O": {"err": 5e-4, "allowed": 1e-3}})])
    legacy = [dict(impl="TileLang (ours)", max_abs_err=3e-2)]
    with pytest.raises(CheckFailed, match="carry no validation"):
        check_stored_errors(legacy)  # a legacy record is accepted only where a chapter says so
    with pytest.raises(CheckFailed, match="exceeds its tolerance"):
        check_stored_errors(legacy, legacy_tolerance=2e-2)
    check_stored_errors([dict(impl="TileLang (ours)", max_abs_err=1e-3)], legacy_tolerance=2e-2)
