"""Eleventh session's A/B call (issues 26 and 27), three questions, each a part (python ... OUT.json [parts]).

P: where the packed forward's gap to the dense kernel is (chapter 09's record batch against the same tokens in
   12 equal sequences of 5376 (no ragged tile) and of 5300 (ragged tiles)), and whether reading the next pair's
   work-list row and sequence bounds ahead (``prefetch_tiles``) closes part of it. O and LSE checked on every head.
   As run in call S1 the kernel had a ``prefetch_tiles`` field (consumers: the next pair's ``Pairs`` row read at
   the top of a pair's first tile, its ``cu_seqlens`` bounds at the top of its second, into registers); it gained
   nothing and was removed, so part P needs it put back to run again (notes/ch09_gpu_notes.md, eleventh session).
F: chapter 07's D=64 forward at S = 1k/2k with the causal mask and 1k without (the cases below cuDNN): the shipped
   tiling against wider key tiles, a third stage and no ping-pong, beside cuDNN. Checked against float64.
B: chapter 08's D=128 backward at 8k and 16k (the cases below 0.95× cuDNN): block_M 64 against 80, beside cuDNN;
   gradients compared with the shipped config's.
C: (after B found 80 query rows 9-13% faster with the causal mask at 8k and 16k, fp16) the same at every length of
   chapter 08's comparison, S = 1k-16k, fp16 and bf16, two blocks each.
D: (80 rows then shipped in the dense causal config) the packed backward with the causal mask on chapter 09's record
   batch, 64 rows (its config) against 80, gradients of every sequence and head checked against float64, beside the
   dense default on the same tokens in equal lengths.
"""
import sys
import time

import torch

sys.path.insert(0, "notes")
from device_ab import blocks, machine, packed_batch, save  # noqa: E402

from course_utils import flash_attention  # noqa: E402
from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS, hopper_forward_config  # noqa: E402
from course_utils.api.inputs import sink_logits  # noqa: E402
from course_utils.api.varlen_api import VARLEN_PERSISTENT_CONFIG as PCONFIG  # noqa: E402
from course_utils.checking.validation import check_forward, varlen_references  # noqa: E402
from course_utils.kernels.flash_varlen import flash_varlen_fwd_persistent_kernel, varlen_pair_list  # noqa: E402
from course_utils.kernels.tiles import compile_kernel  # noqa: E402
from course_utils.measure.bench import attention_flops  # noqa: E402
from course_utils.measure.benchmarks.ch09_varlen_decode import VARLEN_SHAPE, varlen_lengths  # noqa: E402
from course_utils.measure.benchmarks.common import CUDNN, SDPA_PEERS, backward_timer, in_parallel, sdpa  # noqa: E402

out_path = sys.argv[1]
parts = sys.argv[2] if len(sys.argv) > 2 else "PFB"
result = dict(machine=machine(), P=[], F=[], B=[])
t0 = time.time()


def part_packed():
    sh = VARLEN_SHAPE
    heads, dim = sh["heads"], sh["dim"]
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = [(c, pf) for c in (False, True) for pf in (False, True)]

    def build(job):
        causal, pf = job
        func = flash_varlen_fwd_persistent_kernel(heads, dim, causal=causal, dtype="float16", block_M=PCONFIG.block_M,
                                                  block_N=PCONFIG.block_N, num_stages=PCONFIG.num_stages,
                                                  threads=PCONFIG.threads, pingpong=PCONFIG.pingpong, num_ctas=ctas,
                                                  prefetch_tiles=pf)
        return compile_kernel(func, out_idx=[8, 9], target="cuda", dtype="float16")

    kernels = dict(zip(jobs, in_parallel(build, jobs)))
    print(f"P compiled {time.time() - t0:.0f}s", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    dq, dk, dv = (torch.randn(12, heads, 5376, dim, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
    batches = {"mixed": varlen_lengths(sh["tokens"], sh["shortest"], sh["longest"]), "12x5376": [5376] * 12,
               "12x5300": [5300] * 12}
    logits = sink_logits(None, heads, "cuda")
    for name, lengths in batches.items():
        cu, longest, q, k, v = packed_batch(lengths, heads, dim, g)
        for causal in ((False, True) if name == "mixed" else (False,)):
            fns = {}
            refs = varlen_references(q, k, v, cu, cu, causal=causal) if name == "mixed" else None
            for pf in (False, True):
                def call(kernel=kernels[causal, pf], cu=cu, q=q, k=k, v=v, longest=longest):
                    pairs, count = varlen_pair_list(cu, cu, heads, PCONFIG.block_M, longest)
                    return kernel(q, k, v, cu, cu, pairs, count, logits)
                if refs is not None:
                    out, lse = call()
                    check_forward(q, k, v, out, lse, refs=refs, name=f"{name} causal={causal} prefetch={pf}")
                fns["prefetch" if pf else "shipped"] = call
            refs = None
            fns["dense"] = lambda causal=causal: flash_attention(dq, dk, dv, causal=causal)
            work = {n: sum(attention_flops(1, heads, s, s, dim, causal=causal) for s in lengths) for n in fns}
            work["dense"] = attention_flops(12, heads, 5376, 5376, dim, causal=causal)
            result["P"] += blocks(fns, label=f"{name} causal={causal}", base="dense", work=work)
            save(out_path, **result)


def part_forward():
    cases = [(1024, True), (2048, True), (1024, False)]
    variants = {"wide keys 128x192": dict(block_N=192), "3 stages": dict(num_stages=3),
                "no ping-pong": dict(pingpong=False)}
    jobs = []
    for seq, causal in cases:
        shipped = hopper_forward_config(64, causal, seq_len=seq)
        jobs += [(seq, causal, "shipped", shipped)]
        jobs += [(seq, causal, n, shipped._replace(**kw)) for n, kw in variants.items()]
    inputs = {}
    for seq in {seq for seq, _ in cases}:
        g = torch.Generator(device="cuda").manual_seed(seq)
        inputs[seq] = [torch.randn(16384 // seq, 32, seq, 64, device="cuda", dtype=torch.float16, generator=g)
                       for _ in range(3)]

    def build(job):
        seq, causal, name, config = job
        q, k, v = inputs[seq]
        try:
            flash_attention(q, k, v, causal=causal, config=config)  # compiles this config for this shape
            return None
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[-1][:120]}"

    errors = in_parallel(build, jobs)
    print(f"F compiled {time.time() - t0:.0f}s", errors, flush=True)
    for seq, causal in cases:
        q, k, v = inputs[seq]
        fns = {}
        for (s, c, name, config), err in zip(jobs, errors):
            if (s, c) != (seq, causal) or err:
                continue
            out, lse = flash_attention(q, k, v, causal=causal, config=config, return_lse=True)
            check_forward(q[:2], k[:2], v[:2], out[:2], lse[:2], causal=causal,
                          name=f"D64 {seq} causal={causal} {name}")
            fns[name] = lambda config=config, causal=causal: flash_attention(q, k, v, causal=causal, config=config)
        fns["cuDNN"] = lambda causal=causal: sdpa(q, k, v, causal, SDPA_PEERS[CUDNN])
        result["F"] += blocks(fns, label=f"D64 S={seq} causal={causal}", base="shipped")
        save(out_path, **result)


def part_backward(cases=((8192, False, "float16"), (8192, True, "float16"), (16384, True, "float16")), n_blocks=3):
    jobs, inputs = [], {}
    for seq, causal, dtype in cases:
        shipped = HOPPER_BACKWARD_CONFIGS[128, causal]
        other = shipped._replace(block_M=64 if shipped.block_M == 80 else 80)
        jobs += [(seq, causal, dtype, "shipped", shipped), (seq, causal, dtype, f"block_M={other.block_M}", other)]
        g = torch.Generator(device="cuda").manual_seed(seq)
        inputs[seq, dtype] = [torch.randn(16384 // seq, 16, seq, 128, device="cuda", dtype=getattr(torch, dtype),
                                          generator=g) for _ in range(3)]

    def prepare(job):  # compiles in threads, then the gradients once
        seq, causal, dtype, name, config = job
        fn, _ = backward_timer(lambda a, b, c_: flash_attention(a, b, c_, causal=causal, backward_config=config),
                               *inputs[seq, dtype])
        return fn, fn()

    prepared = dict(zip([j[:4] for j in jobs], in_parallel(prepare, jobs)))
    print(f"B compiled {time.time() - t0:.0f}s", flush=True)
    for seq, causal, dtype in cases:
        fns = {name: prepared[s, c, d, name][0] for s, c, d, name in prepared if (s, c, d) == (seq, causal, dtype)}
        grads = {name: prepared[s, c, d, name][1] for s, c, d, name in prepared if (s, c, d) == (seq, causal, dtype)}
        for name, gr in grads.items():
            diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                       for a, b in zip(gr, grads["shipped"]))
            print(f"B {dtype} S={seq} causal={causal} {name}: max |Δgrad| ÷ max |grad| vs shipped {diff:.2e}",
                  flush=True)
            assert diff < 2e-2, diff
        fns["cuDNN"], _ = backward_timer(lambda a, b, c_: sdpa(a, b, c_, causal, SDPA_PEERS[CUDNN]),
                                         *inputs[seq, dtype])
        result["B"] += blocks(fns, label=f"D128 {dtype} S={seq} causal={causal}", base="shipped", n_blocks=n_blocks)
        save(out_path, **result)


def part_packed_backward():
    from course_utils.api.attention import backward_kernels
    from course_utils.api.varlen_api import VARLEN_HOPPER_BACKWARD_CONFIGS, flash_attention_varlen, varlen_kernels
    from course_utils.checking.validation import check_backward
    from course_utils.measure.benchmarks.ch09_varlen_decode import _equal_lengths

    sh = VARLEN_SHAPE
    heads, dim = sh["heads"], sh["dim"]
    lengths = varlen_lengths(sh["tokens"], sh["shortest"], sh["longest"])
    g = torch.Generator(device="cuda").manual_seed(0)
    cu, longest, q, k, v = packed_batch(lengths, heads, dim, g)
    dense_batch, dense_seq = _equal_lengths(lengths)
    dq, dk, dv = (torch.randn(dense_batch, heads, dense_seq, dim, device="cuda", dtype=torch.float16, generator=g)
                  for _ in range(3))
    config = VARLEN_HOPPER_BACKWARD_CONFIGS[dim, True]  # 64 rows when call S3 ran, 80 since
    variants = {"block_M=64 (shipped)": config._replace(block_M=64), "block_M=80": config._replace(block_M=80)}
    in_parallel(lambda c: varlen_kernels(q, k, causal=True, backward_config=c), list(variants.values()))
    backward_kernels(dq, dk, causal=True)
    print(f"D compiled {time.time() - t0:.0f}s", flush=True)
    fns, refs = {}, None
    for name, config in variants.items():
        def attn(q_, k_, v_, c=config):
            return flash_attention_varlen(q_, k_, v_, cu, cu, longest, longest, causal=True, backward_config=c)
        grad_fn, (_, _, _, d_out) = backward_timer(attn, q, k, v)
        refs = refs or varlen_references(q, k, v, cu, cu, d_out=d_out, causal=True)
        check_backward(q, k, v, d_out, grad_fn(), refs=refs, quiet=True, name=name)
        print(f"D {name}: gradients checked on every sequence and head", flush=True)
        fns[name] = grad_fn
    del refs
    fns["dense"] = backward_timer(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=True), dq, dk, dv)[0]
    work = {n: sum(attention_flops(1, heads, s, s, dim, causal=True) for s in lengths) for n in fns}
    work["dense"] = attention_flops(dense_batch, heads, dense_seq, dense_seq, dim, causal=True)
    result["D"] = blocks(fns, label="packed backward causal", base="dense", work=work)
    save(out_path, **result)


def part_causal_lengths():
    part_backward([(s, True, d) for d in ("float16", "bfloat16") for s in (1024, 2048, 4096, 8192, 16384)], n_blocks=2)


for key, part in (("P", part_packed), ("F", part_forward), ("B", part_backward), ("C", part_causal_lengths),
                  ("D", part_packed_backward)):
    if key in parts:
        part()
        print(f"part {key} done {time.time() - t0:.0f}s", flush=True)
