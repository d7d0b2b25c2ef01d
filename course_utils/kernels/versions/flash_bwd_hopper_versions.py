"""Chapter 08's ablation: the Hopper backward built up one change at a time, as numbered versions.

As in ``flash_fwd_hopper_versions``, each version is one line of why. Version 1 is chapter 05's
kernel; the others are the shipped kernel (``flash_bwd_hopper_kernel``, a skeleton whose varying
steps are its ``BackwardPieces``) with the pieces they swap: the key-block order, which tiles pay for the mask,
the LSE's scale, the order of dV and dSᵀ, the order of dQ and dK, the dQ reduce, the dSᵀ buffers
and barriers. The few pieces measured and not kept are below, each written once, with
``fused_preprocess``: a preprocess that also zeroes the dQ accumulator and stores LSE·log2(e). A
version either adds a change to the version before it (the path to the shipped kernel) or varies
the version it names without being kept.

Every version runs the whole backward (preprocess, main kernel, postprocess) through
``Version.build``, so the ablation times what a training step pays.
"""

import functools
import inspect
import threading

import tilelang.language as T
import torch

from ..flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from ..flash_bwd_hopper import (
    DQ_BY_ROWS,
    FA3_TILING,
    PASS_CONFIGS,
    BackwardPieces,
    flash_bwd_hopper_kernel,
    issue_dq,
)
from ..flash_pieces import LOG2E
from ..tiles import TileBackend, Tiling, compile_kernel
from .version import Version, renamed
from .version import versions_for as _versions_for

__all__ = ["Version", "VERSIONS", "SHIPPED_VERSION", "shipped_version", "versions_for", "flash_bwd_hopper_variant",
           "variant_pieces", "with_pieces", "reversed_key_blocks", "every_tile", "dk_before_dq", "atomic_dq",
           "fused_preprocess_kernel", "MANUAL_SYNC_PASS_CONFIGS"]

ACCUM = "float32"
# With the kernel's own barriers (own_barriers, the shipped scheme) TileLang must not add its four.
MANUAL_SYNC_PASS_CONFIGS = PASS_CONFIGS
VARIANT = "flash_bwd_hopper_variant"  # the generated kernel's name for every version but chapter 05's


# ---------------------------------------------------------------------------- the pieces not kept

def reversed_key_blocks(n_kb, bx):
    """Key blocks in reverse launch order: with a causal mask the light ones (few query blocks) first."""
    return n_kb - 1 - bx


def every_tile(p, qb, kb, block_M, block_N):
    """The mask on every tile, not only on the tiles a boundary crosses."""
    return True


@T.macro
def dk_before_dq(K_s, Q_s, dST, dST_cast, dq, dk, swap_dq):
    """dK issued before dQ: dQ's trip through shared memory waits for both."""
    T.wgmma_gemm(dST_cast, Q_s, dk, policy=T.GemmWarpPolicy.FullRow)
    issue_dq(K_s, dST, dq, swap_dq)
    T.wait_wgmma(0)


@T.macro
def atomic_dq(p, dQ_acc, dq, dq_s, bz, head, qb, block_M, dim, swap_dq):
    """dQ added from registers, one float atomic per element (chapter 05's way)."""
    if swap_dq:
        for i, d in T.Parallel(block_M, dim):
            if qb * block_M + i < p.seq_q:
                T.atomic_add(dQ_acc[bz, head, qb * block_M + i, d], dq[d, i])
    else:
        for i, d in T.Parallel(block_M, dim):
            if qb * block_M + i < p.seq_q:
                T.atomic_add(dQ_acc[bz, head, qb * block_M + i, d], dq[i, d])


def variant_pieces(*, asynchronous=True, dq_reduce="tma", mask_all_tiles=False, dq_before_dk=True, ds_buffers=1,
                   manual_sync=False, light_first=False, lse_log2=False, dv_during_ds=True, ds_from_rounded_p=False):
    """The ``BackwardPieces`` of the ablation's switches (defaults: version 6's kernel).

    ``dq_reduce``: "atomic" adds dQ from registers element by element; "tma" stores it to shared
    memory and has the copy engine add the tile (cp.reduce.async.bulk). ``mask_all_tiles``: the mask
    on every tile, not only on boundary tiles. ``dq_before_dk``: issue dQ before dK, so dQ's store
    runs while dK is on the tensor cores. ``ds_buffers``: 1 or 2 shared dSᵀ tiles. ``manual_sync``:
    the kernel's own two barriers per step instead of TileLang's four (compile with
    ``MANUAL_SYNC_PASS_CONFIGS``; needs ``ds_buffers=2``). ``light_first``: causal key blocks in
    reverse order (the light ones first). ``lse_log2``: LSE arrives already multiplied by log2(e)
    (``fused_preprocess_kernel``). ``dv_during_ds``: issue dV before forming dSᵀ, so the two overlap
    (False: FlashAttention-3's order, dSᵀ first, fewer live registers). ``ds_from_rounded_p``: form
    dSᵀ from the 16-bit Pᵀ that dV uses, so the float32 Pᵀ dies early (fewer live registers).
    """
    if not asynchronous:
        raise ValueError("asynchronous=False is chapter 05's kernel (flash_bwd_kernel), version 1")
    if dq_reduce not in ("tma", "atomic"):
        raise ValueError(f"dq_reduce must be 'tma' or 'atomic', got {dq_reduce!r}")
    if manual_sync and ds_buffers != 2:
        raise ValueError("manual_sync drops the barrier before the dS store: it needs ds_buffers=2")
    pieces = dict(ds_buffers=ds_buffers, own_barriers=manual_sync, dv_under_ds=dv_during_ds,
                  ds_from_float32_p=dv_during_ds and not ds_from_rounded_p, lse_log2=lse_log2)
    pieces.update({key: piece for key, piece, on in (
        ("reduce_dq", atomic_dq, dq_reduce == "atomic"), ("mask_when", every_tile, mask_all_tiles),
        ("issue", dk_before_dq, not dq_before_dk), ("order", reversed_key_blocks, light_first)) if on})
    return BackwardPieces(**pieces)


def flash_bwd_hopper_variant(*args, **kwargs):
    """The shipped Hopper backward with the ablation's switches (``variant_pieces``'s keywords) as swapped
    pieces and, as a version's knobs, the fields of its tiling as keywords; the other keywords are the kernel's."""
    switches = {key: kwargs.pop(key) for key in list(kwargs) if key in _SWITCHES}
    tiling = FA3_TILING._replace(**{key: kwargs.pop(key) for key in list(kwargs) if key in FA3_TILING._fields})
    return renamed(flash_bwd_hopper_kernel(*args, **kwargs, tiling=tiling, pieces=variant_pieces(**switches)),
                   VARIANT)


_SWITCHES = frozenset(inspect.signature(variant_pieces).parameters)


def with_pieces(knobs):
    """A version's knobs as ``flash_bwd_hopper_kernel``'s arguments: the fields of its tiling in one ``tiling``
    (the kernel's default, ``FA3_TILING``, for those not given), the swapped steps gathered into its ``pieces``;
    any other knob as it is."""
    tiling = {key: value for key, value in knobs.items() if key in FA3_TILING._fields}
    steps = {key: value for key, value in knobs.items() if key in BackwardPieces._fields}
    rest = {key: value for key, value in knobs.items() if key not in tiling and key not in steps}
    return {**rest, "tiling": FA3_TILING._replace(**tiling), "pieces": BackwardPieces(**steps)}


def fused_preprocess_kernel(batch, heads, seq_q, dim, *, dtype="float16", block=64, threads=128):
    """(O, dO, LSE) -> (Δ, LSE·log2(e), dQ_acc = 0): chapter 05's preprocess, plus the two things the
    main kernel would otherwise get from a memset and a multiply per score (FlashAttention-3's)."""
    tb = TileBackend("cuda")

    @T.prim_func
    def fused_preprocess(
        O: T.Tensor([batch, heads, seq_q, dim], dtype),
        dO: T.Tensor([batch, heads, seq_q, dim], dtype),
        LSE: T.Tensor([batch, heads, seq_q], ACCUM),
        Delta: T.Tensor([batch, heads, seq_q], ACCUM),
        LSE_log2: T.Tensor([batch, heads, seq_q], ACCUM),
        dQ_acc: T.Tensor([batch, heads, seq_q, dim], ACCUM),
    ):
        with tb.kernel(T.ceildiv(seq_q, block), heads, batch, threads=threads) as (bx, by, bz):
            o = tb.fragment([block, dim], ACCUM)
            do = tb.fragment([block, dim], ACCUM)
            zeros = tb.fragment([block, dim], ACCUM)
            delta = tb.fragment([block], ACCUM)
            T.copy(O[bz, by, bx * block:(bx + 1) * block, :], o)
            T.copy(dO[bz, by, bx * block:(bx + 1) * block, :], do)
            for i, d in tb.parallel(block, dim):
                o[i, d] *= do[i, d]
            T.reduce_sum(o, delta, dim=1)
            T.copy(delta, Delta[bz, by, bx * block:(bx + 1) * block])
            for i in tb.parallel(block):
                if bx * block + i < seq_q:
                    LSE_log2[bz, by, bx * block + i] = LSE[bz, by, bx * block + i] * LOG2E
            T.clear(zeros)
            T.copy(zeros, dQ_acc[bz, by, bx * block:(bx + 1) * block, :])

    return fused_preprocess


def _build(version, batch, heads, seq, dim, *, causal, dtype="float16", heads_kv=None, window_size=None, seq_k=None):
    """Compile the three kernels of ``version``; returns a function (q, k, v, out, lse, dO) -> grads."""
    seq_k = seq if seq_k is None else seq_k
    heads_kv = heads if heads_kv is None else heads_kv
    knobs = version.knobs_for(dim, causal)
    variant = dict(heads_kv=heads_kv, causal=causal, window_size=window_size, dtype=dtype)
    if version.factory is flash_bwd_kernel:  # version 1: chapter 05's kernel, synchronous T.gemm
        func = flash_bwd_kernel(batch, heads, seq, seq_k, dim, target="cuda", **variant,
                                tiling=Tiling(**{k: knobs[k] for k in Tiling._fields}))
        options = {}
    else:
        func = renamed(version.factory(batch, heads, seq, seq_k, dim, **variant, **with_pieces(knobs)), version.name)
        options = dict(pass_configs=MANUAL_SYNC_PASS_CONFIGS) if knobs.get("own_barriers", True) else {}
    main = compile_kernel(func, out_idx=[], target="cuda", dtype=dtype, **options)
    fused = knobs.get("lse_log2", False)  # FlashAttention-3's preprocess
    key = (batch, heads, heads_kv, seq, seq_k, dim, dtype, fused)
    with _HELPER_LOCK:  # versions built in parallel threads share one compile of each helper
        lock = _HELPER_LOCKS.setdefault(key, threading.Lock())
    with lock:
        pre, post_q, post_kv = _helper_kernels(*key)

    def backward(q, k, v, out, lse, d_out):
        if fused:
            delta, lse_arg, dq_acc = pre(out, d_out, lse)
        else:
            delta, lse_arg = pre(out, d_out), lse
            dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        if post_kv is None:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        else:
            dk, dv = (torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2))
        main(q, k, v, d_out, lse_arg, delta, dq_acc, dk, dv)
        dq = post_q(dq_acc)
        if post_kv is not None:
            dk, dv = post_kv(dk), post_kv(dv)
        return dq, dk, dv

    return backward


def _backward(number, label, why, knobs=None, *, chapter05=False, **fields):
    """A backward version: the shipped kernel with the pieces ``knobs`` swap in (or chapter 05's kernel),
    the backward's default tiling and builder. ``knobs``: "all", a head dim, or (head dim, causal) -> keywords."""
    knobs = dict(knobs or {})
    return Version(number, label, why, flash_bwd_kernel if chapter05 else flash_bwd_hopper_kernel,
                   knobs=knobs.pop("all", {}), when=knobs, builder=_build, name=None if chapter05 else VARIANT,
                   defaults=dict(block_M=64, block_N=128, num_stages=2, threads=256), **fields)


_HELPER_LOCK, _HELPER_LOCKS = threading.Lock(), {}


@functools.lru_cache(maxsize=32)
def _helper_kernels(batch, heads, heads_kv, seq, seq_k, dim, dtype, fused):
    """The preprocess and postprocess kernels every version of one shape shares (compiled once)."""
    def build(func, out_idx):
        return compile_kernel(func, out_idx=out_idx, target="cuda", dtype=dtype)

    if fused:
        pre = build(fused_preprocess_kernel(batch, heads, seq, dim, dtype=dtype), [3, 4, 5])
    else:
        pre = build(flash_bwd_preprocess_kernel(batch, heads, seq, dim, dtype=dtype, target="cuda"), [2])
    post_q = build(flash_bwd_postprocess_kernel(batch, heads, seq, dim, scale=1.0 / dim ** 0.5, dtype=dtype,
                                                target="cuda"), [1])
    post_kv = None
    if heads_kv != heads:
        post_kv = build(flash_bwd_postprocess_kernel(batch, heads_kv, seq_k, dim, dtype=dtype, target="cuda"), [1])
    return pre, post_q, post_kv


# The path to the shipped kernel. Knob dicts: "all", a head dim, or (head dim, causal). Versions 2-6
# keep one dSᵀ buffer, TileLang's barriers, and issue dV from the 16-bit Pᵀ before dSᵀ is formed from the
# float32 one; versions 7 and 8 change that into the shipped kernel (no knob: its defaults).
_BEFORE_7 = dict(ds_buffers=1, own_barriers=False, dv_under_ds=True, ds_from_float32_p=True)
_ATOMIC_1 = dict(_BEFORE_7, reduce_dq=atomic_dq, issue=dk_before_dq, num_stages=1)
_FA3_TILES = {(128, False): dict(block_M=80), 64: dict(block_M=128)}
_V17 = dict(block_M=128, policies=DQ_BY_ROWS)  # version 17's knobs at D = 64
_V20 = dict(dv_under_ds=True, dkdv_by_tma=True)  # version 20's at D = 128 (80 query rows without a mask)
_V22 = {(128, False): dict(_V20, block_M=80, defer_dq_wait=True),  # version 22's: every shipped kernel's,
        (128, True): dict(_V20, longest_first=True, defer_dq_wait=True),  # dQ's wait moved
        (64, False): dict(_V17, defer_dq_wait=True),
        (64, True): dict(_V17, dv_under_ds=True, defer_dq_wait=True)}

VERSIONS = [
    _backward(1, "chapter 05's kernel (synchronous T.gemm)", "every matmul waits; dQ by per-element atomics",
              chapter05=True, knobs={"all": dict(num_stages=1)}),
    _backward(2, "+ FlashAttention-3's order with async wgmma",
              "Sᵀ and dPᵀ issued together, exponentials under dPᵀ, dSᵀ under dV",
              knobs={"all": dict(_ATOMIC_1, mask_when=every_tile)}),
    _backward(3, "+ mask only on boundary tiles", "interior tiles skip the visibility test", knobs={"all": _ATOMIC_1}),
    _backward(4, "+ two stages for Q and dO", "the next query block loads during this one",
              knobs={"all": dict(_ATOMIC_1, num_stages=2)}),
    _backward(5, "+ dQ by one bulk reduce-add from shared memory", "the copy engine adds the whole tile",
              knobs={"all": dict(_BEFORE_7, issue=dk_before_dq)}),
    _backward(6, "+ dQ issued before dK", "dQ's trip through shared memory runs while dK is on the tensor cores",
              knobs={"all": _BEFORE_7}),
    _backward(7, "+ dSᵀ formed before dV is issued", "fewer live registers: P and dP die before dV starts",
              knobs={"all": dict(ds_buffers=1, own_barriers=False)}),
    _backward(8, "+ two dSᵀ buffers, our own two barriers", "TileLang's four barriers per step become two",
              shipped_code=True),
    _backward(9, "+ FlashAttention-3's tiles (80 × 128 at D=128, 128 × 128 at D=64)",
              "more queries per step; dQᵀ = Kᵀ dSᵀ where 80 rows cannot be split in 64s",
              knobs=_FA3_TILES, shipped_code=True),
    _backward(10, "  (TileLang's four barriers)", "two dSᵀ buffers, barriers left to TileLang",
              knobs={"all": dict(own_barriers=False), **_FA3_TILES}, kept=False),
    _backward(11, "  (FlashAttention-3's preprocess)", "Δ, LSE·log2(e) and dQ_acc = 0 in one kernel",
              knobs={"all": dict(lse_log2=True), **_FA3_TILES}, kept=False),
    _backward(12, "  (one stage)", "one Q/dO stage", knobs={"all": dict(num_stages=1), **_FA3_TILES}, kept=False),
    _backward(13, "  (per-element dQ atomics)", "dQ added from registers",
              knobs={"all": dict(reduce_dq=atomic_dq), **_FA3_TILES}, kept=False),
    _backward(14, "  (dV under dSᵀ, dSᵀ from the 16-bit P)", "overlap kept, registers saved by rounding P first",
              knobs={"all": dict(dv_under_ds=True), **_FA3_TILES}, kept=False),
    _backward(15, "  (80 × 128 tiles with the causal mask)", "FlashAttention-3 keeps 64 × 128 when masked",
              knobs={(128, True): dict(block_M=80)}, kept=False, causal_only=True, dims=(128,), shipped_code=True),
    _backward(16, "  (light key blocks first)", "the launch order the causal kernel does not use",
              knobs={"all": dict(order=reversed_key_blocks), **_FA3_TILES}, kept=False, causal_only=True),
    _backward(17, "  (dQ split by query rows at D=64: shipped without a mask)",
              "FlashAttention-3's AtomLayoutMdQ = 2: each warpgroup 64 queries × all of D, half the dQ wgmmas",
              knobs={64: _V17}, kept=False, dims=(64,), shipped_code=True),
    _backward(18, "  (dQ by query rows and dV under dSᵀ: shipped at D=64 causal)",
              "versions 17 and 14 together; +3-13% over version 9 at D=64 causal, S = 1k-16k",
              knobs={64: dict(_V17, dv_under_ds=True)}, kept=False, dims=(64,),
              causal_only=True, shipped_code=True),
    _backward(19, "  (dK and dV stored by the copy engine)",
              "FlashAttention-3's epilogue: through the K/V tiles' shared memory, one TMA store each",
              knobs={"all": dict(dkdv_by_tma=True), **_FA3_TILES}, kept=False),
    _backward(20, "  (dV under dSᵀ and dK, dV by the copy engine: shipped at D=128)",
              "versions 14 and 19 together; +2.5-8.3% (fp16), -3.9-+5.8% (bf16) over version 9 at D=128, S = 2k-16k",
              knobs={128: _V20, (128, False): dict(block_M=80)}, kept=False,
              dims=(128,), shipped_code=True),
    _backward(21, "  (heads' first key blocks first: shipped at D=128 causal)",
              "FlashAttention-3's longest-first order over (key block, head); +0.8-6.9% over version 20 at S = 2k-8k",
              knobs={128: dict(_V20, longest_first=True)}, kept=False, dims=(128,),
              causal_only=True, shipped_code=True),
    _backward(22, "  (dQ's reduce waited for one step later: shipped everywhere)",
              "the copy engine reads dQ's tile under the next Sᵀ and dPᵀ, not while its issuing warp waits",
              knobs=_V22, kept=False, shipped_code=True),
    _backward(23, "  (80 × 128 tiles with the causal mask after all: shipped at D=128 causal)",
              "version 15's tiles on version 22's step; +1.6-16% over 64 rows at S = 1k-16k, more the longer",
              knobs={(128, True): dict(_V22[128, True], block_M=80)}, kept=False,
              dims=(128,), causal_only=True, shipped_code=True),
]
SHIPPED_VERSION = 9


def versions_for(causal, dim=None):
    """The versions the ablation times for a causal or non-causal problem."""
    return _versions_for(VERSIONS, causal, dim)


def shipped_version(dim, causal, config):
    """The version whose row in the ablation runs what ``flash_attention`` runs: the shipped kernel at
    ``config``'s tiling (a ``BackwardConfig``, or a (block_M, block_N) pair) with its options."""
    defaults = dict(dv_under_ds=False, policies=None, dkdv_by_tma=False, longest_first=False, defer_dq_wait=False,
                    dq_per_warpgroup=False)
    options = {name: getattr(config, name, off) for name, off in defaults.items()}
    candidates = [v for v in VERSIONS if v.shipped_code and (causal or not v.causal_only) and dim in v.dims
                  and v.tiling(dim, causal) == tuple(config[:2])
                  and all(v.knobs_for(dim, causal).get(k, defaults[k]) == value for k, value in options.items())]
    return max(candidates, key=lambda v: v.number == SHIPPED_VERSION)
