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
import linecache
import logging
import math
import os
import re
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import tilelang.language as T
import torch

from ..kernels.flash_pieces import LOG2E
from ..kernels.tiles import compile_kernel
from .common import ExerciseFailed, ExerciseIncomplete, ExerciseWrong, not_written, quiet_builder, stale_definition
from .help import needed_first

__all__ = ["KernelCase", "Suspect", "check_kernel", "build", "compile_c", "same_outputs", "describe_rows",
           "forward_tile_step", "lower_for_gpus", "nearest_variant", "GPU_ARCHS"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_ARCHS = ("sm_90a", "sm_80")  # every kernel exercise is also lowered for these (no GPU needed)
_quiet_builder = quiet_builder


class _Captured:
    """What TileLang said while a block ran: its log records (warnings and up) and the text its C++
    side wrote to the process's stderr (file descriptor 2), kept out of the learner's output."""

    def __init__(self):
        self.records, self.stderr = [], ""

    def warnings(self):
        """TileLang's warnings, one line each, without duplicates."""
        lines = [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]
        lines += [line for line in self.stderr.splitlines() if re.search(r"\bWarning\b|\bwarning:", line, re.I)]
        seen = []
        for line in (re.sub(r"^\[[^\]]*\]\s*:?\s*", "", line).strip() for line in lines):
            if line and line not in seen:
                seen.append(line)
        return seen


class _Handler(logging.Handler):
    def __init__(self, records):
        super().__init__(logging.WARNING)
        self.records = records

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def _stderr_into(captured):
    """Send file descriptor 2 to a temporary file while the block runs; its text goes to ``captured``."""
    try:
        sys.stderr.flush()
        saved_fd = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (some embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            tmp.seek(0)
            captured.stderr += tmp.read().decode(errors="replace")


@contextlib.contextmanager
def _capture(captured=None):
    """Run the block with TileLang's builder dump silenced and its warnings and stderr kept in a ``_Captured``."""
    captured = captured if captured is not None else _Captured()
    handler = _Handler(captured.records)
    logger = logging.getLogger("tilelang")
    logger.addHandler(handler)
    try:
        with quiet_builder(), _stderr_into(captured), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield captured
            finally:
                for w in caught:
                    captured.records.append(logging.makeLogRecord({"msg": str(w.message), "levelno": logging.WARNING}))
    finally:
        logger.removeHandler(handler)


def _is_library(filename):
    return ("site-packages" in filename or "/lib/python" in filename or filename.startswith("<frozen")
            or filename.startswith(_PACKAGE_DIR))


def _one_line(exc):
    """The first informative line of an exception's message, cut to a readable length."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = next((line for line in lines if not line.startswith(("Traceback", "File ", "-->"))), "")
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_learner(filename):
    """A notebook cell (IPython's "<ipython-input-…>" or ipykernel's ".../ipykernel_…/….py"), a cell
    loaded by the tests ("<…>"), or a script of the learner's; not TileLang, TVM or the course."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen") and bool(linecache.getlines(filename))
    return os.path.isabs(filename) and not _is_library(filename)


def _learner_line(exc):
    """'in `fn`, line N: `code`' for the innermost frame of the learner's own code, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_learner(f.filename)]
    if not frames:
        return ""
    frame = frames[-1]
    code = f": `{frame.line.strip()}`" if frame.line else ""
    return f" (in `{frame.name}`, line {frame.lineno} of its cell{code})"


def _where(exc):
    """Where the error is in the learner's cell: a TVM/TileLang error's '--> file:line:col' when it
    names a cell, else the innermost frame of the learner's code."""
    match = re.search(r"-->\s*(.+?):(\d+):\d+", str(exc))
    if match and ("<" in match.group(1) or "ipykernel_" in match.group(1)):
        filename = match.group(1)[match.group(1).find("<"):] if "<" in match.group(1) else match.group(1)
        number = int(match.group(2))
        named = re.search(r"layout for (\w+)|between (\w+)", str(exc))
        buffer = next((g for g in named.groups() if g), None) if named else None
        if buffer and not re.search(rf"\b{buffer}\b", linecache.getline(filename, number)) \
                and re.search(rf"\b{buffer}\b", linecache.getline(filename, number + 1)):
            number += 1  # TileLang 0.1.15's span of a layout error sits one line above the tile's allocation
        line = linecache.getline(filename, number).strip()
        return f" (line {number} of your cell" + (f": `{line}`)" if line else ")")
    return _learner_line(exc)


# What a build error usually means in these exercises, by a piece of its message.
_BUILD_CAUSES = (
    ("K shape check failed", "the inner dimensions of a T.gemm do not agree. T.gemm(A, B, C) computes C += A·B with "
     "A [M, K] and B [K, N]; a tile stored [N, K] (K_s, V_s are [block_N, D]) is passed with transpose_B=True, "
     "as in S = Q Kᵀ."),
    ("but got `tirx.B", "a whole tile is used where one element is expected: index it (alpha[i], not alpha)."),
    ("Selected loop range is smaller than original src range", "a T.copy's region and its tile differ in size: "
     "a slice counted in block_M rows copied into a tile of block_N rows, or the other way round (equal tiles "
     "hide it). Count each tile's rows with its own block size."),
)


def _build_cause(exc):
    cause = next((why for key, why in _BUILD_CAUSES if key in str(exc)), "")
    return f" Likely cause: {cause}" if cause else ''


def build(name, factory, *args, captured=None, **kwargs):
    """Call the learner's kernel factory; a placeholder or a build error becomes a one-line failure."""
    try:
        with _capture(captured):
            return factory(*args, **kwargs)
    except NotImplementedError as exc:
        raise not_written(name, exc) from None
    except ExerciseFailed:
        raise
    except Exception as exc:
        first = needed_first(exc)
        if first is not None:
            raise ExerciseIncomplete(f"{name}: {first}") from None
        raise ExerciseWrong(f"✗ {name}: your kernel does not build: {_one_line(exc)}{_where(exc)}."
                            f"{_build_cause(exc)}") from None


def compile_c(name, prim_func, out_idx, captured=None):
    """Compile for TileLang's C backend (the checks run on the CPU on every machine)."""
    try:
        with _capture(captured):
            return compile_kernel(prim_func, out_idx=out_idx, target="c")
    except Exception as exc:
        raise ExerciseWrong(f"✗ {name}: your kernel builds but does not compile: {_one_line(exc)}{_where(exc)}"
                            f"{_build_cause(exc) or _warned(captured)}") from None


def _warned(captured, limit=2):
    """' TileLang warned: …' (its first warnings, as the likely cause), or ''."""
    lines = captured.warnings() if captured is not None else []
    if not lines:
        return ""
    shown = "; ".join(line if len(line) <= 200 else line[:197] + "..." for line in lines[:limit])
    return f" TileLang warned (a likely cause): {shown}"


# What a GPU compiler error usually means in these exercises, by a piece of its message.
_GPU_CAUSES = (
    ("Get different layout", "a register tile (fragment) is used in two layouts, typically a float32 fragment fed "
     "to T.gemm as an operand, which the GPU's tensor-core gemm cannot read in the accumulator's layout: copy it "
     "into a shared tile first (T.copy(S, P), then T.gemm(P, ...))."),
    ("layout for fragment", "TileLang could not choose a register layout for a fragment: give every fragment a "
     "consumer it can take its layout from (a gemm result, a reduction) or make it a shared tile."),
    ("Layout infer conflict", "two tiles indexed in one parallel loop need different register layouts, typically "
     "a register tile that later feeds T.gemm: keep the gemm operand in a shared tile (tb.shared)."),
    ("Only one dynamic shared memory", "too many or mismatched shared tiles for the GPU kernel."),
)


def lower_for_gpus(name, factory, args, kwargs, archs=GPU_ARCHS, captured=None):
    """Build the learner's factory for CUDA and lower it for each of ``archs`` on the CPU (seconds, no
    GPU): a kernel that is right on the C backend but that the GPU compiler rejects fails here, with
    the compiler's message, the line of the learner's cell and TileLang's warnings."""
    import tilelang
    from tilelang import tvm

    captured = captured if captured is not None else _Captured()
    prim_func = build(name, factory, *args, **kwargs, target="cuda", captured=captured)
    for arch in archs:
        try:
            with _capture(captured), tvm.target.Target({"kind": "cuda", "arch": arch}):
                tilelang.lower(prim_func)
        except Exception as exc:
            cause = next((why for key, why in _GPU_CAUSES if key in str(exc)), "")
            raise ExerciseWrong(
                f"✗ {name}: right on this CPU, but the GPU build fails when lowered for {arch}: {_one_line(exc)}"
                f"{_where(exc)}." + (f" Likely cause: {cause}" if cause else "") + _warned(captured)) from None


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


def _head_scale(want):
    """max(1, the largest finite |value| of each head), broadcastable to ``want`` ([B, H, ...]; 1 otherwise)."""
    if want.dim() < 3:
        return torch.ones(())
    finite = torch.where(torch.isfinite(want), want.abs(), torch.zeros(()))
    per_head = finite.transpose(0, 1).reshape(want.shape[1], -1).amax(-1).clamp(min=1.0)
    return per_head.view(1, -1, *([1] * (want.dim() - 2)))


def same_outputs(got, model, *, atol=1e-3, rtol=1e-3):
    """Whether the learner's outputs equal a model's: same NaN and infinities, finite values close (``atol``
    relative to each head's largest value where that exceeds 1: a head of huge scores has huge gradients, and
    the kernel's float32 rounding of them is not a different bug)."""
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
        tolerance = (atol * _head_scale(want) + rtol * want.abs()).expand_as(want)
        if not ((have[fin] - want[fin]).abs() <= tolerance[fin]).all():
            return False
    return True


def _matching(suspects, case, got, kernel):
    """The suspects whose test holds on this case, in order."""
    found = []
    for suspect in suspects:
        try:
            if suspect.test(case, got, kernel):
                found.append(suspect)
        except ExerciseFailed:
            raise
        except Exception:  # a test that cannot run says nothing
            continue
    return found


def _diagnose(suspects, case, got, kernel, later=()):
    """The message of the suspect that explains the wrong ``case``. Two mistakes can give the same outputs on one
    shape (a stop rounded down and a stop split in two ceilings, when block_N divides block_M): then the later
    wrong cases of ``later`` (compiled and run only for this) keep the suspects that explain them too."""
    found = _matching(suspects, case, got, kernel)
    for run_later in later:
        if len(found) < 2:
            break
        result = run_later()
        if result is not None:
            found = _matching(found, *result) or found
    return found[0].message if found else None


def _wrong_run(name, factory, case, atol, rtol):
    """(case, outputs, kernel) of ``case`` when the learner's kernel is wrong on it, else None."""
    captured = _Captured()
    kernel = compile_c(name, build(name, factory, *case.args, **case.kwargs, target="c", captured=captured),
                       case.out_idx, captured)
    try:
        got = case.run(kernel)
    except Exception:
        return None
    return (case, got, kernel) if _symptom(got, case.expected, atol, rtol, case.rows)[0] is not None else None


def check_kernel(name, factory, cases, *, suspects=(), hint="", atol=1e-4, rtol=1e-3, summary=None, gpu=None,
                 learner=(), nearest=None):
    """Build, compile and run the learner's ``factory`` on every case; print ✓ or raise one line.

    ``cases`` is a list of ``KernelCase`` (or a function returning one), run in order; the first
    wrong case is diagnosed with ``suspects`` and reported with its symptom. When no suspect
    matches, ``nearest(case, got)`` may name the closest reference variant (a string or None), and
    TileLang's warnings are shown as the likely cause. ``gpu`` = (args, kwargs): a GPU-sized
    configuration, lowered for sm_80 and sm_90a once the CPU cases pass. ``learner``: the names of
    the learner's functions (looked up beside ``factory``) whose cells must have run as last written.
    """
    functions = [factory] + [factory.__globals__[n] for n in learner if n in getattr(factory, "__globals__", {})]
    stale = stale_definition(name, *functions)
    if stale is not None:
        raise stale
    cases = cases() if callable(cases) else cases
    for index, case in enumerate(cases):
        captured = _Captured()
        prim_func = build(name, factory, *case.args, **case.kwargs, target="c", captured=captured)
        kernel = compile_c(name, prim_func, case.out_idx, captured)
        try:
            got = case.run(kernel)
        except Exception as exc:
            raise ExerciseWrong(f"✗ {name}, {case.label}: your kernel failed when run: {_one_line(exc)}") from None
        out, symptom = _symptom(got, case.expected, atol, rtol, case.rows)
        if out is None:
            continue
        later = [lambda c=c: _wrong_run(name, factory, c, atol, rtol) for c in cases[index + 1:]]
        cause = _diagnose(suspects, case, got, kernel, later)
        if cause is None and nearest is not None:
            try:
                cause = nearest(case, got)
            except Exception:  # naming the nearest bug is a courtesy: never a crash
                cause = None
        advice = f"Likely cause: {cause}" if cause else (hint + _warned(captured))
        raise ExerciseWrong(f"✗ {name}, {case.label}: {symptom}. {advice}".strip())
    if gpu is not None:
        lower_for_gpus(name, factory, *gpu)
    counted = f"all {len(cases)} cases" if len(cases) > 1 else "its test case"
    lowered = f", and it lowers for {' and '.join(GPU_ARCHS)}" if gpu is not None else ""
    print(f"✓ {name}: correct on {counted}" + (f" ({summary})" if summary else "") + lowered)


def nearest_variant(got, variants, expected, *, outputs=("O",)):
    """Name the reference variant closest to the learner's outputs, if it is much closer than the right
    answer: ``variants`` maps a description to outputs (dicts like ``expected``)."""
    def distance(model):
        total = 0.0
        for out in outputs:
            a, b = got[out].detach().double().cpu(), model[out].detach().double().cpu()
            fin = torch.isfinite(a) & torch.isfinite(b)
            if not torch.equal(torch.isnan(a), torch.isnan(b)):
                total += 1e9
            total += float((a[fin] - b[fin]).abs().mean()) if fin.any() else 0.0
        return total

    right = distance(expected)
    scored = sorted((distance(model), what) for what, model in variants.items())
    if scored and scored[0][0] < 0.25 * right:
        return f"your output is closest to a kernel in which {scored[0][1]} (mean error {scored[0][0]:.2g} from it, " \
               f"{right:.2g} from the right answer)."
    return None


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


def learner_or_course(name, learner, course, probe, chapter_exercise):
    """The learner's kernel factory if it builds (``probe(factory)`` builds one small configuration),
    else the course's, with one line saying so: a chapter that builds on an unfinished exercise
    still runs from the top."""
    try:
        with _capture():
            probe(learner)
        return learner
    except Exception as exc:  # not written, or does not build: the course's version keeps the chapter going
        why = "is not written yet" if isinstance(exc, NotImplementedError) else f"does not build ({_one_line(exc)})"
        print(f"Your `{name}` {why}: using the course's kernel instead (finish {chapter_exercise} to use yours).")
        return course


# --- The compiler on the learner's kernel: TileLang's lower trace ---------------------------------

@dataclass
class TracedPass:
    """One step of a lowering recorded by TileLang's lower trace: the IR before and after it."""
    index: int
    phase: str
    name: str
    before: str
    after: str

    @property
    def changed(self):
        return self.before != self.after


def trace_lowering(prim_func, arch="sm_90a", folder=None):
    """Lower ``prim_func`` for CUDA ``arch`` with TileLang's lower trace on (what ``TL_LOWER_TRACE=1``
    does for a script) and return its steps, in order, as ``TracedPass``es; the last is the code
    generation (``after`` is the CUDA source). The trace's files stay in ``folder`` (a temporary
    folder when None): ``<phase>/<NN>_<pass>_before.tir`` and ``_after.tir``."""
    import tilelang
    from tilelang import tvm
    from tilelang.tools import lower_trace

    folder = folder or tempfile.mkdtemp(prefix="lower_trace_")
    with contextlib.redirect_stdout(open(os.devnull, "w")) as sink:
        lower_trace.enable(mode="html", trace_dir=folder)
        sink.close()
    try:
        with _capture(), contextlib.redirect_stdout(open(os.devnull, "w")) as sink, \
                tvm.target.Target({"kind": "cuda", "arch": arch}):
            try:
                tilelang.lower(prim_func)
            finally:
                sink.close()
    finally:
        with contextlib.redirect_stdout(open(os.devnull, "w")) as sink:
            lower_trace.disable()
            sink.close()
    steps = {}
    for root, _, files in os.walk(folder):
        for name in files:
            match = re.fullmatch(r"(\d+)_(.+)_(before|after)\.(tir|cpp)", name)
            if match:
                with open(os.path.join(root, name), encoding="utf-8") as handle:
                    steps.setdefault((int(match.group(1)), os.path.basename(root), match.group(2)), {})[
                        match.group(3)] = handle.read()
    return [TracedPass(index, phase, name, text.get("before", ""), text.get("after", ""))
            for (index, phase, name), text in sorted(steps.items())]
