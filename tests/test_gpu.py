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

    assert (default_forward_config("cuda", 128).kernel == "flash_fwd_hopper_persistent") == is_hopper()


# --- Chapter 07's persistent Hopper forward (flash_fwd_hopper_persistent_kernel): the default on Hopper ---

_PERSISTENT_PROBLEMS = {
    # name: (batch, heads, heads_kv, seq_q, seq_k, dim, dtype, causal, window, sinks)
    "S=4k D=128": (2, 16, 16, 4096, 4096, 128, torch.float16, False, None, False),
    "S=4k D=64 causal (3 warpgroups)": (2, 32, 32, 4096, 4096, 64, torch.float16, True, None, False),
    "S=1k D=128 causal bf16": (16, 16, 16, 1024, 1024, 128, torch.bfloat16, True, None, False),
    "ragged D=64 (2 warpgroups)": (3, 4, 4, 1000, 1000, 64, torch.float16, False, None, False),
    "ragged D=64 causal (3 warpgroups)": (1, 8, 8, 2500, 2500, 64, torch.float16, True, None, False),
    "S_q < S_k causal GQA": (1, 8, 2, 500, 1300, 128, torch.float16, True, None, False),
    "S_q > S_k causal sinks": (1, 4, 4, 1300, 500, 64, torch.float16, True, None, True),
    "gpt-oss window": (1, 64, 8, 2048, 2048, 64, torch.bfloat16, True, 128, True),
    "window 1": (1, 4, 4, 777, 777, 64, torch.float16, True, 1, False),
}


@pytest.mark.parametrize("problem", _PERSISTENT_PROBLEMS)
def test_persistent_forward_every_head(problem):
    """flash_attention's default on Hopper (the persistent kernel, 2 or 3 consumer warpgroups) on every head."""
    from course_utils.attention import default_forward_config, is_hopper
    from course_utils.validation import check_forward

    if not is_hopper():
        pytest.skip("the persistent kernel needs an sm_90 GPU")
    b, h, hkv, sq, sk, dim, dtype, causal, window, with_sinks = _PERSISTENT_PROBLEMS[problem]
    config = default_forward_config("cuda", dim, causal or window is not None, seq_len=sq, window=window is not None)
    assert config.kernel == "flash_fwd_hopper_persistent"
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, sq, dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, hkv, sk, dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g) if with_sinks else None
    out, lse = flash_attention(q, k, v, causal=causal, window_size=window, sinks=sinks, return_lse=True)
    check_forward(q, k, v, out, lse, causal=causal, window_size=window, sinks=sinks,
                  name=f"{problem} ({config.block_M}x{config.block_N})")


def test_persistent_forward_twice_in_a_row_is_the_same():
    """The persistent blocks keep no state between launches (mbarrier phases restart with each launch)."""
    from course_utils.attention import is_hopper

    if not is_hopper():
        pytest.skip("the persistent kernel needs an sm_90 GPU")
    q, k, v = (torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    first = flash_attention(q, k, v, causal=True)
    second = flash_attention(q, k, v, causal=True)
    assert torch.equal(first, second)
