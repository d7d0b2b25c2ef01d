"""The course's TileLang kernels on the CPU (C backend) against the float64 reference."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course_utils import CheckFailed, attention_reference, check_close, flash_attention
from course_utils.kernels.flash_bwd import flash_bwd_kernel
from course_utils.kernels.tiles import Tiling, compile_kernel


def _qkv(b, h, s, d, hkv=None, s_k=None, requires_grad=False):
    q = torch.randn(b, h, s, d, requires_grad=requires_grad)
    k, v = (torch.randn(b, hkv or h, s_k or s, d, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


# (batch, heads, heads_kv, seq, head_dim, causal, window, sinks); the CPU tile is 16×16.
FORWARD_CASES = [
    (1, 2, 2, 64, 32, False, None, False),   # whole blocks
    (2, 2, 2, 40, 16, True, None, False),    # ragged: 40 is not a multiple of 16
    (1, 1, 1, 7, 16, False, None, False),    # shorter than one block
    (1, 1, 1, 7, 16, True, None, False),
    (1, 4, 2, 33, 16, True, None, False),    # GQA
    (1, 2, 1, 50, 16, True, 20, False),      # window not a multiple of the block
    (1, 2, 2, 30, 16, True, 1, False),       # window of one key: each query sees itself
    (2, 4, 2, 37, 16, True, 12, True),       # everything at once
]


@pytest.mark.parametrize("b, h, hkv, s, d, causal, window, sinks", FORWARD_CASES)
def test_forward_matches_reference(b, h, hkv, s, d, causal, window, sinks):
    q, k, v = _qkv(b, h, s, d, hkv)
    sink_logits = torch.randn(h) if sinks else None
    out, lse = flash_attention(q, k, v, causal=causal, window_size=window, sinks=sink_logits, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, causal=causal, window_size=window, sinks=sink_logits,
                                       return_lse=True)
    check_close(out, ref, "O")
    check_close(lse, ref_lse, "LSE")


def test_forward_cross_attention_lengths():
    q, k, v = _qkv(1, 2, 24, 16, s_k=56)
    for causal in (False, True):
        check_close(flash_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal), "O")


def test_large_logits_stay_finite():
    q, k, v = _qkv(1, 2, 48, 16)
    out = flash_attention(q * 100, k, v, causal=True)
    assert torch.isfinite(out).all()
    check_close(out, attention_reference(q * 100, k, v, causal=True), "O with logits ×100", atol=1e-4)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=st.integers(1, 40), causal=st.booleans())
def test_forward_any_length(s, causal):
    q, k, v = _qkv(1, 1, s, 16)
    check_close(flash_attention(q, k, v, causal=causal), attention_reference(q, k, v, causal=causal), f"S={s}",
                quiet=True)


BACKWARD_CASES = [
    (1, 2, 2, 32, 16, False, None, False),
    (1, 2, 2, 37, 16, True, None, False),    # ragged
    (2, 4, 2, 29, 16, True, 12, True),       # GQA + window + sinks
    (1, 2, 2, 20, 16, True, 1, False),       # one-key window: a single query block per key block
]


@pytest.mark.parametrize("b, h, hkv, s, d, causal, window, sinks", BACKWARD_CASES)
def test_backward_matches_autograd(b, h, hkv, s, d, causal, window, sinks):
    q, k, v = _qkv(b, h, s, d, hkv, requires_grad=True)
    sink_logits = torch.randn(h, requires_grad=True) if sinks else None
    leaves = [q, k, v] + ([sink_logits] if sinks else [])
    out = flash_attention(q, k, v, causal=causal, window_size=window, sinks=sink_logits)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    ref = attention_reference(q, k, v, causal=causal, window_size=window, sinks=sink_logits)
    ref_grads = torch.autograd.grad(ref, leaves, d_out)
    for name, g, r in zip(("dQ", "dK", "dV", "dsinks"), grads, ref_grads):
        check_close(g, r, name)


def test_gradients_accumulate_over_two_backwards():
    q, k, v = _qkv(1, 2, 32, 16, requires_grad=True)
    d_out = torch.randn(1, 2, 32, 16)
    flash_attention(q, k, v).backward(d_out)
    once = q.grad.clone()
    flash_attention(q, k, v).backward(d_out)
    check_close(q.grad, 2 * once, "dQ after two backwards")


def test_a_wrong_backward_kernel_fails_the_check():
    """A kernel built with the wrong softmax scale must not pass check_close."""
    q, k, v = _qkv(1, 1, 32, 16)
    out, lse = flash_attention(q, k, v, return_lse=True)
    d_out = torch.randn_like(out)
    delta = (d_out * out).sum(-1)
    wrong = compile_kernel(flash_bwd_kernel(1, 1, 32, 32, 16, sm_scale=0.5 / math.sqrt(16), dtype="float32",
                                            target="c", tiling=Tiling(16, 16, 1, 128)),
                           out_idx=[], target="c")
    dq_acc, dk, dv = torch.zeros(1, 1, 32, 16), torch.empty(1, 1, 32, 16), torch.empty(1, 1, 32, 16)
    wrong(q, k, v, d_out, lse, delta, dq_acc, dk, dv)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    ref_dk = torch.autograd.grad(attention_reference(q_, k_, v_), k_, d_out)[0]
    with pytest.raises(CheckFailed):
        check_close(dk, ref_dk, "dK from a kernel with the wrong scale")


@pytest.mark.parametrize("make, message", [
    (lambda: _qkv(1, 1, 8, 48), "head_dim must be one of"),
    (lambda: tuple(t.double() for t in _qkv(1, 1, 8, 16)), "supports dtypes"),
    (lambda: (torch.randn(1, 8, 16),) + _qkv(1, 1, 8, 16)[1:], "shape \\[batch, heads, seq, head_dim\\]"),
])
def test_flash_attention_rejects_bad_input(make, message):
    with pytest.raises(ValueError, match=message):
        flash_attention(*make())


def test_forward_plan_is_kept_per_signature(monkeypatch):
    """The second call with the same shapes, dtypes and options skips the checks (one lookup) and still gives
    the reference's answer for new contents; a bad input is never kept, so it raises at every call."""
    import course_utils.api.attention as att

    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    flash_attention(q, k, v, causal=True)
    calls = []
    monkeypatch.setattr(att, "check_attention_inputs", lambda *a, **kw: calls.append(a))
    q2, k2, v2 = (torch.randn(1, 2, 40, 16) for _ in range(3))
    out = flash_attention(q2, k2, v2, causal=True)
    assert calls == []  # the plan was reused
    check_close(out, attention_reference(q2, k2, v2, causal=True), atol=1e-4, rtol=1e-4, name="plan reused")
    flash_attention(q2, k2, v2, causal=False)  # another signature: its own plan, its own checks
    assert len(calls) == 1
    monkeypatch.undo()
    for _ in range(2):
        with pytest.raises(ValueError, match="sm_scale"):
            flash_attention(q, k, v, sm_scale=float("nan"))
    assert att._plan_key(q, k, v, True, None, None, None, None, None, False) != \
        att._plan_key(q, k, v, 1, None, None, None, None, None, False)  # True == 1, but not as a signature


def test_forward_without_gradients_skips_autograd_and_agrees():
    """Inputs that need no gradient run the kernel directly: same output, no graph; with gradients the
    autograd function runs and the backward still matches the reference's."""
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    sinks = torch.randn(2)
    plain = flash_attention(q, k, v, causal=True, sinks=sinks)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tracked = flash_attention(*leaves, causal=True, sinks=sinks)
    assert plain.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())
    with torch.no_grad():
        assert flash_attention(*leaves, causal=True, sinks=sinks).grad_fn is None


def test_rows_put_in_front_change_no_gradient():
    """The deterministic backward runs a shape whose kernel ptxas cannot compile with query rows put in front
    (``backward_with_rows_in_front``). Here on the CPU, with a causal window, sinks and a gradient on the LSE:
    those rows (dO = 0, LSE = +∞) leave dQ, dK, dV and the sinks' gradient as they were."""
    from course_utils.api.attention import attention_backward, backward_with_rows_in_front

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, s, 16, generator=g) for s in (5, 9, 9))
    sinks, d_lse = torch.randn(2, generator=g), torch.randn(1, 2, 5, generator=g)
    d_out = torch.randn(1, 2, 5, 16, generator=g)
    options = dict(causal=True, window_size=4, sinks=sinks)
    out, lse = flash_attention(q, k, v, return_lse=True, **options)
    plain = attention_backward(q, k, v, out, lse, d_out, d_lse=d_lse, **options)
    padded = backward_with_rows_in_front(11, q, k, v, out, lse, d_out, d_lse=d_lse, **options)
    for name, a, b in zip(("dQ", "dK", "dV", "dsinks"), plain, padded):
        assert a.shape == b.shape, name
        check_close(b, a, name, atol=1e-5, rtol=1e-5)
