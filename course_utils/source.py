"""Reading code in pieces: a kernel factory's Python source, and the CUDA TileLang generates from it.

``show_source`` prints the lines of a function between two recognisable lines (with the file's
line numbers), so a chapter can explain a kernel piece by piece without copying its text.
``cuda_source`` lowers a ``@T.prim_func`` to CUDA for a given architecture without a GPU, and
``grep`` prints short, numbered excerpts of that (long) source.
"""

from __future__ import annotations

import inspect
import re

__all__ = ["show_source", "cuda_source", "grep", "count"]


def _find(lines, text, begin, what):
    for index in range(begin, len(lines)):
        if lines[index].lstrip().startswith(text):
            return index
    raise ValueError(f"{what} text {text!r} not found in the source")


def show_source(obj, start, end=None, *, after=None):
    """Print the lines of ``obj``'s source from the first line that begins with ``start`` (after
    its indentation) through the first line, at or after it, that begins with ``end`` (just the
    ``start`` line when ``end`` is None).

    ``after`` skips ahead: the search for ``start`` begins below the first line beginning with it.
    Lines are shown with their line numbers in the file, the common indentation removed.
    """
    lines, first_line = inspect.getsourcelines(obj)
    lines = [line.rstrip("\n") for line in lines]
    begin = _find(lines, after, 0, "after") + 1 if after is not None else 0
    i = _find(lines, start, begin, "start")
    j = _find(lines, end, i, "end") if end is not None else i
    chunk = lines[i:j + 1]
    indent = min(len(s) - len(s.lstrip()) for s in chunk if s.strip())
    for number, line in enumerate(chunk, start=first_line + i):
        print(f"{number:4d} │ {line[indent:]}")


def cuda_source(prim_func, arch="sm_90a"):
    """The CUDA source TileLang generates for ``prim_func`` on ``arch`` (no GPU needed)."""
    import tilelang
    from tilelang import tvm

    with tvm.target.Target({"kind": "cuda", "arch": arch}):
        return tilelang.lower(prim_func).kernel_source


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
