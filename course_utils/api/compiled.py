"""The one compile cache: every kernel the front doors run is a registry row compiled here.

``compiled(row, problem, config, **extra)`` is ``row.compile(problem, config, **extra)``, kept per
(row, problem, config, extra): the row (hashed by identity), the frozen ``AttentionProblem``, the row's
config (a ``ForwardConfig``, ``BackwardConfig``, ``DecodeConfig`` or None) and the keywords the front door
adds (a schedule, a tile size, a flex kernel's ``tiling`` and ``plan``; a dict of pass options is keyed by its
items). A ``ModifierPlan`` is keyed by its traced formulas (``ModifierPlan.key``: plans with equal keys are
equal), so an equal formula of another function object finds the kernel compiled with the first; the entry
keeps that plan alive. A second call with the same key compiles nothing. ``compiled.cache_clear()`` drops
every kernel (the correctness gate does, between planted bugs).
"""

from __future__ import annotations

import functools

__all__ = ["compiled", "CACHE_SIZE"]

# Bounded: a loop over many sequence lengths must not keep every compiled kernel alive.
CACHE_SIZE = 256


def _frozen(value):
    return ("dict", tuple(value.items())) if isinstance(value, dict) else value


def _thawed(value):
    return dict(value[1]) if isinstance(value, tuple) and len(value) == 2 and value[0] == "dict" else value


@functools.lru_cache(maxsize=CACHE_SIZE)
def _compiled(row, problem, config, extra):
    return row.compile(problem, config, **{name: _thawed(value) for name, value in extra})


def compiled(row, problem, config=None, **extra):
    """``row.compile(problem, config, **extra)``, compiled once per distinct arguments."""
    return _compiled(row, problem, config, tuple(sorted((name, _frozen(value)) for name, value in extra.items())))


compiled.cache_clear = _compiled.cache_clear
compiled.cache_info = _compiled.cache_info
