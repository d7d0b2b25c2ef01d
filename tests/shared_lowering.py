"""Generated code shared by the tests of one process: each kernel lowered once, ptxas run once on each source.

Several tests read the same kernel's sm_90a code for different properties (its loop's order, its barriers, ptxas's
report), and tests that compare two ways of building a kernel (a config field, a version, the registry) build the
same kernel again. Lowering one takes seconds to tens of seconds on a CPU, so ``cuda_source`` and ``ptxas_report``
here are ``course_utils.core.source``'s, remembered for the process: a kernel is the same when its TVMScript text
(the whole TIR function: buffers, attributes, body), the architecture and the pass options are; a report is the
same when the CUDA source and the architecture are. Lowering and ptxas are deterministic, so a test gets exactly
what it would have got from a lowering of its own.
"""

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
