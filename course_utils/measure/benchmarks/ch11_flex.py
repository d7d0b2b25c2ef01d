"""Chapter 11: FlexAttention in TileLang against PyTorch's compiled FlexAttention, SDPA with an explicit mask,
and our specialised causal kernel; on Hopper also our flex forward on chapter 03's loop instead of chapter 07's.

One shape (B = 2, H = 16, S = 8192, D = 128, bfloat16: 16k tokens, H·D = 2048), five modifiers:
soft-capping (Gemma 2, cap 50, causal), ALiBi (causal), document masking of a packed batch (document
lengths drawn from 128 to 8192, each row packed on its own), prefix-LM (a 2048-token prefix) and plain
causal. The *same* modifier functions run in our kernels and in PyTorch's ``flex_attention``
(``torch.compile``d); SDPA gets the mask (and ALiBi's bias) as a dense tensor where it can express it.
Every row of ours is checked on every head against the float64 reference, forward and gradients.

    python -m course_utils.measure.benchmarks ch11_flex_h100
"""

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ...api.attention import flash_attention
from ...api.flex import (
    FlexFunction,
    alibi,
    alibi_slopes,
    cached_plan,
    causal_mask,
    create_block_mask,
    default_flex_config,
    document_ids,
    document_mask,
    flex_attention,
    flex_backward,
    flex_backward_kernels,
    flex_forward,
    flex_forward_kernel,
    flex_forward_row,
    flex_forward_uses_hopper,
    prefix_lm,
    soft_cap,
    visible_pairs,
)
from ...checking.flex_reference import flex_references
from ...checking.validation import check_backward, check_forward
from ...core.labels import OURS
from ..bench import tflops, time_side_by_side
from .common import backward_timer, in_parallel, quiet_flash_attention_4_compiles, random_inputs

__all__ = ["FLEX_SHAPE", "TORCH_FLEX", "TORCH_FLEX_FA4", "SDPA_MASKED", "OURS_NO_SKIP", "OURS_CAUSAL",
           "OURS_SM80_FORWARD", "OURS_ROTATED_FORWARD", "OURS_SM80_BWD", "flex_cases", "flex_vs_peers",
           "packed_lengths"]

FLEX_SHAPE = dict(batch=2, heads=16, seq=8192, dim=128)
TORCH_FLEX = "PyTorch flex_attention (compiled)"
# The same call with kernel_options={"BACKEND": "FLASH"}: PyTorch's FlexAttention on FlashAttention-4's kernels,
# where flash-attn-4 is installed and the variant is one it runs.
TORCH_FLEX_FA4 = "PyTorch flex_attention (compiled, FLASH backend: FlashAttention-4)"
SDPA_MASKED = "SDPA, explicit mask"
OURS_NO_SKIP = "TileLang (ours), no block skipping"
OURS_CAUSAL = "TileLang flash_attention(causal=True)"
# Our flex forward on chapter 03's loop (``FlexConfig.fwd_kernel="sm80"``), where ``OURS`` runs one of chapter 07's
# kernels, and on chapter 07's rotated loop where ``OURS`` runs its persistent kernel: forward rows only (the
# backward is the same kernel for all of them).
OURS_SM80_FORWARD = "TileLang (ours), forward on chapter 03's loop"
OURS_ROTATED_FORWARD = "TileLang (ours), forward on chapter 07's rotated loop"
OURS_SM80_BWD = "TileLang (ours), sm_80 backward"
BACKWARD_ONLY = (OURS_SM80_BWD,)  # its forward is ours: timed once, in the OURS row
UNCHECKED = (TORCH_FLEX, TORCH_FLEX_FA4, SDPA_MASKED)  # peers: not ours to prove (check_stored_errors's ``unchecked``)
PREFIX = 2048


def packed_lengths(seq, seed, low=128, high=8192):
    """Document lengths drawn uniformly from [low, high] until ``seq`` tokens are filled (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        n = min(int(torch.randint(low, high + 1, (1,), generator=g)), seq - total)
        lengths.append(n)
        total += n
    return lengths


def flex_cases(shape, device="cuda"):
    """{case: (score_mod, mask_mod, B of the mask (None: shared), dense SDPA mask builder or None, note)}."""
    b, h, s = shape["batch"], shape["heads"], shape["seq"]
    slopes = alibi_slopes(h).to(device)
    lengths = [packed_lengths(s, seed) for seed in range(b)]
    docs = torch.stack([document_ids(row, device) for row in lengths])
    positions = torch.arange(s, device=device)
    causal_dense = positions[:, None] >= positions[None, :]

    def alibi_bias(dtype):
        bias = slopes[:, None, None] * (positions[None, None, :] - positions[None, :, None]).float()
        return bias.masked_fill(~causal_dense, float("-inf")).to(dtype)[None]

    def doc_dense(dtype):
        return ((docs[:, :, None] == docs[:, None, :]) & causal_dense)[:, None]

    def prefix_dense(dtype):
        return ((positions[None, :] < PREFIX) | causal_dense)[None, None]

    return {
        "soft-cap 50": (soft_cap(50.0), causal_mask, None, None, "not expressible in SDPA (it changes the scores)"),
        "ALiBi": (alibi(slopes), causal_mask, None, alibi_bias, "SDPA: a dense bias, -inf above the diagonal"),
        "documents": (None, document_mask(docs), b, doc_dense, f"document lengths {lengths}"),
        "prefix-LM": (None, prefix_lm(PREFIX), None, prefix_dense, f"prefix of {PREFIX} tokens"),
        "causal": (None, causal_mask, None, lambda dtype: causal_dense[None, None], "SDPA: causal mask tensor"),
    }


def _triton_version():
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _torch_flex():
    # The timed backward re-runs one graph (retain_graph=True), which AOT autograd refuses for a graph
    # compiled with donated buffers (it frees saved tensors after the first backward); found on the H100.
    import torch._functorch.config as functorch_config
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex_attention

    functorch_config.donated_buffer = False
    # Five modifiers x two block masks x grad/no-grad inputs pass dynamo's default of 8 recompiles, after
    # which flex_attention silently runs eagerly (84 ms for the causal case on the H100 instead of ~1 ms).
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    return torch.compile(torch_flex_attention), torch_block_mask


def _flash_backend(compiled_flex, score_mod, torch_mask, q, k, v):
    """PyTorch's flex_attention on its FLASH backend (FlashAttention-4) as f(q, k, v), or None where flash-attn-4
    is not installed or refuses this variant (the refusal is printed: it is part of what the record says)."""
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return None
    quiet_flash_attention_4_compiles()

    def on_fa4(q_, k_, v_):
        return compiled_flex(q_, k_, v_, score_mod=score_mod, block_mask=torch_mask,
                             kernel_options={"BACKEND": "FLASH"})

    try:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.autograd.grad(on_fa4(*leaves), leaves, torch.ones_like(q))
    except Exception as exc:  # a variant the FLASH backend does not run
        print(f"  FLASH backend refused this case: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}")
        return None
    return on_fa4


class _FlexOnSm80Backward(FlexFunction):
    """``flex_attention``'s autograd Function with the backward on chapter 05's sm_80 loop, on any GPU."""

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, block_mask, sm_scale = ctx.flex
        config = default_flex_config(q.device.type, block_mask.block)._replace(bwd_kernel="sm80")
        d_out = torch.zeros_like(out) if d_out is None else d_out
        dq, dk, dv = flex_backward(q, k, v, out, lse, d_out, plan, block_mask, sm_scale, d_lse=d_lse, config=config)
        return dq, dk, dv, None, None, None


def _ours_on_sm80_backward(q, k, v, score_mod, block_mask):
    """``flex_attention(q, k, v, score_mod=..., block_mask=..., return_lse=True)`` with the sm_80 backward."""
    plan = cached_plan(score_mod, block_mask.mask_mod)
    return _FlexOnSm80Backward.apply(q, k, v, plan, block_mask, 1.0 / math.sqrt(q.shape[-1]))


def _ours_with_lse(score_mod, block_mask, causal):
    """Each implementation of ours as a function (q, k, v) -> (O, LSE), for the checks."""
    every_tile = block_mask.without_skipping()
    ours = {
        OURS: lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True),
        OURS_NO_SKIP: lambda q, k, v: flex_attention(q, k, v, score_mod=score_mod, block_mask=every_tile,
                                                     return_lse=True),
        OURS_SM80_BWD: lambda q, k, v: _ours_on_sm80_backward(q, k, v, score_mod, block_mask),
    }
    if causal:
        ours[OURS_CAUSAL] = lambda q, k, v: flash_attention(q, k, v, causal=True, return_lse=True)
    return ours


def _other_forward_configs(q, block_mask):
    """{row of ours: flex config} of the forward-only rows: chapter 03's loop where ``flex_attention`` runs a Hopper
    kernel, and chapter 07's rotated loop where it runs the persistent one, in either order (none where neither
    applies)."""
    config = default_flex_config(q.device.type, block_mask.block)
    others = {}
    if flex_forward_uses_hopper(q, q, block_mask, config=config):
        others[OURS_SM80_FORWARD] = config._replace(fwd_kernel="sm80")
    if flex_forward_row(q, q, block_mask, config=config).startswith("flex_fwd_hopper_persistent"):
        others[OURS_ROTATED_FORWARD] = config._replace(fwd_kernel="rotated")
    return others


def _compile_ours_in_parallel(shape, dtype, all_cases, device):
    """Compile every case's forward and backward kernels at once (TileLang's compiles release the GIL), for the
    same modifier functions and scale ``flex_attention`` will use: the later calls find them in its cache."""
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    q = torch.empty(b, h, s, d, dtype=dtype, device=device)
    jobs = []
    for score_mod, mask_mod, mask_b, _, _ in all_cases.values():
        plan = cached_plan(score_mod, mask_mod)
        block_mask = create_block_mask(mask_mod, mask_b, None, s, s, device=device)
        sm80_backward = default_flex_config(q.device.type, block_mask.block)._replace(bwd_kernel="sm80")
        jobs += [(flex_forward_kernel, plan, block_mask, None), (flex_backward_kernels, plan, block_mask, None),
                 (flex_backward_kernels, plan, block_mask, sm80_backward)]
        jobs += [(flex_forward_kernel, plan, block_mask, c) for c in _other_forward_configs(q, block_mask).values()]
    in_parallel(lambda job: job[0](q, q, job[1], job[2], 1.0 / math.sqrt(d), job[3]), jobs)


def flex_vs_peers(shape=None, dtype=torch.bfloat16, cases=None, device="cuda"):
    """Forward and backward times of every case: ours (with and without block skipping), PyTorch's compiled
    flex_attention, SDPA with an explicit mask where it can express one, for the causal case our
    specialised ``flash_attention(causal=True)``, and on Hopper our forward on chapter 03's loop (forward rows).
    Rows carry ms, TFLOP/s over the visible pairs, the share of tiles skipped, and for ours the errors of O, LSE,
    dQ, dK, dV (of O and LSE for a forward row) against the float64 reference."""
    sh = dict(shape or FLEX_SHAPE)
    b, h, s, d = sh["batch"], sh["heads"], sh["seq"], sh["dim"]
    compiled_flex, torch_block_mask = _torch_flex()
    all_cases = {c: spec for c, spec in flex_cases(sh, device).items() if cases is None or c in cases}
    _compile_ours_in_parallel(sh, dtype, all_cases, device)
    rows = []
    for case, (score_mod, mask_mod, mask_b, dense, note) in all_cases.items():
        q, k, v = random_inputs(sh, dtype)
        block_mask = create_block_mask(mask_mod, mask_b, None, s, s, device=device)
        torch_mask = torch_block_mask(mask_mod, mask_b, None, s, s, device=device)
        pairs = visible_pairs(mask_mod, mask_b, None, s, s, device=device) * (b if mask_b is None else 1) * h
        flops = 4.0 * pairs * d
        # Every function below is timed within this iteration: the closures see this case's values.
        ours = _ours_with_lse(score_mod, block_mask, case == "causal")
        plan = cached_plan(score_mod, mask_mod)
        forward_only = {name: lambda q_, k_, v_, c=c: flex_forward(q_, k_, v_, plan, block_mask, 1.0 / math.sqrt(d),
                                                                   config=c)
                        for name, c in _other_forward_configs(q, block_mask).items()}
        impls = {name: (lambda q_, k_, v_, f=f: f(q_, k_, v_)[0]) for name, f in {**ours, **forward_only}.items()}
        impls[TORCH_FLEX] = lambda q_, k_, v_: compiled_flex(q_, k_, v_, score_mod=score_mod, block_mask=torch_mask)
        on_fa4 = _flash_backend(compiled_flex, score_mod, torch_mask, q, k, v)
        if on_fa4 is not None:
            impls[TORCH_FLEX_FA4] = on_fa4
        if dense is not None:
            mask_tensor = dense(dtype)
            impls[SDPA_MASKED] = lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask_tensor)
        # Check every row of ours on every head, forward and gradients, before timing anything.
        d_out = torch.randn_like(q)
        refs = flex_references(q, k, v, d_out=d_out, score_mod=score_mod, mask_mod=mask_mod)
        errors = {}
        for name, with_lse in ours.items():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out, lse = with_lse(*leaves)
            grads = torch.autograd.grad(out, leaves, d_out)
            errors[name] = check_forward(q, k, v, out, lse, refs=refs, name=f"{case}, {name}", quiet=True)
            errors[name].update(check_backward(q, k, v, d_out, grads, refs=refs, name=f"{case}, {name}", quiet=True))
        for name, with_lse in forward_only.items():
            out, lse = with_lse(q, k, v)
            errors[name] = check_forward(q, k, v, out, lse, refs=refs, name=f"{case}, {name}", quiet=True)
        del refs, out, lse, grads, leaves
        fwd_ms = time_side_by_side({impl: (lambda a=attn: a(q, k, v)) for impl, attn in impls.items()
                                    if impl not in BACKWARD_ONLY})
        bwd_ms = time_side_by_side({impl: backward_timer(attn, q, k, v)[0] for impl, attn in impls.items()
                                    if impl not in forward_only})
        for impl in impls:
            for mode, ms in (("fwd", fwd_ms.get(impl)), ("bwd", bwd_ms.get(impl))):
                if ms is None:
                    continue
                row = dict(sh, case=case, impl=impl, mode=mode, ms=ms, tflops=tflops(flops * (2.5 if mode == "bwd"
                                                                                            else 1.0), ms),
                           visible_pairs=pairs, skipped=block_mask.fraction_skipped(), block=list(block_mask.block),
                           dtype=str(dtype).removeprefix("torch."), note=note, triton=_triton_version())
                if impl in errors:
                    row["errors"] = errors[impl]
                rows.append(row)
            fwd, bwd = (f"{times[impl]:.3f} ms" if impl in times else "not timed" for times in (fwd_ms, bwd_ms))
            print(f"{case:12} {impl:40} fwd {fwd}, bwd {bwd}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows
