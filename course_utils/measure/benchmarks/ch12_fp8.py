"""Chapter 12: the FP8 forward on Hopper, checked against its own FP8 roundings, then timed beside the course's
bf16 forward and the peers, FP8 and bf16, that run on the machine."""

import math

import torch

from ...api.attention import flash_attention
from ...api.fp8 import (
    FP8_GPU_LOOPS,
    _quantise,
    _run_gpu,
    emulate_fp8_forward,
    flash_attention_fp8,
    quantise_inputs,
    within_ties,
)
from ...core.labels import CUDNN, FA4, OURS
from ...core.reference import attention_reference
from ..bench import attention_flops, tflops, time_side_by_side
from .common import SDPA_PEERS, comparison_shapes, flash_attention_4, random_inputs, sdpa

__all__ = ["fp8_vs_peers", "cudnn_fp8_attention", "OURS_FP8", "OURS_FP8_KERNEL", "OURS_FP8_ROTATED",
           "OURS_FP8_PLAIN", "CUDNN_FP8", "FP8_SEQS"]

OURS_FP8 = "TileLang FP8 (ours, flash_attention_fp8)"
OURS_FP8_KERNEL = "TileLang FP8 kernel alone (inputs quantised beforehand)"
OURS_FP8_ROTATED = "TileLang FP8 kernel alone, chapter 07's rotated loop"
OURS_FP8_PLAIN = "TileLang FP8 kernel alone, chapter 03's loop (no overlap)"
CUDNN_FP8 = "cuDNN FP8 (cudnn-frontend sdpa_fp8)"
FP8_SEQS = (4096, 8192, 16384)
_P_SCALE_CUDNN = 256.0  # cuDNN's scale for P before its FP8 cast: the course's P_SCALE, for a like comparison


def cudnn_fp8_attention():
    """cuDNN's FP8 SDPA through ``nvidia-cudnn-frontend`` as ``f(q, k, v, causal) -> O`` (bfloat16), per-tensor
    scales, or (None, why) where it does not run. On Hopper cuDNN writes O in e4m3 too (with ``scale_o``), so its
    output carries one more FP8 rounding than the course's, which writes O in the input dtype."""
    try:
        import cudnn

        handle = cudnn.create_handle()
    except Exception as exc:  # not installed, or no cuDNN library it can load: recorded, never timed
        return None, f"nvidia-cudnn-frontend does not load: {type(exc).__name__}: {str(exc)[:200]}"
    graphs = {}

    def quantise(x):
        descale = (x.float().abs().amax() / 448.0).clamp(min=1e-12).reshape(1, 1, 1, 1)
        return (x.float() / descale).to(torch.float8_e4m3fn), descale

    def build(shape, causal):
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        stride = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
        q, k, v = (graph.tensor(name=n, dim=shape, stride=stride, data_type=e4m3) for n in "qkv")
        scalars = [graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
                   for n in ("dq", "dk", "dv", "ds", "ss", "so")]
        o, _, amax_s, amax_o = graph.sdpa_fp8(q=q, k=k, v=v, descale_q=scalars[0], descale_k=scalars[1],
                                              descale_v=scalars[2], descale_s=scalars[3], scale_s=scalars[4],
                                              scale_o=scalars[5], generate_stats=False,
                                              attn_scale=1.0 / math.sqrt(shape[3]), use_causal_mask=causal)
        o.set_output(True).set_dim(shape).set_stride(stride).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device="cuda")
        return graph, (q, k, v, o, amax_s, amax_o, *scalars), workspace

    def attention(q, k, v, causal, quantised=None):
        shape = tuple(q.shape)
        if (shape, causal) not in graphs:
            graphs[shape, causal] = build(shape, causal)
        graph, (tq, tk, tv, to, tas, tao, tdq, tdk, tdv, tds, tss, tso), workspace = graphs[shape, causal]
        (q8, dq), (k8, dk), (v8, dv) = quantised or (quantise(q), quantise(k), quantise(v))
        scale_o = 1 / dv  # |O| ≤ max |V|: O at V's scale
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
        amax_s, amax_o = (torch.empty(1, 1, 1, 1, device="cuda") for _ in range(2))
        one = torch.ones(1, 1, 1, 1, device="cuda")
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute({tq: q8, tk: k8, tv: v8, to: out, tas: amax_s, tao: amax_o, tdq: dq, tdk: dk, tdv: dv,
                       tds: one / _P_SCALE_CUDNN, tss: one * _P_SCALE_CUDNN, tso: scale_o}, workspace, handle=handle)
        return (out.float() / scale_o).to(q.dtype)

    attention.quantise = quantise
    return attention, None


def _head_error(out, q, k, v, causal):
    """max |O − O_exact| over the first head of the first batch (float64 reference)."""
    exact = attention_reference(q[:1, :1].double(), k[:1, :1].double(), v[:1, :1].double(), causal=causal)
    return float((out[:1, :1].double() - exact).abs().max())


def _check_against_emulation(q, k, v, causal):
    """Every loop of the kernel on the GPU equals the float64 emulation of its own FP8 roundings on the first head
    (what the correctness gate judges, at the record's size): the largest difference beyond what the emulation's
    slack allows, per loop."""
    (q8, k8, v8), descales = quantise_inputs(q[:1, :1], k[:1, :1], v[:1, :1])
    emulated, emulated_lse, slack, lse_slack = emulate_fp8_forward(q8, k8, v8, descales, causal=causal,
                                                                   return_slack=True)
    (q8_all, k8_all, _), all_descales, v_keys_major = _quantise(q, k, v, False, 0)
    gaps = {}
    for loop in FP8_GPU_LOOPS:
        out, lse = _run_gpu(q8_all, k8_all, v_keys_major, all_descales, causal, None, loop, out_dtype=q.dtype)
        judged = within_ties(out[:1, :1], emulated, slack)
        gaps[loop] = float((out[:1, :1].double() - judged).abs().max())
        bound = 1e-4 + (1e-3 + torch.finfo(q.dtype).eps) * float(judged.abs().max())
        judged_lse = within_ties(lse[:1, :1], emulated_lse, lse_slack)
        if not gaps[loop] <= bound or not torch.allclose(lse[:1, :1].double(), judged_lse, atol=1e-5, rtol=1e-5):
            raise AssertionError(f"the FP8 kernel ({loop} loop) differs from the emulation of its roundings by "
                                 f"{gaps[loop]:.3g} (bound {bound:.3g}) at S={q.shape[2]} causal={causal}")
    return gaps


def fp8_vs_peers(seqs=FP8_SEQS, dim=128, causal_options=(False, True), dtype=torch.bfloat16):
    """Per case: ms and TFLOP/s of the FP8 forward through its public API and of its kernel alone, of the course's
    bf16 forward, cuDNN (bf16 and FP8) and FlashAttention-4 (bf16); each output's error on one head against float64.
    FlashAttention-4 4.0.0b36 has no FP8 path for sm_90 (its interface asserts SM100 for FP8 inputs)."""
    cudnn_fp8, cudnn_missing = cudnn_fp8_attention()
    fa4 = flash_attention_4()
    rows, not_run = [], {FA4 + " FP8": "FlashAttention-4's FP8 forward runs on SM100 only"}
    if cudnn_missing:
        not_run[CUDNN_FP8] = cudnn_missing
    for shape in comparison_shapes(seq_lens=seqs, dim=dim):
        for causal in causal_options:
            q, k, v = random_inputs(shape, dtype)
            emulation_gap = _check_against_emulation(q, k, v, causal)
            (q8, k8, _), descales, v_keys_major = _quantise(q, k, v, False, 0)
            impls = {OURS_FP8: lambda: flash_attention_fp8(q, k, v, causal=causal),
                     OURS_FP8_KERNEL: lambda: _run_gpu(q8, k8, v_keys_major, descales, causal, None,
                                                       out_dtype=dtype),
                     OURS_FP8_ROTATED: lambda: _run_gpu(q8, k8, v_keys_major, descales, causal, None, "rotated",
                                                        out_dtype=dtype),
                     OURS_FP8_PLAIN: lambda: _run_gpu(q8, k8, v_keys_major, descales, causal, None, "plain",
                                                      out_dtype=dtype),
                     OURS: lambda: flash_attention(q, k, v, causal=causal),
                     CUDNN: lambda: sdpa(q, k, v, causal, SDPA_PEERS[CUDNN])}
            if fa4 is not None:
                impls[FA4] = lambda: fa4(q, k, v, causal)
            if cudnn_fp8 is not None:
                try:
                    cudnn_fp8(q, k, v, causal)
                    quantised = tuple(cudnn_fp8.quantise(x) for x in (q, k, v))
                    impls[CUDNN_FP8] = lambda: cudnn_fp8(q, k, v, causal, quantised)
                except Exception as exc:  # a peer that fails is recorded with its error, never timed
                    not_run[CUDNN_FP8] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    cudnn_fp8 = None
            kernels_alone = (OURS_FP8_KERNEL, OURS_FP8_ROTATED, OURS_FP8_PLAIN)
            errors = {name: _head_error(fn()[0] if name in kernels_alone else fn(), q, k, v, causal)
                      for name, fn in impls.items()}
            errors["TileLang FP8 (ours), Hadamard-rotated"] = _head_error(
                flash_attention_fp8(q, k, v, causal=causal, hadamard=True), q, k, v, causal)
            flops = attention_flops(shape["batch"], shape["heads"], shape["seq"], shape["seq"], dim, causal=causal)
            case = [dict(impl=impl, causal=causal, ms=ms, tflops=tflops(flops, ms), dtype=str(dtype)[6:],
                         error=errors[impl], **shape) for impl, ms in time_side_by_side(impls).items()]
            next(r for r in case if r["impl"] == OURS_FP8).update(
                emulation_gap=emulation_gap, hadamard_error=errors["TileLang FP8 (ours), Hadamard-rotated"])
            rows += case
            print(f"D={dim} S={shape['seq']} causal={causal}: " + ", ".join(
                f"{r['impl'].split(' (')[0]} {r['tflops']:.0f} (err {r['error']:.1e})" for r in case), flush=True)
    return dict(rows=rows, not_run=not_run)
