"""2026-11-27 (tenth session), device call R2: the Hopper backward's dQ reduce-add with its wait moved, against the
shipped kernel. An experiment on the generated CUDA, not a kernel change: TileLang 0.1.15 lowers
``T.atomic_add(..., use_tma=True)`` to the bulk reduce followed at once by the issuing thread's wait until the copy
engine has read dq_s (``tma_store_wait<0, true>``). That thread's warp stalls there every step; FlashAttention-3
gives the reduce to a warp of its own. Here a CUDA post-processing hook (``tilelang.register_cuda_postproc``)
deletes that wait and puts it before the next step's dSᵀ barrier, which every thread passes before it writes
dq_s again: the copy engine's read then runs under the next step's Sᵀ and dPᵀ products.

Prediction: a gain of a few per cent wherever the kernel is issue-bound (every case), none if the wait was hidden
under the dK product. Three blocks of interleaved rounds per case; gradients compared with the shipped kernel's."""
import itertools
import json
import re
import sys

import tilelang
import torch

from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS, flash_attention
from course_utils.kernels.flash_bwd_hopper import _DS_BARRIER
from course_utils.kernels.versions import flash_bwd_hopper_versions as bv
from course_utils.measure.bench import attention_flops, tflops, time_side_by_side
from course_utils.measure.benchmarks.common import comparison_shapes, in_parallel, random_inputs

OUT = sys.argv[1] if len(sys.argv) > 1 else "/tmp/dq_wait.json"
REDUCE = re.compile(r"(if \(\(\(int\)threadIdx\.x\) == (\d+)\) \{\s*#pragma unroll\s*for \(int (\w+) = 0; \3 < \d+; "
                    r"\+\+\3\) \{\s*tl::tma_store_add\(dQ_acc_desc[^;]*;\s*\}\s*tl::tma_store_arrive\(\);)"
                    r"\s*tl::tma_store_wait<0, true>\(\);")


def defer_dq_wait(code, target=None):
    """Move the dQ reduce's read wait from right after the reduce to just before the next dSᵀ barrier."""
    if "dQ_acc_desc" not in code:
        return code
    found = REDUCE.search(code)
    assert found, "the dQ reduce-add was not found in the generated CUDA"
    thread = found.group(2)
    code = code[:found.start()] + found.group(1) + code[found.end():]
    barrier = f"tl::__sync_thread_partial({_DS_BARRIER}, 256);"
    assert code.count(barrier) == 1, code.count(barrier)
    wait = f"if (((int)threadIdx.x) == {thread}) {{ tl::tma_store_wait<0, true>(); }}\n      "
    code = code.replace(barrier, wait + barrier)
    # after the loop: the last reduce must have read dq_s before the epilogue reuses shared memory
    epilogue = code.index("\n    }\n", code.rindex("stage_in_use[0] =")) + len("\n    }")
    return code[:epilogue + 1] + f"    if (((int)threadIdx.x) == {thread}) {{ tl::tma_store_wait<0, true>(); }}\n" \
        + code[epilogue + 1:]


def version(dim, causal):
    c = HOPPER_BACKWARD_CONFIGS[dim, causal]
    knobs = dict(block_M=c.block_M, dv_under_ds=c.dv_under_ds, policies=c.policies, dkdv_by_tma=c.dkdv_by_tma,
                 longest_first=c.longest_first)
    return bv._backward(30, "shipped", "", knobs={"all": knobs}, kept=False)


def build(case):
    dim, dtype, causal, seq = case
    shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
    return version(dim, causal).build(shape["batch"], shape["heads"], seq, dim, causal=causal, dtype=dtype)


if __name__ == "__main__":
    tilelang.disable_cache()
    cases = list(itertools.product((128, 64), ("float16", "bfloat16"), (False, True), (4096, 16384)))
    cases = [c for c in cases if c[1] == "float16" or c[0] == 128]
    kernels = {}
    for patched in (False, True):  # the hook is global: build every plain kernel first
        if patched:
            tilelang.register_cuda_postproc(defer_dq_wait)
        kernels.update({(case, patched): kernel for case, kernel in zip(cases, in_parallel(build, cases, workers=16))})
        print("built", patched, flush=True)
    rows = []
    for case in cases:
        dim, dtype, causal, seq = case
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        q, k, v = random_inputs(shape, getattr(torch, dtype))
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
        d_out = torch.randn_like(out)
        fns = {r: (lambda kern=kernels[case, r]: kern(q, k, v, out, lse, d_out)) for r in (False, True)}
        base, new = fns[False](), fns[True]()
        diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(new, base))
        ms = {r: [] for r in fns}
        for _ in range(3):
            for r, t in time_side_by_side(fns, rounds=6).items():
                ms[r].append(t)
        flops = attention_flops(shape["batch"], shape["heads"], seq, seq, dim, causal=causal, mode="bwd")
        gains = [ms[False][i] / ms[True][i] - 1 for i in range(3)]
        rows.append(dict(dim=dim, dtype=dtype, seq=seq, causal=causal, ms={str(r): t for r, t in ms.items()},
                         gains=gains, rel_diff=diff))
        med = {r: sorted(t)[1] for r, t in ms.items()}
        print(f"D={dim} {dtype} {'causal' if causal else 'full'} S={seq:>5}: shipped {tflops(flops, med[False]):.0f}"
              f" deferred {tflops(flops, med[True]):.0f} TFLOP/s; gain {' '.join(f'{x:+.1%}' for x in gains)};"
              f" max rel diff {diff:.1e}", flush=True)
        json.dump(rows, open(OUT, "w"))
