"""Adversarial inputs on the CPU: each gives the right answer (the float64 reference's, which has
SDPA's semantics) or a clear ValueError; never a silent wrong answer or a TVM internal error."""

import math

import pytest
import torch

from course_utils import attention_reference, check_close, flash_attention
from course_utils.api.attention import _compiled_backward
from course_utils.api.compiled import compiled


def _qkv(b=1, h=2, s=40, d=16, hkv=None):
    q = torch.randn(b, h, s, d)
    k, v = (torch.randn(b, hkv or h, s, d) for _ in range(2))
    return q, k, v


def _same(actual, expected, name):
    """NaN exactly where the reference has it, and close elsewhere."""
    assert torch.equal(actual.isnan(), expected.isnan()), f"{name}: NaN positions differ"
    check_close(actual.nan_to_num(0), expected.nan_to_num(0), name, quiet=True)


@pytest.mark.parametrize("scale", [0, 0.0, -0.125, float("nan"), float("inf"), True])
def test_non_positive_or_non_finite_scale_is_rejected(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="sm_scale"):
        flash_attention(q, k, v, causal=True, sm_scale=scale)


def test_nan_in_a_query_gives_nan_in_that_row_only():
    q, k, v = _qkv()
    q[0, 1, 5, 3] = float("nan")
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert out[0, 1, 5].isnan().all() and lse[0, 1, 5].isnan()
    _same(out, ref, "O")
    _same(lse, ref_lse, "LSE")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_key_a_row_cannot_see_has_no_influence(bad):
    """A NaN or inf in a future key (causal) must not touch the rows before it, in its key block or not."""
    q, k, v = _qkv(s=40)
    clean, clean_lse = flash_attention(q, k, v, causal=True, return_lse=True)
    k[0, 0, 20, 7] = bad
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    check_close(out[0, 0, :20], clean[0, 0, :20], "rows before the bad key")
    check_close(lse[0, 0, :20], clean_lse[0, 0, :20], "their LSE")
    _same(out, attention_reference(q, k, v, causal=True), "O, every row")


def test_a_key_outside_a_window_has_no_influence():
    q, k, v = _qkv(s=40)
    clean = flash_attention(q, k, v, causal=True, window_size=8)
    k[0, 1, 3] = float("nan")  # visible only to queries 3..10
    out = flash_attention(q, k, v, causal=True, window_size=8)
    check_close(out[0, 1, 11:], clean[0, 1, 11:], "rows whose window has left the bad key")
    _same(out, attention_reference(q, k, v, causal=True, window_size=8), "O, every row")


@pytest.mark.parametrize("sink, scores", [(100.0, 1.0), (0.0, 1e-2), (-30.0, 1.0)])
def test_sinks_that_dominate_or_vanish_stay_finite(sink, scores):
    """A sink of logit 100, or ordinary sinks against tiny scores: no overflow in the LSE or O."""
    q, k, v = _qkv(s=33)
    q = q * scores
    sinks = torch.full((2,), sink)
    out, lse = flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_close(out, ref, "O")
    check_close(lse, ref_lse, "LSE")


def test_scores_of_minus_100_against_a_sink_of_0():
    q, k, v = _qkv(s=20, d=16)
    q, k = torch.full_like(q, 2.5), -torch.full_like(k, 10.0)  # every score is 2.5·(−10)·16/4 = −100
    sinks = torch.zeros(2)
    out, lse = flash_attention(q, k, v, sinks=sinks, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, sinks=sinks, return_lse=True)
    check_close(lse, ref_lse, "LSE")
    check_close(out, ref, "O")


def test_nan_sink_gives_nan():
    q, k, v = _qkv()
    sinks = torch.tensor([0.5, float("nan")])
    out, lse = flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert out[:, 1].isnan().all() and lse[:, 1].isnan().all()
    assert torch.isfinite(out[:, 0]).all()


def test_second_derivatives_raise_instead_of_dropping_terms():
    q, k, v = (t.requires_grad_() for t in _qkv(s=24))
    out = flash_attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|double backward"):
        dq.square().sum().backward()  # a gradient penalty


@pytest.mark.parametrize("sinks", [False, True])
def test_a_loss_on_the_lse_gets_its_gradient(sinks):
    """z-loss: Σ LSE² joins the loss. Its gradient must reach q, k and the sinks."""
    q, k, v = (t.requires_grad_() for t in _qkv(s=29, hkv=1))
    sink = torch.randn(2, requires_grad=True) if sinks else None
    leaves = [q, k, v] + ([sink] if sinks else [])
    d_out = torch.randn(1, 2, 29, 16)
    out, lse = flash_attention(q, k, v, causal=True, sinks=sink, return_lse=True)
    grads = torch.autograd.grad((out * d_out).sum() + 1e-2 * lse.square().sum(), leaves)
    ref, ref_lse = attention_reference(q, k, v, causal=True, sinks=sink, return_lse=True)
    ref_grads = torch.autograd.grad((ref * d_out).sum() + 1e-2 * ref_lse.square().sum(), leaves)
    for name, g, r in zip(("dQ", "dK", "dV", "dsinks"), grads, ref_grads):
        check_close(g, r, name)
    # Only the LSE used: the same gradients through Δ − dLSE alone.
    (dq_lse_only,) = torch.autograd.grad(flash_attention(q, k, v, causal=True, sinks=sink, return_lse=True)[1].sum(), q)
    ref_lse = attention_reference(q, k, v, causal=True, sinks=sink, return_lse=True)[1]
    (ref_lse_only,) = torch.autograd.grad(ref_lse.sum(), q)
    check_close(dq_lse_only, ref_lse_only, "dQ of Σ LSE")


@pytest.mark.parametrize("window", [40, 41, 2 ** 31 - 1, 2 ** 40])
def test_windows_as_long_as_the_keys_are_plain_causal(window):
    q, k, v = _qkv(s=40)
    out = flash_attention(q, k, v, causal=True, window_size=window)
    check_close(out, attention_reference(q, k, v, causal=True), f"window {window}")


@pytest.mark.parametrize("window, message", [(True, "window_size"), (0, "window_size"), (2.5, "window_size"),
                                             (-3, "window_size")])
def test_bad_windows_are_rejected(window, message):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, causal=True, window_size=window)


@pytest.mark.parametrize("make, message", [
    (lambda: (torch.randn(1, 0, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16)), "query heads"),
    (lambda: (torch.randn(0, 1, 8, 16),) * 3, "positive"),
    (lambda: (torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)), "multiple"),
    (lambda: (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 8, 16)), "same shape"),
])
def test_bad_shapes_are_rejected(make, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*make())


def test_integer_sinks_are_rejected():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="floating-point"):
        flash_attention(q, k, v, sinks=torch.tensor([1, 2]))


def test_kernel_caches_are_bounded():
    for cache in (compiled, _compiled_backward):
        assert cache.cache_info().maxsize is not None and cache.cache_info().maxsize <= 256


def test_scale_other_than_default_matches_reference():
    q, k, v = _qkv(s=35)
    for scale in (0.05, 1.0, 2 / math.sqrt(16)):
        check_close(flash_attention(q, k, v, causal=True, sm_scale=scale),
                    attention_reference(q, k, v, causal=True, sm_scale=scale), f"sm_scale={scale}")


def test_keys_no_query_sees_are_left_out_and_get_zero_gradients():
    """Few queries against many keys with a window (chunked prefill): the keys before the first query's window
    are never read, so NaN and inf there change nothing, and their dK and dV are exactly 0."""
    q, k, v = _qkv(s=60)
    q = q[:, :, -5:].clone().requires_grad_()
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = flash_attention(q, k, v, causal=True, window_size=7)
    out.backward(torch.ones_like(out))
    unseen = 60 - 5 - 7 + 1  # keys 0 .. 48 are behind every query's window
    assert (k.grad[:, :, :unseen] == 0).all() and (v.grad[:, :, :unseen] == 0).all()
    assert (k.grad[:, :, unseen:] != 0).any()
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, :unseen], v2[:, :, :unseen] = float("nan"), float("inf")
    assert torch.equal(flash_attention(q.detach(), k2, v2, causal=True, window_size=7), out.detach())


def test_flash_decode_refuses_inputs_that_require_a_gradient():
    from course_utils import flash_decode

    q = torch.randn(1, 1, 2, 32, requires_grad=True)
    cache = torch.randn(1, 8, 2, 32)
    lengths = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="forward only"):
        flash_decode(q, cache, cache, lengths)
    with torch.no_grad():
        assert flash_decode(q, cache, cache, lengths).shape == q.shape
