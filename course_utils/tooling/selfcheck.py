"""What ``python -m course_utils.check <kernel>`` runs: check the kernel, then (on a GPU) time it.

Like TileLang's examples and llm.c's ``dev/cuda`` kernels, each kernel can be run on its own, through
one runner (``course_utils.check``, where the kernels are registered). The
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

__all__ = ["check_and_time_forward", "check_and_time_backward", "report_lowering", "check_hopper_forward",
           "check_persistent_forward", "check_varlen", "check_decode", "check_ring", "check_flex", "check_fp8_forward"]


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


def check_hopper_forward():
    """Chapter 07's rotated loop: on sm_90 the default forward checked and timed; elsewhere lowered for
    sm_90a, with ptxas's report."""
    from ..api.attention import is_hopper
    from ..kernels.flash_fwd_hopper import flash_fwd_hopper_kernel

    if is_hopper():
        check_and_time_forward()  # flash_attention's default on sm_90 is this kernel
    else:
        print("No sm_90 GPU here: wgmma exists only on Hopper. The kernel at D=128, S=4k, lowered:")
        report_lowering(flash_fwd_hopper_kernel(4, 16, 4096, 4096, 128, causal=True))


def _check_and_time_configs(configs, dim, seq):
    """``flash_attention`` with each of ``configs`` ({name: ForwardConfig}) on chapter 07's fp16 shape with ``seq``
    queries and head dim ``dim``, causal or not: checked against the float64 reference, then timed beside SDPA's
    peers."""
    from ..api.attention import flash_attention
    from ..checking.validation import check_forward
    from ..measure.bench import attention_flops, tflops, time_side_by_side
    from ..measure.benchmarks.common import SDPA_PEERS, comparison_shapes, random_inputs, sdpa

    q, k, v = random_inputs(comparison_shapes(seq_lens=(seq,), dim=dim)[0], torch.float16)
    for causal in (False, True):
        impls = {}
        for name, config in configs.items():
            out, lse = flash_attention(q, k, v, causal=causal, config=config, return_lse=True)
            check_forward(q, k, v, out, lse, causal=causal, name=f"{name} D={dim} S={seq} causal={causal}")
            impls[name] = lambda config=config, causal=causal: flash_attention(q, k, v, causal=causal, config=config)
        impls.update({n: (lambda b=b, causal=causal: sdpa(q, k, v, causal, b)) for n, b in SDPA_PEERS.items()})
        flops = attention_flops(q.shape[0], q.shape[1], seq, seq, dim, causal=causal)
        for name, ms in time_side_by_side(impls).items():
            print(f"D={dim} S={seq} causal={causal}: {name:32} {tflops(flops, ms):6.0f} TFLOP/s")


def check_persistent_forward():
    """Chapter 07's persistent forward (sm_90 only): checked at S = 4k, D = 128 and 64, causal or not,
    and timed against the peers."""
    from ..api.attention import ForwardConfig

    for dim in (128, 64):
        _check_and_time_configs({"persistent": ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent")},
                                dim, 4096)


def check_one_warpgroup_forward():
    """Chapter 07's one-warpgroup forward (sm_90 only): checked at D = 64, S = 1k and 4k, causal or not, and timed
    against the persistent kernel's three warpgroups and the peers."""
    from ..api.attention import HOPPER_FORWARD_CONFIGS, ONE_WARPGROUP_FORWARD_CONFIG

    configs = {"one warpgroup": ONE_WARPGROUP_FORWARD_CONFIG, "three warpgroups": HOPPER_FORWARD_CONFIGS[64, False]}
    for seq in (1024, 4096):
        _check_and_time_configs(configs, 64, seq)


def check_decode():
    """``python -m course_utils.check flash_decode``: contiguous and paged decoding against the float64 reference."""
    from ..api.decode_api import flash_decode
    from ..core.device import DEVICE, HAS_GPU
    from ..core.reference import attention_reference

    torch.manual_seed(0)
    dtype = torch.bfloat16 if HAS_GPU else torch.float32
    batch, seq_new, heads, heads_kv, dim = (4, 1, 64, 8, 64) if HAS_GPU else (3, 2, 4, 2, 16)
    seq_max, page_size = (4096, 256) if HAS_GPU else (48, 16)
    q = torch.randn(batch, seq_new, heads, dim, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(batch, seq_max, heads_kv, dim, device=DEVICE, dtype=dtype) for _ in range(2))
    lengths = torch.randint(seq_new, seq_max + 1, (batch,), device=DEVICE, dtype=torch.int32)
    sinks = torch.randn(heads, device=DEVICE)
    pages = seq_max // page_size
    table = torch.randperm(batch * pages, device=DEVICE).view(batch, pages).to(torch.int32)
    k_pages, v_pages = (torch.empty(batch * pages, page_size, heads_kv, dim, device=DEVICE, dtype=dtype)
                        for _ in range(2))
    k_pages[table.long()] = k.view(batch, pages, page_size, heads_kv, dim)
    v_pages[table.long()] = v.view(batch, pages, page_size, heads_kv, dim)
    for name, caches, extra in (("contiguous", (k, v), {}), ("paged", (k_pages, v_pages), dict(block_table=table))):
        out = flash_decode(q, *caches, lengths, causal=True, sinks=sinks, **extra)
        worst = 0.0
        for b in range(batch):
            n = int(lengths[b])
            ref = attention_reference(q[b:b + 1].transpose(1, 2), k[b:b + 1, :n].transpose(1, 2),
                                      v[b:b + 1, :n].transpose(1, 2), causal=True, sinks=sinks)
            worst = max(worst, float((out[b:b + 1].transpose(1, 2).double() - ref.double()).abs().max()))
        print(f"flash_decode, {name} cache: max abs error vs float64 {worst:.2e}")
        assert worst < (2e-2 if HAS_GPU else 1e-5), name
    if HAS_GPU:  # a quick look at the speed; chapter 09's records are the measurements
        from ..measure.bench import time_side_by_side

        full = torch.full_like(lengths, seq_max)
        ms = time_side_by_side({"ours": lambda: flash_decode(q, k, v, full, sinks=sinks, check_indices=False),
                                "torch.sum": lambda: torch.sum(k) + torch.sum(v)})
        nbytes = 2 * k.numel() * k.element_size()
        print(f"B={batch}, context {seq_max}: ours {nbytes / ms['ours'] / 1e6:.0f} GB/s, "
              f"torch.sum over the same bytes {nbytes / ms['torch.sum'] / 1e6:.0f} GB/s")


def check_varlen():
    """``python -m course_utils.check flash_varlen``: a packed batch against the float64 reference, per sequence."""
    from ..api.varlen_api import flash_attention_varlen
    from ..core.device import DEVICE, HAS_GPU
    from ..core.reference import attention_reference

    torch.manual_seed(0)
    dtype = torch.bfloat16 if HAS_GPU else torch.float32
    heads, heads_kv, dim = (16, 4, 128) if HAS_GPU else (4, 2, 16)
    lengths = [1000, 1, 4096, 0, 129] if HAS_GPU else [20, 1, 16, 0, 17]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    total = int(cu[-1])
    q = torch.randn(total, heads, dim, device=DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(total, heads_kv, dim, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(2))
    out = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    worst = {}
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        leaves = [t[rows].detach().double().transpose(0, 1)[None].requires_grad_() for t in (q, k, v)]
        ref = attention_reference(*leaves, causal=True)
        ref_grads = torch.autograd.grad(ref, leaves, d_out[rows].double().transpose(0, 1)[None])
        for name, mine, theirs in zip(("O", "dQ", "dK", "dV"), (out,) + grads, (ref,) + ref_grads):
            err = float((mine[rows].detach().double() - theirs[0].detach().transpose(0, 1)).abs().max())
            worst[name] = max(worst.get(name, 0.0), err)
    print("flash_attention_varlen, causal, lengths", lengths, "max abs error vs float64:",
          ", ".join(f"{n} {e:.2e}" for n, e in worst.items()))
    assert all(e < (5e-2 if HAS_GPU else 1e-4) for e in worst.values()), worst
    if HAS_GPU:  # a quick look at the speed; chapter 09's records are the measurements
        from ..measure.bench import attention_flops, tflops, time_cuda

        ms = time_cuda(lambda: flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True))
        flops = sum(attention_flops(1, heads, n, n, dim, causal=True) for n in lengths)
        print(f"forward: {ms:.3f} ms, {tflops(flops, ms):.0f} TFLOP/s")


def check_ring(world=2):
    """``python -m course_utils.check ring``: ring attention on ``world`` CPU processes (gloo), contiguous
    and zigzag, causal or not, GQA; O and every gradient vs the float64 reference; the bad inputs."""
    from ..api.ring import LAYOUTS
    from ..api.ring_harness import BAD_INPUTS, RingCase, run_ring_attention
    from ..checking.checks import check_true
    from ..checking.validation import check_backward, check_forward, references

    torch.manual_seed(0)
    batch, heads, heads_kv, seq_local, dim = 2, 4, 2, 32, 16
    seq = world * seq_local
    cases = []
    for layout in LAYOUTS:
        for causal in (False, True):
            q, d_out = (torch.randn(batch, heads, seq, dim) for _ in range(2))
            k, v = (torch.randn(batch, heads_kv, seq, dim) for _ in range(2))
            cases.append(RingCase(q, k, v, d_out, causal, layout))
    results, errors = run_ring_attention(cases, world, bad_inputs=True)
    for case, (out, grads) in zip(cases, results):
        name = f"{world} ranks, {case.layout}, {'causal' if case.causal else 'non-causal'}"
        refs = references(case.q, case.k, case.v, d_out=case.d_out, causal=case.causal)
        check_forward(case.q, case.k, case.v, out, causal=case.causal, refs=refs, name=name)
        check_backward(case.q, case.k, case.v, case.d_out, grads, causal=case.causal, refs=refs, name=name)
    for name in BAD_INPUTS:
        answers = [rank_errors[name] for rank_errors in errors]
        refused = all(answer.startswith("ValueError") for answer in answers)
        check_true(refused, f"bad input, {name}: {min(answers, key=len)[:110]}" if refused
                   else f"bad input {name!r} did not raise a ValueError on every rank: {answers}")


def check_flex():
    """``python -m course_utils.check flex``: soft-capping (cap 50) with a causal mask, forward and backward,
    checked on every head against float64; on a GPU also timed next to ``flash_attention(causal=True)``."""
    from ..api.flex import causal_mask, create_block_mask, flex_attention, soft_cap
    from ..checking.flex_reference import flex_references
    from ..measure.bench import time_cuda

    batch, heads, seq, dim = (1, 16, 4096, 128) if HAS_GPU else (1, 2, 48, 32)
    dtype = torch.bfloat16 if HAS_GPU else torch.float32
    q, k, v, d_out = (torch.randn(batch, heads, seq, dim, device=DEVICE, dtype=dtype) for _ in range(4))
    mods = dict(score_mod=soft_cap(50.0), block_mask=create_block_mask(causal_mask, None, None, seq, seq, DEVICE))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, return_lse=True, **mods)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = flex_references(q, k, v, d_out=d_out, score_mod=mods["score_mod"], mask_mod=causal_mask)
    check_forward(q, k, v, out, lse, refs=refs, name="soft-cap 50, causal")
    check_backward(q, k, v, d_out, grads, refs=refs, name="soft-cap 50, causal")
    if HAS_GPU:
        flex_ms = time_cuda(lambda: flex_attention(q, k, v, **mods))
        flash_ms = time_cuda(lambda: flash_attention(q, k, v, causal=True))
        print(f"forward: flex (soft-cap, causal) {flex_ms:.3f} ms, flash_attention(causal=True) {flash_ms:.3f} ms")



def check_fp8_forward():
    """Chapter 12's FP8 forward: on the CPU (on any machine) against the float64 emulation of the same FP8 roundings
    and within the FP8 bound of exact attention, with planted bugs caught; then its sm_90a variant lowered, with
    ptxas's report (on a GPU the correctness gate runs it)."""
    from ..api.fp8 import emulate_fp8_forward, flash_attention_fp8, fp8_error_bound, quantise_inputs, within_ties
    from ..checking.checks import check_close, check_true, expect_failure
    from ..core.reference import attention_reference
    from ..kernels.flash_fwd_fp8 import flash_fwd_fp8_kernel
    from ..kernels.tiles import Tiling

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 32, generator=g)
    k, v = (torch.randn(2, 2, 56, 32, generator=g) for _ in range(2))
    for hadamard in (False, True):
        out = flash_attention_fp8(q, k, v, causal=True, hadamard=hadamard)
        (q8, k8, v8), descales = quantise_inputs(q, k, v, hadamard)
        emulated, _, slack, _ = emulate_fp8_forward(q8, k8, v8, descales, causal=True, return_slack=True)
        check_close(out, within_ties(out, emulated, slack),
                    f"FP8 forward, GQA 4/2, causal, hadamard={hadamard}: O against the FP8 emulation", atol=1e-4,
                    rtol=1e-3)
        error = (emulated - attention_reference(q.double(), k.double(), v.double(), causal=True)).abs().amax(-1)
        bound = fp8_error_bound(q, k, v, causal=True, hadamard=hadamard)
        check_true(bool((error <= bound).all()),
                   f"  within the FP8 bound of exact attention (error {float(error.max()):.3g})")
    for bug in ("no descale", "P not quantised", "K descale of the query block"):
        wrong, _, slack, _ = emulate_fp8_forward(q8, k8, v8, descales, causal=True, bugs=(bug,), return_slack=True)
        expect_failure(bug, lambda: check_close(out, within_ties(out, wrong, slack), bug, atol=1e-4, rtol=1e-3,
                                                quiet=True))
    print("The sm_90a variant (FP8 wgmma) at D=128, S=4k, lowered:")
    report_lowering(flash_fwd_fp8_kernel(1, 16, 4096, 4096, 128, causal=True, target="cuda",
                                         tiling=Tiling(128, 128, 2, 256)))
