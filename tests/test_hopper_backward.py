"""Chapter 08's Hopper backward without a GPU: which tiles it masks, the schedule it lowers to for
sm_90a, its own two barriers, ptxas's report, and clear errors where it cannot run."""

import itertools
import math
import re

import numpy as np
import pytest
import torch
from shared_lowering import cuda_source, ptxas_reports
from tilelang import tvm

from course_utils import flash_attention
from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS, BackwardConfig, default_backward_config
from course_utils.api.registry import BACKWARD
from course_utils.api.varlen_api import VARLEN_HOPPER_BACKWARD_CONFIGS
from course_utils.core.device import is_hopper
from course_utils.core.problem import AttentionProblem
from course_utils.kernels.flash_bwd_hopper import (
    _DQ_BARRIER,
    _DQ_WARPGROUP_BARRIERS,
    _DS_BARRIER,
    DQ_TILING,
    FA3_TILING,
    PASS_CONFIGS,
    BackwardPieces,
    flash_bwd_hopper_dq_kernel,
    flash_bwd_hopper_kernel,
    needs_mask,
    query_steps,
)
from course_utils.kernels.flash_pieces import prelude
from course_utils.kernels.generated_code import _EARLY_WAIT, MOVED_WAIT, drop_early_waits
from course_utils.kernels.versions.flash_bwd_hopper_versions import (
    SHIPPED_VERSION,
    VERSIONS,
    flash_bwd_hopper_variant,
    shipped_version,
    with_pieces,
)
from course_utils.pictures.diagrams import MASKED, SKIPPED, tile_classes

SHAPE = dict(batch=2, heads=4, seq_q=2048, seq_k=2048)


def _value(expr):
    """A TileLang condition built from Python ints, as a Python bool."""
    if isinstance(expr, (bool, int, np.bool_)):
        return bool(expr)
    return bool(tvm.arith.Analyzer().simplify(expr))


@pytest.mark.parametrize("seq_q, seq_k, causal, window", [(256, 256, False, None), (200, 256, False, None),
                                                          (200, 256, True, None),
                                                          (256, 200, True, None), (300, 300, True, 70),
                                                          (130, 300, True, 1)])
@pytest.mark.parametrize("block_M, block_N", [(64, 128), (80, 128), (128, 128)])
def test_visited_and_masked_tiles(seq_q, seq_k, causal, window, block_M, block_N):
    """Every tile with a visible pair is visited, and every visited tile with a hidden pair or a row past
    the queries' end is masked (the backward's rows run past S_q: it needs the query guard too)."""
    p = prelude(1, seq_q, seq_k, 64, causal=causal, window_size=window)
    classes = tile_classes(seq_q, seq_k, block_M, block_N, causal=causal, window_size=window)
    for kb in range(classes.shape[1]):
        first, end, offset = query_steps(p, kb, block_M, block_N)
        visited = {_as_int(offset) + s for s in range(_as_int(first), _as_int(end))}
        assert visited >= {qb for qb in range(classes.shape[0]) if classes[qb, kb] != SKIPPED}
        for qb in visited:
            ragged_rows = (qb + 1) * block_M > seq_q
            must_mask = classes[qb, kb] == MASKED or ragged_rows or classes[qb, kb] == SKIPPED
            assert _value(needs_mask(p, qb, kb, block_M, block_N)) or not must_mask, (qb, kb)


def _as_int(x):
    return int(x) if isinstance(x, int) else int(tvm.arith.Analyzer().simplify(x))


def _source(factory=flash_bwd_hopper_kernel, pass_configs=PASS_CONFIGS, dim=128, **options):
    return cuda_source(factory(**SHAPE, dim=dim, **options), pass_configs=pass_configs)


def _consumer_loop(source):
    start = source.index("for (int qb_1 = ")
    return source[start:source.index("stage_in_use[0] =", start)]


STEP = ["wgmma_ss<", "wgmma_ss<", "wait_wgmma<1>", "exp2f", "wait_wgmma<0>", "__sync_thread_partial(6, 256)",
        "wgmma_rs<", "wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>", "__sync_thread_partial(5, 256)", "tma_store_add",
        "wait_wgmma<0>"]


@pytest.mark.parametrize("dim, masked", sorted(HOPPER_BACKWARD_CONFIGS))
def test_one_step_in_flash_attention_3_order(dim, masked):
    """Sᵀ and dPᵀ issued together, exponentials after the first wait, dSᵀ stored, one barrier, dV, dQ and
    dK issued together, dQ stored under dK, a second barrier, the bulk reduce-add; no other barrier."""
    config = HOPPER_BACKWARD_CONFIGS[dim, masked]
    loop = _consumer_loop(_source(dim=dim, causal=masked,
                                  tiling=FA3_TILING._replace(block_M=config.block_M, block_N=config.block_N)))
    position = 0
    for mark in STEP:
        found = loop.find(mark, position)
        assert found >= 0, f"{mark} missing after position {position}"
        position = found + len(mark)
    assert loop.count("__sync_thread_partial") == 2
    assert "AtomicAdd" not in loop


def test_tilelang_adds_four_barriers_without_the_pass_config():
    """The reason for PASS_CONFIGS: left to itself, TileLang guards the same step with four barriers."""
    loop = _consumer_loop(_source(flash_bwd_hopper_variant, pass_configs={}, ds_buffers=2, dv_during_ds=False))
    assert loop.count("__sync_thread_partial(3, 256)") == 4


@pytest.mark.parametrize("options", [dict(causal=True), dict(tiling=FA3_TILING._replace(block_M=80), heads_kv=2,
                                                             window_size=100, seq=1000)])
def test_shipped_kernel_is_the_ablations_last_step(options):
    """The shipped kernel, the ablation's shipped version and the variant with the shipped switches
    generate the same CUDA (the versions are the shipped skeleton plus the pieces they swap)."""
    shipped = next(v for v in VERSIONS if v.number == SHIPPED_VERSION)
    knobs = {k: v for k, v in shipped.knobs_for(128, True).items() if k not in ("block_M", "block_N")}
    seq = options.pop("seq", SHAPE["seq_q"])
    shape = dict(SHAPE, seq_q=seq, seq_k=seq)
    tiling = options.pop("tiling", FA3_TILING)
    a = cuda_source(flash_bwd_hopper_kernel(**shape, dim=128, **options, tiling=tiling), pass_configs=PASS_CONFIGS)
    b = cuda_source(shipped.factory(**shape, dim=128, **options, **with_pieces({**knobs, **tiling._asdict()})),
                    pass_configs=PASS_CONFIGS)
    c = cuda_source(flash_bwd_hopper_variant(**shape, dim=128, **options, **tiling._asdict(), dv_during_ds=False,
                                             ds_buffers=2, manual_sync=True), pass_configs=PASS_CONFIGS)
    name = re.compile(r"flash_bwd_hopper(_variant)?_kernel")
    assert a == b and "flash_bwd_hopper_variant_kernel" in c
    assert name.sub("K", a) == name.sub("K", c)


def test_version_14_is_a_config_field():
    """Version 14's change (dV issued under dSᵀ, dSᵀ from the rounded P) is ``dv_under_ds``: a field of
    ``BackwardConfig`` that the registry passes to the kernel, on at D=128 (version 20) and D=64 causal
    (version 18)."""
    v14 = next(v for v in VERSIONS if v.number == 14)
    assert [key for key, c in HOPPER_BACKWARD_CONFIGS.items() if c.dv_under_ds] == [(128, False), (128, True),
                                                                                   (64, True)]
    shape = dict(SHAPE, dim=128, tiling=FA3_TILING._replace(block_M=80))
    on = cuda_source(flash_bwd_hopper_kernel(**shape, pieces=BackwardPieces(dv_under_ds=True)),
                     pass_configs=PASS_CONFIGS)
    version = cuda_source(v14.factory(**dict(SHAPE, dim=128), **with_pieces(v14.knobs_for(128, False))),
                          pass_configs=PASS_CONFIGS)
    assert on == version
    assert on != cuda_source(flash_bwd_hopper_kernel(**shape), pass_configs=PASS_CONFIGS)
    config = HOPPER_BACKWARD_CONFIGS[128, False]._replace(dv_under_ds=True, dkdv_by_tma=False, defer_dq_wait=False)
    problem = AttentionProblem(heads=4, heads_kv=4, dim=128, dtype="float16", target="cuda",
                               sm_scale=1 / math.sqrt(128), batch=2, seq_q=2048, seq_k=2048)
    built = cuda_source(BACKWARD["flash_bwd_hopper"].build(problem, config), pass_configs=PASS_CONFIGS)
    assert built == on


def test_dkdv_by_tma_is_a_config_field():
    """Version 19's epilogue (dK and dV through shared memory, one TMA store each) is ``dkdv_by_tma``: the registry
    passes it to the kernel, which then stores by TMA between two barriers; with GQA (float32 accumulators added
    atomically) it keeps the register path, so the code is the same as with the field off."""
    shape = dict(SHAPE, dim=128, tiling=FA3_TILING._replace(block_M=80))
    on = cuda_source(flash_bwd_hopper_kernel(**shape, pieces=BackwardPieces(dkdv_by_tma=True)),
                     pass_configs=PASS_CONFIGS)
    off = cuda_source(flash_bwd_hopper_kernel(**shape), pass_configs=PASS_CONFIGS)
    assert on != off and "tma_store(dV_desc" in on and "tma_store(dK_desc" in on and "tma_store(dV_desc" not in off
    gqa = dict(shape, heads_kv=shape["heads"] // 2)
    assert (cuda_source(flash_bwd_hopper_kernel(**gqa, pieces=BackwardPieces(dkdv_by_tma=True)),
                        pass_configs=PASS_CONFIGS)
            == cuda_source(flash_bwd_hopper_kernel(**gqa), pass_configs=PASS_CONFIGS))
    assert all(c.dkdv_by_tma == (dim == 128) for (dim, _), c in HOPPER_BACKWARD_CONFIGS.items())
    config = HOPPER_BACKWARD_CONFIGS[128, False]._replace(dv_under_ds=False, defer_dq_wait=False)
    problem = AttentionProblem(heads=4, heads_kv=4, dim=128, dtype="float16", target="cuda",
                               sm_scale=1 / math.sqrt(128), batch=2, seq_q=2048, seq_k=2048)
    assert cuda_source(BACKWARD["flash_bwd_hopper"].build(problem, config), pass_configs=PASS_CONFIGS) == on


def test_longest_first_is_a_config_field():
    """``longest_first``: one launch index over (key block, head), the key block outermost, so every head's first
    key blocks (with the causal mask, the longest) start first. On only in the D=128 causal config (version 21); the
    deterministic kernel (one block per K/V head) ignores it; the registry passes it on."""
    shape = dict(SHAPE, dim=128, causal=True)  # FA3_TILING: 64 query rows
    on = cuda_source(flash_bwd_hopper_kernel(**shape, pieces=BackwardPieces(longest_first=True)),
                     pass_configs=PASS_CONFIGS)
    off = cuda_source(flash_bwd_hopper_kernel(**shape), pass_configs=PASS_CONFIGS)
    assert "blockIdx.z" in off and "blockIdx.z" not in on  # the batch moves to the grid's second axis
    heads = SHAPE["heads"]
    assert f"((int)blockIdx.x) >> {heads.bit_length() - 1}" in on or f"((int)blockIdx.x) / {heads}" in on
    assert [key for key, c in HOPPER_BACKWARD_CONFIGS.items() if c.longest_first] == [(128, True)]
    version_21 = HOPPER_BACKWARD_CONFIGS[128, True]._replace(block_M=64, defer_dq_wait=False)
    assert shipped_version(128, True, version_21).number == 21
    assert (cuda_source(flash_bwd_hopper_kernel(**shape, deterministic=True, pieces=BackwardPieces(longest_first=True)),
                        pass_configs=PASS_CONFIGS)
            == cuda_source(flash_bwd_hopper_kernel(**shape, deterministic=True), pass_configs=PASS_CONFIGS))
    problem = AttentionProblem(heads=4, heads_kv=4, dim=128, dtype="float16", target="cuda", causal=True,
                               sm_scale=1 / math.sqrt(128), batch=2, seq_q=2048, seq_k=2048)
    config = HOPPER_BACKWARD_CONFIGS[128, True]._replace(block_M=64, dv_under_ds=False, dkdv_by_tma=False,
                                                         longest_first=True, defer_dq_wait=False)
    assert cuda_source(BACKWARD["flash_bwd_hopper"].build(problem, config), pass_configs=PASS_CONFIGS) == on


def _reduce_waits(code):
    """(waits right after a dQ reduce-add, waits right before a consumer barrier) in generated CUDA."""
    return len(_EARLY_WAIT.findall(code)), len(MOVED_WAIT.findall(code))


def test_defer_dq_wait_moves_the_reduce_wait_and_edits_nothing_else():
    """``defer_dq_wait`` (version 22, every Hopper config, dense and packed): the wait for the copy engine's read of
    dQ's staging tile stands before the next step's dSᵀ barrier, and ``generated_code`` drops the one TileLang puts
    right after the reduce-add; with the field off, or in any other kernel, the code is TileLang's, untouched. The
    edit never drops a wait from code that has no moved wait (that would be a race on dq_s)."""
    shape = dict(SHAPE, dim=128, tiling=FA3_TILING._replace(block_M=80))
    on = cuda_source(flash_bwd_hopper_kernel(**shape, pieces=BackwardPieces(defer_dq_wait=True)),
                     pass_configs=PASS_CONFIGS)
    off = cuda_source(flash_bwd_hopper_kernel(**shape), pass_configs=PASS_CONFIGS)
    assert _reduce_waits(off) == (1, 0) and _reduce_waits(on) == (0, 1)
    assert drop_early_waits(off) == off  # no moved wait: nothing dropped
    loop = on[on.index("for (int qb"):on.rindex("stage_in_use[0] =")]
    assert loop.index("tma_store_wait<0, true>") < loop.index(f"__sync_thread_partial({_DS_BARRIER}, 256)") \
        < loop.index("tma_store_add(dQ_acc_desc")
    # planted: the moved wait left out but TileLang's dropped (a race) cannot come out of the edit
    racy = _EARLY_WAIT.sub(r"\1", off)
    assert _reduce_waits(racy) == (0, 0) and drop_early_waits(racy) == racy
    assert all(c.defer_dq_wait for c in (*HOPPER_BACKWARD_CONFIGS.values(), *VARLEN_HOPPER_BACKWARD_CONFIGS.values()))
    shipped = {key: shipped_version(*key, cfg).number for key, cfg in HOPPER_BACKWARD_CONFIGS.items()}
    assert shipped == {(128, False): 22, (128, True): 23, (64, False): 22, (64, True): 22}  # 23: 80 rows, causal
    problem = AttentionProblem(heads=4, heads_kv=4, dim=128, dtype="float16", target="cuda",
                               sm_scale=1 / math.sqrt(128), batch=2, seq_q=2048, seq_k=2048)
    config = BackwardConfig(80, 128, 2, 256, kernel="flash_bwd_hopper", defer_dq_wait=True)
    assert cuda_source(BACKWARD["flash_bwd_hopper"].build(problem, config), pass_configs=PASS_CONFIGS) == on
    deterministic = dict(shape, deterministic=True)  # no dQ to add: the field changes nothing
    assert (cuda_source(flash_bwd_hopper_kernel(**deterministic, pieces=BackwardPieces(defer_dq_wait=True)),
                        pass_configs=PASS_CONFIGS)
            == cuda_source(flash_bwd_hopper_kernel(**deterministic), pass_configs=PASS_CONFIGS))
    with pytest.raises(ValueError, match="own_barriers"):
        flash_bwd_hopper_kernel(**shape, pieces=BackwardPieces(defer_dq_wait=True, own_barriers=False, ds_buffers=2))


def test_warp_policies_are_a_config_field_and_change_only_dq_at_d64():
    """``policies`` (a ``BackwardConfig`` field, version 17): None and the shipped split spelled out generate the
    same CUDA; dQ by rows changes the D=64 kernel (128 × 64 dQ) and not the D=128 causal one (64 rows: one
    split only); a bad value is a clear error."""
    from course_utils.kernels.flash_bwd_hopper import gemm_policies

    v17, v18 = (next(v for v in VERSIONS if v.number == n) for n in (17, 18))
    assert sorted(key for key, c in HOPPER_BACKWARD_CONFIGS.items() if c.policies is not None) == [(64, False),
                                                                                                   (64, True)]
    without = {key: c._replace(defer_dq_wait=False) for key, c in HOPPER_BACKWARD_CONFIGS.items()}
    assert shipped_version(64, True, without[64, True]) is v18
    assert shipped_version(64, False, without[64, False]) is v17
    assert shipped_version(128, False, without[128, False]).number == 20  # versions 14 + 19
    d64 = dict(SHAPE, dim=64, causal=True)
    shipped = cuda_source(flash_bwd_hopper_kernel(**d64, tiling=FA3_TILING._replace(block_M=128)),
                          pass_configs=PASS_CONFIGS)
    spelled = ("row", "row", "row", "row", "square")
    assert cuda_source(flash_bwd_hopper_kernel(**d64, tiling=FA3_TILING._replace(block_M=128),
                                               pieces=BackwardPieces(policies=spelled)),
                       pass_configs=PASS_CONFIGS) == shipped
    rows = cuda_source(flash_bwd_hopper_kernel(**d64, **with_pieces(v17.knobs_for(64, True))),
                       pass_configs=PASS_CONFIGS)
    assert rows != shipped
    d128 = dict(SHAPE, dim=128, causal=True)
    by_rows = BackwardPieces(policies=v17.knobs_for(64, True)["policies"])
    assert (cuda_source(flash_bwd_hopper_kernel(**d128, pieces=by_rows), pass_configs=PASS_CONFIGS)
            == cuda_source(flash_bwd_hopper_kernel(**d128), pass_configs=PASS_CONFIGS))
    for bad in (["row"] * 5, ("row",) * 4, ("row", "row", "row", "row", "diagonal")):
        with pytest.raises(ValueError, match="policies must be"):
            gemm_policies(bad, swap_dq=False)


def test_deterministic_kernels_add_nothing_atomically():
    dkdv = _source(causal=True, heads_kv=2, deterministic=True)
    dq = _source(flash_bwd_hopper_dq_kernel, pass_configs={}, causal=True, tiling=DQ_TILING._replace(block_N=64))
    for source in (dkdv, dq):
        assert not re.search(r"[Aa]tomic|tma_store_add|red\.", source)
    assert "tma_store_add" in _source(causal=True, heads_kv=2)


@pytest.fixture(scope="module")
def reports():
    """ptxas's report on each kernel the tests below compile, all from one nvcc run (``shared_lowering.ptxas_reports``:
    each kernel under its own name in one translation unit); None where nvcc is not installed."""
    return ptxas_reports({"shipped order, 80 rows": _source(causal=False, tiling=FA3_TILING._replace(block_M=80)),
                           "dV issued before dSᵀ, 80 rows": _source(flash_bwd_hopper_variant, block_M=80, ds_buffers=2,
                                                                    manual_sync=True),
                           **{("dq_per_warpgroup", dim, masked): _dq_per_warpgroup_code(dim, masked)
                              for dim, masked in DQ_PER_WARPGROUP_CONFIGS}})


def report_of(reports, kernel):
    """``kernel``'s report; the test is skipped where nvcc is not installed."""
    if reports is None:
        pytest.skip("nvcc is not installed")
    return reports[kernel]


def test_ptxas_keeps_every_wgmma_async_without_spills(reports):
    """At 80 × 128, issuing dV before dSᵀ is formed keeps the float32 P alive next to everything else:
    ptxas runs out of registers and serialises the wgmmas. The shipped order does not."""
    good, bad = report_of(reports, "shipped order, 80 rows"), report_of(reports, "dV issued before dSᵀ, 80 rows")
    assert not any("C751" in line for line in good), good
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in good), good
    assert any("serialized" in line for line in bad), bad


# One consumer warpgroup's dQ handoff: the proxy fence, its own 128-thread barrier, one elected thread (the
# warpgroup's first) issuing the bulk reduce-adds of its box. Consumer threads are 128-383 (the producer is 0-127).
_WARPGROUP_HANDOFF = re.compile(
    r"tl::fence_proxy_async\(\);\s*if \(\(\(int\)threadIdx\.x\) < 256\) \{\s*"
    r"tl::__sync_thread_partial\((\d+), 128\);\s*if \(\(\(int\)threadIdx\.x\) == 128\) \{(.*?)"
    r"tl::tma_store_arrive\(\);\s*\}\s*\} else \{\s*"
    r"tl::__sync_thread_partial\((\d+), 128\);\s*if \(\(\(int\)threadIdx\.x\) == 256\) \{(.*?)"
    r"tl::tma_store_arrive\(\);", re.S)
# A store into dQ's staging tile: one float or a vector of ``n`` (its offset in floats is the group).
_DQ_STAGE_STORE = re.compile(r"^\s*(?:\(\(float\*\)dq_s\)\[(.*)\]|\*\(float(\d)\*\)\(\(\(float\*\)dq_s\) \+ (.*)\)) = ")


def _offsets(expr, loop, names):
    """The values of a generated index expression (C integer arithmetic on non-negative values, which Python's
    operators share) over ``loop`` = (variable, extent) and the given ``names``."""
    expr = expr.replace("((int)threadIdx.x)", "tid")
    return {eval(expr, {}, dict(names, **{loop[0]: i})) for i in range(loop[1])}  # noqa: S307


def _loop_before(lines, n):
    """(variable, extent) of the ``for`` loop that opens right before line ``n``."""
    m = next(re.search(r"for \(int (\w+) = 0; \1 < (\d+);", line) for line in reversed(lines[:n]) if "for (int" in line)
    return m.group(1), int(m.group(2))


# Both ways the warpgroups split dQ: by D (D = 128, dQ computed transposed) and by rows (D = 64).
DQ_PER_WARPGROUP_CONFIGS = [(128, True), (64, False)]


def _dq_per_warpgroup_code(dim, masked):
    """The registry's kernel for the shipped config at (dim, masked) with ``dq_per_warpgroup`` on."""
    config = HOPPER_BACKWARD_CONFIGS[dim, masked]._replace(dq_per_warpgroup=True)
    problem = AttentionProblem(heads=4, heads_kv=4, dim=dim, dtype="float16", target="cuda", causal=masked,
                               sm_scale=1 / math.sqrt(dim), batch=2, seq_q=2048, seq_k=2048)
    return cuda_source(BACKWARD["flash_bwd_hopper"].build(problem, config), pass_configs=PASS_CONFIGS)


@pytest.mark.parametrize("dim, masked", DQ_PER_WARPGROUP_CONFIGS)
def test_dq_per_warpgroup_each_warpgroup_adds_its_own_box(dim, masked, reports):
    """``dq_per_warpgroup`` (a ``BackwardConfig`` field, off in every shipped config), on two shipped configs: every
    consumer thread stages dQ only into its own warpgroup's half of the staging tile (the index expressions of the
    generated stores, evaluated for each thread), each warpgroup meets on a 128-thread barrier of its own and its
    first thread adds its own half by TMA; no 256-thread barrier for dQ is left, and ``defer_dq_wait`` still moves
    the reduce's wait to the dSᵀ barrier. ptxas: no spills, no wgmma serialised. (At D=64 with the causal mask ptxas
    injects one wgmma wait, C7517, which the shipped kernel does not get; measured in docs/fa4_sm90.md.)"""
    shipped = HOPPER_BACKWARD_CONFIGS[dim, masked]
    assert not shipped.dq_per_warpgroup
    config = shipped._replace(dq_per_warpgroup=True)
    code = _dq_per_warpgroup_code(dim, masked)
    loop = _consumer_loop(code)
    assert f"__sync_thread_partial({_DQ_BARRIER}, 256)" not in code
    assert loop.count("__sync_thread_partial") == 3 and loop.count(f"__sync_thread_partial({_DS_BARRIER}, 256)") == 1
    handoff = _WARPGROUP_HANDOFF.search(loop)
    assert handoff, loop[-3000:]
    assert (int(handoff.group(1)), int(handoff.group(3))) == _DQ_WARPGROUP_BARRIERS
    assert _reduce_waits(code) == (0, 1)
    half = config.block_M * dim // 2  # floats of one warpgroup's box
    lines = loop.splitlines()
    stores = [(n, m) for n, line in enumerate(lines) if (m := _DQ_STAGE_STORE.match(line))]
    assert stores
    for tid in range(128, 384):
        warpgroup = tid // 128 - 1
        for n, m in stores:
            width = int(m.group(2) or 1)
            offsets = _offsets(m.group(1) or m.group(3), _loop_before(lines, n), dict(tid=tid))
            assert all(warpgroup * half <= o and o + width <= (warpgroup + 1) * half for o in offsets), (tid, n)
    for warpgroup, branch in enumerate((handoff.group(2), handoff.group(4))):
        assert branch.count("tl::tma_store_add(dQ_acc_desc") == 1
        sources = re.search(r"tma_store_add\(dQ_acc_desc, \(&\(\(\(float\*\)dq_s\)\[(.*?)\]\)\)", branch).group(1)
        loop_var = re.search(r"for \(int (\w+) = 0; \1 < (\d+);", branch)
        offsets = _offsets(sources, (loop_var.group(1), int(loop_var.group(2))) if loop_var else ("_", 1), {})
        assert all(warpgroup * half <= o < (warpgroup + 1) * half for o in offsets), (warpgroup, offsets)
    report = report_of(reports, ("dq_per_warpgroup", dim, masked))
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report
    assert not any("serialized" in line for line in report), report


def test_dq_per_warpgroup_needs_a_split_into_boxes():
    """The field is off everywhere it ships, changes nothing in the deterministic kernel (no dQ), and refuses a dQ
    split it cannot cut into one box per warpgroup, or the kernel's barriers left to TileLang."""
    assert not any(c.dq_per_warpgroup for c in HOPPER_BACKWARD_CONFIGS.values())
    shape = dict(SHAPE, dim=128, causal=True)
    on = BackwardPieces(dq_per_warpgroup=True)
    assert (cuda_source(flash_bwd_hopper_kernel(**shape, deterministic=True, pieces=on), pass_configs=PASS_CONFIGS)
            == cuda_source(flash_bwd_hopper_kernel(**shape, deterministic=True), pass_configs=PASS_CONFIGS))
    with pytest.raises(ValueError, match="warp policy 'row' or 'col'"):  # D=64, 128 rows: "square" has two choices
        flash_bwd_hopper_kernel(**dict(SHAPE, dim=64), tiling=FA3_TILING._replace(block_M=128), pieces=on)
    with pytest.raises(ValueError, match="own_barriers"):
        flash_bwd_hopper_kernel(**shape, pieces=on._replace(own_barriers=False))


@pytest.mark.skipif(is_hopper(), reason="the defaults and errors of a machine without a Hopper GPU")
def test_defaults_and_clear_errors_off_hopper():
    assert default_backward_config("cpu", 64).kernel == "flash_bwd"
    assert default_backward_config("cuda", 128, True).kernel == "flash_bwd"  # no Hopper GPU here
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="sm_90"):
        flash_attention(q, q, q, backward_config=HOPPER_BACKWARD_CONFIGS[128, False])
    with pytest.raises(ValueError, match="deterministic=True needs"):
        flash_attention(q, q, q, deterministic=True)
    with pytest.raises(ValueError, match="must be one of"):
        flash_attention(q, q, q, backward_config=BackwardConfig(16, 16, 1, 1, kernel="flash_bwd_hoper"))
    for option in (dict(dv_under_ds=True), dict(policies=("row",) * 5)):  # chapter 08's kernel only
        name = next(iter(option))
        with pytest.raises(ValueError, match=rf"{name}=.* needs a kernel that takes it, one of \['flash_bwd_hopper'\]"):
            flash_attention(q, q, q, backward_config=BackwardConfig(16, 16, 1, 1, kernel="flash_bwd", **option))


def test_every_version_has_a_distinct_number_and_tiling():
    assert [v.number for v in VERSIONS] == list(range(1, len(VERSIONS) + 1))
    for v, dim, causal in itertools.product(VERSIONS, (64, 128), (False, True)):
        block_M, block_N = v.tiling(dim, causal)
        assert block_N == 128 and block_M in (64, 80, 128)


def test_lse_and_delta_stages_start_on_128_byte_boundaries():
    """TMA writes each LSE/Δ stage to shared memory at a 128-byte boundary: with 80-row tiles a stage of
    80 floats would put the second one 320 bytes in (the H100 stops with a misaligned address)."""
    source = cuda_source(flash_bwd_hopper_kernel(**dict(SHAPE, seq_q=1000, seq_k=1000), dim=128,
                                                 tiling=FA3_TILING._replace(block_M=80)), pass_configs=PASS_CONFIGS)
    strides = re.findall(r"\(\(float\*\)(?:lse|delta)\)\[\(\(qb & 1\) \* (\d+)\)\]", source)
    assert strides and all(int(s) * 4 % 128 == 0 for s in strides), strides


def _shared_buffers(source):
    """{name: byte offset} of the dynamic shared-memory buffers in generated CUDA."""
    return {name: int(off) for name, off in
            re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)}


def _overlapping_buffers(source, dim, block_M, block_N, stages=2):
    """Pairs of shared buffers whose byte ranges overlap (sizes from the kernel's allocations)."""
    from course_utils.kernels.flash_bwd_hopper import padded_rows

    size = dict(K_s=block_N * dim * 2, V_s=block_N * dim * 2, Q_s=stages * block_M * dim * 2,
                dO_s=stages * block_M * dim * 2, lse=stages * padded_rows(block_M) * 4,
                delta=stages * padded_rows(block_M) * 4, dST_s=2 * block_N * block_M * 2, dq_s=block_M * dim * 4)
    spans = sorted((off, off + size[name], name) for name, off in _shared_buffers(source).items())
    assert {name for _, _, name in spans} == set(size), spans
    return [(a[2], b[2]) for a, b in zip(spans, spans[1:]) if b[0] < a[1]]


@pytest.mark.parametrize("dim, masked, seq, window", [(64, True, 1000, 1), (64, False, 100, None),
                                                      (128, False, 64, None), (128, True, 64, 2), (64, True, 1000, 2),
                                                      (128, False, 1000, None)])
def test_no_shared_buffers_overlap_when_the_loop_has_one_step(dim, masked, seq, window):
    """The one-key-window race (docs/hopper_backward.md): with one query block per key block TileLang unrolls
    the loop and, left to reuse shared memory, puts dSᵀ over LSE/Δ and dQ's tile over K and V. Under the
    kernel's own barriers that is a race between the two consumer warpgroups; PASS_CONFIGS forbids the reuse.
    The check sees the overlap in the kernel built without that option."""
    config = HOPPER_BACKWARD_CONFIGS[dim, masked]
    func = flash_bwd_hopper_kernel(2, 8, seq, seq, dim, heads_kv=2, causal=masked, window_size=window,
                                   tiling=FA3_TILING._replace(block_M=config.block_M, block_N=config.block_N))
    tiles = dict(dim=dim, block_M=config.block_M, block_N=config.block_N)
    assert _overlapping_buffers(cuda_source(func, pass_configs=PASS_CONFIGS), **tiles) == []
    reuse = {k: v for k, v in PASS_CONFIGS.items() if "reuse" not in str(k).lower()}
    assert len(reuse) == len(PASS_CONFIGS) - 1
    overlaps = _overlapping_buffers(cuda_source(func, pass_configs=reuse), **tiles)
    single_step = seq <= config.block_M or (window == 1 and config.block_M == config.block_N)
    assert bool(overlaps) == single_step, overlaps
