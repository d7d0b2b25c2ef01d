"""FlexAttention's backward on chapter 08's Hopper loop (``flash_flex_hopper_bwd``).

Without a GPU: the kernel lowers for sm_90a for every kind of modifier (wgmma, dQ added by the copy engine) and
ptxas compiles it without spills; the backward build picks it only where it runs. On an sm_90 GPU (marked gpu):
the gradients of ``flex_attention`` through it against float64, by the FlashAttention criterion, for the ten
modifiers of ``test_flex_dropin`` written the documentation's way, GQA, D = 64 and 128, bfloat16 and float16,
lengths that 128 does not divide, keys no query sees and rows a score_mod hides entirely.
"""

import pytest
import test_flex_dropin as dropin
import torch
from shared_lowering import cuda_source, ptxas_reports

import course_utils as cu
from course_utils.api import flex
from course_utils.api.flex import (
    alibi,
    alibi_slopes,
    cached_plan,
    causal_mask,
    create_block_mask,
    default_block,
    default_flex_config,
    document_ids,
    document_mask,
    flex_attention,
    flex_backward_kernels,
    noop_mask,
    plan_modifiers,
    soft_cap,
    uses_hopper_backward,
)
from course_utils.checking.flex_reference import flex_references
from course_utils.checking.fuzz import draw_problems
from course_utils.core import device
from course_utils.kernels.flash_bwd_hopper import PASS_CONFIGS, BackwardPieces, flash_bwd_hopper_kernel
from course_utils.kernels.flash_flex_hopper_bwd import flex_bwd_hopper_kernel
from course_utils.kernels.tiles import Tiling

# --- Without a GPU: the generated code ---------------------------------------------------------------------------

S_CPU = 512


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 200)


LOWERED = {  # name: (score_mod, mask_mod, heads_kv, head dim)
    "causal": (None, causal_mask, 8, 128),
    "soft-cap, causal": (soft_cap(50.0), causal_mask, 8, 128),
    "ALiBi (captured slopes)": (alibi(alibi_slopes(8)), causal_mask, 8, 64),
    "document mask (captured ids)": (None, document_mask(document_ids([100, 300, 112])), 8, 128),
    "sliding window": (None, _window, 8, 64),
    "GQA, soft-cap": (soft_cap(30.0), None, 2, 128),
}


def _lowered(name):
    score_mod, mask_mod, heads_kv, dim = LOWERED[name]
    plan = plan_modifiers(score_mod, mask_mod)
    blocks = S_CPU // 128
    return cuda_source(flex_bwd_hopper_kernel(1, 8, S_CPU, S_CPU, dim, plan, (1, 1, blocks, blocks), (128, 128),
                                              heads_kv=heads_kv, sm_scale=0.09, dtype="bfloat16"),
                       pass_configs=PASS_CONFIGS)


@pytest.fixture(scope="module")
def reports():
    """ptxas's report on every plan's kernel, from one nvcc run (``shared_lowering.ptxas_reports``: each kernel under
    its own name in one translation unit); None where nvcc is not installed."""
    return ptxas_reports({name: _lowered(name) for name in LOWERED})


@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_for_sm90a_and_compiles_without_spills(name, reports):
    score_mod, mask_mod, heads_kv, dim = LOWERED[name]
    source = _lowered(name)
    assert "wgmma" in source and "tma_store_add" in source  # chapter 08's products, dQ added by the copy engine
    assert "QList" in source and "State" in source  # the block mask's walk and its FULL tiles
    assert ("tanhf" in source) == (score_mod is not None and "soft-cap" in name)
    assert ("AtomicAdd" in source) == (heads_kv != 8)  # GQA: float32 dK, dV accumulated over a group
    if reports is None:
        pytest.skip("nvcc is not installed")
    report = reports[name]
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report


def test_pieces_refuse_what_a_flex_walk_cannot_take():
    plan = plan_modifiers(None, causal_mask)
    with pytest.raises(ValueError, match="multiple of 64"):
        flex_bwd_hopper_kernel(1, 2, 256, 256, 64, plan, (1, 1, 2, 2), (128, 128), tiling=Tiling(80, 128, 2, 256))
    with pytest.raises(ValueError, match="is not the state"):
        flex_bwd_hopper_kernel(1, 2, 256, 256, 64, plan, (1, 1, 4, 4), (128, 128))
    pieces = BackwardPieces(modifiers=object(), longest_first=True)
    with pytest.raises(ValueError, match="neither deterministic, longest_first nor order"):
        flash_bwd_hopper_kernel(1, 2, 256, 256, 64, pieces=pieces)


def test_backward_build_picks_the_hopper_loop_only_where_it_runs(monkeypatch):
    monkeypatch.setattr(device, "is_hopper", lambda: True)
    hopper = default_flex_config("cuda", (128, 128))
    assert hopper.bwd_kernel == "hopper"
    assert uses_hopper_backward("cuda", 128, (128, 128), hopper)
    assert uses_hopper_backward("cuda", 64, (128, 128), hopper)
    assert not uses_hopper_backward("cuda", 128, (128, 128), hopper._replace(bwd_kernel="sm80"))
    assert not uses_hopper_backward("cuda", 128, (64, 128), hopper)  # another block mask tile
    assert not uses_hopper_backward("cuda", 96, (128, 128), hopper)
    assert not uses_hopper_backward("c", 64, (128, 128), default_flex_config("cpu", (128, 128)))
    with pytest.raises(ValueError, match="bwd_kernel must be one of"):
        uses_hopper_backward("cuda", 64, (128, 128), hopper._replace(bwd_kernel="sm90"))
    monkeypatch.setattr(device, "is_hopper", lambda: False)
    assert not uses_hopper_backward("cuda", 128, (128, 128), hopper)


def test_gate_flex_draws_reach_the_hopper_backward(monkeypatch):
    """The correctness gate's flex problems on a GPU use the default 128 × 128 block mask and D = 64 or 128."""
    monkeypatch.setattr(device, "is_hopper", lambda: True)
    problems = draw_problems(0, 400, gpu=True, apis=("flex",))
    assert problems and all(p.api == "flex" for p in problems)
    block = default_block("cuda")
    reached = [uses_hopper_backward("cuda", p.dim, block, default_flex_config("cuda", block)) for p in problems]
    assert all(reached)
    assert {p.dim for p in problems} == {64, 128}


# --- On an sm_90 GPU: gradients against float64 ------------------------------------------------------------------

on_hopper = pytest.mark.skipif(not device.is_hopper(), reason="needs an sm_90 GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, S = 2, 4, 300  # 300 queries and keys: the last 128-row block is ragged

softcap = 20.0  # the row hidden by a score_mod below caps its other scores like test_flex_dropin's soft_cap_mod


def _inputs(dim=128, dtype=torch.bfloat16, heads_kv=H, seq=S, scale=1.0, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(B, H, seq, dim, generator=g, device=DEVICE) * scale
    k, v = (torch.randn(B, heads_kv, seq, dim, generator=g, device=DEVICE) for _ in range(2))
    d_out = torch.randn(B, H, seq, dim, generator=g, device=DEVICE)
    return tuple(t.to(dtype) for t in (q, k, v, d_out))


def _check(name, q, k, v, d_out, score_mod=None, mask_mod=None, shared_mask=False):
    """Forward and gradients against float64; asserts the backward ran on the Hopper loop."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    dims = (None, None) if shared_mask else (q.shape[0], q.shape[1])
    block_mask = create_block_mask(mask_mod or noop_mask, *dims, seq_q, seq_k, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    grads = torch.autograd.grad(out, leaves, d_out)
    kernels = flex_backward_kernels(q, k, cached_plan(score_mod, mask_mod or noop_mask), block_mask,
                                    q.shape[-1] ** -0.5)  # the cached kernels that backward used
    assert "flex_bwd_hopper" in kernels.main.get_kernel_source(), f"{name}: not the Hopper backward"
    refs = flex_references(q, k, v, d_out=d_out, score_mod=score_mod, mask_mod=mask_mod)
    cu.check_forward(q, k, v, out.detach(), lse, refs=refs, name=name, quiet=True)
    cu.check_backward(q, k, v, d_out, grads, refs=refs, name=name, quiet=True)
    return out.detach(), lse, grads


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("name", list(dropin.DOCUMENTED))
def test_documented_modifiers(name, gpu_dropin):
    """The ten modifiers of test_flex_dropin, unchanged (their tables sized for this problem by ``gpu_dropin``)."""
    mods = dict(gpu_dropin.DOCUMENTED[name])
    if mods.pop("block", None) == "sliding":  # test_flex_dropin builds this one's block mask from the mask_mod
        mods["mask_mod"] = gpu_dropin.sliding_window_causal
    q, k, v, d_out = _inputs(scale=3.0)
    _check(name, q, k, v, d_out, **mods)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("dim, heads_kv, dtype", [(64, H, torch.float16), (64, 2, torch.bfloat16),
                                                  (128, 2, torch.float16), (128, 1, torch.bfloat16)])
def test_head_dims_gqa_and_dtypes(dim, heads_kv, dtype):
    q, k, v, d_out = _inputs(dim=dim, dtype=dtype, heads_kv=heads_kv, seq=700, seed=dim + heads_kv)
    _check(f"soft-cap, causal, D={dim}, H_kv={heads_kv}", q, k, v, d_out, score_mod=soft_cap(30.0),
           mask_mod=causal_mask, shared_mask=True)
    slopes = alibi_slopes(H).to(DEVICE)
    doc = document_mask(document_ids([129, 311, 260], DEVICE))
    _check(f"ALiBi, documents, D={dim}, H_kv={heads_kv}", q, k, v, d_out, score_mod=alibi(slopes), mask_mod=doc,
           shared_mask=True)


@pytest.mark.gpu
@on_hopper
@pytest.mark.parametrize("heads_kv", [H, 2])
def test_keys_no_query_sees_get_exactly_zero(heads_kv):
    """Key block 1 (keys 128-255) is EMPTY for every query block: its one step adds exactly 0."""

    def skip_second_block(b, h, q_idx, kv_idx):
        return (kv_idx < 128) | (kv_idx >= 256)

    q, k, v, d_out = _inputs(heads_kv=heads_kv, seq=400)
    block_mask = create_block_mask(skip_second_block, None, None, 400, 400, device=DEVICE)
    assert int(block_mask.q_count[0, 0, 1]) == 0
    _, _, (dq, dk, dv) = _check(f"an unseen key block, H_kv={heads_kv}", q, k, v, d_out,
                                score_mod=soft_cap(20.0), mask_mod=skip_second_block, shared_mask=True)
    assert torch.equal(dk[:, :, 128:256], torch.zeros_like(dk[:, :, 128:256]))
    assert torch.equal(dv[:, :, 128:256], torch.zeros_like(dv[:, :, 128:256]))


@pytest.mark.gpu
@on_hopper
def test_a_row_the_score_mod_hides_has_no_gradient():
    def hide_row_5(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx == 5, -float("inf"), softcap * torch.tanh(score / softcap))

    q, k, v, d_out = _inputs(scale=2.0)
    out, lse, (dq, dk, dv) = _check("row 5 hidden by score_mod", q, k, v, d_out, score_mod=hide_row_5,
                                    mask_mod=causal_mask, shared_mask=True)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5])) and torch.isneginf(lse[:, :, 5]).all()
    assert torch.equal(dq[:, :, 5], torch.zeros_like(dq[:, :, 5]))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))


@pytest.mark.gpu
@on_hopper
def test_sm80_backward_on_hopper_when_asked():
    """``FlexConfig.bwd_kernel="sm80"`` keeps chapter 05's loop (the benchmark's comparison row)."""
    q, k, v, d_out = _inputs(dtype=torch.float16)
    plan = cached_plan(soft_cap(20.0), causal_mask)
    block_mask = create_block_mask(causal_mask, None, None, S, S, device=DEVICE)
    scale = q.shape[-1] ** -0.5
    out, lse = flex.flex_forward(q, k, v, plan, block_mask, scale)
    grads = {}
    for kernel in ("hopper", "sm80"):
        config = default_flex_config("cuda", block_mask.block)._replace(bwd_kernel=kernel)
        main = flex_backward_kernels(q, k, plan, block_mask, scale, config).main
        assert ("flex_bwd_hopper" in main.get_kernel_source()) == (kernel == "hopper")
        grads[kernel] = flex.flex_backward(q, k, v, out, lse, d_out, plan, block_mask, scale, config=config)
    refs = flex_references(q, k, v, d_out=d_out, score_mod=soft_cap(20.0), mask_mod=causal_mask)
    for kernel, g in grads.items():
        cu.check_backward(q, k, v, d_out, g, refs=refs, name=kernel, quiet=True)

