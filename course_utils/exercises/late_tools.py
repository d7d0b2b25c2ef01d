"""Surface TileLang's own warnings in a checker's verdict (chapters 04, 07, 09).

TileLang's C++ passes print warnings such as "`S` is read before anything writes it" straight to
the process's stderr (file descriptor 2), where a notebook shows them far from the checker's
one-line verdict, or not at all. ``surfacing_warnings(run)`` runs a check with descriptor 2
captured; if the check fails, the warnings TileLang printed are added to the verdict as the likely
cause; whatever was captured is written back to stderr either way. TileLang prints them only when
it compiles, not when it loads a kernel from its cache, so a failed check with nothing captured
lowers the learner's kernel again (``relower``, e.g. ``c_lowering(...)``) to hear them.
"""

import contextlib
import os
import re
import sys
import tempfile

from .common import ExerciseWrong

__all__ = ["surfacing_warnings", "c_lowering", "lowered_steps"]


@contextlib.contextmanager
def _captured_stderr():
    """Capture file descriptor 2 (C++ output included); yields a list that holds the text at exit."""
    sys.stderr.flush()
    saved = os.dup(2)
    text = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield text
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text.append(sink.read().decode(errors="replace"))


def _warnings(text):
    """TileLang's warnings in ``text``, one short line each (the numbered '[n] ...' detail lines)."""
    details = [m.strip() for m in re.findall(r"^\s*\[\d+\]\s*(.+)$", text, re.M)]
    heads = [m.strip() for m in re.findall(r"Warning:\s*(.+)$", text, re.M)]
    return details or heads


def c_lowering(factory, *args, **kwargs):
    """A ``relower`` for ``surfacing_warnings``: build ``factory(*args, **kwargs, target="c")`` and lower it
    for the C backend (TileLang's passes run again; nothing is compiled)."""
    def relower():
        import tilelang
        from tilelang import tvm

        from .kernels import build

        prim_func = build("relower", factory, *args, **kwargs, target="c")
        with tvm.target.Target("c"):
            tilelang.lower(prim_func, target="c")
    return relower


def surfacing_warnings(run, relower=None):
    """Call ``run()``; a failure gets TileLang's warnings, printed meanwhile (or by ``relower()``, called
    when nothing was printed), added as the likely cause."""
    failure = None
    captured = []
    try:
        with _captured_stderr() as captured:
            try:
                run()
            except ExerciseWrong as exc:
                failure = exc
    finally:
        if captured and captured[0]:
            sys.stderr.write(captured[0])
    if failure is None:
        return
    found = _warnings(captured[0] if captured else "")
    if not found and relower is not None:
        with _captured_stderr() as again:
            try:
                relower()
            except Exception:  # noqa: BLE001  (a kernel that does not lower has no warnings to add)
                pass
        found = _warnings(again[0] if again else "")
    # check_kernel may already have added TileLang's one-line summary ("1 buffer(s) read before ...") when the
    # kernel was compiled afresh rather than loaded from the cache; the detail naming the buffer is still news.
    new = [line for line in dict.fromkeys(found) if line not in str(failure)]
    if new:
        shown = "; ".join(new)[:300]
        raise ExerciseWrong(f"{str(failure).rstrip()} TileLang warned: {shown} — a likely cause.") from None
    raise failure


def lowered_steps(name, factory, args, loop_header, steps, *, kwargs=None, pass_configs=None, arch="sm_90a"):
    """Build the learner's ``factory(*args, **kwargs, target="cuda")``, lower it for ``arch`` on the CPU and
    return the labels of ``steps`` (``source.loop_skeleton``'s format) met in the loop whose first line
    matches ``loop_header``, in order, one per statement (a repeated statement's "×n" dropped). A kernel
    that does not lower is an ``ExerciseWrong`` naming the compiler's last line. Chapters 07 and 08 read
    the order of issues, waits and barriers from it."""
    from ..core.source import cuda_source, loop_skeleton
    from .kernels import build

    prim_func = build(name, factory, *args, **(kwargs or {}), target="cuda")
    try:
        source = cuda_source(prim_func, arch=arch, pass_configs=pass_configs)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = (lines or [type(exc).__name__])[-1][:200]
        raise ExerciseWrong(f"✗ {name}: your code does not lower for {arch}: {why}") from None
    return [label.split(" ×")[0] for _, label in loop_skeleton(source, loop_header, steps)]
