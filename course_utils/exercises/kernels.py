"""Check a learner's TileLang kernel on the CPU and say, in one line, what is wrong with it.

A kernel exercise gives the learner a kernel factory with the signature, buffers, copies and loop
written, and a marked part to fill in. Its checker (in ``chNN.py``) lists ``KernelCase``s: a
configuration to build the learner's factory with, inputs made to expose the usual mistakes
(a ragged sequence, one shorter than a block, S_q ≠ S_k, rows that see no key, large logits) and
the float64 reference. ``check_kernel`` builds, compiles (TileLang's C backend, whatever the
machine) and runs each case in order and stops at the first wrong one, so the most revealing case
goes first. It then names the likely bug: each ``Suspect`` is a known mistake with a test, most
often "the learner's outputs equal those of a float64 PyTorch model of the kernel with that one
bug" (``same_outputs``); the first suspect whose test holds gives the diagnosis. A correct kernel
never reaches the suspects, so it cannot be misnamed; a kernel with an unknown bug gets the
symptom (which output, which rows, NaN or not) and the chapter's hint.

Every failure is an ``ExerciseFailed`` with a one-line message: the placeholder still in place
("not written yet"), a kernel that does not build or compile (the TileLang error in one line,
with the line of the learner's code where Python saw it), or a wrong result.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import tilelang.language as T
import torch

from ..kernels.flash_pieces import LOG2E
from ..kernels.tiles import compile_kernel
from .common import ExerciseFailed, ExerciseWrong, not_written

__all__ = ["KernelCase", "Suspect", "check_kernel", "build", "compile_c", "same_outputs", "describe_rows",
           "forward_tile_step"]

# TileLang logs the whole generated builder source at CRITICAL when a prim_func fails to build.
_NOISY_LOGGERS = ("tilelang.language.eager.builder",)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _quiet_builder():
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    saved = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, saved):
            logger.disabled = was


def _is_library(filename):
    return ("site-packages" in filename or "/lib/python" in filename or filename.startswith("<frozen")
            or filename.startswith(_PACKAGE_DIR))


def _one_line(exc):
    """The first informative line of an exception's message, cut to a readable length."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = next((line for line in lines if not line.startswith(("Traceback", "File ", "-->"))), "")
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _learner_line(exc):
    """'in `fn`, line N: `code`' for the innermost frame of the learner's own code, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f" (in `{frame.name}`, line {frame.lineno} of its cell{code})"


def build(name, factory, *args, **kwargs):
    """Call the learner's kernel factory; a placeholder or a build error becomes a one-line failure."""
    try:
        with _quiet_builder():
            return factory(*args, **kwargs)
    except NotImplementedError as exc:
        raise not_written(name, exc) from None
    except ExerciseFailed:
        raise
    except Exception as exc:
        raise ExerciseWrong(f"✗ {name}: your kernel does not build: {_one_line(exc)}{_learner_line(exc)}") from None


def compile_c(name, prim_func, out_idx):
    """Compile for TileLang's C backend (the checks run on the CPU on every machine)."""
    try:
        return compile_kernel(prim_func, out_idx=out_idx, target="c")
    except Exception as exc:
        raise ExerciseWrong(f"✗ {name}: your kernel builds but does not compile: {_one_line(exc)}") from None


@dataclass
class KernelCase:
    """One configuration of the learner's factory, its inputs and the float64 reference outputs.

    ``run(kernel)`` calls the compiled kernel and returns its outputs as a dict (name -> tensor);
    ``expected`` has the same names. ``data`` keeps whatever the suspects' models need.
    """
    label: str
    args: tuple
    kwargs: dict
    out_idx: list
    run: Callable
    expected: dict
    data: dict = field(default_factory=dict)
    rows: str = "row"  # what a row of the outputs is, for messages ("query", "row")


@dataclass
class Suspect:
    """A known mistake: ``test(case, got, kernel)`` says whether the learner's outputs look like it."""
    message: str
    test: Callable


def _bad(actual, expected, atol, rtol):
    """Boolean mask of the wrong elements: NaN, infinities that differ, or finite values out of tolerance."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    finite = torch.isfinite(e)
    bad = torch.isnan(a) | (~finite & (a != e)) | (finite & ~torch.isfinite(a))
    close = (a - e).abs() <= atol + rtol * e.abs()
    return bad | (finite & torch.isfinite(a) & ~close)


def describe_rows(mask, what="row"):
    """'rows 0–10, 33' (with the head when there are several) for a boolean mask [S], [S, D],
    [B, H, S] or [B, H, S, D]."""
    if mask.dim() in (2, 4):  # [S, D] or [B, H, S, D]: a row is wrong when any of its elements is
        mask = mask.any(dim=-1)
    if mask.dim() == 1:
        mask = mask[None, None]
    parts = []
    for head in range(mask.shape[1]):
        rows = torch.nonzero(mask[:, head].any(dim=0)).flatten().tolist()
        if not rows:
            continue
        spans, start = [], rows[0]
        for prev, cur in zip(rows, rows[1:] + [None]):
            if cur != prev + 1:
                spans.append(f"{start}–{prev}" if prev > start else f"{start}")
                start = cur
        shown = ", ".join(spans[:4]) + (", …" if len(spans) > 4 else "")
        plural = "s" if len(rows) > 1 else ""
        parts.append(f"{what}{plural} {shown}" + (f" of head {head}" if mask.shape[1] > 1 else ""))
    return "; ".join(parts[:3]) if parts else f"no {what}"


def _symptom(got, expected, atol, rtol, rows_name):
    """One clause naming the wrong outputs (and the right ones), then where the first one is wrong."""
    wrong = [out for out, want in expected.items() if _bad(got[out], want, atol, rtol).any()]
    if not wrong:
        return None, ""
    right = [out for out in expected if out not in wrong]
    first, detail = _first_symptom(got, {out: expected[out] for out in wrong}, atol, rtol, rows_name)
    if len(expected) > 2 and len(wrong) > 1:
        detail = f"{', '.join(wrong)} are wrong" + (f" ({', '.join(right)} right)" if right else "") + f"; {detail}"
    elif len(expected) > 2 and right:
        detail = f"{detail} ({', '.join(right)} right)"
    return first, detail


def _first_symptom(got, expected, atol, rtol, rows_name):
    for out, want in expected.items():
        have = got[out].detach().double().cpu()
        bad = _bad(have, want, atol, rtol)
        if not bad.any():
            continue
        where = describe_rows(bad, rows_name)
        nan = torch.isnan(have) & ~torch.isnan(want.double())
        if nan.any():
            return out, f"{out} has NaN in {describe_rows(nan, rows_name)}, where the reference is finite"
        inf_diff = ~torch.isfinite(want.double()) & bad
        if inf_diff.any():
            return out, f"{out} should be {float(want.double()[inf_diff][0]):g} in {describe_rows(inf_diff, rows_name)}"
        err = float((have - want.double()).abs()[bad & torch.isfinite(want.double())].max())
        return out, f"{out} is wrong in {where} (off by up to {err:.3g})"
    return None, ""


def same_outputs(got, model, *, atol=1e-3, rtol=1e-3):
    """Whether the learner's outputs equal a model's: same NaN and infinities, finite values close."""
    for out, want in model.items():
        have = got[out].detach().double().cpu()
        want = want.detach().double().cpu()
        if not torch.equal(torch.isnan(have), torch.isnan(want)):
            return False
        fin = torch.isfinite(want)
        if not torch.equal(have[~fin & ~torch.isnan(want)], want[~fin & ~torch.isnan(want)]):
            return False
        if not torch.isfinite(have[fin]).all():
            return False
        if not torch.allclose(have[fin], want[fin], atol=atol, rtol=rtol):
            return False
    return True


def _diagnose(suspects, case, got, kernel):
    for suspect in suspects:
        try:
            if suspect.test(case, got, kernel):
                return suspect.message
        except ExerciseFailed:
            raise
        except Exception:  # a test that cannot run says nothing
            continue
    return None


def check_kernel(name, factory, cases, *, suspects=(), hint="", atol=1e-4, rtol=1e-3, summary=None):
    """Build, compile and run the learner's ``factory`` on every case; print ✓ or raise one line.

    ``cases`` is a list of ``KernelCase`` (or a function returning one), run in order; the first
    wrong case is diagnosed with ``suspects`` and reported with its symptom.
    """
    cases = cases() if callable(cases) else cases
    for case in cases:
        prim_func = build(name, factory, *case.args, **case.kwargs, target="c")
        kernel = compile_c(name, prim_func, case.out_idx)
        try:
            got = case.run(kernel)
        except Exception as exc:
            raise ExerciseWrong(f"✗ {name}, {case.label}: your kernel failed when run: {_one_line(exc)}") from None
        out, symptom = _symptom(got, case.expected, atol, rtol, case.rows)
        if out is None:
            continue
        cause = _diagnose(suspects, case, got, kernel)
        advice = f"Likely cause: {cause}" if cause else hint
        raise ExerciseWrong(f"✗ {name}, {case.label}: {symptom}. {advice}".strip())
    counted = f"all {len(cases)} cases" if len(cases) > 1 else "its test case"
    print(f"✓ {name}: correct on {counted}" + (f" ({summary})" if summary else ""))


# --- Given building blocks: solved exercises that later chapters' skeletons call -----------------

def forward_tile_step(tb, seq_q, seq_k, dim, *, block_M, block_N, causal=False, window=None):
    """Chapter 03's exercise 3, solved: the body of the forward's key-tile loop as a ``T.macro``, with
    an optional sliding window (query q sees key k iff k <= q + past and k > q + past − window)."""
    scale_log2 = LOG2E / math.sqrt(dim)
    past = seq_k - seq_q
    neg_inf = -T.infinity("float32")

    def visible(q, k):
        cond = k < seq_k
        if causal or window is not None:
            cond = T.And(cond, k <= q + past)
        if window is not None:
            cond = T.And(cond, k > q + past - window)
        return cond

    @T.macro
    def tile_step(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, l, row_sum, qb, kb):
        T.clear(S)
        T.gemm(Q_s, K_s, S, transpose_B=True)
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.if_then_else(visible(qb * block_M + i, kb * block_N + j), S[i, j], neg_inf)
        T.copy(m, m_prev)
        T.reduce_max(S, m, dim=1, clear=False)
        for i in tb.parallel(block_M):
            shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
            alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])
        T.reduce_sum(S, row_sum, dim=1)
        for i in tb.parallel(block_M):
            l[i] = l[i] * alpha[i] + row_sum[i]
        for i, j in tb.parallel(block_M, dim):
            acc_o[i, j] *= alpha[i]
        T.copy(S, P)
        T.gemm(P, V_s, acc_o)

    return tile_step
