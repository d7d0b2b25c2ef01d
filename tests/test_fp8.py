"""The FP8 forward of chapter 12 on the CPU, against float64.

The bound is FP8-aware in two parts. (1) The kernel must equal the float64 emulation of the same FP8 roundings
(``emulate_fp8_forward``: the same quantised Q, K, V and descales, P rounded to e4m3 tile by tile) to float32's
rounding (10⁻⁴ absolute, 10⁻³ relative), beyond what a P within ``TIE_MARGIN`` of the midpoint of two e4m3 values
may change when float32 rounds it to the other neighbour (``within_ties``): the only error allowed beyond that is
the one the algorithm prescribes, so a small bug (a descale missing, P left unrounded) fails. (2) That emulation
must sit within ``fp8_error_bound`` of the exact float64 attention: the worst case of e4m3's relative rounding
(2⁻⁴) of every input and of P, which says how far FP8 attention may be from exact attention at all.
"""

import math

import pytest
import torch

from course_utils.api import fp8
from course_utils.core.reference import attention_reference
from course_utils.kernels.flash_fwd_fp8 import wgmma_key_slot

CASES = [  # batch, heads, heads_kv, seq_q, seq_k, dim, causal
    (1, 2, 2, 40, 40, 32, False), (2, 4, 2, 33, 50, 16, True), (1, 2, 1, 64, 64, 64, True), (1, 2, 2, 50, 20, 16, True),
]


def _inputs(batch, heads, heads_kv, seq_q, seq_k, dim, seed, outliers=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=g)
    k, v = (torch.randn(batch, heads_kv, seq_k, dim, generator=g) for _ in range(2))
    if outliers:
        q[..., :3] *= 100
        k[..., :3] *= 100
    return q, k, v


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fp8_forward_within_its_bound(case, hadamard):
    batch, heads, heads_kv, seq_q, seq_k, dim, causal = case
    q, k, v = _inputs(batch, heads, heads_kv, seq_q, seq_k, dim, seed=sum(case))
    out, lse = fp8.flash_attention_fp8(q, k, v, causal=causal, hadamard=hadamard, return_lse=True)
    (q8, k8, v8), descales = fp8.quantise_inputs(q, k, v, hadamard, 0)
    model_out, model_lse, slack, _ = fp8.emulate_fp8_forward(q8, k8, v8, descales, causal=causal, return_slack=True)
    torch.testing.assert_close(out.double(), fp8.within_ties(out, model_out, slack), atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(lse.double(), model_lse, atol=1e-5, rtol=1e-5)
    exact = attention_reference(q.double(), k.double(), v.double(), causal=causal)
    error = (model_out - exact).abs().amax(-1)
    bound = fp8.fp8_error_bound(q, k, v, causal=causal, hadamard=hadamard)
    assert (error <= bound).all(), f"FP8 error {float(error.max()):.3g} beyond its bound"


def test_the_emulation_check_catches_each_planted_bug():
    q, k, v = _inputs(1, 2, 2, 40, 40, 32, seed=3)
    q[:, :, 16:] *= 8  # blocks of different scales: a wrong block's descale shows
    out = fp8.flash_attention_fp8(q, k, v, causal=True).double()
    (q8, k8, v8), descales = fp8.quantise_inputs(q, k, v, False, 0)
    for bug in ("no descale", "q descale twice", "P not quantised", "K descale of the query block",
                "V descale missing"):
        wrong, _, slack, _ = fp8.emulate_fp8_forward(q8, k8, v8, descales, causal=True, bugs=(bug,), return_slack=True)
        assert not torch.allclose(out, fp8.within_ties(out, wrong, slack), atol=1e-4, rtol=1e-3), bug


def test_hadamard_rotation_is_orthogonal_and_keeps_scores():
    rotation = fp8.random_hadamard(64, seed=5)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(64, dtype=torch.float64))
    q, k, _ = _inputs(1, 1, 1, 8, 8, 64, seed=1, outliers=True)
    torch.testing.assert_close((q.double() @ rotation) @ (k.double() @ rotation).transpose(-1, -2),
                               q.double() @ k.double().transpose(-1, -2))


def test_quantise_blocks_matches_a_per_block_cast():
    x = torch.randn(2, 3, 37, 16)
    x[:, :, 20:] *= 50
    values, descale = fp8.quantise_blocks(x, 16)
    assert values.dtype == torch.float8_e4m3fn and descale.shape == (2, 3, 3)
    for b in range(3):
        block = x[:, :, 16 * b:16 * (b + 1)]
        assert torch.allclose(block.abs().amax(dim=(-1, -2)) / descale[..., b], torch.tensor(fp8.E4M3_MAX))
    restored = values.float() * descale.repeat_interleave(16, -1)[..., :37, None]
    assert ((restored - x).abs() <= fp8.E4M3_UNIT_ROUNDOFF * x.abs() + 1e-2).all()


@pytest.mark.parametrize("what, args, kwargs, words", [
    ("float64", lambda x: (x.double(),) * 3, {}, "float32, float16 or bfloat16"),
    ("already FP8", lambda x: (x.to(torch.float8_e4m3fn),) * 3, {}, "float32, float16 or bfloat16"),
    ("head_dim 48", lambda x: (torch.randn(1, 2, 8, 48),) * 3, {}, "head_dim"),
    ("wrong rank", lambda x: (x[0],) * 3, {}, "shape"),
    ("GQA heads", lambda x: (torch.randn(1, 3, 8, 16), x, x), {}, "multiple"),
    ("requires grad", lambda x: (x.clone().requires_grad_(), x, x), {}, "forward only"),
    ("NaN input", lambda x: (x, torch.where(x > 1, math.nan, x), x), {}, "NaN"),
    ("scale of zero", lambda x: (x, x, x), dict(sm_scale=0.0), "sm_scale"),
])
def test_unsupported_inputs_raise_a_clear_error(what, args, kwargs, words):
    x = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match=words):
        fp8.flash_attention_fp8(*args(x), **kwargs)


def test_the_hopper_kernel_lowers_to_fp8_wgmma_and_compiles():
    """The rotated Hopper kernel ``flash_attention_fp8`` runs there lowers for sm_90a to FP8 wgmma and ptxas compiles
    it without spills (no GPU: the correctness gate's GPU tier runs it on Hopper). Chapter 12, section 7 checks the
    same of chapter 03's loop with FP8 tiles, and CI runs that cell."""
    from course_utils.core.source import cuda_source, ptxas_report
    from course_utils.kernels.flash_fwd_fp8 import flash_fwd_fp8_hopper_kernel

    kernel = flash_fwd_fp8_hopper_kernel(1, 16, 4096, 4096, 128, causal=True)
    source = cuda_source(kernel, arch="sm_90a")
    # Q Kᵀ from shared memory; P V with P from registers (its columns in wgmma_key_slot order)
    assert source.count("wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 1
    assert source.count("wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 1
    report = ptxas_report(source)
    if report is None:
        pytest.skip("nvcc is not installed")
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report


@pytest.mark.parametrize("causal, dim", [(True, 128), (False, 64)])
def test_the_persistent_kernel_lowers_to_fp8_wgmma_with_turns_and_compiles(causal, dim):
    """The FP8 forward on chapter 07's persistent kernel lowers for sm_90a to FP8 wgmma (Q Kᵀ from shared memory, P V
    from registers, Vᵀ's stages loaded by TMA), its two consumer warpgroups taking turns on named barriers 8 and 9
    (with ``pingpong=False`` there are none), and ptxas compiles it without spills."""
    from course_utils.core.source import cuda_source, ptxas_report
    from course_utils.kernels.flash_fwd_fp8_persistent import FP8_PERSISTENT_TILING, flash_fwd_fp8_persistent_kernel

    kernel = flash_fwd_fp8_persistent_kernel(2, 16, 1000, 1000, dim, heads_kv=4, causal=causal, v_keys=1008,
                                             out_dtype="bfloat16")
    source = cuda_source(kernel, arch="sm_90a")
    # the first key block's Q Kᵀ before the loop and the loop's; the loop's P V and the last one after it
    assert source.count("wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 2
    assert source.count("wgmma_rs<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3") == 2
    assert "tl::__named_barrier_arrive(8, 256)" in source  # the first turn, handed to warpgroup 0
    assert source.count("tl::__sync_thread_partial(((((int)threadIdx.x) >> 7) + 7), 256)") == 2
    if causal:  # once is enough: the turns are all that pingpong changes
        alone = cuda_source(flash_fwd_fp8_persistent_kernel(2, 16, 1000, 1000, dim, heads_kv=4, causal=causal,
                                                            v_keys=1008, tiling=FP8_PERSISTENT_TILING._replace(
                                                                pingpong=False)), arch="sm_90a")
        assert "__named_barrier_arrive" not in alone
    report = ptxas_report(source)
    if report is None:
        pytest.skip("nvcc is not installed")
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report


def test_the_exponential_split_lowers_with_and_without_the_causal_mask():
    """The FP8 persistent kernel takes the softmax's exponential as a piece (``exp2``; chapter 12's A/B
    ``fp8_poly_exp2_h200`` times FlashAttention-4's split with it): 4 of 16 column groups by the polynomial lowers
    (its rounding constant is in the code, the SFU's exp2 too), with the causal mask too since the kernel reads Q's
    descale once a tile (before, TileLang 0.1.15's ThreadSync refused the causal split at this shape)."""
    from course_utils.core.source import cuda_source
    from course_utils.kernels.flash_fwd_fp8_persistent import flash_fwd_fp8_persistent_kernel
    from course_utils.kernels.versions.flash_fwd_hopper_versions import exp2_poly_share

    for causal in (False, True):  # the A/B's shape
        source = cuda_source(flash_fwd_fp8_persistent_kernel(4, 16, 4096, 4096, 128, causal=causal, v_keys=4096,
                                                             out_dtype="bfloat16", exp2=exp2_poly_share(4, degree=4)),
                             arch="sm_90a")
        assert "0x1.0001p+23" in source and "exp2f(" in source  # the polynomial's rounding add (2^23 + 2^7), the SFU


def test_the_persistent_kernel_lowers_causal_tiles_of_one_fold():
    """129 to 255 causal queries: the folded walk's query block is a select on the tile counter, and reading Q's
    descale at it in every key step made TileLang 0.1.15's ThreadSync refuse the kernel ("a divergent region with
    255 participating threads"; the correctness gate found it). Read once a tile, it lowers."""
    from course_utils.core.source import lowering_error
    from course_utils.kernels.flash_fwd_fp8_persistent import flash_fwd_fp8_persistent_kernel

    assert lowering_error(flash_fwd_fp8_persistent_kernel(1, 2, 129, 129, 128, causal=True, v_keys=144,
                                                          out_dtype="bfloat16")) is None


def _score_to_p_kernel(slot):
    """Q Kᵀ into a float32 accumulator, copied into an e4m3 register tile at column ``slot(j)``, then P V."""
    import tilelang.language as T

    fp8, rows, keys, dim = "float8_e4m3fn", 128, 64, 64

    @T.prim_func
    def score_to_p(Q: T.Tensor([rows, dim], fp8), K: T.Tensor([keys, dim], fp8), V: T.Tensor([dim, keys], fp8),
                   O: T.Tensor([rows, dim], "float32")):
        with T.Kernel(1, threads=256):
            Q_s, K_s, V_s = (T.alloc_shared(shape, fp8) for shape in ([rows, dim], [keys, dim], [dim, keys]))
            S, P = T.alloc_fragment([rows, keys], "float32"), T.alloc_fragment([rows, keys], fp8)
            acc = T.alloc_fragment([rows, dim], "float32")
            T.copy(Q, Q_s)
            T.copy(K, K_s)
            T.copy(V, V_s)
            T.gemm(Q_s, K_s, S, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            for i, j in T.Parallel(rows, keys):
                P[i, slot(j)] = S[i, j]
            T.gemm(P, V_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
            T.copy(acc, O)

    return score_to_p


def test_wgmma_key_slot_keeps_each_score_in_its_thread():
    """``wgmma_key_slot`` permutes each group of 16 keys, and with it the accumulator's columns land in an FP8 A
    operand's register tile without leaving their thread: TileLang lowers the copy and ``wgmma_rs``. In key order
    (the planted bug) the copy would cross threads, and TileLang refuses it."""
    from course_utils.core.source import cuda_source

    assert sorted(wgmma_key_slot(j) for j in range(64)) == list(range(64))
    assert all(wgmma_key_slot(j) // 16 == j // 16 for j in range(64))
    assert "wgmma_rs<tl::DataType::kFloat8_e4m3" in cuda_source(_score_to_p_kernel(wgmma_key_slot), arch="sm_90a")
    with pytest.raises(Exception, match="Layout infer conflict"):
        cuda_source(_score_to_p_kernel(lambda j: j), arch="sm_90a")


def test_the_gpu_producer_kernels_lower_for_sm90a_without_spills():
    """The producer step's two kernels (``kernels.fp8_producer``) lower for sm_90a and ptxas compiles them without
    spills; the GPU test below checks their values bit for bit against PyTorch's producer."""
    from course_utils.core.source import cuda_source, ptxas_report
    from course_utils.kernels.fp8_producer import quantise_inputs_kernel, quantise_transposed_kernel

    hadamard = quantise_inputs_kernel(2, 4, 2, 300, 200, 128, dtype="float32", v_dtype="bfloat16")  # Q, K rotated
    for kernel, one_launch in ((quantise_inputs_kernel(2, 4, 2, 300, 200, 128), True), (hadamard, True),
                               (quantise_transposed_kernel(2, 2, 200, 128, 208), False)):
        source = cuda_source(kernel, arch="sm_90a")
        assert "__NV_E4M3" in source or "fp8_e4_t" in source
        # the one launch asks for three resident blocks per SM (chapter 12's occupancy A/B), V's kernel for none
        assert ("__launch_bounds__(256, 3)" in source) == one_launch
        report = ptxas_report(source)
        if report is None:
            pytest.skip("nvcc is not installed")
        assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_gpu_producer_equals_pytorchs_bit_for_bit(dtype):
    """Q and K per 128-row tile, V per (batch, head) and key-major: the GPU producer's values and descales equal
    ``quantise_blocks``/``quantise_tensor``'s on the CPU exactly (rows past a multiple of 128, a block of zeros,
    GQA), and a NaN or an infinity gives its block a descale that is not finite, which ``flash_attention_fp8``
    refuses."""
    if not torch.cuda.is_available() or not fp8.is_hopper():
        pytest.skip("the producer kernels run on a Hopper GPU")
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(2, 4, 300, 128, generator=g) * 3).to(dtype).cuda()
    k = torch.randn(2, 2, 200, 128, generator=g).to(dtype).cuda()
    v = torch.randn(2, 2, 200, 128, generator=g).to(dtype).cuda()
    q[1, 2, 128:256] = 0  # a block of zeros: descale 1
    (q8, k8, _), descales, v_keys_major = fp8._quantise(q, k, v, False, 0)
    v8 = fp8.keys_in_order(v_keys_major, 200)  # the kernel's key order undone: key j is read from wgmma_key_slot(j)
    # On the CPU: PyTorch's CUDA division by a scalar multiplies by its reciprocal, which is not IEEE's division.
    by_pytorch = {"Q": fp8.quantise_blocks(q.cpu(), 128), "K": fp8.quantise_blocks(k.cpu(), 128),
                  "V": fp8.quantise_tensor(v.cpu())}
    for name, got in (("Q", q8), ("K", k8), ("V", v8)):
        values, descale = by_pytorch[name]
        assert torch.equal(got.cpu().view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(descales[name].cpu(), descale), name
    # The kernel's key order: keys 200..207 (padding, zero) sit in the slots that wgmma_key_slot gives them
    padding = [wgmma_key_slot(j) for j in range(200, 208)]
    assert v_keys_major.shape == (2, 2, 128, 208) and not v_keys_major[..., padding].float().any()
    for bad in (float("nan"), float("inf"), -float("inf")):
        k_bad, v_bad = k.clone(), v.clone()
        k_bad[0, 1, 150, 3] = bad
        v_bad[1, 0, 199, 127] = bad  # V's last key, in its last (partial) block
        _, descales, _ = fp8._quantise(q, k_bad, v_bad, False, 0)
        assert not descales["K"][0, 1, 1].isfinite() and descales["K"].isfinite().sum() == descales["K"].numel() - 1
        assert not descales["V"][1, 0].isfinite() and descales["V"].isfinite().sum() == descales["V"].numel() - 1
        for inputs in ((q, k_bad, v), (q, k, v_bad)):
            with pytest.raises(ValueError, match="NaN or infinite"):
                fp8.flash_attention_fp8(*inputs)
