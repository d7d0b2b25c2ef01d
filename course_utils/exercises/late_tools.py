"""Surface TileLang's own warnings in a checker's verdict (chapters 04, 07, 09), and ptxas's on the lowered code
(chapters 07, 08).

TileLang's C++ passes print warnings such as "`S` is read before anything writes it" straight to
the process's stderr (file descriptor 2), where a notebook shows them far from the checker's
one-line verdict, or not at all. ``surfacing_warnings(run)`` runs a check with descriptor 2
captured; if the check fails, the warnings TileLang printed are added to the verdict as the likely
cause; whatever was captured is written back to stderr either way. TileLang prints them only when
it compiles, not when it loads a kernel from its cache, so a failed check with nothing captured
lowers the learner's kernel again (``relower``, e.g. ``c_lowering(...)``) to hear them.

The Hopper exercises are also compiled by nvcc (``ptxas_verdict``; seconds, no GPU): a loop whose order of
issues and waits looks right can still write or read a wgmma's registers while it runs, and ptxas then
serialises every wgmma (C7513-C7515) or injects a wait of its own (C7517). Either, or a register spill, fails
the exercise with the likely cause.
"""

import contextlib
import os
import re
import sys
import tempfile

from .common import ExerciseWrong

__all__ = ["surfacing_warnings", "c_lowering", "lowered_steps", "lowered_source", "loop_steps", "ptxas_problem",
           "ptxas_verdict"]


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


def lowered_source(name, factory, args, *, kwargs=None, pass_configs=None, arch="sm_90a"):
    """The CUDA source of the learner's ``factory(*args, **kwargs, target="cuda")`` lowered for ``arch`` on the
    CPU. A kernel that does not lower is an ``ExerciseWrong`` naming the compiler's last line."""
    from ..core.source import cuda_source
    from .kernels import build

    prim_func = build(name, factory, *args, **(kwargs or {}), target="cuda")
    try:
        return cuda_source(prim_func, arch=arch, pass_configs=pass_configs)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = (lines or [type(exc).__name__])[-1][:200]
        raise ExerciseWrong(f"✗ {name}: your code does not lower for {arch}: {why}") from None


def loop_steps(source, loop_header, steps):
    """The labels of ``steps`` (``source.loop_skeleton``'s format) met in the loop of ``source`` whose first line
    matches ``loop_header``, in order, one per statement (a repeated statement's "×n" dropped)."""
    from ..core.source import loop_skeleton

    return [label.split(" ×")[0] for _, label in loop_skeleton(source, loop_header, steps)]


def lowered_steps(name, factory, args, loop_header, steps, *, kwargs=None, pass_configs=None, arch="sm_90a"):
    """``loop_steps`` of ``lowered_source``: the order of issues, waits and barriers that chapters 07 and 08
    read from the learner's loop."""
    source = lowered_source(name, factory, args, kwargs=kwargs, pass_configs=pass_configs, arch=arch)
    return loop_steps(source, loop_header, steps)


# What ptxas's serialisation of the wgmmas means in a learner's loop, by the reason it gives ("due to ...").
# ptxas keeps a wgmma pipeline asynchronous only when no ordinary instruction touches its registers between the
# issue and the wait that retires it; when one does, it waits after every wgmma of the function: the answer is
# right, the overlap the exercise is about is gone, and the order it read was a race.
_SERIALISED = (
    ("defining input registers", "a register operand of a wgmma (P, Pᵀ or dSᵀ held in registers) is written while "
     "the wgmma that reads it may still be running: compute into another tile and write the operand only after the "
     "wait that retires its reader (e.g. the exponentials into S, wait(0), then T.copy(S, P))"),
    ("defining accumulator registers", "a wgmma's accumulator is written (a rescale, a clear, a copy into it) while "
     "the wgmma that adds into it may still be running: wait for its batch first"),
    ("reading accumulator registers", "a wgmma's accumulator is read or changed (a copy out, a clear, a rescale) "
     "while the wgmma may still be running: wait for its batch before the statement that touches it"),
    ("insufficient register resources", "the loop needs more registers than a thread has: fewer or smaller register "
     "tiles live at once"),
)


def ptxas_problem(report):
    """The first hazard that ptxas's report (``source.ptxas_report``'s lines) shows, as a sentence; None if none.
    Serialised wgmmas, a wait ptxas had to inject, and register spills are hazards in a Hopper exercise."""
    for line in report:
        match = re.search(r"\((C75\d\d)\)\s*(.*)", line)
        if not match:
            continue
        code, text = match.groups()
        if "serialized" in text:
            why = re.search(r"due to (.*?)(?: of\s+a wgmma| for the function|$)", text)
            cause = next((c for key, c in _SERIALISED if key in text), None)
            reason = re.sub(r"\s+", " ", why.group(1)).strip() if why else "its own reasons"
            return (f"ptxas serialises every wgmma of the kernel ({code}: \"{reason}\"), so nothing overlaps"
                    + (f". Likely cause: {cause}" if cause else ""))
        if "warpgroup.wait is injected" in text:
            return (f"ptxas had to inject a wait of its own ({code}): a register a wgmma writes is used before any "
                    "wait retires that wgmma (a race the CPU cannot show). Likely cause: a wait(n) missing or too "
                    "lenient before the statement that reads the result")
        return f"ptxas warns: {code} {text.strip()[:160]}"
    for line in report:
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if spill and (int(spill.group(1)) or int(spill.group(2))):
            return (f"ptxas spills registers to local memory ({spill.group(1)} bytes stored, {spill.group(2)} "
                    "loaded per thread): the loop keeps more register tiles live than a thread holds. Likely cause: "
                    "a fragment that could be a shared tile, or a copy of a tile kept beside the tile")
    return None


def ptxas_verdict(name, source, arch="sm_90a"):
    """Compile the learner's lowered ``source`` with nvcc for ``arch`` (no GPU needed) and raise ``ExerciseWrong``
    on the hazard ptxas reports (``ptxas_problem``). Returns what was checked, for the ✓ line: "ptxas: no
    serialised wgmma, no spill", or why ptxas was not run (no nvcc on this machine, or nvcc failed)."""
    from ..core.source import ptxas_report

    try:
        report = ptxas_report(source, arch=arch)
    except RuntimeError as exc:  # nvcc's own failure (headers, version): the checks above still stand
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"ptxas not run: {(lines or ['nvcc failed'])[-1][:120]}"
    if report is None:
        return "ptxas not run: nvcc is not installed here"
    problem = ptxas_problem(report)
    if problem:
        raise ExerciseWrong(f"✗ {name}: right on the CPU and in the order of the sm_90a loop, but {problem}.")
    return "ptxas: no serialised wgmma, no spill"
