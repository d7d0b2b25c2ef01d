"""Every kernel the front doors can run, one row each: factory, architecture, options and compile options.

``flash_attention`` picks a row by the ``kernel`` field of its ``ForwardConfig``/``BackwardConfig`` and
calls ``row.compile(problem, config)``; nothing downstream asks for a kernel by name. A new kernel is
one row here (and, for its default tiling, one entry in ``attention``'s configs). ``flash_attention_varlen``
picks its rows from ``PACKED_FORWARD`` and ``PACKED_BACKWARD`` by the same names: each is the packed prelude
under the loop of the dense kernel of that name. ``flash_decode`` runs the rows of ``DECODE``, ``flex_attention``
those of ``FLEX``. A row's ``layout`` says which of the problem's fields its factory takes (``DENSE``, ``PACKED``,
``DECODE_LAYOUT``, ``FLEX_LAYOUT``...).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import tilelang
import torch

from ..core.device import is_hopper
from ..kernels.flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from ..kernels.flash_bwd_hopper import PASS_CONFIGS as HOPPER_BACKWARD_PASS_CONFIGS
from ..kernels.flash_bwd_hopper import (
    BackwardPieces,
    flash_bwd_hopper_dq_kernel,
    flash_bwd_hopper_kernel,
    gemm_policies,
)
from ..kernels.flash_decode import DecodeConfig, flash_decode_kernel, flash_decode_merge_kernel
from ..kernels.flash_flex import flex_bwd_kernel, flex_fwd_kernel
from ..kernels.flash_flex_hopper import flex_fwd_hopper_kernel
from ..kernels.flash_flex_hopper_bwd import flex_bwd_hopper_kernel
from ..kernels.flash_flex_persistent import flex_fwd_hopper_persistent_kernel
from ..kernels.flash_fwd import ForwardTiling, flash_fwd_kernel
from ..kernels.flash_fwd_fp8 import flash_fwd_fp8_hopper_kernel, flash_fwd_fp8_kernel
from ..kernels.flash_fwd_fp8_persistent import flash_fwd_fp8_persistent_kernel
from ..kernels.flash_fwd_hopper import RotatedPieces, flash_fwd_hopper_kernel
from ..kernels.flash_fwd_hopper_one_warpgroup import OneWarpgroupTiling, flash_fwd_hopper_one_warpgroup_kernel
from ..kernels.flash_fwd_hopper_persistent import PersistentTiling, flash_fwd_hopper_persistent_kernel
from ..kernels.flash_varlen import (
    flash_varlen_bwd_kernel,
    flash_varlen_fwd_kernel,
    scale_cast_kernel,
    varlen_delta_kernel,
)
from ..kernels.flash_varlen_hopper import (
    PackedBackwardPieces,
    flash_varlen_bwd_hopper_kernel,
    flash_varlen_fwd_persistent_kernel,
)
from ..kernels.fp8_producer import quantise_inputs_kernel, quantise_transposed_kernel
from ..kernels.tiles import Tiling, compile_kernel

__all__ = ["KernelRow", "FORWARD", "BACKWARD", "PACKED_FORWARD", "PACKED_BACKWARD", "DECODE", "HELPERS", "FP8",
           "FLEX", "OPTION_OFF", "forward_row", "backward_row", "DENSE", "PACKED", "DECODE_LAYOUT", "MERGE",
           "FLEX_LAYOUT", "FLEX_BACKWARD_LAYOUT", "ROWS"]


def _sm_count():
    """One persistent block per SM of the current GPU."""
    return dict(num_ctas=torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)


# Config fields that only some kernels take (a row's ``options``), with the value that leaves each off.
OPTION_OFF = {"pingpong": False, "blocks_per_sm": 1, "dv_under_ds": False, "policies": None, "dkdv_by_tma": False,
              "longest_first": False, "defer_dq_wait": False, "dq_per_warpgroup": False}


def _shape(problem):
    """The leading arguments of the kernel factories that take a whole problem's shape, by name."""
    return dict(zip(("batch", "heads", "seq_q", "seq_k", "dim"), problem.shape))


def DENSE(problem):
    """A dense kernel's arguments: the shape and the variant."""
    return dict(_shape(problem), **problem.kernel_options())


def PACKED(problem):
    """A packed-batch kernel's: head count and dim (the lengths are run-time) and the variant."""
    return dict(heads=problem.heads, dim=problem.dim, **problem.kernel_options())


def DECODE_LAYOUT(problem):
    """A decoding kernel's: head counts, dim, new tokens per sequence, the cache's page size and the variant."""
    return dict(heads=problem.heads, dim=problem.dim, seq_new=problem.seq_new, page_size=problem.page_size,
                **problem.kernel_options())


def MERGE(problem):
    """Decoding's merge of partial results: it reads only the query heads, dim, new tokens and dtype."""
    return dict(heads=problem.heads, dim=problem.dim, seq_new=problem.seq_new, dtype=problem.dtype)


def FLEX_LAYOUT(problem):
    """A flex forward's: the shape, the shape of the block mask's tile states (its tile is the kernel's, in the
    ``tiling`` the front door passes), heads_kv, scale and dtype."""
    return dict(_shape(problem), mask_shape=problem.mask_shape,
                heads_kv=problem.heads_kv, sm_scale=problem.sm_scale, dtype=problem.dtype)


def FLEX_BACKWARD_LAYOUT(problem):
    """A flex backward's: the forward's and the block mask's tile, whose query rows it walks in steps of its own."""
    return dict(FLEX_LAYOUT(problem), mask_block=problem.mask_block)


def _fp8_layout(problem):
    """The FP8 forwards': the shape and the mask (no window, no sinks; the dtype is e4m3's)."""
    return dict(_shape(problem), heads_kv=problem.heads_kv, causal=problem.causal, sm_scale=problem.sm_scale)


def _producer_layout(problem):
    """The FP8 producer's: Q's, K's and V's shapes and their dtype."""
    return dict(_shape(problem), heads_kv=problem.heads_kv, dtype=problem.dtype)


def _transposed_layout(problem):
    """The FP8 producer of V's: V's shape and its dtype."""
    return dict(batch=problem.batch, heads=problem.heads_kv, seq=problem.seq_k, dim=problem.dim, dtype=problem.dtype)


# The rows are keys of the one compile cache (``api.compiled``): a row is hashed by identity.
@dataclass(frozen=True, eq=False)
class KernelRow:
    """One kernel: how to build it for an ``AttentionProblem`` and a config, and where it runs."""

    name: str
    factory: object  # (**layout(problem), **arguments(config)) -> @T.prim_func
    out_idx: tuple  # the parameters the compiled kernel allocates and returns
    what: str  # for error messages: "chapter 08's Hopper kernel"
    hopper_only: bool = False  # wgmma/TMA: needs an sm_90 GPU
    on_cpu: bool = True  # the factory takes ``target`` (one source for the CPU and the GPU)
    sinks: bool = False  # the factory takes ``has_sinks`` (the forwards)
    options: tuple = ()  # config fields passed on beyond the tiling, e.g. ("pingpong",), ("dv_under_ds",)
    pieces: object = None  # a factory that takes its options as one ``pieces`` argument of this type
    tiling: object = None  # a factory that takes its tiling as one ``tiling`` argument of this type: the config's
    # tiling, the options that are fields of it, the GPU's (``per_device``) and the front door's (``num_ctas``)
    deterministic: bool = False  # has a deterministic mode (``deterministic=`` and a dQ kernel)
    pass_configs: dict = field(default_factory=dict)  # TileLang pass options it is compiled with
    per_device: object = None  # () -> more factory arguments read from the GPU (num_ctas)
    keyless_blocks_unaliased: bool = False  # see CH03_LOOP_KEYLESS_PASS_CONFIGS
    fixed: tuple = ()  # ((argument, value), ...): what makes a factory that serves two rows this row's loop
    takes_schedule: bool = False  # a packed kernel that hands out its blocks by a "grid" or "list" schedule
    layout: object = DENSE  # problem -> the factory's keywords for the problem's sizes and variant
    fast_math: bool = True  # False: IEEE division (the FP8 producer's values must equal PyTorch's on the CPU)

    def check(self, problem, config, deterministic=False):
        """A clear ``ValueError`` for a config this kernel cannot run here."""
        kind = type(config).__name__
        if self.hopper_only and (problem.target != "cuda" or not is_hopper()):
            raise ValueError(f"{kind}(kernel={self.name!r}) is {self.what}: it needs an sm_90 GPU")
        for option, off in OPTION_OFF.items():
            value = getattr(config, option, off)
            if value != off and option not in self.options:
                takers = [name for name, row in {**FORWARD, **BACKWARD}.items() if option in row.options]
                raise ValueError(f"{kind}({option}={value!r}) needs a kernel that takes it, one of {takers}; "
                                 f"{self.name!r} is {self.what}")
        if getattr(config, "policies", None) is not None:
            gemm_policies(config.policies, swap_dq=False)  # a clear ValueError now, not at the backward
        if deterministic and not self.deterministic:
            raise ValueError("deterministic=True needs chapter 08's Hopper backward (kernel='flash_bwd_hopper', sm_90 "
                             "GPU); chapter 05's kernel adds dQ with atomics in whatever order blocks finish")

    def build(self, problem, config, **extra):
        """The ``@T.prim_func`` of this kernel for ``problem`` with ``config``'s tiling (None: the factory's)."""
        kwargs = dict(self.layout(problem), **dict(self.fixed))
        if self.sinks:
            kwargs["has_sinks"] = problem.has_sinks
        if self.on_cpu:
            kwargs["target"] = problem.target
        if self.per_device is not None:
            extra = {**self.per_device(), **extra}
        return self.factory(**kwargs, **self.arguments(config, **extra))

    def arguments(self, config, **extra):
        """The factory's arguments for ``config``'s tiling and ``options`` and for ``extra``: keywords, or, for a
        factory that takes them so, one ``tiling`` (the factory's default with the config's and ``extra``'s fields
        of it) and one ``pieces`` (the other options); any other ``extra`` as a keyword."""
        tiling = {} if config is None else config.tiling()
        options = {} if config is None else {o: getattr(config, o) for o in self.options}
        if self.tiling is None:
            if self.pieces is not None and options:
                options = {"pieces": self.pieces(**options)}
            return {**tiling, **options, **extra}
        fields = self.tiling._fields
        tiling.update({k: v for k, v in {**options, **extra}.items() if k in fields})
        arguments = {"tiling": inspect.signature(self.factory).parameters["tiling"].default._replace(**tiling)}
        options = {k: v for k, v in options.items() if k not in fields}
        if options:
            arguments["pieces"] = self.pieces(**options)
        return {**arguments, **{k: v for k, v in extra.items() if k not in fields}}

    def compile(self, problem, config, *, pass_configs=None, **extra):
        """Build and compile for ``problem.target``, with ``pass_configs`` added to the row's and the config's."""
        pass_configs = {**self.pass_configs, **_config_pass_configs(config), **(pass_configs or {})}
        if self.keyless_blocks_unaliased and _has_keyless_rows(problem) and problem.target == "cuda" and is_hopper():
            pass_configs.update(CH03_LOOP_KEYLESS_PASS_CONFIGS)
        return compile_kernel(self.build(problem, config, **extra), out_idx=list(self.out_idx), target=problem.target,
                              dtype=problem.dtype, pass_configs=pass_configs or None, fast_math=self.fast_math)


def _config_pass_configs(config):
    """The pass options a config asks for (``DecodeConfig``'s warp specialisation), if it has any."""
    return config.pass_configs() if hasattr(config, "pass_configs") else {}


_HOPPER_FORWARD = "one of chapter 07's Hopper kernels"
# Chapter 03's loop on sm_90: TileLang's shared-memory plan puts O's staging tile over Q's and waits for Q's
# TMA load only inside the key loop, so a query block that sees no key (causal with more queries than keys:
# the diagonal is aligned bottom-right) would store O while Q is still landing on it. Only such problems are
# compiled unaliased (the others keep their measured layout); sm_80's loads are not TMA.
CH03_LOOP_KEYLESS_PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_SHARED_MEMORY_REUSE: True}


def _has_keyless_rows(problem):
    return problem.causal and problem.seq_q is not None and problem.seq_q > problem.seq_k
# The kernels a ForwardConfig or BackwardConfig can select: chapter 03/04's forward, chapter 07's three
# Hopper forwards (the rotated loop, its persistent version, and one warpgroup per block issuing its own loads);
# chapter 05's and chapter 08's backward.
FORWARD = {row.name: row for row in (
    KernelRow("flash_fwd", flash_fwd_kernel, (4, 5), "chapter 03/04's kernel", sinks=True,
              keyless_blocks_unaliased=True, tiling=ForwardTiling),
    KernelRow("flash_fwd_hopper", flash_fwd_hopper_kernel, (4, 5), _HOPPER_FORWARD, hopper_only=True, on_cpu=False,
              sinks=True, options=("pingpong",), tiling=Tiling, pieces=RotatedPieces),
    KernelRow("flash_fwd_hopper_persistent", flash_fwd_hopper_persistent_kernel, (4, 5), _HOPPER_FORWARD,
              hopper_only=True, on_cpu=False, sinks=True, options=("pingpong", "blocks_per_sm"), per_device=_sm_count,
              tiling=PersistentTiling),
    KernelRow("flash_fwd_hopper_one_warpgroup", flash_fwd_hopper_one_warpgroup_kernel, (4, 5), _HOPPER_FORWARD,
              hopper_only=True, on_cpu=False, sinks=True, options=("blocks_per_sm",), tiling=OneWarpgroupTiling),
)}
BACKWARD = {row.name: row for row in (
    KernelRow("flash_bwd", flash_bwd_kernel, (), "chapter 05's kernel", tiling=Tiling),
    KernelRow("flash_bwd_hopper", flash_bwd_hopper_kernel, (), "chapter 08's Hopper kernel", hopper_only=True,
              on_cpu=False, options=("dv_under_ds", "policies", "dkdv_by_tma", "longest_first", "defer_dq_wait",
                                     "dq_per_warpgroup"),
              pieces=BackwardPieces, tiling=Tiling, deterministic=True,
              pass_configs=HOPPER_BACKWARD_PASS_CONFIGS),
)}


# The packed-batch kernels (``flash_attention_varlen``), named as the dense kernels whose loops they run.
# ``flash_fwd_hopper`` is chapter 07's rotated loop under the packed prelude; its ping-pong never finished on the
# H100, so it takes no ``pingpong``.
PACKED_FORWARD = {row.name: row for row in (
    KernelRow("flash_fwd", flash_varlen_fwd_kernel, (7, 8), "chapter 03/04's kernel", fixed=(("hopper", False),),
              takes_schedule=True, layout=PACKED, tiling=Tiling),
    KernelRow("flash_fwd_hopper", flash_varlen_fwd_kernel, (7, 8), _HOPPER_FORWARD, hopper_only=True,
              fixed=(("hopper", True),), takes_schedule=True, layout=PACKED, tiling=Tiling),
    KernelRow("flash_fwd_hopper_persistent", flash_varlen_fwd_persistent_kernel, (8, 9), _HOPPER_FORWARD,
              hopper_only=True, on_cpu=False, options=("pingpong",), layout=PACKED, tiling=PersistentTiling),
)}
PACKED_BACKWARD = {row.name: row for row in (
    KernelRow("flash_bwd", flash_varlen_bwd_kernel, (), "chapter 05's kernel", takes_schedule=True, layout=PACKED,
              tiling=Tiling),
    KernelRow("flash_bwd_hopper", flash_varlen_bwd_hopper_kernel, (), "chapter 08's Hopper kernel", hopper_only=True,
              on_cpu=False, options=("dv_under_ds", "dkdv_by_tma", "longest_first", "defer_dq_wait"),
              takes_schedule=True, pass_configs=HOPPER_BACKWARD_PASS_CONFIGS, layout=PACKED, tiling=Tiling,
              pieces=PackedBackwardPieces),
)}


# Decoding against a KV cache (``flash_decode``), chapter 09's kernels, contiguous or paged by the problem's
# ``page_size``: the split kernel writes partial results and the merge combines them; with one split, the
# one-split kernel writes the result itself. Each is compiled with a ``DecodeConfig`` (the merge: None). The
# merge writes into O and LSE it is given; "decode_merge_allocating" allocates and returns them.
DECODE = {row.name: row for row in (
    KernelRow("decode_split", flash_decode_kernel, (), "chapter 09's split kernel", layout=DECODE_LAYOUT,
              tiling=DecodeConfig),
    KernelRow("decode_single", flash_decode_kernel, (), "chapter 09's one-split kernel", layout=DECODE_LAYOUT,
              fixed=(("single", True),), tiling=DecodeConfig),
    KernelRow("decode_merge", flash_decode_merge_kernel, (), "chapter 09's merge kernel", layout=MERGE),
    KernelRow("decode_merge_allocating", flash_decode_merge_kernel, (3, 4), "chapter 09's merge kernel",
              layout=MERGE),
)}


# The kernels around the main ones, each compiled with the tile size and thread count its front door passes:
# the dense backward's Δ, its dQ cast (and GQA's dK/dV casts), the deterministic backward's dQ kernel, and the
# packed backward's Δ and scale-and-cast (per token: a problem of one head of ``dim`` serves every batch).
HELPERS = {row.name: row for row in (
    KernelRow("bwd_preprocess", flash_bwd_preprocess_kernel, (2,), "chapter 05's Δ kernel",
              layout=lambda pr: dict(batch=pr.batch, heads=pr.heads, seq_q=pr.seq_q, dim=pr.dim, dtype=pr.dtype)),
    KernelRow("bwd_postprocess_dq", flash_bwd_postprocess_kernel, (1,), "chapter 05's dQ cast",
              layout=lambda pr: dict(batch=pr.batch, heads=pr.heads, seq=pr.seq_q, dim=pr.dim, scale=pr.sm_scale,
                                     dtype=pr.dtype)),
    KernelRow("bwd_postprocess_dkv", flash_bwd_postprocess_kernel, (1,), "chapter 05's GQA dK/dV cast",
              layout=lambda pr: dict(batch=pr.batch, heads=pr.heads_kv, seq=pr.seq_k, dim=pr.dim, dtype=pr.dtype)),
    KernelRow("bwd_hopper_dq", flash_bwd_hopper_dq_kernel, (6,), "chapter 08's deterministic dQ kernel",
              hopper_only=True, on_cpu=False, tiling=Tiling),
    KernelRow("varlen_delta", varlen_delta_kernel, (), "chapter 09's packed Δ kernel",
              layout=lambda pr: dict(dim=pr.dim, dtype=pr.dtype)),
    KernelRow("varlen_scale_cast", scale_cast_kernel, (2,), "chapter 09's packed scale-and-cast",
              layout=lambda pr: dict(dim=pr.dim, dtype=pr.dtype)),
)}


# Chapter 12's FP8 forward (``flash_attention_fp8``): the tile step on the CPU (float32 tiles holding e4m3 values)
# or chapter 03's loop on the GPU, and chapter 07's rotated loop or its persistent kernel on sm_90a. The problem's
# dtype is e4m3's.
FP8 = {row.name: row for row in (
    KernelRow("flash_fwd_fp8", flash_fwd_fp8_kernel, (6, 7), "chapter 12's FP8 forward", layout=_fp8_layout,
              tiling=Tiling),
    KernelRow("flash_fwd_fp8_hopper", flash_fwd_fp8_hopper_kernel, (6, 7), "chapter 12's FP8 Hopper forward",
              hopper_only=True, on_cpu=False, layout=_fp8_layout, tiling=Tiling),
    KernelRow("flash_fwd_fp8_persistent", flash_fwd_fp8_persistent_kernel, (6, 7),
              "chapter 12's FP8 forward on chapter 07's persistent kernel", hopper_only=True, on_cpu=False,
              layout=_fp8_layout, per_device=_sm_count, tiling=PersistentTiling),
    KernelRow("fp8_quantise_inputs", quantise_inputs_kernel, (4, 5, 6, 7),
              "chapter 12's FP8 producer of Q and K, and of V's largest magnitude", hopper_only=True, on_cpu=False,
              layout=_producer_layout, fast_math=False),
    KernelRow("fp8_quantise_keys_major", quantise_transposed_kernel, (2, 3), "chapter 12's FP8 producer of V",
              hopper_only=True, on_cpu=False, layout=_transposed_layout, fast_math=False),
)}

# Chapter 11's flex kernels (``flex_attention``): the forward on chapter 03's loop or chapter 07's rotated loop, the
# backward on chapter 05's loop or chapter 08's Hopper loop (between the dense backward's Δ and casts, ``HELPERS``).
# Each is compiled with the front door's ``plan=`` (a ``ModifierPlan``: the modifiers, inlined; the cache keys it by
# its traced formulas) and, but for the Hopper backward, which keeps its own, ``tiling=`` (a ``Tiling``).
FLEX = {row.name: row for row in (
    KernelRow("flex_fwd", flex_fwd_kernel, (8, 9), "chapter 11's flex forward on chapter 03's loop",
              layout=FLEX_LAYOUT),
    KernelRow("flex_fwd_hopper", flex_fwd_hopper_kernel, (8, 9), "chapter 11's flex forward on chapter 07's loop",
              hopper_only=True, on_cpu=False, layout=FLEX_LAYOUT),
    KernelRow("flex_fwd_hopper_persistent", flex_fwd_hopper_persistent_kernel, (8, 9),
              "chapter 11's flex forward on chapter 07's persistent kernel", hopper_only=True, on_cpu=False,
              layout=FLEX_LAYOUT, per_device=_sm_count),
    KernelRow("flex_fwd_hopper_persistent_sorted", flex_fwd_hopper_persistent_kernel, (9, 10),
              "chapter 11's flex forward on chapter 07's persistent kernel, tiles longest first", hopper_only=True,
              on_cpu=False, layout=FLEX_LAYOUT, per_device=_sm_count, fixed=(("tile_order", "sorted"),)),
    KernelRow("flex_bwd", flex_bwd_kernel, (), "chapter 11's flex backward on chapter 05's loop",
              layout=FLEX_BACKWARD_LAYOUT),
    KernelRow("flex_bwd_hopper", flex_bwd_hopper_kernel, (), "chapter 11's flex backward on chapter 08's loop",
              hopper_only=True, on_cpu=False, pass_configs=HOPPER_BACKWARD_PASS_CONFIGS, layout=FLEX_BACKWARD_LAYOUT),
)}

# Every row, by table: what the one compile cache (``api.compiled``) compiles.
ROWS = {"forward": FORWARD, "backward": BACKWARD, "packed_forward": PACKED_FORWARD,
        "packed_backward": PACKED_BACKWARD, "decode": DECODE, "helpers": HELPERS, "fp8": FP8, "flex": FLEX}


def forward_row(config):
    """The row of ``config.kernel`` (a ``ValueError`` naming the choices for an unknown one)."""
    if config.kernel not in FORWARD:
        raise ValueError(f"ForwardConfig.kernel must be one of {sorted(FORWARD)}; got {config.kernel!r}")
    return FORWARD[config.kernel]


def backward_row(config):
    """The row of ``config.kernel`` (a ``ValueError`` naming the choices for an unknown one)."""
    if config.kernel not in BACKWARD:
        raise ValueError(f"BackwardConfig.kernel must be one of {sorted(BACKWARD)}; got {config.kernel!r}")
    return BACKWARD[config.kernel]
