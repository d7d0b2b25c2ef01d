"""Reading code in pieces: a kernel factory's Python source, and the CUDA TileLang generates from it.

``show_source`` prints a function, or one marked region of it (with the file's line numbers), so a
chapter can explain a kernel piece by piece without copying its text.
``cuda_source`` lowers a ``@T.prim_func`` to CUDA for a given architecture without a GPU, and
``grep`` prints short, numbered excerpts of that (long) source, and ``loop_skeleton`` the steps of
one of its loops in order. ``ptxas_report`` compiles it with nvcc and returns what ptxas says
about registers, spills and serialised wgmmas; ``machine_code`` disassembles what ptxas made (SASS) and
``wait_before_exponentials`` finds where it put a warpgroup's wait for its P·V. ``lowering_error`` lowers a kernel
that is expected to be refused and returns TileLang's message.
"""

from __future__ import annotations

import inspect
import re

__all__ = ["show_source", "shown_runs", "source_regions", "cuda_source", "grep", "count", "loop_skeleton",
           "ptxas_report", "machine_code", "wait_before_exponentials", "lowering_error"]


_REGION = re.compile(r"^\s*# region: (.+?)\s*$")
_END_REGION = re.compile(r"^\s*# endregion\s*$")
_SHOWN_LINE = re.compile(r"^\s*(\d+) │ ?(.*)$")  # a line show_source prints: its number in the file, then the code


def _python_object(obj):
    """The Python function behind ``obj`` (a TileLang macro keeps it as ``orig_func``)."""
    return getattr(obj, "orig_func", obj)


def source_regions(obj):
    """The names of the ``# region: name`` … ``# endregion`` blocks in ``obj``'s source."""
    return [m.group(1) for line in inspect.getsourcelines(_python_object(obj))[0] if (m := _REGION.match(line))]


def show_source(obj, region=None):
    """Print ``obj``'s source (a function, macro or class) with its line numbers in the file.

    With ``region``, print only the lines between ``# region: <region>`` and the next
    ``# endregion`` (the marker lines themselves are left out). A region that does not exist is an
    error, so a chapter cannot silently show the wrong lines after a kernel changes.
    """
    obj = _python_object(obj)
    lines, first_line = inspect.getsourcelines(obj)
    lines = [line.rstrip("\n") for line in lines]
    numbers = range(first_line, first_line + len(lines))
    if region is not None:
        starts = [i for i, line in enumerate(lines) if (m := _REGION.match(line)) and m.group(1) == region]
        if not starts:
            raise ValueError(f"no region {region!r} in {obj.__qualname__}; it has {source_regions(obj)}")
        end = next((j for j in range(starts[0] + 1, len(lines)) if _END_REGION.match(lines[j])), None)
        if end is None:
            raise ValueError(f"region {region!r} of {obj.__qualname__} has no '# endregion'")
        lines, numbers = lines[starts[0] + 1:end], numbers[starts[0] + 1:end]
    shown = [(n, line) for n, line in zip(numbers, lines) if not _REGION.match(line) and not _END_REGION.match(line)]
    indent = min(len(s) - len(s.lstrip()) for _, s in shown if s.strip())
    for number, line in shown:
        print(f"{number:4d} │ {line[indent:]}")


def shown_runs(text):
    """The runs of consecutive numbered lines ``show_source`` printed in ``text`` (a stored output):
    [[(line number, code), ...], ...]."""
    runs, run = [], []
    for line in text.splitlines():
        m = _SHOWN_LINE.match(line)
        if m and (not run or int(m.group(1)) == run[-1][0] + 1):
            run.append((int(m.group(1)), m.group(2)))
            continue
        if run:
            runs.append(run)
        run = [(int(m.group(1)), m.group(2))] if m else []
    return runs + ([run] if run else [])


def cuda_source(prim_func, arch="sm_90a", pass_configs=None):
    """The CUDA source TileLang generates for ``prim_func`` on ``arch`` (no GPU needed).

    ``pass_configs``: TileLang pass options, as ``compile_kernel`` takes them (e.g. chapter 08's own
    barriers, or warp specialisation off)."""
    import tilelang
    from tilelang import tvm

    with tvm.transform.PassContext(config=dict(pass_configs or {})), tvm.target.Target({"kind": "cuda", "arch": arch}):
        return tilelang.lower(prim_func).kernel_source


def lowering_error(prim_func, arch="sm_90a"):
    """Lower ``prim_func`` for ``arch`` when that is expected to fail: TileLang's error message, or None
    if it lowered. TVM's C++ logger also writes a fatal error to the process's stderr (a timestamped
    "Fatal:" line, the same message) before raising it; that copy is dropped here, so a chapter shows
    the message once, as the check prints it."""
    import os
    import sys

    import tilelang
    from tilelang import tvm

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        with tvm.target.Target({"kind": "cuda", "arch": arch}):
            tilelang.lower(prim_func)
    except Exception as exc:  # TVM raises its own error types (InternalError, TVMError, ...)
        return str(exc).strip()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    return None


def grep(source, pattern, *, max_hits=2, width=110):
    """Print up to ``max_hits`` lines of ``source`` matching the regex ``pattern``, numbered and
    cut to ``width`` characters (generated CUDA lines are long), and how many matched in all.
    Returns nothing, so a notebook cell ending with it shows only what it printed."""
    hits = [(n, line.strip()) for n, line in enumerate(source.splitlines(), start=1)
            if re.search(pattern, line)]
    for number, line in hits[:max_hits]:
        print(f"{number:4d} │ {line[:width]}{' …' if len(line) > width else ''}")
    if len(hits) > max_hits:
        print(f"       ({len(hits)} lines match {pattern!r})")
    if not hits:
        print(f"       (no line matches {pattern!r})")


def count(source, patterns):
    """How many lines of ``source`` match each regex in ``patterns`` (a dict name → regex)."""
    lines = source.splitlines()
    return {name: sum(1 for line in lines if re.search(p, line)) for name, p in patterns.items()}


def loop_skeleton(source, loop_header, steps):
    """The statements of one loop of generated code that match ``steps``, in order.

    ``loop_header`` is a regex for the loop's first line (e.g. ``r"for \\(int kb = 0"``); ``steps``
    maps a label (``str.format``-ed with the regex's groups) to a regex. Consecutive equal labels
    are merged ("label ×n"). Returns a list of (first line number, label).
    """
    lines = source.splitlines()
    start = next(n for n, line in enumerate(lines) if re.search(loop_header, line))
    depth, out = 0, []
    for n in range(start, len(lines)):
        depth += lines[n].count("{") - lines[n].count("}")
        for label, pattern in steps.items():
            m = re.search(pattern, lines[n])
            if m:
                text = label.format(*(g or "" for g in m.groups()))
                if out and out[-1][1] == text:
                    out[-1][2] += 1
                else:
                    out.append([n + 1, text, 1])
                break
        if depth == 0 and n > start:
            break
    return [(n, text + (f" ×{k}" if k > 1 else "")) for n, text, k in out]


def _nvcc(source, arch, output, extra, tmp):
    """Run nvcc on TileLang's CUDA ``source`` in directory ``tmp``, writing ``output`` (``-cubin``: device code)."""
    import os
    import subprocess

    import tilelang

    root = os.path.dirname(tilelang.__file__)
    number = arch.removeprefix("sm_")
    path = os.path.join(tmp, "kernel.cu")
    with open(path, "w") as f:
        f.write(source)
    cmd = ["nvcc", "-std=c++17", "-O3", "--use_fast_math", "-w", output, path, "-o", os.path.join(tmp, "kernel.out"),
           "-gencode", f"arch=compute_{number},code=sm_{number}", *extra,
           "-I", os.path.join(root, "src"), "-I", os.path.join(root, "3rdparty", "cutlass", "include")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{done.stderr[-2000:]}")
    return done, os.path.join(tmp, "kernel.out")


def ptxas_report(source, arch="sm_90a"):
    """Compile TileLang's CUDA ``source`` with nvcc (no GPU needed) and return ptxas's report lines.

    The report gives registers, spills and performance warnings such as C7514 (wgmma serialised).
    Returns None when nvcc is not installed.
    """
    import shutil
    import tempfile

    if shutil.which("nvcc") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        # -cubin: the device code only, which is all ptxas reports on; -c also compiled the host side with the
        # host compiler (CUTLASS's headers): the same report, in about 2.5x the time
        done, _ = _nvcc(source, arch, "-cubin", ["-Xptxas", "-v"], tmp)
    return [line.strip() for line in done.stderr.splitlines() if line.startswith("ptxas") or "spill" in line]


def _nvdisasm():
    """nvdisasm on the PATH, or the one of the ``nvidia-cuda-nvdisasm`` wheel (requirements.txt), or None."""
    import shutil
    from pathlib import Path

    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    candidates = [p for root in nvidia.__path__ for p in Path(root).glob("cu*/bin/nvdisasm")]
    return str(candidates[0]) if candidates else None


def machine_code(source, arch="sm_90a"):
    """The SASS that ptxas makes of TileLang's CUDA ``source``: one instruction per item (predicate, opcode and
    operands, without addresses or encodings). None when nvcc or nvdisasm is not installed."""
    import shutil
    import subprocess
    import tempfile

    nvdisasm = _nvdisasm()
    if shutil.which("nvcc") is None or nvdisasm is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        _, cubin = _nvcc(source, arch, "-cubin", [], tmp)
        text = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", text)]


def wait_before_exponentials(sass):
    """In SASS from ``machine_code``, after the first wait for all but the last wgmma batch (``WARPGROUP.DEPBAR.LE
    gsb0, 0x1``: the scores are ready, P·V may still run): (instructions up to the first exponential ``MUFU.EX2``,
    whether a wait for every batch, ``DEPBAR.LE gsb0, 0x0``, comes before that exponential on its path). A wait
    before the window's last branch belongs to another path (the rotated loop's last iteration, which has no
    softmax), so only the waits after it count."""
    start = next(i for i, op in enumerate(sass) if op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1"))
    first_exp = next(i for i in range(start, len(sass)) if "MUFU.EX2" in sass[i])
    window = sass[start:first_exp + 1]
    branches = [i for i, op in enumerate(window) if re.search(r"(^|\s)BRA\b", op)]
    on_path = window[branches[-1] + 1:] if branches else window
    return window, any(op.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0") for op in on_path)
