"""Chapter 07's exponential pieces without a GPU: ``exp2_poly`` (FlashAttention-4's exp2 on the FP32 units)
is accurate over the range the softmax uses and exact where it must be (masked scores, NaN), a forward
that takes part of its exponentials from it passes the course's check on every head, and on sm_90a it
compiles to fewer SFU instructions and no conversion instruction, without spills."""

import functools
import re

import pytest
import tilelang.language as T
import torch

from course_utils.checking.checks import CheckFailed
from course_utils.checking.validation import check_forward
from course_utils.kernels import flash_fwd
from course_utils.kernels.flash_pieces import online_softmax
from course_utils.kernels.tiles import compile_kernel
from course_utils.kernels.versions.flash_fwd_hopper_versions import exp2_nearly_free, exp2_poly, exp2_poly_share

N = 1 << 16


@functools.cache
def _exp2_poly_on_cpu(degree):
    @T.prim_func
    def elementwise(X: T.Tensor([N], "float32"), Y: T.Tensor([N], "float32")):
        with T.Kernel(1):
            for i in T.serial(N):
                Y[i] = exp2_poly(X[i], degree)

    return compile_kernel(elementwise, out_idx=[1], target="c")


def _run(x, degree=3):
    x = torch.as_tensor(x, dtype=torch.float32)
    padded = torch.zeros(N)
    padded[:len(x)] = x
    return _exp2_poly_on_cpu(degree)(padded)[:len(x)]


@pytest.mark.parametrize("degree, worst", [(3, 1e-4), (4, 4e-6)])
def test_exp2_poly_relative_error_over_the_softmax_range(degree, worst):
    # Exponents the online softmax feeds it: x = s·scale_log2 - shift ≤ 0. Below 2^-125 the results are
    # subnormal or flushed to 0 (as the SFU's ex2.approx.ftz flushes them): not held to a relative error.
    x = torch.cat([-torch.rand(N - 4002, generator=torch.Generator().manual_seed(0)) * 125,
                   -torch.arange(4001) / 32.0, torch.tensor([0.0])])
    y = _run(x, degree).double()
    rel = (y / torch.exp2(x.double()) - 1).abs().max().item()
    assert rel < worst, rel  # the minimax errors: 7.5e-5 (degree 3), 2.6e-6 (degree 4)
    assert rel > worst / 100, rel  # and it is a polynomial, not the exact exp2 by accident


def test_exp2_poly_masked_scores_are_exactly_zero_and_nan_stays_nan():
    y = _run([-float("inf"), -1e30, -1000.0, -127.0, float("nan"), 5.5])
    assert torch.equal(y[:4], torch.zeros(4))
    assert y[4].isnan()
    assert abs(y[5].item() / 2 ** 5.5 - 1) < 1e-4


def test_exp2_poly_share_rejects_a_share_out_of_range():
    for bad in (-1, 17, 2.5):
        with pytest.raises(ValueError, match="n must be an int"):
            exp2_poly_share(bad)
    with pytest.raises(ValueError, match="degree must be one of"):
        exp2_poly_share(2, degree=2)


def _forward_with(monkeypatch, exp2, *, causal, dtype):
    """Chapter 03's forward on the C backend with ``online_softmax``'s exponential swapped (the Hopper
    kernels do not run on the CPU; the piece is the same expression)."""
    @T.macro
    def softmax_with_exp2(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, scale_log2):  # noqa: E741
        online_softmax(tb, S, m, m_prev, shift, alpha, row_sum, l, block_M, block_N, scale_log2, exp2=exp2)

    monkeypatch.setattr(flash_fwd, "online_softmax", softmax_with_exp2)
    b, h, s, d = 1, 2, 80, 16
    func = flash_fwd.flash_fwd_kernel(b, h, s, s, d, causal=causal, dtype=dtype, target="c",
                                      tiling=flash_fwd.ForwardTiling(16, 16, 1, 1))
    return compile_kernel(func, out_idx=[4, 5], target="c", dtype=dtype), (b, h, s, d)


def _inputs(b, h, s, d):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).half() * 2 for _ in range(3))
    q[:, :, 0] = 0  # row 0 (causal: one key) has LSE = 0, where float32's tolerance is tightest (1e-5)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
def test_forward_with_half_the_exponentials_by_a_quartic_passes_the_check(monkeypatch, causal):
    # block_N = 16 holds two groups of 8 columns: a share of 8 in 16 puts group 0 (column 0) on the polynomial.
    kernel, shape = _forward_with(monkeypatch, exp2_poly_share(8, degree=4), causal=causal, dtype="float16")
    q, k, v = _inputs(*shape)
    out, lse = kernel(q, k, v, torch.full((shape[1],), float("-inf")))
    check_forward(q, k, v, out, lse, causal=causal, name="exp2_poly_share(8, degree=4)", quiet=True)


def test_the_check_rejects_the_cubic_in_the_lse_of_a_row_with_one_key(monkeypatch):
    """Degree 3 (FlashAttention-4's) gives row 0 l = p(0) = 1 - 7.2e-5: O is exact (P·V / l with the same P)
    but the LSE is off by 7.2e-5, more than float32's tolerance at 0."""
    kernel, shape = _forward_with(monkeypatch, exp2_poly_share(8, degree=3), causal=True, dtype="float16")
    q, k, v = _inputs(*shape)
    out, lse = kernel(q, k, v, torch.full((shape[1],), float("-inf")))
    with pytest.raises(CheckFailed, match="LSE"):
        check_forward(q, k, v, out, lse, causal=True, name="exp2_poly_share(8, degree=3)", quiet=True)


def test_the_check_catches_the_upper_bound_that_is_not_an_exponential(monkeypatch):
    kernel, shape = _forward_with(monkeypatch, exp2_nearly_free, causal=False, dtype="float16")
    q, k, v = _inputs(*shape)
    out, lse = kernel(q, k, v, torch.full((shape[1],), float("-inf")))
    with pytest.raises(CheckFailed, match="✗ O"):
        check_forward(q, k, v, out, lse, name="exp2_nearly_free", quiet=True)


def _ptx(source):
    """nvcc's PTX for TileLang's CUDA ``source`` (sm_90a; ``#pragma unroll`` loops unrolled), or None."""
    import os
    import shutil
    import subprocess
    import tempfile

    import tilelang

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    root = os.path.dirname(tilelang.__file__)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cu")
        with open(path, "w") as f:
            f.write(source)
        subprocess.run([nvcc, "-std=c++17", "-O3", "--use_fast_math", "-w", "-ptx", path, "-o", path + ".ptx",
                        "-arch=sm_90a", "-I", os.path.join(root, "src"),
                        "-I", os.path.join(root, "3rdparty", "cutlass", "include")], check=True)
        with open(path + ".ptx") as f:
            return f.read()


@functools.cache
def _persistent_ptx(share):
    from course_utils.core.source import cuda_source
    from course_utils.kernels.flash_fwd_hopper_persistent import (
        PersistentPieces,
        PersistentTiling,
        flash_fwd_hopper_persistent_kernel,
    )

    exp2 = None if share is None else exp2_poly_share(share)
    func = flash_fwd_hopper_persistent_kernel(2, 8, 2048, 2048, 64,
                                              tiling=PersistentTiling(block_M=192, threads=384, pingpong=True),
                                              pieces=PersistentPieces(exp2=exp2))
    return _ptx(cuda_source(func))


def test_exp2_poly_takes_exponentials_off_the_sfu_without_conversions():
    shipped, split = _persistent_ptx(None), _persistent_ptx(4)
    if shipped is None:
        pytest.skip("nvcc is not installed")

    def count(ptx, pattern):
        return len(re.findall(pattern, ptx))

    # 4 of 16 groups: a quarter of the 2 × 64 score exponentials of a thread (peeled block and loop).
    ex2 = r"\bex2\.approx"
    assert count(shipped, ex2) - count(split, ex2) == 32, (count(shipped, ex2), count(split, ex2))
    # No rounding conversion (FRND, F2I: the SFU's rate) came with them, unlike exp2_on_fma.
    conversions = r"\bcvt\.r[mnpz]i\b"
    assert count(split, conversions) == count(shipped, conversions)
