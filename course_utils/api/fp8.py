"""``flash_attention_fp8``: the FP8 forward of chapter 12, with its producer step and its error bound.

The producer step quantises what the kernel reads: Q per block of query rows, K per block of
keys (one descale per tile the kernel loads), V per (batch, K/V head), each to e4m3 with the scale that
maps the block's largest magnitude to 448. With ``hadamard=True`` Q and K are first rotated by the same
random orthogonal matrix ``H·diag(±1)/√D``, which leaves Q Kᵀ unchanged and spreads an outlier channel over
every channel (FlashAttention-3's incoherent processing). The kernel (``kernels.flash_fwd_fp8``) runs on
TileLang's C backend with FP8 rounding emulated in float32 on the CPU, and as FP8 ``wgmma`` on a Hopper GPU
(sm_90a), where the tiles are 128 × 128 and the producer step is two kernels of its own
(``kernels.fp8_producer``) that also write V transposed (FP8 ``wgmma`` reads K-major operands only); on the
CPU it is PyTorch (``quantise_blocks``, ``quantise_tensor``), which those kernels equal bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch

from ..core.device import is_hopper
from ..core.problem import DTYPE_NAMES, AttentionProblem, target_of
from ..core.reference import validate_attention_inputs
from ..kernels.flash_fwd_fp8 import E4M3_MAX, P_SCALE, wgmma_key_slot
from .compiled import compiled
from .inputs import check_sm_scale
from .registry import FP8

__all__ = ["flash_attention_fp8", "quantise_blocks", "quantise_tensor", "random_hadamard", "fp8_error_bound",
           "emulate_fp8_forward", "within_ties", "TIE_MARGIN", "quantise_inputs", "FP8_TILE", "FP8_DTYPES",
           "E4M3_MAX", "P_SCALE", "E4M3_UNIT_ROUNDOFF", "E4M3_SUBNORMAL_SPACING", "fp8_tile",
           "FP8_GPU_TILE", "FP8_GPU_HEAD_DIMS", "keys_in_order"]

FP8_TILE = 16  # block_M = block_N on the C backend: the blocks the Q and K descales belong to
FP8_GPU_TILE = 128  # block_M = block_N of the sm_90a kernel: 128 × 128 tiles, two warpgroups of 64 rows
FP8_GPU_HEAD_DIMS = (64, 128)  # FP8 wgmma reduces 32 values per step; D = 16 is too short and 32 untested
# The loops of the sm_90a kernel: "persistent" (chapter 07's persistent kernel, the consumer warpgroups taking turns;
# the default), "rotated" (chapter 07's rotated loop) and "plain" (chapter 03's), which chapter 12's record times
# beside it.
FP8_GPU_LOOPS = ("persistent", "rotated", "plain")
V_KEY_ALIGN = 16  # Vᵀ's rows are keys: TMA needs each row's start 16-byte aligned, so the keys are padded to 16
FP8_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # inputs quantised to e4m3 by the producer step
FP8_HEAD_DIMS = (16, 32, 64, 128)  # powers of two: the Hadamard rotation needs one
E4M3_UNIT_ROUNDOFF = 2.0 ** -4  # half the spacing of 3 mantissa bits, relative to the value
E4M3_SUBNORMAL_SPACING = 2.0 ** -9  # below 2⁻⁶ e4m3 numbers are evenly spaced by this


def fp8_tile(device):
    """The block of rows one Q or K descale covers on ``device``: the kernel's tile there."""
    return FP8_GPU_TILE if torch.device(device).type == "cuda" else FP8_TILE


def _descale_of(amax):
    """E4M3_MAX / amax's inverse, and 1 for a block of zeros (any scale represents it); NaN stays NaN. The divisor
    is a tensor: PyTorch's CUDA division by a Python scalar multiplies by its reciprocal instead, which would make
    the descales of the CPU and of a GPU differ in the last bit."""
    return torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, E4M3_MAX))


def quantise_blocks(x, block):
    """e4m3 values of ``x`` [..., S, D] in blocks of ``block`` rows (the last may be shorter), each block scaled
    so that its largest magnitude becomes 448: returns (values as torch.float8_e4m3fn, descale [..., ⌈S/block⌉]
    in float32) with ``values · descale`` ≈ ``x``."""
    seq = x.shape[-2]
    blocks = -(-seq // block)
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, blocks * block - seq))
    amax = padded.unflatten(-2, (blocks, block)).abs().amax(dim=(-1, -2))
    descale = _descale_of(amax)
    scaled = x.float() / descale.repeat_interleave(block, dim=-1)[..., :seq, None]
    return scaled.to(torch.float8_e4m3fn), descale


def quantise_tensor(x):
    """e4m3 values of ``x`` [B, H, S, D] with one scale per (batch, head): (values, descale [B, H])."""
    amax = x.float().abs().amax(dim=(-1, -2))
    descale = _descale_of(amax)
    return (x.float() / descale[..., None, None]).to(torch.float8_e4m3fn), descale


@functools.lru_cache(maxsize=8)
def _sylvester(dim):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def random_hadamard(dim, seed=0):
    """The orthogonal matrix H·diag(s)/√D [D, D] (float64): H Sylvester's Hadamard matrix, s random signs drawn
    from ``seed``. ``dim`` must be a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim; got {dim}")
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return _sylvester(dim) * signs[None, :] / math.sqrt(dim)


def _check_fp8_inputs(q, k, v, sm_scale):
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        raise ValueError("flash_attention_fp8 takes torch tensors q, k, v")
    validate_attention_inputs(q, k, v)
    if q.dtype not in FP8_DTYPES:
        raise ValueError(f"flash_attention_fp8 quantises float32, float16 or bfloat16 inputs; got {q.dtype} "
                         "(already-quantised FP8 tensors are not taken: pass the values they stand for)")
    if q.device.type == "cuda":
        if not is_hopper():
            raise ValueError("flash_attention_fp8 runs on a Hopper GPU (sm_90, FP8 wgmma) or on the CPU; "
                             f"{torch.cuda.get_device_name(q.device)} is neither (move the tensors to the CPU)")
        if q.shape[-1] not in FP8_GPU_HEAD_DIMS:
            raise ValueError(f"flash_attention_fp8 on the GPU: head_dim must be one of {FP8_GPU_HEAD_DIMS}; "
                             f"got {q.shape[-1]}")
    elif q.device.type != "cpu":
        raise ValueError(f"flash_attention_fp8 runs on the CPU or a Hopper GPU; got device {q.device}")
    if q.shape[-1] not in FP8_HEAD_DIMS:
        raise ValueError(f"flash_attention_fp8: head_dim must be one of {FP8_HEAD_DIMS}; got {q.shape[-1]}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("flash_attention_fp8 is forward only: its inputs must not require grad (use "
                         "torch.no_grad(), or flash_attention for a differentiable forward)")
    check_sm_scale(sm_scale)


def _largest_descales(descales):
    """Each tensor's largest descale, copied to the host without waiting: (values, an event that says they have
    arrived). Descales are positive, so the largest is finite only if all are (a NaN propagates through amax)."""
    largest = torch.stack([descale.amax() for descale in descales.values()])
    if largest.device.type != "cuda":
        return largest, None
    on_host = torch.empty(largest.shape, dtype=largest.dtype, pin_memory=True)
    on_host.copy_(largest, non_blocking=True)
    arrived = torch.cuda.Event()
    arrived.record()
    return on_host, arrived


def _check_descales(descales, largest=None):
    """Refuse inputs holding a NaN or an infinity. On a GPU the caller queues the attention kernel between
    ``_largest_descales`` and this check, so the wait here leaves the GPU busy (its output is discarded if the
    check fails)."""
    values, arrived = largest or _largest_descales(descales)
    if arrived is not None:
        arrived.synchronize()
    for name, value in zip(descales, values.tolist()):
        if not math.isfinite(value):
            raise ValueError(f"flash_attention_fp8: a {name} block has a NaN or infinite scale (its input holds a NaN "
                             "or an infinity, which no FP8 scale can represent)")


def _problem(q, k, causal, sm_scale):
    """The FP8 forward's problem: ``q``'s and ``k``'s shapes, the mask and the scale, in e4m3."""
    batch, heads, seq_q, dim = q.shape
    return AttentionProblem(heads=heads, heads_kv=k.shape[1], dim=dim, dtype="float8_e4m3fn",
                            target=target_of(q.device), sm_scale=AttentionProblem._scale(dim, sm_scale),
                            causal=bool(causal), batch=batch, seq_q=seq_q, seq_k=k.shape[2])


def _compiled(problem):
    """The C backend's kernel: the tile step on float32 tiles of e4m3 values."""
    return compiled(FP8["flash_fwd_fp8"], problem, block_M=FP8_TILE, block_N=FP8_TILE)


def _compiled_gpu(problem, loop, out_dtype):
    v_keys = -(-problem.seq_k // V_KEY_ALIGN) * V_KEY_ALIGN
    tiles = dict(block_M=FP8_GPU_TILE, block_N=FP8_GPU_TILE, v_keys=v_keys, out_dtype=DTYPE_NAMES[out_dtype])
    if loop == "persistent":
        return compiled(FP8["flash_fwd_fp8_persistent"], problem, **tiles)
    if loop == "rotated":
        return compiled(FP8["flash_fwd_fp8_hopper"], problem, **tiles)
    return compiled(FP8["flash_fwd_fp8"], problem, threads=256, num_stages=2, **tiles)


def _producer_problem(q, k):
    """The producer kernels' problem: Q's and K's shapes, in Q's dtype."""
    return AttentionProblem(heads=q.shape[1], heads_kv=k.shape[1], dim=q.shape[-1], dtype=DTYPE_NAMES[q.dtype],
                            target="cuda", sm_scale=1.0, batch=q.shape[0], seq_q=q.shape[2], seq_k=k.shape[2])


def _compiled_producer(q, k, v):
    """The GPU producer kernel of Q and K per tile and V's largest magnitudes (V may have another dtype than Q and
    K: they are float32 after the Hadamard rotation)."""
    return compiled(FP8["fp8_quantise_inputs"], _producer_problem(q, k), block=FP8_GPU_TILE,
                    v_dtype=DTYPE_NAMES[v.dtype])


def _compiled_transposer(v):
    """The GPU producer kernel of V, transposed and padded."""
    return compiled(FP8["fp8_quantise_keys_major"], _producer_problem(v, v), block=FP8_GPU_TILE,
                    padded_seq=-(-v.shape[2] // V_KEY_ALIGN) * V_KEY_ALIGN)


def keys_in_order(v_keys_major, seq_k):
    """V's values [B, H_kv, S_k, D] from the producer's key-major tensor, whose key j sits at ``wgmma_key_slot(j)``."""
    return v_keys_major[..., wgmma_key_slot(torch.arange(seq_k, device=v_keys_major.device))].transpose(-1, -2)


def _quantise_on_gpu(q, k, v):
    """The producer step as two kernels (``kernels.fp8_producer``): the first reads Q, K and V once and leaves V's
    largest magnitude per head, the second reads V again and writes it key-major. Returns ((q8, k8, None),
    descales, V's values key-major [B, H_kv, D, S_k padded] in the kernel's key order, what the kernel reads).
    V's values in key order are not made here: the kernel does not read them (``keys_in_order`` gives them)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    v_largest = torch.zeros(v.shape[:2], dtype=torch.int32, device=v.device)  # float32 bits, for an atomic max
    q8, q_descale, k8, k_descale = _compiled_producer(q, k, v)(q, k, v, v_largest)
    v_keys_major, v_descale = _compiled_transposer(v)(v, v_largest)
    return (q8, k8, None), dict(Q=q_descale, K=k_descale, V=v_descale), v_keys_major


def _quantise(q, k, v, hadamard, seed):
    """The producer step in e4m3 tensors: ((q8, k8, v8), descales, V's values key-major or None), the blocks of
    ``fp8_tile(q.device)``. On a GPU V is written key-major, padded and in the kernel's key order instead
    (``_quantise_on_gpu``), the layout the kernel reads, and v8 is None (``keys_in_order`` gives it); on the CPU
    that third entry is None."""
    if hadamard:
        rotation = random_hadamard(q.shape[-1], seed).to(device=q.device, dtype=torch.float32)
        q, k = q.float() @ rotation, k.float() @ rotation
    if q.device.type == "cuda":
        return _quantise_on_gpu(q, k, v)
    tile = fp8_tile(q.device)
    q8, q_descale = quantise_blocks(q, tile)
    k8, k_descale = quantise_blocks(k, tile)
    v8, v_descale = quantise_tensor(v)
    return (q8, k8, v8), dict(Q=q_descale, K=k_descale, V=v_descale), None


def quantise_inputs(q, k, v, hadamard=False, seed=0):
    """The producer step: ((q8, k8, v8) as float32 tensors of e4m3 values, their descales {"Q", "K", "V"}); with
    ``hadamard``, Q and K rotated by ``random_hadamard(D, seed)`` first. Q and K are quantised in blocks of
    ``fp8_tile(q.device)`` rows, the kernel's tile on that device."""
    (q8, k8, v8), descales, v_keys_major = _quantise(q, k, v, hadamard, seed)
    if v8 is None:
        v8 = keys_in_order(v_keys_major, v.shape[2])
    return (q8.float(), k8.float(), v8.float()), descales


def _run_gpu(q8, k8, v_keys_major, descales, causal, sm_scale, loop="persistent", out_dtype=torch.float32):
    """The sm_90a kernel (``loop``: one of FP8_GPU_LOOPS) on e4m3 tensors, V key-major as the producer step writes
    it ([B, H_kv, D, S_k padded to V_KEY_ALIGN], keys in ``wgmma_key_slot`` order); O in ``out_dtype``."""
    kernel = _compiled_gpu(_problem(q8, k8, causal, sm_scale), loop, out_dtype)
    return kernel(q8.contiguous(), k8.contiguous(), v_keys_major, descales["Q"].contiguous(),
                  descales["K"].contiguous(), descales["V"].contiguous())


def flash_attention_fp8(q, k, v, *, causal=False, sm_scale=None, hadamard=False, hadamard_seed=0, return_lse=False):
    """Attention with Q, K, V and P in e4m3, the FP8 forward of chapter 12 (forward only).

    q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] (GQA: H a multiple of H_kv), float32, float16 or bfloat16 on the
    CPU or a Hopper GPU (D = 64 or 128 there); causal aligned bottom-right as in ``flash_attention``. Q and K are
    quantised per block of ``fp8_tile(device)`` rows (16 on the CPU, 128 on the GPU), V per (batch, K/V head), P at
    the fixed scale ``P_SCALE``. ``hadamard``: rotate Q and K by ``random_hadamard(D, hadamard_seed)`` first.
    Returns O in the input dtype (and the natural-log LSE [B, H, S_q], float32, with ``return_lse``).
    Raises ``ValueError`` for inputs it does not take (see ``_check_fp8_inputs``).
    """
    _check_fp8_inputs(q, k, v, sm_scale)
    (q8, k8, v8), descales, v_keys_major = _quantise(q, k, v, hadamard, hadamard_seed)
    if q.device.type == "cuda":
        largest = _largest_descales(descales)
        out, lse = _run_gpu(q8, k8, v_keys_major, descales, causal, sm_scale, out_dtype=q.dtype)
        _check_descales(descales, largest)
    else:
        _check_descales(descales)
        kernel = _compiled(_problem(q, k, causal, sm_scale))
        out, lse = kernel(q8.float(), k8.float(), v8.float(), descales["Q"].contiguous(), descales["K"].contiguous(),
                          descales["V"].contiguous())
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def fp8_error_bound(q, k, v, *, causal=False, sm_scale=None, hadamard=False, hadamard_seed=0):
    """A bound [B, H, S_q] on max_d |O − O_exact| of ``flash_attention_fp8`` on these inputs (float64).

    Every quantised number is within u = 2⁻⁴ of its value relatively, or half a subnormal spacing absolutely
    (2⁻¹⁰ times its block's descale). So score (i, j) is off by at most E_ij = sm_scale · Σ_d (δq|k| + |q|δk +
    δqδk), with δq, δk those per-element bounds; each weight P_ij/ℓ then moves by a factor within e^{±2E}, and
    the rounding of P (relative u, or 2⁻¹⁰/P_SCALE absolutely) and of V (relative u, or 2⁻¹⁰ · V's descale) adds
    to what each value row contributes. The bound is the sum: max|v| (e^{2 max_j E_ij} − 1) + max|v| (2u + u²)
    + S_k · 2⁻¹⁰/P_SCALE · max|v| + V's absolute term. float32 accumulation is far below it (D ≤ 128 terms).
    """
    (q8, k8, v8), descales = quantise_inputs(q, k, v, hadamard, hadamard_seed)
    del q8, k8, v8
    tile = fp8_tile(q.device)
    if hadamard:
        rotation = random_hadamard(q.shape[-1], hadamard_seed).to(q.device)
        q, k = q.double() @ rotation, k.double() @ rotation
    q, k, v = q.double(), k.double(), v.double()
    scale = 1 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    u, half_subnormal = E4M3_UNIT_ROUNDOFF, E4M3_SUBNORMAL_SPACING / 2

    def per_element(x, descale):
        return u * x.abs() + half_subnormal * descale.double().repeat_interleave(tile, -1)[..., :x.shape[-2], None]

    group = q.shape[1] // k.shape[1]
    k_rep = k.repeat_interleave(group, 1)
    dq, dk = per_element(q, descales["Q"]), per_element(k, descales["K"]).repeat_interleave(group, 1)
    score_error = scale * (dq @ k_rep.abs().transpose(-1, -2) + q.abs() @ dk.transpose(-1, -2)
                           + dq @ dk.transpose(-1, -2))
    seq_q, seq_k = q.shape[2], k.shape[2]
    if causal:
        visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
        score_error = score_error.masked_fill(~visible, 0)
    v_max = v.abs().amax(dim=(-1, -2)).repeat_interleave(group, 1)[..., None]
    v_absolute = (half_subnormal * descales["V"].double()).repeat_interleave(group, 1)[..., None]
    weights = v_max * torch.expm1(2 * score_error.amax(-1))
    return weights + v_max * (2 * u + u * u + seq_k * half_subnormal / P_SCALE) + v_absolute


# How close to the midpoint of two e4m3 values, in units of their spacing, a P · P_SCALE of the emulation may be for
# the kernel's float32 arithmetic (another summation order, exp2f) to round it to the other one.
TIE_MARGIN = 1e-2
# FP8 wgmma does not keep a float32 accumulator: about 14 bits of the running sum survive each step (DeepSeek-V3's
# technical report, arXiv:2412.19437, section 3.3.2, on the H800; the chapter's GPU run saw score errors near 2⁻¹⁴ of
# Σ|q||k|). The GPU check allows each 32-product step of the tensor cores a relative error of 2⁻¹³ (twice that) of
# the magnitudes summed, in the scores and in P V.
WGMMA_ACCUMULATION = 2.0 ** -13
WGMMA_K = 32  # products one FP8 wgmma step sums per output (its k extent)


def fp8_accumulation(device):
    """The relative accumulation error per ``WGMMA_K`` products that the check of the kernel on ``device`` allows:
    0 on the C backend (float32 sums of products that float32 holds exactly), ``WGMMA_ACCUMULATION`` on a GPU."""
    return WGMMA_ACCUMULATION if torch.device(device).type == "cuda" else 0.0


def _tie_spacing(x, relative=0.0):
    """The spacing of e4m3 values around ``x ≥ 0`` where ``x`` lies within TIE_MARGIN of a rounding midpoint, or
    within ``relative · x`` of one (how far the kernel's own x may be from this one), else 0."""
    exponent = torch.floor(torch.log2(x.clamp(min=2.0 ** -30))).clamp(min=-6)
    spacing = torch.exp2(exponent - 3)
    fraction = x / spacing - torch.floor(x / spacing)
    near = (fraction - 0.5).abs() < TIE_MARGIN + relative * x / spacing
    return torch.where(near, spacing, torch.zeros_like(spacing))


def within_ties(actual, emulated, slack):
    """The reference ``actual`` is judged against: ``emulated`` moved towards ``actual`` by at most ``slack`` (what
    P's near-ties may change, from ``emulate_fp8_forward(..., return_slack=True)``), so only differences beyond them
    count."""
    actual = actual.to(emulated.dtype)
    return emulated + torch.nan_to_num(actual - emulated).clamp(-slack, slack)


def emulate_fp8_forward(q8, k8, v8, descales, *, causal=False, sm_scale=None, block_M=None, block_N=None,
                        dtype=torch.float64, bugs=(), return_slack=False, accumulation=None):
    """The FP8 kernel's arithmetic in PyTorch, tile by tile (P is rounded against the running max of its tile, so
    the tiling matters): O and the natural-log LSE from quantised q8 [B, H, S_q, D], k8, v8 [B, H_kv, S_k, D] (e4m3
    values in any float dtype) and ``descales`` {"Q": [B, H, ⌈S_q/block_M⌉], "K": [B, H_kv, ⌈S_k/block_N⌉],
    "V": [B, H_kv]}. ``bugs`` switches on known mistakes for the exercise checker: "no descale", "q descale
    twice", "P not quantised", "K descale of the query block", "V descale missing". The blocks default to the
    kernel's tile on q8's device (``fp8_tile``).

    ``return_slack``: also how far the kernel's O and LSE may be from these by arithmetic alone: (O, LSE, O's slack,
    LSE's slack). On the C backend that is P's near-ties (a P within TIE_MARGIN of a rounding midpoint that float32
    may round the other way). On a GPU (``accumulation``, default ``fp8_accumulation(q8.device)``) the tensor cores'
    short accumulator also moves every score by up to ε⌈D/32⌉ Σ|q||k|: a P that far from a midpoint counts as a
    near-tie, and O and LSE get the bound of what those score errors and P V's accumulation move."""
    device = q8.device
    block_M, block_N = block_M or fp8_tile(device), block_N or fp8_tile(device)
    accumulation = fp8_accumulation(device) if accumulation is None else accumulation
    q8, k8, v8 = q8.to(dtype), k8.to(dtype), v8.to(dtype)
    batch, heads, seq_q, dim = q8.shape
    group, seq_k = heads // k8.shape[1], k8.shape[2]
    k8, v8 = k8.repeat_interleave(group, 1), v8.repeat_interleave(group, 1)
    q_descale = descales["Q"].to(dtype)
    k_descale, v_descale = (descales[n].to(dtype).repeat_interleave(group, 1) for n in ("K", "V"))
    scale_log2 = (1 / math.sqrt(dim) if sm_scale is None else sm_scale) * 1.4426950408889634
    out = torch.zeros(batch, heads, seq_q, dim, dtype=dtype, device=device)
    slack = torch.zeros_like(out)
    lse = torch.full((batch, heads, seq_q), -math.inf, dtype=dtype, device=device)
    lse_slack = torch.zeros_like(lse)
    for qb in range(-(-seq_q // block_M)):
        rows = torch.arange(qb * block_M, min(seq_q, (qb + 1) * block_M), device=device)
        m = torch.full((batch, heads, len(rows)), -math.inf, dtype=dtype, device=device)
        l, acc = torch.zeros_like(m), torch.zeros(batch, heads, len(rows), dim, dtype=dtype, device=device)
        acc_slack, acc_abs = torch.zeros_like(acc), torch.zeros_like(acc)
        score_error = torch.zeros_like(m)  # the largest error of a score of the row so far, in exp2 units
        for kb in range(-(-seq_k // block_N)):
            keys = torch.arange(kb * block_N, min(seq_k, (kb + 1) * block_N), device=device)
            qd = q_descale[..., qb, None, None]
            # The bug reads the query block's entry (the last key block's where there is none).
            k_block = min(qb, k_descale.shape[-1] - 1) if "K descale of the query block" in bugs else kb
            kd = k_descale[..., k_block, None, None]
            factor = scale_log2 * (1 if "no descale" in bugs else qd * kd * (qd if "q descale twice" in bugs else 1))
            s = (q8[:, :, rows] @ k8[:, :, keys].transpose(-1, -2)) * factor
            errors = accumulation * math.ceil(dim / WGMMA_K) * (
                q8[:, :, rows].abs() @ k8[:, :, keys].abs().transpose(-1, -2)) * abs(factor)
            if causal:
                hidden = keys[None, :] > rows[:, None] + seq_k - seq_q
                s, errors = s.masked_fill(hidden, -math.inf), errors.masked_fill(hidden, 0)
            score_error = torch.maximum(score_error, errors.amax(-1))
            m_prev, m = m, torch.maximum(m, s.amax(-1))
            alpha = torch.where(m == -math.inf, 1.0, torch.exp2(m_prev - m))
            p = torch.where(m[..., None] == -math.inf, 0.0, torch.exp2(s - m[..., None]))
            l = l * alpha + p.sum(-1)
            p8 = p * P_SCALE if "P not quantised" in bugs else (p * P_SCALE).float().to(torch.float8_e4m3fn).to(dtype)
            acc = acc * alpha[..., None] + p8 @ v8[:, :, keys]
            moved = torch.exp2(errors + score_error[..., None]) - 1  # how far the kernel's P may be, relatively
            acc_slack = acc_slack * alpha[..., None] + _tie_spacing(p * P_SCALE, moved) @ v8[:, :, keys].abs()
            acc_abs = acc_abs * alpha[..., None] + p8.abs() @ v8[:, :, keys].abs()
        v_factor = 1 if "V descale missing" in bugs else v_descale[..., None, None]
        out[:, :, rows] = torch.where(l[..., None] == 0, 0.0, acc * v_factor / (P_SCALE * l[..., None]))
        # Each term's weight moves by up to 2^(4E) (its exponent and ℓ's), and P V's sum by its accumulation.
        steps = -(-seq_k // block_N) * math.ceil(block_N / WGMMA_K)
        drift = (torch.exp2(4 * score_error) - 1)[..., None] + accumulation * steps
        slack[:, :, rows] = torch.where(l[..., None] == 0, 0.0, (acc_slack + drift * acc_abs) * abs(v_factor)
                                        / (P_SCALE * l[..., None]))
        lse[:, :, rows] = torch.where(l == 0, -math.inf, (m + torch.log2(l)) / 1.4426950408889634)
        lse_slack[:, :, rows] = torch.where(l == 0, 0.0, 3 * score_error / 1.4426950408889634)
    return (out, lse, slack, lse_slack) if return_slack else (out, lse)
