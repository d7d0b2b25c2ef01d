"""Run a learner's function on test cases and explain, in plain words, what went wrong.

A checker's verdict is one line. In a notebook, IPython shows an exception that defines
``_render_traceback_()`` with the lines it returns instead of a traceback through the checker, so
``ExerciseIncomplete`` and ``ExerciseWrong`` appear as their message alone; in plain Python and
pytest they stay ordinary ``AssertionError`` subclasses with a full traceback.
"""

import contextlib
import linecache
import logging
import re
import traceback
from pathlib import Path

import torch

# The learner's copies live in workspace/ at the repository's root (tooling/workspace.py makes them), and
# each solution block there is replaced by this line, which the checkers recognise.
WORKSPACE = Path(__file__).resolve().parents[2] / "workspace"
PLACEHOLDER = "raise NotImplementedError  # your code here"

# TileLang logs the whole generated builder source at CRITICAL when a prim_func fails to build
# (a learner's placeholder included): 40 lines before the one-line verdict.
_NOISY_LOGGERS = ("tilelang.language.eager.builder",)


@contextlib.contextmanager
def quiet_builder():
    """Silence TileLang's dump of the builder source while a learner's kernel is built."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    saved = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, saved):
            logger.disabled = was


class ExerciseFailed(AssertionError):
    """A checker's verdict: shown in a notebook as its one-line message, without a traceback."""

    def _render_traceback_(self):
        return [str(self)]


class ExerciseIncomplete(ExerciseFailed):
    """The exercise still has its ``raise NotImplementedError`` placeholder."""


class ExerciseWrong(ExerciseFailed):
    """The learner's answer ran but gave a wrong result."""


def placeholder_function(exc):
    """The name of the function whose ``raise NotImplementedError`` raised ``exc`` (innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1].name if frames else None


def not_written(name, exc=None):
    """The ``ExerciseIncomplete`` for a placeholder still in place; names the function that raised it."""
    where = placeholder_function(exc) if exc is not None else None
    what = f"`{where}` is not written yet" if where and where not in (name, "<module>") else "not written yet"
    return ExerciseIncomplete(f"{name}: {what} — replace the `raise NotImplementedError` line with your code "
                              "and run the cell again.")


@contextlib.contextmanager
def needs(name, exercise):
    """Run a cell that uses the learner's ``name``: a placeholder still in it ends the cell in one line.

        with needs("kernel_flops", "exercise 2"):
            ...   # code that calls kernel_flops
    """
    try:
        with quiet_builder():
            yield
    except NotImplementedError as exc:
        where = placeholder_function(exc)
        who = f"`{where}`" if where and where != "<module>" else f"`{name}`"
        raise ExerciseIncomplete(f"{who} is not written yet: finish {exercise} above, then run this cell "
                                 "again.") from None


def _ipython_history():
    """The inputs of the running IPython kernel, oldest first (``In``), or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    if shell is None:
        return None
    return list(shell.user_ns.get("In") or [])


def _normalised(text):
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def stale_definition(name, *functions, history=None):
    """The ``ExerciseWrong`` to raise when a function the checker is about to run is not the one the
    learner last wrote, or None.

    In a notebook, a solution cell with a SyntaxError defines nothing, so the previous definition
    stays and a checker would silently re-check it. The cell's code lives in ``linecache`` under
    the code object's file name; the learner's latest cell that defines the function is the last
    entry of ``In`` with ``def <name>(``. If the two differ, the latest version never ran.
    """
    history = _ipython_history() if history is None else history
    if not history:
        return None
    for fn in functions:
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        loaded = "".join(linecache.getlines(code.co_filename))
        if not loaded:
            continue
        pattern = re.compile(rf"^\s*def {re.escape(fn.__name__)}\(", re.M)
        latest = next((cell for cell in reversed(history) if cell and pattern.search(cell)), None)
        if latest is None or _normalised(latest) == _normalised(loaded):
            continue
        try:
            compile(latest, "<your cell>", "exec")
        except SyntaxError as exc:
            return ExerciseWrong(
                f"✗ {name}: the cell that defines `{fn.__name__}` has a SyntaxError (line {exc.lineno} of the cell: "
                f"{exc.msg}), so it defined nothing and Python still holds your previous `{fn.__name__}`. Fix the "
                "cell, run it, then run this checker again.")
        return ExerciseWrong(
            f"✗ {name}: you edited the cell that defines `{fn.__name__}` but the version Python holds is an older "
            "one: run that cell, then this checker again.")
    return None


def _describe(args):
    return ", ".join(f"tensor{tuple(a.shape)}" if isinstance(a, torch.Tensor) else repr(a) for a in args)


def check_exercise(name, learner_fn, reference_fn, cases, *, atol=1e-6, rtol=1e-5, hint=None, solutions=()):
    """Compare ``learner_fn(*args)`` with ``reference_fn(*args)`` for every ``args`` in ``cases``.

    ``solutions``: the learner's functions that ``learner_fn`` calls, checked for a definition that
    did not run (see ``stale_definition``). Prints a ✓ line when all cases pass; raises
    ``ExerciseIncomplete`` or ``ExerciseWrong`` with a
    message naming the failing case, the error and a hint otherwise.
    """
    stale = stale_definition(name, learner_fn, *solutions)
    if stale is not None:
        raise stale
    for index, args in enumerate(cases):
        try:
            with quiet_builder():
                got = learner_fn(*args)
        except NotImplementedError as exc:
            raise not_written(name, exc) from None
        except ExerciseFailed:
            raise
        except Exception as exc:
            raise ExerciseWrong(f"{name}: your function raised {type(exc).__name__}: {exc} "
                                f"on case {index} ({_describe(args)})") from exc
        expected = reference_fn(*args)
        if got is None:
            raise ExerciseWrong(f"{name}: case {index} ({_describe(args)}) returned None — did you forget `return`?")
        try:
            got_t = torch.as_tensor(got)
        except (TypeError, ValueError, RuntimeError):
            raise ExerciseWrong(f"{name}: case {index} ({_describe(args)}) returned a {type(got).__name__}, "
                                f"expected a tensor of shape {tuple(expected.shape)}") from None
        if got_t.shape != expected.shape:
            raise ExerciseWrong(f"{name}: case {index} ({_describe(args)}) returned shape {tuple(got_t.shape)}, "
                                f"expected {tuple(expected.shape)}")
        got_t, expected = got_t.double(), expected.double()
        if torch.isnan(got_t).any() and not torch.isnan(expected).any():
            raise ExerciseWrong(f"{name}: case {index} ({_describe(args)}) produced NaN. "
                                + (hint or "Look for inf - inf or 0 / 0."))
        if not torch.allclose(got_t, expected, atol=atol, rtol=rtol, equal_nan=True):
            err = (got_t - expected).abs().nan_to_num(float("inf")).max().item()
            raise ExerciseWrong(f"{name}: case {index} ({_describe(args)}) is off by up to {err:.3g}."
                                + (f" {hint}" if hint else ""))
    print(f"✓ {name}: correct on all {len(cases)} test cases")


def with_diagnosis(run, mistakes):
    """Run ``run()`` (a check); on a wrong answer, name the first mistake whose test ``matches()``.

    ``mistakes``: (message, matches) pairs, tried in order; a test that cannot run says nothing.
    """
    try:
        run()
    except ExerciseWrong as exc:
        for message, matches in mistakes:
            try:
                if matches():
                    raise ExerciseWrong(f"{str(exc).rstrip()} Likely cause: {message}") from None
            except ExerciseWrong:
                raise
            except Exception:  # a diagnosis that cannot run says nothing
                continue
        raise
