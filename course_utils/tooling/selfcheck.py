"""What ``python -m course_utils.<kernel module>`` runs: check the kernel, then (on a GPU) time it.

Like TileLang's examples and llm.c's ``dev/cuda`` kernels, each kernel module runs on its own. The
check compares every head with the float64 reference (``validation``) and shows planted bugs
being caught; on a GPU the kernel is then timed side by side with SDPA's FlashAttention-2 and cuDNN
backends at the usual benchmark shape (B·S = 16k tokens, H·D = 2048, S = 4k, fp16).
"""

import torch

from ..api.attention import flash_attention
from ..checking.validation import (
    backward_bugs,
    backward_without_delta,
    check_backward,
    check_forward,
    forward_bugs,
    references,
    show_bugs_caught,
)
from ..core.device import DEVICE, HAS_GPU
from ..core.labels import OURS, SHORT
from ..measure.bench import attention_flops, tflops, time_side_by_side

__all__ = ["check_and_time_forward", "check_and_time_backward", "report_lowering"]


def _problem(seed=0):
    torch.manual_seed(seed)
    if HAS_GPU:
        batch, heads, seq, dim, dtype = 4, 16, 4096, 128, torch.float16
    else:
        batch, heads, seq, dim, dtype = 2, 2, 40, 32, torch.float32
    return [torch.randn(batch, heads, seq, dim, device=DEVICE, dtype=dtype) for _ in range(3)]


def _time(impls, flops, label):
    ms = time_side_by_side(impls)
    print(f"{label}: " + ", ".join(f"{SHORT[impl]} {tflops(flops, t):.0f} TFLOP/s" for impl, t in ms.items()))


def check_and_time_forward(config=None):
    """Check ``flash_attention``'s forward with ``config`` (None: the default), then time it on a GPU."""
    for causal in (False, True):
        q, k, v = _problem()
        out, lse = flash_attention(q, k, v, causal=causal, config=config, return_lse=True)
        refs = references(q, k, v, causal=causal)
        check_forward(q, k, v, out, lse, causal=causal, refs=refs, name=f"causal={causal}")
        show_bugs_caught(lambda o, l: check_forward(q, k, v, o, l, causal=causal, refs=refs, quiet=True),
                         forward_bugs(out, lse))
        if HAS_GPU:
            from ..measure.benchmarks.common import SDPA_PEERS, sdpa

            impls = {OURS: lambda: flash_attention(q, k, v, causal=causal, config=config)}
            impls.update({name: (lambda b=b: sdpa(q, k, v, causal, b)) for name, b in SDPA_PEERS.items()})
            _time(impls, attention_flops(*q.shape[:3], k.shape[2], q.shape[3], causal=causal),
                  f"forward causal={causal}")


def check_and_time_backward(config=None):
    """Check ``flash_attention``'s backward with ``config`` (None: the default), then time it on a GPU."""
    for causal in (False, True):
        q, k, v = _problem(seed=1)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention(*leaves, causal=causal, backward_config=config, return_lse=True)
        d_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, d_out)
        refs = references(q, k, v, d_out=d_out, causal=causal)
        check_backward(q, k, v, d_out, grads, causal=causal, refs=refs, name=f"causal={causal}")
        without_delta = backward_without_delta(q, k, v, out.detach(), lse.detach(), d_out, causal=causal,
                                               config=config)
        show_bugs_caught(lambda *g: check_backward(q, k, v, d_out, g, causal=causal, refs=refs, quiet=True),
                         backward_bugs(grads, grads_without_delta=without_delta))
        if HAS_GPU:
            from ..measure.benchmarks.common import SDPA_PEERS, backward_timer, sdpa

            attns = {OURS: lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=causal, backward_config=config)}
            attns.update({name: (lambda q_, k_, v_, b=b: sdpa(q_, k_, v_, causal, b))
                          for name, b in SDPA_PEERS.items()})
            impls = {name: backward_timer(attn, q, k, v)[0] for name, attn in attns.items()}
            _time(impls, attention_flops(*q.shape[:3], k.shape[2], q.shape[3], causal=causal, mode="bwd"),
                  f"backward causal={causal}")


def report_lowering(prim_func, arch="sm_90a"):
    """Without the GPU a kernel needs: lower it for ``arch`` and print what ptxas says (registers, spills)."""
    from ..core.source import cuda_source, ptxas_report

    source = cuda_source(prim_func, arch)
    print(f"lowered for {arch}: {len(source.splitlines())} lines of CUDA")
    for line in ptxas_report(source, arch) or ["(nvcc is not installed: no ptxas report)"]:
        print("  ", line)
