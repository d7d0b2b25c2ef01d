"""Full-size checks that run only on a CUDA machine (the lent H100); skipped elsewhere."""

import pytest
import torch

from course_utils import attention_reference, check_close, flash_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _slice_ref(q, k, v, heads, **kw):
    """float64 reference for the first batch and the first ``heads`` query heads."""
    group = q.shape[1] // k.shape[1]
    kv_heads = max(1, heads // group)
    sinks = kw.pop("sinks", None)
    return attention_reference(q[:1, :heads], k[:1, :kv_heads], v[:1, :kv_heads],
                               sinks=None if sinks is None else sinks[:heads], **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [4096, 1000])
def test_forward_full_size(dtype, dim, causal, seq):
    q, k, v = (torch.randn(2, 16, seq, dim, device="cuda", dtype=dtype) for _ in range(3))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = _slice_ref(q, k, v, 2, causal=causal, return_lse=True)
    check_close(out[:1, :2], ref, f"O {dtype} D={dim} S={seq} causal={causal}")
    check_close(lse[:1, :2], ref_lse, "LSE", atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 128, 100])
def test_forward_gpt_oss_shape(window):
    q = torch.randn(1, 64, 2048, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 2048, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(64, device="cuda")
    out = flash_attention(q, k, v, causal=True, window_size=window, sinks=sinks)
    ref = _slice_ref(q, k, v, 16, causal=True, window_size=window, sinks=sinks)
    check_close(out[:1, :16], ref, f"O gpt-oss window={window}")


def _check_grads(q, k, v, heads, atol=3e-2, rtol=3e-2, **kw):
    """Gradients of flash_attention vs autograd through the float64 reference on a head slice."""
    sinks = kw.get("sinks")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        kw["sinks"] = sinks.detach().requires_grad_()
        leaves.append(kw["sinks"])
    out = flash_attention(*leaves[:3], **kw)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    group = q.shape[1] // k.shape[1]
    ref_leaves = [leaves[0][:1, :heads], leaves[1][:1, :max(1, heads // group)], leaves[2][:1, :max(1, heads // group)]]
    ref_leaves = [t.detach().double().requires_grad_() for t in ref_leaves]
    ref_kw = dict(kw)
    if sinks is not None:
        ref_kw["sinks"] = kw["sinks"][:heads].detach().double().requires_grad_()
    ref = attention_reference(*ref_leaves, **ref_kw)
    ref_grads = torch.autograd.grad(ref, ref_leaves + ([ref_kw["sinks"]] if sinks is not None else []),
                                    d_out[:1, :heads].double())
    for name, g, r in zip(("dQ", "dK", "dV"), grads, ref_grads):
        check_close(g[:1, :r.shape[1]], r, name, atol=atol, rtol=rtol, dtype=g.dtype)
    if sinks is not None:
        # A sink's gradient sums over batches and queries of its head: the slice covers them when B = 1.
        assert q.shape[0] == 1
        check_close(grads[3][:heads], ref_grads[3], "dsinks", atol=atol, rtol=rtol, dtype=torch.float32)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_full_size(dim, causal):
    q, k, v = (torch.randn(2, 16, 4096, dim, device="cuda", dtype=torch.float16) for _ in range(3))
    _check_grads(q, k, v, 2, causal=causal)


def test_backward_ragged_bf16():
    q, k, v = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    _check_grads(q, k, v, 4, causal=True, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("window", [None, 128])
def test_backward_gpt_oss_shape(window):
    q = torch.randn(1, 64, 4096, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(64, device="cuda")
    _check_grads(q, k, v, 16, causal=True, window_size=window, sinks=sinks, atol=6e-2, rtol=6e-2)


def test_backward_one_key_window():
    """window_size=1: each query sees only its own key (the backward's special loop bounds)."""
    q, k, v = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    _check_grads(q, k, v, 4, causal=True, window_size=1)


@pytest.mark.parametrize("causal", [False, True])
def test_chapter04_kernel_at_full_size(causal):
    """On Hopper the default is chapter 07's kernel; chapter 04's tuned kernel must stay correct too."""
    from course_utils.attention import TUNED_FORWARD_CONFIG

    q, k, v = (torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    out = flash_attention(q, k, v, causal=causal, config=TUNED_FORWARD_CONFIG)
    check_close(out[:1, :2], _slice_ref(q, k, v, 2, causal=causal), f"O chapter 04 kernel causal={causal}")


def test_hopper_default_is_the_hopper_kernel():
    from course_utils.attention import default_forward_config, is_hopper

    assert (default_forward_config("cuda", 128).kernel == "flash_fwd_hopper") == is_hopper()


# ---------------------------------------------------------------------------------------------
# Chapter 08: the Hopper backward (flash_bwd_hopper) and its deterministic mode, on every head.

_HOPPER_ONLY = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                  reason="needs an sm_90 GPU")


@_HOPPER_ONLY
def test_hopper_backward_is_the_default_on_hopper():
    from course_utils.attention import default_backward_config

    for dim in (64, 128):
        for masked in (False, True):
            assert default_backward_config("cuda", dim, masked).kernel == "flash_bwd_hopper"


@_HOPPER_ONLY
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", ["GQA 8/2 causal", "window 128", "one-key window", "sinks, GQA, window, bf16",
                                  "ragged causal S=1000", "S_q=500, S_k=1000 causal", "S_q=1000, S_k=700 causal"])
def test_hopper_backward_features(case, deterministic):
    """GQA, windows, sinks (dsinks too), ragged lengths, S_q ≠ S_k: dQ, dK, dV on every head, both modes."""
    from course_utils.benchmarks.ch08_hopper_backward import FEATURE_CASES, feature_checks

    (row,) = feature_checks({case: FEATURE_CASES[case]}, deterministic_options=(deterministic,))
    assert row["error"] is None, row["error"]


@_HOPPER_ONLY
@pytest.mark.parametrize("dim, causal", [(128, False), (64, True)])
def test_hopper_backward_deterministic_is_bitwise_reproducible(dim, causal):
    q, k, v = (torch.randn(2, 4, 1024, dim, device="cuda", dtype=torch.float16) for _ in range(3))  # FEATURE_CASES
    leaves = [t.requires_grad_() for t in (q, k, v)]
    d_out = torch.randn_like(q)
    runs = [torch.autograd.grad(flash_attention(*leaves, causal=causal, deterministic=True), leaves, d_out)
            for _ in range(3)]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))
    default = torch.autograd.grad(flash_attention(*leaves, causal=causal), leaves, d_out)
    for a, b in zip(default, runs[0]):
        check_close(a.float(), b.float(), "default vs deterministic", atol=2e-2, rtol=2e-2)
