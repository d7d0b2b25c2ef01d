"""One ``Version`` type for both ablations (chapter 07's forward, chapter 08's backward).

A version is a shipped kernel (a skeleton whose varying steps are arguments) plus the pieces and
tiling it swaps in (``knobs``), and one line of why. ``knobs_for`` is the whole keyword list for one
case (head dim, causal or not); each direction's module says how a version is built and run
(``build``), and ``versions_for`` picks the versions an ablation times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Version", "versions_for", "renamed", "grouped"]


@dataclass(frozen=True)
class Version:
    """One row of an ablation: a kernel factory, the knobs (tiling, swapped pieces) it is called with, why."""

    number: int
    label: str
    why: str
    factory: object = None  # the skeleton (a shipped kernel) or chapter 03/05's kernel
    knobs: dict = field(default_factory=dict)  # for every case
    compile_options: dict = field(default_factory=dict)  # compile_kernel's (fast_math, pass_configs)
    when: dict = field(default_factory=dict)  # more knobs for some cases: "causal", a head dim, (head dim, causal)
    kept: bool = True  # on the path to the shipped kernel; False for a variation that was measured and dropped
    base: int | None = None  # for a variation: the number of the version it varies
    causal_only: bool = False
    dims: tuple = (64, 128)  # head dimensions the version is measured at
    defaults: dict = field(default_factory=dict)  # the direction's default tiling
    builder: object = None  # (version, batch, heads, seq, dim, *, causal, dtype, **options) -> what the ablation runs
    shipped_code: bool = False  # runs the shipped kernel's code as it is (at this version's tiling)
    name: str | None = None  # the generated kernel's name, when not the factory's own

    def knobs_for(self, dim, causal):
        """Every keyword this version passes to its factory at head dim ``dim``."""
        knobs = {**self.defaults, **self.knobs}
        for key in (("causal",) if causal else ()) + (dim, (dim, causal)):
            knobs.update(self.when.get(key, {}))
        return knobs

    def tiling(self, dim, causal):
        """The (block_M, block_N) this version uses at head dim ``dim``."""
        knobs = self.knobs_for(dim, causal)
        return knobs["block_M"], knobs["block_N"]

    def build(self, batch, heads, seq, dim, *, causal, dtype="float16", **options):
        """Compile this version for self-attention of the given shape (CUDA, sm_90)."""
        return self.builder(self, batch, heads, seq, dim, causal=causal, dtype=dtype, **options)


def versions_for(versions, causal, dim=None):
    """The versions an ablation times for a causal or non-causal problem (at head dimension ``dim``)."""
    return [v for v in versions if (causal or not v.causal_only) and (dim is None or dim in v.dims)]


def renamed(func, name):
    """``func`` under the kernel name ``name`` (a variation keeps the name its listing shows)."""
    return func if name is None else func.with_attr("global_symbol", name)


def grouped(knobs, tiling, pieces=None):
    """A version's knobs as its kernel's arguments: the fields of ``tiling`` (the kernel's tiling type) in one
    ``tiling`` argument, those of ``pieces`` (its pieces type, if it takes one) in one ``pieces`` argument, and any
    other knob (``target``) as it is."""
    groups = [(name, kind) for name, kind in (("tiling", tiling), ("pieces", pieces)) if kind is not None]
    arguments = {k: v for k, v in knobs.items() if not any(k in kind._fields for _, kind in groups)}
    for name, kind in groups:
        arguments[name] = kind(**{k: v for k, v in knobs.items() if k in kind._fields})
    return arguments
