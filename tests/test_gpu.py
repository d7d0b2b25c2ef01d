"""Full-size checks that run only on a CUDA machine (an H100 here); skipped elsewhere.

Every check compares every batch entry and head with the float64 reference, by FlashAttention's
criterion for 16-bit results (``course_utils.checking.checks.check_attention_error``), and the planted-bug
tests show that those checks fail on wrong kernels at these sizes.
"""

import pytest
import torch

from course_utils import (
    backward_bugs,
    check_backward,
    check_close,
    check_forward,
    flash_attention,
    forward_bugs,
    show_bugs_caught,
)
from course_utils.api.attention import TUNED_FORWARD_CONFIG, ForwardConfig, default_forward_config, is_hopper
from course_utils.checking.validation import backward_without_delta, references

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)


def _qkv(batch, heads, seq, dim, dtype=torch.float16, heads_kv=None):
    q = torch.randn(batch, heads, seq, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, heads_kv or heads, seq, dim, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v


def _grads(q, k, v, d_out, sinks=None, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + ([sinks.detach().requires_grad_()] if sinks is not None
                                                                  else [])
    out = flash_attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None, **kw)
    return torch.autograd.grad(out, leaves, d_out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [4096, 1000])
def test_forward_full_size(dtype, dim, causal, seq):
    q, k, v = _qkv(2, 16, seq, dim, dtype)
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    check_forward(q, k, v, out, lse, causal=causal, name=f"{dtype} D={dim} S={seq} causal={causal}")


def test_forward_checks_catch_planted_bugs_at_full_size():
    q, k, v = _qkv(2, 16, 4096, 128)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    refs = references(q, k, v, causal=True)
    show_bugs_caught(lambda o, l: check_forward(q, k, v, o, l, causal=True, refs=refs, quiet=True),
                     forward_bugs(out, lse))


@pytest.mark.parametrize("window", [None, 128, 100])
def test_forward_gpt_oss_shape(window):
    q, k, v = _qkv(1, 64, 2048, 64, torch.bfloat16, heads_kv=8)
    sinks = torch.randn(64, device="cuda")
    out, lse = flash_attention(q, k, v, causal=True, window_size=window, sinks=sinks, return_lse=True)
    check_forward(q, k, v, out, lse, causal=True, window_size=window, sinks=sinks, name=f"gpt-oss window={window}")


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_full_size(dim, causal):
    q, k, v = _qkv(2, 16, 4096, dim)
    d_out = torch.randn_like(q)
    check_backward(q, k, v, d_out, _grads(q, k, v, d_out, causal=causal), causal=causal)


def test_backward_checks_catch_planted_bugs_at_full_size():
    """The trust issue's case: S=4096, fp16, D=128, where a fixed 2e-2 tolerance passed dV × 0.9 and a dK without Δ."""
    q, k, v = _qkv(2, 16, 4096, 128)
    d_out = torch.randn_like(q)
    grads = _grads(q, k, v, d_out, causal=True)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    refs = references(q, k, v, d_out=d_out, causal=True)
    bugs = backward_bugs(grads, grads_without_delta=backward_without_delta(q, k, v, out, lse, d_out, causal=True))
    show_bugs_caught(lambda *g: check_backward(q, k, v, d_out, g, causal=True, refs=refs, quiet=True), bugs)


def test_backward_ragged_bf16():
    q, k, v = _qkv(1, 4, 1000, 128, torch.bfloat16)
    d_out = torch.randn_like(q)
    check_backward(q, k, v, d_out, _grads(q, k, v, d_out, causal=True), causal=True)


@pytest.mark.parametrize("window", [None, 128])
def test_backward_gpt_oss_shape(window):
    q, k, v = _qkv(1, 64, 4096, 64, torch.bfloat16, heads_kv=8)
    sinks = torch.randn(64, device="cuda")
    d_out = torch.randn_like(q)
    grads = _grads(q, k, v, d_out, sinks=sinks, causal=True, window_size=window)
    check_backward(q, k, v, d_out, grads, causal=True, window_size=window, sinks=sinks, name=f"window={window}")


def test_backward_one_key_window():
    """window_size=1: each query sees only its own key (the backward's special loop bounds)."""
    q, k, v = _qkv(1, 4, 1000, 64)
    d_out = torch.randn_like(q)
    check_backward(q, k, v, d_out, _grads(q, k, v, d_out, causal=True, window_size=1), causal=True, window_size=1)


@pytest.mark.parametrize("seq_q, seq_k, causal, deterministic",
                         [(1, 64, False, False), (3, 1, False, False), (6, 64, False, True), (257, 1, True, False),
                          (3, 1, False, True)])
def test_backward_of_a_few_queries_compiles_and_is_right(seq_q, seq_k, causal, deterministic):
    """ptxas cannot allocate chapter 08's kernel's registers at some tiny query counts (D = 128; found by the
    correctness gate on an H200): those shapes are built with 64-row query blocks instead of failing to compile."""
    q = torch.randn(1, 2, seq_q, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, seq_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    d_out = torch.randn_like(q)
    grads = _grads(q, k, v, d_out, causal=causal, deterministic=deterministic)
    check_backward(q, k, v, d_out, grads, causal=causal)


def test_deterministic_backward_runs_where_its_kernel_does_not_compile():
    """At S_q = 2 (D = 128, bf16, causal, a 34-key window; found by the correctness gate on an H200) ptxas cannot
    allocate the deterministic kernel's registers even with 64-row query blocks: the backward runs it with query
    rows put in front (``backward_with_rows_in_front``), right and still bitwise reproducible."""
    q = torch.randn(1, 2, 2, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 35, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    d_out = torch.randn_like(q)
    runs = [_grads(q, k, v, d_out, causal=True, window_size=34, deterministic=True) for _ in range(2)]
    check_backward(q, k, v, d_out, runs[0], causal=True, window_size=34, name="deterministic, rows in front")
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("causal", [False, True])
def test_chapter04_kernel_at_full_size(causal):
    """On Hopper the default is chapter 07's kernel; chapter 04's tuned kernel must stay correct too."""
    q, k, v = _qkv(2, 16, 4096, 128)
    out, lse = flash_attention(q, k, v, causal=causal, config=TUNED_FORWARD_CONFIG, return_lse=True)
    check_forward(q, k, v, out, lse, causal=causal, name=f"chapter 04 kernel causal={causal}")


@pytest.mark.parametrize("config", ["default", "chapter 03", "chapter 04"])
@pytest.mark.parametrize("seq_q, seq_k", [(512, 100), (1000, 7), (384, 256)])
def test_query_blocks_without_keys(config, seq_q, seq_k):
    """Causal with more queries than keys: the first query blocks see no key and must give O = 0, LSE = −∞.
    Chapter 03's loop on sm_90 put O's staging tile over Q's (TileLang's shared-memory plan) and waited for Q's
    load only inside the key loop; the registry compiles such problems unaliased there."""
    configs = {"default": None, "chapter 03": ForwardConfig(128, 128, 2, 256), "chapter 04": TUNED_FORWARD_CONFIG}
    q = torch.randn(2, 8, seq_q, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 8, seq_k, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = flash_attention(q, k, v, causal=True, config=configs[config], return_lse=True)
    check_forward(q, k, v, out, lse, causal=True, name=f"{config} S_q={seq_q} S_k={seq_k}")


def test_a_hidden_key_has_no_influence_on_the_gpu():
    q, k, v = _qkv(1, 4, 1000, 128)
    clean = flash_attention(q, k, v, causal=True)
    k[0, 1, 500, 3] = float("nan")
    k[0, 2, 700, 5] = float("inf")
    out = flash_attention(q, k, v, causal=True)
    assert torch.equal(out[0, 1, :500], clean[0, 1, :500]) and torch.equal(out[0, 2, :700], clean[0, 2, :700])
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 3]).all()


def test_sinks_that_dominate_stay_finite_on_the_gpu():
    q, k, v = _qkv(1, 4, 1000, 64)
    sinks = torch.tensor([100.0, 0.0, -30.0, 5.0], device="cuda")
    out, lse = flash_attention(q * 0.01, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    check_forward(q * 0.01, k, v, out, lse, causal=True, sinks=sinks)


def test_hopper_default_is_the_hopper_kernel():

    assert (default_forward_config("cuda", 128).kernel == "flash_fwd_hopper_persistent") == is_hopper()


# --- Chapter 07's Hopper forwards, the defaults on Hopper: the persistent kernel (flash_fwd_hopper_persistent_kernel)
# and, at D = 64, one warpgroup per block issuing its own loads (flash_fwd_hopper_one_warpgroup_kernel) ---

_PERSISTENT_PROBLEMS = {
    # name: (batch, heads, heads_kv, seq_q, seq_k, dim, dtype, causal, window, sinks)
    "S=4k D=128": (2, 16, 16, 4096, 4096, 128, torch.float16, False, None, False),
    "S=4k D=64 causal (one warpgroup)": (2, 32, 32, 4096, 4096, 64, torch.float16, True, None, False),
    "S=8k D=64 (3 warpgroups)": (1, 16, 16, 8192, 8192, 64, torch.bfloat16, False, None, False),
    "S=1k D=64 causal bf16 (one warpgroup)": (16, 32, 32, 1024, 1024, 64, torch.bfloat16, True, None, False),
    "S=1k D=128 causal bf16": (16, 16, 16, 1024, 1024, 128, torch.bfloat16, True, None, False),
    "ragged D=64 (one warpgroup)": (3, 4, 4, 1000, 1000, 64, torch.float16, False, None, False),
    "ragged D=64 causal (one warpgroup)": (1, 8, 8, 2500, 2500, 64, torch.float16, True, None, False),
    "S_q < S_k causal GQA": (1, 8, 2, 500, 1300, 128, torch.float16, True, None, False),
    "S_q > S_k causal sinks (one warpgroup)": (1, 4, 4, 1300, 500, 64, torch.float16, True, None, True),
    "gpt-oss window (one warpgroup)": (1, 64, 8, 2048, 2048, 64, torch.bfloat16, True, 128, True),
    "window 1 (one warpgroup)": (1, 4, 4, 777, 777, 64, torch.float16, True, 1, False),
}


@pytest.mark.parametrize("problem", _PERSISTENT_PROBLEMS)
def test_persistent_forward_every_head(problem):
    """flash_attention's default on Hopper (the persistent kernel with 2 or 3 consumer warpgroups, or one warpgroup
    per block at D = 64) on every head."""
    from course_utils.checking.validation import check_forward

    if not is_hopper():
        pytest.skip("the persistent kernel needs an sm_90 GPU")
    b, h, hkv, sq, sk, dim, dtype, causal, window, with_sinks = _PERSISTENT_PROBLEMS[problem]
    config = default_forward_config("cuda", dim, causal or window is not None, seq_len=sq, window=window is not None)
    assert config.kernel in ("flash_fwd_hopper_persistent", "flash_fwd_hopper_one_warpgroup")
    assert (config.kernel == "flash_fwd_hopper_one_warpgroup") == ("one warpgroup" in problem)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, sq, dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, hkv, sk, dim, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g) if with_sinks else None
    out, lse = flash_attention(q, k, v, causal=causal, window_size=window, sinks=sinks, return_lse=True)
    check_forward(q, k, v, out, lse, causal=causal, window_size=window, sinks=sinks,
                  name=f"{problem} ({config.block_M}x{config.block_N})")


def test_persistent_forward_twice_in_a_row_is_the_same():
    """The persistent blocks keep no state between launches (mbarrier phases restart with each launch)."""

    if not is_hopper():
        pytest.skip("the persistent kernel needs an sm_90 GPU")
    q, k, v = (torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    first = flash_attention(q, k, v, causal=True)
    second = flash_attention(q, k, v, causal=True)
    assert torch.equal(first, second)


# ---------------------------------------------------------------------------------------------
# Chapter 08: the Hopper backward (flash_bwd_hopper) and its deterministic mode, on every head.

_HOPPER_ONLY = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                                  reason="needs an sm_90 GPU")


@_HOPPER_ONLY
def test_hopper_backward_is_the_default_on_hopper():
    from course_utils.api.attention import default_backward_config

    for dim in (64, 128):
        for masked in (False, True):
            assert default_backward_config("cuda", dim, masked).kernel == "flash_bwd_hopper"


@_HOPPER_ONLY
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", ["GQA 8/2 causal", "window 128", "one-key window", "sinks, GQA, window, bf16",
                                  "ragged causal S=1000", "S_q=500, S_k=1000 causal", "S_q=1000, S_k=700 causal"])
def test_hopper_backward_features(case, deterministic):
    """GQA, windows, sinks (dsinks too), ragged lengths, S_q ≠ S_k: dQ, dK, dV on every head, both modes."""
    from course_utils.measure.benchmarks.ch08_hopper_backward import FEATURE_CASES, feature_checks

    (row,) = feature_checks({case: FEATURE_CASES[case]}, deterministic_options=(deterministic,))
    assert row["error"] is None, row["error"]


# (batch, heads, heads_kv, seq, dim, causal, window): one query block per key block (windows 1-3 over whole
# blocks, S <= block_M), where TileLang unrolled the single-iteration loop and reused shared memory.
_SINGLE_STEP_CASES = [(2, 8, 2, 1000, 64, True, 1), (2, 8, 8, 1000, 64, True, 1), (2, 8, 2, 1000, 64, True, 2),
                      (2, 8, 2, 1000, 64, True, 3), (2, 8, 2, 1024, 128, True, 1), (4, 8, 8, 100, 64, False, None),
                      (4, 8, 8, 128, 64, True, None), (4, 8, 8, 64, 128, False, None), (4, 8, 8, 64, 128, True, 2)]


@_HOPPER_ONLY
@pytest.mark.parametrize("case", _SINGLE_STEP_CASES, ids=lambda c: "B{}H{}/{}S{}D{}{}w{}".format(
    *c[:5], "c" if c[5] else "", c[6]))
def test_hopper_backward_stress_single_step_blocks(case):
    """The atomic Hopper backward, 20 runs on the same inputs, every head of dQ, dK, dV checked each time.

    Chapter 06's GPU case (GQA 8/2, S = 1000, D = 64, window 1: dQ and dK exactly 0) failed in some runs
    while TileLang reused shared memory under the kernel's own barriers (dSᵀ over LSE/Δ, dQ's tile over K
    and V, in the unrolled one-iteration loop): a race shows only in some runs, so each case runs 20 times."""
    from course_utils.api.attention import attention_backward

    b, h, hkv, s, d, causal, window = case
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s, d, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    d_out = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    refs = references(q, k, v, d_out=d_out, causal=causal, window_size=window)
    out, lse = flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True)
    for run in range(20):
        grads = attention_backward(q, k, v, out, lse, d_out, causal=causal, window_size=window)[:3]
        check_backward(q, k, v, d_out, grads, causal=causal, window_size=window, refs=refs, quiet=True,
                       name=f"run {run}")


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
