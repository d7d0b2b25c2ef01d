"""Generated code shared by the tests of one process: each kernel lowered once, ptxas run once on each source.

Several tests read the same kernel's sm_90a code for different properties (its loop's order, its barriers, ptxas's
report), and tests that compare two ways of building a kernel (a config field, a version, the registry) build the
same kernel again. Lowering one takes seconds to tens of seconds on a CPU, so ``cuda_source`` and ``ptxas_report``
here are ``course_utils.core.source``'s, remembered for the process: a kernel is the same when its TVMScript text
(the whole TIR function: buffers, attributes, body), the architecture and the pass options are; a report is the
same when the CUDA source and the architecture are. Lowering and ptxas are deterministic, so a test gets exactly
what it would have got from a lowering of its own.
"""

import re

from course_utils.core import source as _source

_LOWERED = {}
_REPORTS = {}


def _options_key(pass_configs):
    return tuple(sorted((str(key), repr(value)) for key, value in dict(pass_configs or {}).items()))


def cuda_source(prim_func, arch="sm_90a", pass_configs=None):
    """``course_utils.core.source.cuda_source``, lowered once per kernel, architecture and pass options."""
    key = (prim_func.script(), arch, _options_key(pass_configs))
    if key not in _LOWERED:
        _LOWERED[key] = _source.cuda_source(prim_func, arch=arch, pass_configs=pass_configs)
    return _LOWERED[key]


def ptxas_report(source, arch="sm_90a"):
    """``course_utils.core.source.ptxas_report`` (None without nvcc), run once per source and architecture."""
    key = (source, arch)
    if key not in _REPORTS:
        _REPORTS[key] = _source.ptxas_report(source, arch=arch)
    report = _REPORTS[key]
    return None if report is None else list(report)  # a copy: a test may edit its list


_ENTRY = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(")


def ptxas_reports(sources, arch="sm_90a"):
    """ptxas's report on each of ``sources`` (a dict: label → CUDA source), from one nvcc run: {label: its lines},
    or None without nvcc. Most of an nvcc run is its front end reading TileLang's and CUTLASS's headers, the same
    for every kernel, so the kernels go into one translation unit, each under its own name (ptxas compiles and
    reports on each entry function on its own: registers, spills and serialised wgmmas are per function).

    A line naming one kernel, and the lines of that kernel's section (from "Compiling entry function" on), are its
    own; any other line (before the first section) is given to every kernel, so no warning is lost. The names are
    given back in the lines, as a report of the source alone would have them."""
    labels = list(sources)
    renamed, names = [], []
    for i, label in enumerate(labels):
        entries = sorted(set(_ENTRY.findall(sources[label])), key=len, reverse=True)
        assert entries, f"{label}: no __global__ function in its source"
        own = {name: f"{name}_in_unit_{i}" for name in entries}
        text = sources[label]
        for name, new in own.items():
            text = re.sub(rf"\b{name}\b", new, text)
        renamed.append(text)
        names.append(own)
    report = ptxas_report("\n".join(renamed), arch=arch)
    if report is None:
        return None
    owner = {new: i for i, own in enumerate(names) for new in own.values()}
    lines = {i: [] for i in range(len(labels))}
    section = None
    for line in report:
        named = {owner[name] for name in re.findall(r"\w+", line) if name in owner}
        if line.startswith("ptxas info    : Compiling entry function") and len(named) == 1:
            section = next(iter(named))
        for i in named or ([section] if section is not None else range(len(labels))):
            lines[i].append(line)
    back = {}
    for i, label in enumerate(labels):
        restored = []
        for line in lines[i]:
            for name, new in names[i].items():
                line = line.replace(new, name)
            restored.append(line)
        back[label] = restored
    return back
