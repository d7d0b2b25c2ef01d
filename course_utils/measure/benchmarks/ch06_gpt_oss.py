"""Chapter 06: gpt-oss attention (GQA 64/8, sinks, full-causal and 128-token window layers)."""

import itertools

import torch

from ...api.attention import default_forward_config, flash_attention
from ...checking.validation import check_backward, check_forward, references
from ...core.labels import FA4, NAIVE, OURS
from ...core.reference import attention_reference
from ..bench import attention_flops, tflops, time_cuda, time_side_by_side
from .common import SDPA_PEERS, backward_timer, flash_attention_4, sdpa

__all__ = ["GPT_OSS_SHAPE", "gpt_oss_inputs", "gpt_oss_vs_peers", "gqa_backward_strategies"]

GPT_OSS_SHAPE = dict(batch=1, heads=64, heads_kv=8, seq=4096, dim=64, window=128)


def gpt_oss_inputs(shape, dtype=torch.bfloat16, seed=0):
    """Q [B, 64, S, D], K and V [B, 8, S, D] and 64 sink logits, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, h, hkv, s, d = (shape[x] for x in ("batch", "heads", "heads_kv", "seq", "dim"))
    q = torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    sinks = torch.randn(h, device="cuda", generator=g)
    return q, k, v, sinks


def gpt_oss_vs_peers(shape=None, dims=(64, 128)):
    """Forward and backward of gpt-oss attention: ours (checked on every head, O, LSE and every
    gradient including dsinks), the naive PyTorch reference with sinks (float32 math), and SDPA's
    FlashAttention-2 and cuDNN backends *without* sinks or windows on K/V expanded to 64 heads: an
    upper bound of what a sink-free kernel does on the causal layers. FlashAttention-4, where it is
    installed, runs the same layer as ours (GQA, sinks, window); its rows store how far its output is from
    ours (``max_diff_vs_ours``), which shows that both computed the same attention."""
    rows, fa4 = [], flash_attention_4()
    base = shape or GPT_OSS_SHAPE
    for dim, window in itertools.product(dims, (None, base["window"])):
        sh = dict(base, dim=dim)
        q, k, v, sinks = gpt_oss_inputs(sh)
        b, h, s = sh["batch"], sh["heads"], sh["seq"]
        variant = dict(causal=True, window_size=window, sinks=sinks)
        flops = attention_flops(b, h, s, s, dim, causal=True, window_size=window)
        impls = {
            OURS: lambda q_, k_, v_: flash_attention(q_, k_, v_, **variant),
            NAIVE: lambda q_, k_, v_: attention_reference(q_, k_, v_, **variant, compute_dtype=torch.float32),
        }
        if window is None:
            group = h // sh["heads_kv"]
            for name, backend in SDPA_PEERS.items():
                impls[name + ", no sinks"] = lambda q_, k_, v_, b_=backend: sdpa(
                    q_, k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1), True, b_)
        out, lse = flash_attention(q, k, v, return_lse=True, **variant)
        errors = check_forward(q, k, v, out, lse, quiet=True, **variant)
        fa4_diff = None
        if fa4 is not None:
            impls[FA4] = lambda q_, k_, v_: fa4(q_, k_, v_, True, window=window, sinks=sinks)
            fa4_diff = (impls[FA4](q, k, v).float() - out.float()).abs().max().item()
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        d_out = torch.randn_like(q)
        grads = torch.autograd.grad(flash_attention(*leaves[:3], causal=True, window_size=window, sinks=leaves[3]),
                                    leaves, d_out)
        errors.update(check_backward(q, k, v, d_out, grads, quiet=True, **variant))
        fwd_ms = time_side_by_side({impl: (lambda a=attn: a(q, k, v)) for impl, attn in impls.items()})
        bwd_ms = time_side_by_side({impl: backward_timer(attn, q, k, v)[0] for impl, attn in impls.items()})
        for impl in impls:
            for mode, ms in (("fwd", fwd_ms[impl]), ("bwd", bwd_ms[impl])):
                rows.append(dict(sh, impl=impl, mode=mode, window=window, dtype=str(q.dtype).split(".")[1], ms=ms,
                                 tflops=tflops(flops * (2.5 if mode == "bwd" else 1.0), ms)))
                if impl == FA4:
                    rows[-1].update(max_diff_vs_ours=fa4_diff)
                if impl == OURS:
                    config = default_forward_config("cuda", dim, True, seq_len=s, window=window is not None)
                    rows[-1].update(errors=errors, config=config._asdict())
            print(f"gpt-oss D={dim} window={window} {impl}: fwd {rows[-2]['tflops']:.0f}, bwd {rows[-1]['tflops']:.0f}")
    return rows


def gqa_backward_strategies(shape=None):
    """dK/dV for GQA: atomic adds into the shared K/V head vs a per-query-head pass then a sum."""
    sh = dict(shape or GPT_OSS_SHAPE, window=None)  # the full-causal layers
    q, k, v, sinks = gpt_oss_inputs(sh)
    group = sh["heads"] // sh["heads_kv"]
    b, h, s, d = sh["batch"], sh["heads"], sh["seq"], sh["dim"]

    # region: split then sum
    def split_then_sum(q_, k_, v_):
        k_rep, v_rep = k_.repeat_interleave(group, 1), v_.repeat_interleave(group, 1)
        return flash_attention(q_, k_rep, v_rep, causal=True, sinks=sinks)  # autograd sums the repeats
    # endregion

    atomic = lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=True, sinks=sinks)  # noqa: E731
    rows, grads, refs = [], {}, None
    for name, attn in (("atomic adds", atomic), ("split then sum", split_then_sum)):
        fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
        grads[name] = fn()
        refs = refs or references(q, k, v, d_out=d_out, causal=True, sinks=sinks)
        # Sinks are not a leaf here: dQ, dK and dV are checked.
        errors = check_backward(q, k, v, d_out, grads[name], causal=True, sinks=sinks, refs=refs, quiet=True,
                                name=name)
        ms = time_cuda(fn)
        rows.append(dict(strategy=name, ms=ms, errors=errors, dtype=str(q.dtype).split(".")[1], **sh,
                         tflops=tflops(attention_flops(b, h, s, s, d, causal=True, mode="bwd"), ms)))
        print(f"GQA backward, {name}: {ms:.3f} ms")
    return rows
