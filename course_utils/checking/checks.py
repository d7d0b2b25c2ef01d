"""Checks that print what they compared and fail loudly.

Every result in the course goes through a check that prints one line with the error and a ✓,
and raises ``CheckFailed`` when the result is wrong, so a broken kernel stops the notebook (and
CI) at the cell that produced it:

* ``check_close``: a fixed tolerance, for exact and float32 results;
* ``check_attention_error``: for a low-precision kernel, the criterion of FlashAttention's own
  tests: the kernel's error against the float64 reference may be at most ``ERROR_FACTOR`` times
  the error that a PyTorch implementation in the same precision makes on the same inputs, plus a
  tiny absolute slack. The allowance follows the problem: long sequences and large gradients
  have larger rounding errors, and the check still catches a bug far smaller than a fixed
  tolerance loose enough for every problem would;
* ``expect_failure``: a negative control, which passes only if a check *fails* on a planted bug.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["CheckFailed", "Tolerance", "tolerance_for", "check_close", "check_true", "check_attention_error",
           "expect_failure", "ERROR_FACTOR", "ERROR_SLACK"]


class CheckFailed(AssertionError):
    """A result did not match its reference."""


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# Chosen for attention outputs of unit-variance inputs: an element passes when
# |actual - expected| <= atol + rtol * |expected|. Low-precision kernels round P to 16 bits
# before the PV product, which dominates their error.
_TOLERANCES = {
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: Tolerance(atol=1e-5, rtol=1e-4),
    torch.float16: Tolerance(atol=3e-3, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=2e-2, rtol=5e-2),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The default tolerance for results computed in ``dtype``."""
    try:
        return _TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no default tolerance for {dtype}; pass atol and rtol explicitly") from None


def check_close(actual, expected, name="result", *, atol=None, rtol=None, dtype=None, quiet=False):
    """Compare ``actual`` with ``expected`` (usually a float64 reference), print, raise on failure.

    The tolerance defaults to the one for ``dtype`` (or ``actual.dtype``). Non-finite values must
    match exactly in position and value (NaN never passes). Returns the max absolute error.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError("check_close compares two torch tensors")
    if actual.shape != expected.shape:
        raise CheckFailed(f"✗ {name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    tol = tolerance_for(dtype or actual.dtype)
    atol = tol.atol if atol is None else atol
    rtol = tol.rtol if rtol is None else rtol

    # On the device of the reference (the GPU for the records: these tensors can be gigabytes).
    e = expected.detach().to(torch.float64)
    a = actual.detach().to(e.device, torch.float64)
    if torch.isnan(a).any():
        raise CheckFailed(f"✗ {name}: {int(torch.isnan(a).sum())} NaN value(s) in the result")
    finite = torch.isfinite(e)
    if not torch.equal(a[~finite], e[~finite]) or not torch.isfinite(a[finite]).all():
        raise CheckFailed(f"✗ {name}: infinities differ from the reference")

    diff = (a - e).abs()[finite]
    ref = e.abs()[finite]
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / ref.clamp_min(atol)).max()) if diff.numel() else 0.0
    bad = diff > atol + rtol * ref
    line = f"{name}: max abs err {max_abs:.2e}, max rel err {max_rel:.2e} (atol {atol:.0e}, rtol {rtol:.0e})"
    if bad.any():
        raise CheckFailed(f"✗ {line} — {int(bad.sum())} of {bad.numel()} elements out of tolerance")
    if not quiet:
        print(f"✓ {line}")
    return max_abs


def check_true(condition, message):
    """Print ✓ message when ``condition`` holds, raise ``CheckFailed`` otherwise."""
    if not condition:
        raise CheckFailed(f"✗ {message}")
    print(f"✓ {message}")


# FlashAttention's tests allow 2× the low-precision PyTorch reference's error (plus a small absolute
# term); our kernels keep scores in float32 where that reference rounds them, so 3× leaves room
# for summation order without letting a planted bug through.
ERROR_FACTOR = 3.0
ERROR_SLACK = 1e-5


def _max_abs_error(actual, expected):
    """Largest |actual − expected| over the finite reference values; NaN or a misplaced inf is an error.

    Computed in float64 on the reference's device (the GPU for full-size checks: same numbers, and a
    fraction of the time of copying gigabytes to the CPU)."""
    e = expected.detach().to(torch.float64)
    a = actual.detach().to(e.device, torch.float64)
    if a.shape != e.shape:
        return None, f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    if not torch.equal(nan_a, nan_e):
        return None, f"{int((nan_a & ~nan_e).sum())} NaN value(s) where the reference has none"
    finite = torch.isfinite(e)
    if not torch.equal(a[~finite & ~nan_e], e[~finite & ~nan_e]) or not torch.isfinite(a[finite]).all():
        return None, "infinities differ from the reference"
    diff = (a - e).abs()[finite]
    return (float(diff.max()) if diff.numel() else 0.0), None


def check_attention_error(actual, reference, low_precision, name="result", *, factor=ERROR_FACTOR,
                          slack=ERROR_SLACK, quiet=False):
    """Check a low-precision result the way FlashAttention's tests do; returns (error, baseline error).

    ``reference`` is the float64 result, ``low_precision`` a PyTorch computation in the kernel's
    precision on the same inputs. Passes when max|actual − reference| ≤ factor · max|low_precision
    − reference| + slack. NaN must appear exactly where the reference has it.
    """
    err, problem = _max_abs_error(actual, reference)
    base, base_problem = _max_abs_error(low_precision, reference)
    if base_problem:
        raise ValueError(f"{name}: the low-precision reference itself is unusable: {base_problem}")
    if problem:
        raise CheckFailed(f"✗ {name}: {problem}")
    allowed = factor * base + slack
    line = (f"{name}: max err {err:.2e} vs float64; PyTorch in low precision {base:.2e} "
            f"(allowed {factor:g}× + {slack:.0e} = {allowed:.2e})")
    if err > allowed:
        raise CheckFailed(f"✗ {line}")
    if not quiet:
        print(f"✓ {line}")
    return err, base


def expect_failure(label, check):
    """A negative control: run ``check()`` on a planted bug, print how it failed, raise if it passed."""
    try:
        check()
    except CheckFailed as failure:
        reason = re.split(r" vs float64|, max rel| — ", str(failure).removeprefix("✗ "))[0]
        print(f"✓ planted bug caught: {label} ({reason})")
    else:
        raise CheckFailed(f"✗ the check passed a planted bug ({label}): it could not catch a wrong kernel")
