"""Checks that print what they compared and fail loudly.

Every result in the course goes through ``check_close``: it prints one line with the largest
absolute and relative error and a ✓ or ✗, and raises ``CheckFailed`` when the result is wrong,
so a broken kernel stops the notebook (and CI) at the cell that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CheckFailed", "Tolerance", "tolerance_for", "check_close", "check_true"]


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

    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
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
