"""FlexAttention's forward on chapter 07's rotated loop (``flex_fwd_hopper_kernel``) and on its persistent kernel
(``flex_fwd_hopper_persistent_kernel``).

Without a GPU: both kernels lower for sm_90a for every kind of modifier (a mask, a score_mod, captured float and
int tensors, GQA), the rotated one with its loop's order of asynchronous matmuls, the persistent one loading the
listed key blocks from its producer, and ptxas compiles them without serialising the wgmmas or spilling; the
forward picks the persistent kernel at D = 128, in the folded order exactly where a block mask's rows grow down and
longest row first elsewhere. The sorted order (``fwd_kernel="persistent_sorted"``): each block mask row's query
blocks longest first, a permutation, and its walk takes every tile once, the longest first. On an sm_90 GPU (marked
``gpu``): ``flex_attention`` runs its forward on these kernels, and the documented modifiers of
``test_flex_dropin``, at lengths that are not a multiple of the tile and with query blocks that see no key, agree
with the float64 reference on both.
"""

import math
import re

import pytest
import test_flex_dropin as dropin
import torch

import course_utils as cu
from course_utils.api import flex
from course_utils.api.flex import (
    create_block_mask,
    default_flex_config,
    flex_attention,
    flex_forward,
    flex_forward_kernel,
    flex_forward_uses_hopper,
    plan_modifiers,
)
from course_utils.checking.flex_reference import flex_references
from course_utils.core.device import is_hopper
from course_utils.core.problem import AttentionProblem
from course_utils.core.source import cuda_source, ptxas_report
from course_utils.kernels.flash_flex_hopper import HOPPER_FLEX_BLOCK, HOPPER_FLEX_DIMS, flex_fwd_hopper_kernel
from course_utils.kernels.flash_flex_persistent import (
    flex_fwd_hopper_persistent_kernel,
    sorted_schedule,
    strided_tile_count,
)

# --- Lowered for sm_90a, no GPU needed --------------------------------------------------------------------------

BATCH, HEADS, SEQ = 2, 8, 1000
_SLOPES = flex.alibi_slopes(HEADS)
_DOCS = flex.document_ids([300, 450, 250])


def _sliding_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 256)


PLANS = {  # name: (score_mod, mask_mod, K/V heads, D, dtype)
    "causal": (None, flex.causal_mask, HEADS, 128, "float16"),
    "soft-cap": (flex.soft_cap(30.0), None, HEADS, 128, "bfloat16"),
    "ALiBi, captured slopes": (flex.alibi(_SLOPES), flex.causal_mask, HEADS, 64, "float16"),
    "document mask, captured ids": (None, flex.document_mask(_DOCS), HEADS, 64, "bfloat16"),
    "sliding window": (None, _sliding_window, HEADS, 128, "bfloat16"),
    "GQA, soft-cap and causal": (flex.soft_cap(30.0), flex.causal_mask, 2, 128, "float16"),
}


def _lowered(name, factory=flex_fwd_hopper_kernel, **options):
    score_mod, mask_mod, heads_kv, dim, dtype = PLANS[name]
    plan = plan_modifiers(score_mod, mask_mod)
    blocks = -(-SEQ // 128)
    return cuda_source(factory(BATCH, HEADS, SEQ, SEQ, dim, plan, (1, 1, blocks, blocks), heads_kv=heads_kv,
                               sm_scale=dim ** -0.5, dtype=dtype, **options))


def _consumer_loop(source):
    start = source.index("for (int kb_1 = ")
    return source[start:source.index("stage_in_use[0] =", start)]


@pytest.fixture(scope="module")
def lowered():
    return {name: _lowered(name) for name in PLANS}


@pytest.fixture(scope="module")
def lowered_persistent():
    return {name: _lowered(name, flex_fwd_hopper_persistent_kernel) for name in PLANS}


def test_every_plan_lowers_to_the_rotated_loop(lowered):
    for name, source in lowered.items():
        loop = _consumer_loop(source)
        marks = [loop.find(mark) for mark in ("wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>", "exp2f", "wait_wgmma<0>")]
        assert -1 not in marks and marks == sorted(marks), (name, marks)
        assert "tl::tma_load(K_desc" in source and "KVList[" in source, name  # TMA of the listed key blocks
    assert "tanhf" in lowered["soft-cap"] and "tanhf" not in lowered["causal"]
    assert "CapturedF[" in lowered["ALiBi, captured slopes"]
    assert "CapturedI[" in lowered["document mask, captured ids"]
    assert re.search(r"blockIdx\.y\) >> 2\)", lowered["GQA, soft-cap and causal"])  # K/V head = query head // 4


# The sorted order changes only the tile walk, which the modifiers do not touch (the folded kernel's tests cover
# them): a plan without captured tensors and one reading them.
SORTED_PLANS = ("causal", "document mask, captured ids")


@pytest.fixture(scope="module")
def lowered_sorted():
    return {name: _lowered(name, flex_fwd_hopper_persistent_kernel, tile_order="sorted") for name in SORTED_PLANS}


def _ptxas_of_every_plan(lowered, kernel_name):
    """ptxas's report on every plan's kernel, in one translation unit (one nvcc run), each under its own name."""
    unit = "\n".join(source.replace(kernel_name, f"{kernel_name}_{i}") for i, source in enumerate(lowered.values()))
    report = ptxas_report(unit)
    if report is None:
        pytest.skip("nvcc is not installed")
    entries = [line for line in report if "Compiling entry function" in line]
    assert len(entries) == len(lowered), report
    assert not any("C75" in line or "serialized" in line for line in report), report
    spills = [line for line in report if "spill" in line]
    assert len(spills) == len(lowered) and all("0 bytes spill stores, 0 bytes spill loads" in s for s in spills), report


def test_ptxas_keeps_the_wgmmas_async_without_spills(lowered):
    _ptxas_of_every_plan(lowered, "flex_fwd_hopper_kernel")


def test_the_persistent_kernel_loads_the_listed_key_blocks_and_modifies_every_step(lowered_persistent):
    for name, source in lowered_persistent.items():
        producer = source[source.index("tl::warpgroup_reg_dealloc"):source.index("tl::warpgroup_reg_alloc")]
        assert "KVList[" in producer and "tl::tma_load(K_desc" in producer, name  # the listed block's TMA
        assert "KVCount[" in source and "wgmma_rs<" in source and "__named_barrier_arrive" in source, name
    assert "tanhf" in lowered_persistent["soft-cap"] and "tanhf" not in lowered_persistent["causal"]
    assert "CapturedF[" in lowered_persistent["ALiBi, captured slopes"]
    assert "CapturedI[" in lowered_persistent["document mask, captured ids"]
    _ptxas_of_every_plan(lowered_persistent, "flex_fwd_hopper_persistent_kernel")


def test_the_sorted_persistent_kernel_reads_its_order_and_compiles_without_spills(lowered_sorted):
    for name, source in lowered_sorted.items():
        producer = source[source.index("tl::warpgroup_reg_dealloc"):source.index("tl::warpgroup_reg_alloc")]
        consumer = source[source.index("tl::warpgroup_reg_alloc"):]
        for part in (producer, consumer):  # both walk the same tiles: each reads the order
            assert "RowsByCost[" in part and "KVCount[" in part, name
        assert "KVList[" in producer and "tl::tma_load(K_desc" in producer, name
    assert "CapturedI[" in lowered_sorted["document mask, captured ids"]
    _ptxas_of_every_plan(lowered_sorted, "flex_fwd_hopper_persistent_sorted_kernel")


def _per_head_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 128 * (h + 1))


def _documents_per_head(b, h, q_idx, kv_idx):  # depends on b and h: the ids of batch entry b, shifted by head h
    n = _SORT_DOCS.shape[1]
    return _SORT_DOCS[b, (q_idx + 64 * h) % n] == _SORT_DOCS[b, (kv_idx + 64 * h) % n]


_SORT_DOCS = torch.stack([flex.document_ids([700, 100, 1200, 300]), flex.document_ids([150, 1500, 200, 450])])


def _sorted_cases():
    """{name: (block mask, batch, heads)}: masks shared and not, rows growing down and not."""
    seq = 2300  # 18 query blocks, the last ragged
    docs = torch.stack([flex.document_ids([700, 300, 1300]), flex.document_ids([200, 1600, 500])])
    return {
        "documents": (create_block_mask(flex.document_mask(docs), 2, None, seq, seq, block=(128, 128)), 2, 4),
        "causal": (create_block_mask(flex.causal_mask, None, None, seq, seq, block=(128, 128)), 2, 4),
        "prefix-LM": (create_block_mask(flex.prefix_lm(600), None, None, seq, seq, block=(128, 128)), 3, 2),
        "window per head": (create_block_mask(_per_head_window, None, 4, seq, seq, block=(128, 128)), 2, 4),
        "documents per b and h": (create_block_mask(_documents_per_head, 2, 3, seq, seq, block=(128, 128)), 2, 3),
        "rows that see no key": (create_block_mask(lambda b, h, q, k: (q >= 700) & (k <= q), None, None, seq, seq,
                                                   block=(128, 128)), 1, 5),
    }


def test_rows_by_cost_lists_each_mask_rows_query_blocks_longest_first():
    for name, (bm, _, _) in _sorted_cases().items():
        order = bm.rows_by_cost
        assert order.dtype == torch.int32 and order.shape == bm.kv_count.shape and order.is_contiguous(), name
        n_qb = bm.kv_count.shape[-1]
        assert torch.equal(order.sort(dim=-1).values, torch.arange(n_qb, dtype=torch.int32).expand_as(order)), name
        counts = bm.kv_count.gather(-1, order.long())
        assert (counts[..., 1:] <= counts[..., :-1]).all(), name
        assert (order[..., 0] == bm.kv_count.argmax(-1)).all(), name
    causal = _sorted_cases()["causal"][0]
    assert causal.rows_by_cost[0, 0].tolist() == list(range(17, -1, -1))  # causal: the bottom row first


@pytest.mark.parametrize("num_ctas", [132, 16, 7, 1, 1000])
def test_the_sorted_walk_takes_every_tile_once_longest_first(num_ctas):
    for name, (bm, batch, heads) in _sorted_cases().items():
        n_qb = bm.kv_count.shape[-1]
        total = batch * heads * n_qb
        schedule = sorted_schedule(bm.rows_by_cost, batch, heads, num_ctas)
        tiles = [t for block in schedule for t in block]
        assert sorted(tiles) == [(b, h, qb) for b in range(batch) for h in range(heads) for qb in range(n_qb)], name
        launched = max(1, min(num_ctas, (total + 1) // 2))
        assert len(schedule) == launched and all(
            len(block) == int(tvm_value(strided_tile_count(total, launched, cta))) for cta, block in
            enumerate(schedule)), name

        def cost(tile):
            b, h, qb = tile
            return int(bm.kv_count[b if bm.kv_count.shape[0] > 1 else 0, h if bm.kv_count.shape[1] > 1 else 0, qb])

        # Round w: the w-th tile of every block; with a mask shared across b and h every round's tiles are at
        # least as long as the next round's.
        rounds = [[cost(block[w]) for block in schedule if w < len(block)] for w in range(len(schedule[0]))]
        if bm.kv_count.shape[:2] == (1, 1):
            assert all(min(a) >= max(b) for a, b in zip(rounds, rounds[1:])), name
        if launched >= batch * heads:  # round 0 holds every (batch entry, head)'s longest row
            assert max(rounds[0]) == int(bm.kv_count.max()), name


def tvm_value(expr):
    from tilelang import tvm

    return expr if isinstance(expr, int) else tvm.arith.Analyzer().simplify(expr)


def _flex_problem(mask_mod, dim=128, mask_b=None, seq=1000):
    q, k = torch.empty(2, 4, seq, dim, dtype=torch.float16), torch.empty(2, 4, seq, dim, dtype=torch.float16)
    bm = create_block_mask(mask_mod, mask_b, None, seq, seq, block=(128, 128))
    return AttentionProblem.flex(q, k, bm, dim ** -0.5).replace(target="cuda"), bm


def test_the_persistent_forward_runs_at_d128_in_the_order_the_mask_rows_call_for(monkeypatch):
    """D = 128: the folded order where the rows grow down, longest row first elsewhere (the documents); the rotated
    loop at D = 64; and every kernel a config names."""
    monkeypatch.setattr(flex._device, "is_hopper", lambda: True)
    docs = torch.stack([flex.document_ids([700, 300]), flex.document_ids([200, 800])])
    rows = {"causal": _flex_problem(flex.causal_mask), "prefix-LM": _flex_problem(flex.prefix_lm(300)),
            "window": _flex_problem(_sliding_window), "no mask": _flex_problem(flex.noop_mask),
            "documents": _flex_problem(flex.document_mask(docs), mask_b=2),
            "D = 64": _flex_problem(flex.causal_mask, 64)}
    config = default_flex_config("cuda", (128, 128))
    chosen = {name: flex.forward_row(pr, config, bm.longest_rows_last) for name, (pr, bm) in rows.items()}
    assert chosen == {"causal": "flex_fwd_hopper_persistent", "prefix-LM": "flex_fwd_hopper_persistent",
                      "window": "flex_fwd_hopper_persistent", "no mask": "flex_fwd_hopper_persistent",
                      "documents": "flex_fwd_hopper_persistent_sorted", "D = 64": "flex_fwd_hopper"}
    pr, bm = rows["documents"]
    assert not bm.longest_rows_last and rows["causal"][1].longest_rows_last
    for asked, row in (("persistent", "flex_fwd_hopper_persistent"), ("rotated", "flex_fwd_hopper"),
                       ("persistent_sorted", "flex_fwd_hopper_persistent_sorted"), ("sm80", "flex_fwd")):
        assert flex.forward_row(pr, config._replace(fwd_kernel=asked), bm.longest_rows_last) == row


@pytest.mark.skipif(is_hopper(), reason="the dispatch of a machine without a Hopper GPU")
def test_without_a_hopper_gpu_the_forward_keeps_chapter_03s_loop():
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    bm = create_block_mask(flex.causal_mask, None, None, 40, 40)
    assert not flex_forward_uses_hopper(q, k, bm)


def test_unknown_forward_kernel_is_an_error():
    q, k = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    bm = create_block_mask(flex.causal_mask, None, None, 40, 40)
    config = default_flex_config("cpu", bm.block)._replace(fwd_kernel="sm90")
    with pytest.raises(ValueError, match="fwd_kernel must be one of"):
        flex_forward_uses_hopper(q, k, bm, config=config)


def test_the_gates_flex_draws_reach_the_hopper_kernel(monkeypatch):
    """The correctness gate's flex problems on a GPU go through flex_attention with the default block: each one
    is a shape the Hopper kernels take, and together they reach each forward flex_attention picks there (the
    rotated loop, the persistent kernel in the folded order and in the sorted order), so on an sm_90 GPU the gate
    checks them all."""
    from course_utils.checking.fuzz import _flex_modifiers, draw_problems

    monkeypatch.setattr(flex._device, "is_hopper", lambda: True)
    draws = draw_problems(0, 1500, gpu=True, apis=("flex",))  # a gate run's count
    assert flex.default_block("cuda") == HOPPER_FLEX_BLOCK
    assert draws and all(p.dim in HOPPER_FLEX_DIMS and p.dtype in ("float16", "bfloat16") for p in draws)
    assert {p.dim for p in draws} == set(HOPPER_FLEX_DIMS)
    config = default_flex_config("cuda", HOPPER_FLEX_BLOCK)
    rows = set()
    for p in draws:
        _, mask_mod = _flex_modifiers(p, "cpu")
        bm = create_block_mask(mask_mod or flex.noop_mask, None, None, p.seq_q, p.seq_k, block=HOPPER_FLEX_BLOCK)
        q = torch.empty(p.batch, p.heads, p.seq_q, p.dim, dtype=getattr(torch, p.dtype))
        k = torch.empty(p.batch, p.heads_kv, p.seq_k, p.dim, dtype=q.dtype)
        problem = AttentionProblem.flex(q, k, bm, p.dim ** -0.5).replace(target="cuda")
        rows.add(flex.forward_row(problem, config, bm.longest_rows_last))
    assert rows == {"flex_fwd_hopper", "flex_fwd_hopper_persistent", "flex_fwd_hopper_persistent_sorted"}


# --- On an sm_90 GPU -----------------------------------------------------------------------------------------------

hopper = pytest.mark.skipif(not is_hopper(), reason="needs an sm_90 GPU (the kernel uses wgmma and TMA)")

GPU_BATCH, GPU_HEADS, GPU_HEADS_KV, GPU_SEQ = 2, 4, 2, 300  # GQA; 300 keys: the last tile is ragged
GPU_CASES = [(128, torch.float16), (64, torch.bfloat16)]  # both head dims, both 16-bit types


def _gpu_inputs(dim, dtype, seq=GPU_SEQ, scale=3.0):
    g = torch.Generator(device="cuda").manual_seed(seq + dim)
    q = torch.randn(GPU_BATCH, GPU_HEADS, seq, dim, device="cuda", generator=g) * scale
    k, v = (torch.randn(GPU_BATCH, GPU_HEADS_KV, seq, dim, device="cuda", generator=g) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _forward_through_hopper(name, q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, fwd_kernel="hopper"):
    """flex_attention's forward, checked to run on the Hopper kernel and against float64; returns (O, LSE).
    ``fwd_kernel`` "persistent", "persistent_sorted" or "rotated": ``flex_forward`` asked for that kernel
    (``FlexConfig.fwd_kernel``)."""
    if block_mask is None:
        block_mask = create_block_mask(mask_mod or flex.noop_mask, None, None, q.shape[2], k.shape[2], device="cuda")
        if mask_mod is not None:
            plan = plan_modifiers(mask_mod=mask_mod)
            if plan.mask_reads_b or plan.mask_reads_h:
                block_mask = create_block_mask(mask_mod, q.shape[0] if plan.mask_reads_b else None,
                                               q.shape[1] if plan.mask_reads_h else None, q.shape[2], k.shape[2],
                                               device="cuda")
    assert block_mask.block == (128, 128)
    assert flex_forward_uses_hopper(q, k, block_mask)
    plan = plan_modifiers(score_mod, block_mask.mask_mod if mask_mod is None else mask_mod)
    config = default_flex_config("cuda", block_mask.block)._replace(fwd_kernel=fwd_kernel)
    source = flex_forward_kernel(q, k, plan, block_mask, 1.0 / math.sqrt(q.shape[-1]), config).get_kernel_source()
    assert "flex_fwd_hopper" in source
    if fwd_kernel == "hopper":  # flex_attention's own choice
        out, lse = flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                                  return_lse=True)
    else:
        assert ("flex_fwd_hopper_persistent" in source) == fwd_kernel.startswith("persistent")
        assert ("flex_fwd_hopper_persistent_sorted" in source) == (fwd_kernel == "persistent_sorted")
        out, lse = flex_forward(q, k, v, plan, block_mask, 1.0 / math.sqrt(q.shape[-1]), config)
    refs = flex_references(q, k, v, score_mod=score_mod, mask_mod=block_mask.mask_mod)
    cu.check_forward(q, k, v, out, lse, refs=refs, name=name, quiet=True)
    return out, lse


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dim, dtype", GPU_CASES, ids=[f"D{d}-{str(t)[6:]}" for d, t in GPU_CASES])
@pytest.mark.parametrize("fwd_kernel", ["persistent", "persistent_sorted", "rotated"])
@pytest.mark.parametrize("name", list(dropin.DOCUMENTED))
def test_documented_modifiers_on_the_hopper_kernel(name, fwd_kernel, dim, dtype, gpu_dropin):
    mods = dict(gpu_dropin.DOCUMENTED[name])
    q, k, v = _gpu_inputs(dim, dtype)
    if mods.pop("block", None):
        mods["block_mask"] = create_block_mask(gpu_dropin.sliding_window_causal, None, None, GPU_SEQ, GPU_SEQ,
                                               device="cuda")
        assert mods["block_mask"].counts()["empty"] > 0  # skipped tiles, as on the CPU
    _forward_through_hopper(f"{name}, {fwd_kernel}", q, k, v, fwd_kernel=fwd_kernel, **mods)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dim, dtype", GPU_CASES, ids=[f"D{d}-{str(t)[6:]}" for d, t in GPU_CASES])
@pytest.mark.parametrize("fwd_kernel", ["hopper", "persistent", "persistent_sorted", "rotated"])
def test_query_blocks_that_see_no_key(dim, dtype, fwd_kernel):
    def late_queries_only(b, h, q_idx, kv_idx):
        return (q_idx >= 200) & (kv_idx <= q_idx)

    q, k, v = _gpu_inputs(dim, dtype)
    bm = create_block_mask(late_queries_only, None, None, GPU_SEQ, GPU_SEQ, device="cuda")
    assert bm.kv_count[0, 0, 0] == 0  # query block 0 lists no key block; block 1 has rows that see none
    out, lse = _forward_through_hopper(f"rows that see no key, {fwd_kernel}", q, k, v, block_mask=bm,
                                       fwd_kernel=fwd_kernel)
    assert torch.equal(out[:, :, :200], torch.zeros_like(out[:, :, :200]))
    assert torch.isneginf(lse[:, :, :200]).all()


@pytest.mark.gpu
@hopper
def test_causal_flex_on_both_kernels_and_flash_attention_against_float64():
    q, k, v = _gpu_inputs(128, torch.bfloat16, seq=2000, scale=1.0)
    bm = create_block_mask(flex.causal_mask, None, None, 2000, 2000, device="cuda")
    _forward_through_hopper("causal, S = 2000, Hopper flex kernel", q, k, v, block_mask=bm)
    sm80 = default_flex_config("cuda", bm.block)._replace(fwd_kernel="sm80")
    assert not flex_forward_uses_hopper(q, k, bm, config=sm80)
    assert "flex_fwd_hopper" not in flex_forward_kernel(q, k, plan_modifiers(mask_mod=flex.causal_mask), bm,
                                                        1.0 / math.sqrt(128), config=sm80).get_kernel_source()
    refs = flex_references(q, k, v, mask_mod=flex.causal_mask)
    out, lse = flex_forward(q, k, v, plan_modifiers(mask_mod=flex.causal_mask), bm, 1.0 / math.sqrt(128), config=sm80)
    cu.check_forward(q, k, v, out, lse, refs=refs, name="causal, S = 2000, sm80 flex kernel", quiet=True)
    out, lse = cu.flash_attention(q, k, v, causal=True, return_lse=True)
    cu.check_forward(q, k, v, out, lse, refs=refs, name="causal, S = 2000, flash_attention", quiet=True)


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("mask", ["documents", "documents per b and h", "window per head"])
def test_the_sorted_persistent_forward_over_several_rounds_against_float64(mask):
    """More tiles than two per SM, so every persistent block walks several rounds of the sorted list; masks that
    depend on b, on h, on both."""
    seq = 4600  # 36 query blocks, 2 · 4 · 36 = 288 tiles (a 132-SM GPU: at least two rounds), the last block ragged
    docs = torch.stack([flex.document_ids([900, 100, 2600, 1000]), flex.document_ids([150, 3500, 200, 750])])
    docs = docs.to("cuda")
    mask_mod, mask_b, mask_h = {
        "documents": (flex.document_mask(docs), 2, None),
        "documents per b and h": (lambda b, h, q, k: docs[b, (q + 64 * h) % seq] == docs[b, (k + 64 * h) % seq], 2, 4),
        "window per head": (_per_head_window, None, 4),
    }[mask]
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4, seq, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
    bm = create_block_mask(mask_mod, mask_b, mask_h, seq, seq, device="cuda")
    assert bm.rows_by_cost.device.type == "cuda"
    _forward_through_hopper(f"{mask}, sorted persistent", q, k, v, block_mask=bm, fwd_kernel="persistent_sorted")
