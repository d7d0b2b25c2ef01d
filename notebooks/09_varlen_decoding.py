# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 09 · Packed variable-length batches, and decoding with a paged KV cache
#
# **Question.** Two things every FlashAttention user meets and no course explains. *Training*: the
# sequences of a batch have different lengths; padding them to the longest wastes work, so how does
# a kernel attend over a batch packed without padding (FlashAttention's `cu_seqlens`)? *Inference*:
# a model generates one token at a time, and each step attends one new query per sequence over a
# long cache of keys and values; how is that fast, and what changes when the cache is paged, as in
# vLLM?
#
# | section | idea | evidence |
# |---|---|---|
# | 1 | pack the batch; each sequence's tiles start where it starts | picture, FLOPs padding wastes |
# | 2 | a per-sequence prelude: lengths read at run time, then the shared pieces | the kernel's lines |
# | 3 | two ways to hand out blocks: a padded grid, or a work list | picture, work list |
# | 4 | the varlen kernels, checked forward and backward | every sequence vs float64, planted bugs |
# | 5 | packing against our dense kernel and SDPA on the padded batch | H100 record |
# | 6 | decoding is a memory read | roofline |
# | 7 | split-KV: many blocks per sequence, merged with chapter 02's rule | picture, the merge checked |
# | 8 | GQA packing and the paged cache | pictures, the kernel's lines, checks |
# | 9 | how many splits | the rule, H100 sweep |
# | 10 | bandwidth against a plain read and SDPA | H100 record |
#
# *Credit.* Tri Dao, [FlashAttention-2](https://arxiv.org/abs/2307.08691) (2023), whose `varlen`
# interface (`cu_seqlens`, `max_seqlen`) we follow; Tri Dao, Daniel Haziza, Francisco Massa, Grigory
# Sizov, [Flash-Decoding](https://crfm.stanford.edu/2023/10/12/flashdecoding.html) (2023), the split-KV
# decoding scheme; Woosuk Kwon et al., [PagedAttention / vLLM](https://arxiv.org/abs/2309.06180) (2023),
# the paged cache and its block table; FlashAttention's `flash_attn_with_kvcache`, whose layout and
# `num_splits` heuristic shaped ours. TileLang's examples `flash_attention/example_gqa_fwd_varlen.py`
# and `flash_decoding/example_gqa_decode.py` show the same ideas in TileLang; our kernels are built
# from the course's shared pieces instead.

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import math

import matplotlib.pyplot as plt
import torch

from course_utils.pictures import plots, varlen_diagrams
from course_utils.measure.benchmarks import RECORDS
from course_utils.measure.benchmarks.ch09_varlen_decode import (DENSE_EQUAL, PACKED_GRID, PACKED_LIST, PAGED, SUM,
                                                        varlen_lengths)
from course_utils.kernels.flash_decode import ONE_SPLIT_TILES, blocks_per_sm, choose_num_splits, decode_config, \
    flash_decode_kernel, flash_decode_merge_kernel
from course_utils.kernels.flash_pieces import with_lengths, zero_rows_past_end
from course_utils.kernels.flash_varlen import flash_varlen_fwd_kernel, varlen_work_list
from course_utils.core.labels import CUDNN, FA2, OURS
from course_utils.kernels.softmax import merge_attention_states
from course_utils.core.source import show_source
from course_utils.checking.validation import (check_backward, check_forward, check_stored_errors, decode_references,
                                     varlen_references)
from course_utils.api.decode_api import decode_kernels

torch.manual_seed(0)
print("device:", cu.DEVICE, "| tile target:", cu.TILE_TARGET)

# %% [markdown]
# ## 1 · Packing instead of padding
#
# A batch of sequences of lengths 300, 1000, 120, 700 and 450 padded to the longest is a
# [5, 1000] tensor: almost half of it padding, and a kernel that tiles it computes on padding
# (or must be taught to skip it). *Packed*, the same batch is its 2570 tokens one after the
# other, `q` of shape `[total, H, D]`, plus the prefix sums of the lengths, `cu_seqlens =
# [0, 300, 1300, 1420, 2120, 2570]`: sequence `b` is rows `cu_seqlens[b] … cu_seqlens[b+1] − 1`.
# Attention over a packed batch is block-diagonal: each sequence attends to itself only. The
# kernel tiles each sequence on its own, starting where it starts (right): no tile is wasted on
# padding, and no FLOP is spent between sequences.

# %%
lengths = [300, 1000, 120, 700, 450]
cu_seqlens = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
print("lengths", lengths, "→ cu_seqlens", cu_seqlens.tolist())
fig, (ax_padded, ax_packed) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw=dict(width_ratios=[1.25, 1]))
varlen_diagrams.packed_batch(ax_padded, ax_packed, lengths, 128)
fig.tight_layout()

# %% [markdown]
# How much does padding cost on a realistic batch? Take the one this chapter's H100 record
# measures: lengths drawn uniformly from 128 to 8192 tokens until they fill 64k tokens. Causal
# attention's work grows with the square of each length, so padding every sequence to the longest
# multiplies it:

# %%
mix = varlen_lengths(65536, 128, 8192)
packed_flops = sum(cu.attention_flops(1, 16, n, n, 128, causal=True) for n in mix)
padded_flops = cu.attention_flops(len(mix), 16, max(mix), max(mix), 128, causal=True)
print(f"{len(mix)} sequences, {sum(mix)} tokens, longest {max(mix)}")
print(f"causal attention, H=16, D=128: packed {packed_flops:.3e} FLOPs, padded {padded_flops:.3e} "
      f"({padded_flops / packed_flops:.2f}× the work)")

# %% [markdown]
# ## 2 · The per-sequence prelude
#
# Every kernel of the course starts from a `Prelude`: the constants of its problem (heads, lengths,
# scale, masking) from which `key_block_range`, `visible`, `mask_scores` and the epilogue derive
# everything. For packed sequences the lengths are not constants of the kernel: each thread block
# reads them from `cu_seqlens` once it knows which sequence it owns, and `with_lengths` builds a
# prelude with those run-time lengths (TIR expressions instead of ints). After that, the loop is
# chapter 03's, unchanged. (On Hopper GPUs the default is another loop under the same prelude:
# chapter 07's persistent kernel, `flash_varlen_fwd_persistent_kernel`, whose blocks walk a list of
# query-block pairs made on the device, heaviest sequences first; section 5 measures why. Chapter 03's
# loop stays the default on other GPUs; on sm_90 it places one barrier itself, only on a sequence's
# last key tile: `own_barriers`.)

# %%
show_source(with_lengths)
show_source(flash_varlen_fwd_kernel, "per-sequence prelude")

# %% [markdown]
# Tiles do not respect sequence boundaries: the last query tile of a sequence also holds the first
# rows of the next sequence, and its last key tile the next sequence's keys. Three rules keep the
# sequences apart. The mask (`visible`, as in every chapter) hides keys past the sequence's end. The
# epilogue stores only the sequence's own rows. And the value rows past the end are zeroed before
# P·V: their P is 0, but 0 · NaN is NaN, so a NaN in the next sequence would otherwise leak in
# (FlashAttention-3 has had [that bug](https://github.com/Dao-AILab/flash-attention/issues/1745) with
# KV-cache padding):

# %%
show_source(flash_varlen_fwd_kernel, "guarded epilogue")
show_source(zero_rows_past_end)

# %% [markdown]
# ## 3 · Handing out the blocks: a padded grid, or a work list
#
# *Grid*: launch `⌈max_seqlen / block_M⌉ × H × B` blocks, as if the batch were padded; a block whose
# query block lies past its sequence's end finds an empty key range and exits at once (idle blocks
# cost a launch slot and a few instructions, no memory traffic beyond their Q tile). *List*: the host
# writes one entry (sequence, query block) per real block, `varlen_work_list`, and launches exactly
# that many; ordered heaviest first (with causal masking, a sequence's last query blocks see the
# most keys), so the long blocks start early and short ones fill the end. Section 5 measures both.

# %%
# NBVAL_CHECK_OUTPUT
small = torch.tensor([300, 1000, 120, 700, 450])
work = varlen_work_list(small, small, 128, causal=True)
print("work list (sequence, query block), first ten:", work[:10].tolist())
print(f"{len(work)} blocks instead of {len(small) * math.ceil(1000 / 128)} in the padded grid")
fig, (ax_grid, ax_list) = plt.subplots(2, 1, figsize=(12, 4.2), gridspec_kw=dict(height_ratios=[3, 1]))
varlen_diagrams.schedules(ax_grid, ax_list, small.tolist(), 128, work.tolist())
fig.tight_layout()

# %% [markdown]
# ## 4 · Checking `flash_attention_varlen`
#
# The public function follows FlashAttention's `flash_attn_varlen_func`: `q [total_q, H, D]`,
# `k, v [total_k, H_kv, D]`, `cu_seqlens_q/k`, `max_seqlen_q/k`, and the masking options of
# chapter 06 (GQA, causal aligned bottom-right when a sequence's q and k lengths differ, windows,
# sinks). It is differentiable; its backward is chapter 05's kernel with the same prelude (chapter
# 08's on Hopper GPUs). The check
# runs every sequence on its own through the float64 reference (and the low-precision PyTorch
# reference for FlashAttention's criterion on the GPU), for O, the LSE and every gradient. The
# lengths include 1, a tile, a tile + 1 and an empty sequence.
#
# Two bugs this check found on the H100 (`docs/varlen_and_decoding.md`), both invisible on the CPU:
# - the backward reads a block of LSE and Δ values with the copy engine (TMA), which faults
#   (*illegal instruction*) when the block does not start on a 16-byte boundary: a sequence may
#   start at any token. FlashAttention-3's fix, used here: in the backward's copy of LSE and Δ, each
#   sequence starts on a block boundary (`flash_varlen.lse_row_layout`);
# - the packed rotated loop gave its producer warpgroup 32 registers and the consumers 240: with
#   128 + 256 threads that is all 65,536 registers of the SM, and the consumers' request for more
#   (`setmaxnreg`) waited forever. TileLang's default split (24 + 240) runs.
#
# A third, found by the same kind of check with ragged lengths (an H200, 2026-11-26): chapter 03's packed
# loop on sm_90 got O wrong for query blocks that see *no* key block (causal with fewer keys than
# queries; a sequence with queries and no keys). TileLang had put O's staging tile at Q's address and
# waits for Q's load only inside the key loop, so with no iteration the late load overwrote O. The
# persistent kernel runs at least one (masked) key block per tile and waits for Q itself.

# %%
V_DEVICE = cu.DEVICE
V_H, V_HKV, V_D = cu.pick(cpu=(4, 2, 16), gpu=(16, 16, 128))
V_LENGTHS = cu.pick(cpu=[1, 16, 17, 0, 40, 23], gpu=[1, 127, 128, 129, 0, 3000, 8192, 4097])
V_DTYPE = cu.pick(cpu=torch.float32, gpu=torch.float16)
cu_v = torch.tensor([0] + torch.tensor(V_LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device=V_DEVICE)
total = sum(V_LENGTHS)
q = torch.randn(total, V_H, V_D, device=V_DEVICE, dtype=V_DTYPE)
k, v = (torch.randn(total, V_HKV, V_D, device=V_DEVICE, dtype=V_DTYPE) for _ in range(2))
sinks = torch.randn(V_H, device=V_DEVICE)
leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
out, lse = cu.flash_attention_varlen(*leaves[:3], cu_v, cu_v, max(V_LENGTHS), max(V_LENGTHS), causal=True,
                                     sinks=leaves[3], return_lse=True)
d_out = torch.randn_like(out)
grads = torch.autograd.grad(out, leaves, d_out)
refs = varlen_references(q, k, v, cu_v, cu_v, d_out=d_out, causal=True, sinks=sinks)
print(f"packed q {tuple(q.shape)}, k/v {tuple(k.shape)}, lengths {V_LENGTHS}, {V_DTYPE}")
check_forward(q, k, v, out, lse, refs=refs, name="varlen")
check_backward(q, k, v, d_out, grads, refs=refs, name="varlen");

# %% [markdown]
# Would these checks notice a broken kernel? Each planted bug below must fail them: rows shifted by
# one token (an off-by-one in `cu_seqlens`), O from the wrong head, an LSE off by 1%, and the kernel
# itself run with one sequence boundary moved by a row.

# %%
check = lambda o, s: check_forward(q, k, v, o, s, refs=refs, quiet=True)  # noqa: E731
wrong_cu = cu_v.clone()
wrong_cu[2] += 1
moved = cu.flash_attention_varlen(q, k, v, wrong_cu, wrong_cu, max(V_LENGTHS) + 1, max(V_LENGTHS) + 1, causal=True,
                                  sinks=sinks, return_lse=True)
bugs = {"rows shifted by one token": (out.roll(1, dims=0), lse), "O from the wrong head": (out.roll(1, dims=1), lse),
        "LSE off by 1%": (out, lse * 1.01), "a sequence boundary moved by one row": moved}
cu.show_bugs_caught(check, bugs)

# %% [markdown]
# And the sequences really are independent: NaN in every input of sequence 1 (its q, k, v and the
# gradient reaching its output) leaves every other sequence's O and gradients exactly as they were.
# One exception on the GPU: dQ is summed with float32 atomic additions, whose order changes from run
# to run, so there it may differ by a rounding step (never by a NaN, which is what a leak would bring).

# %%
def run_all(q_, k_, v_, d_out_):
    ls = [t.clone().requires_grad_() for t in (q_, k_, v_)]
    o = cu.flash_attention_varlen(*ls, cu_v, cu_v, max(V_LENGTHS), max(V_LENGTHS), causal=True)
    return (o,) + torch.autograd.grad(o, ls, d_out_)


def unchanged(name, dirty, clean):
    if name == "dQ" and dirty.is_cuda:  # atomics: finite, and within one rounding step of the clean run
        step = torch.finfo(dirty.dtype).eps * clean.abs().max()
        return bool(torch.isfinite(dirty).all()) and bool((dirty - clean).abs().max() <= step)
    return torch.equal(dirty, clean)


seq1 = slice(int(cu_v[1]), int(cu_v[2]))
poisoned = [t.clone() for t in (q, k, v, d_out)]
for t in poisoned:
    t[seq1] = float("nan")
others = torch.ones(total, dtype=torch.bool, device=V_DEVICE)
others[seq1] = False
for name, dirty, clean in zip(("O", "dQ", "dK", "dV"), run_all(*poisoned), run_all(q, k, v, d_out)):
    cu.check_true(unchanged(name, dirty[others], clean[others]) and dirty[seq1].isnan().all(),
                  f"{name}: other sequences unchanged, sequence 1 all NaN")

# %% [markdown]
# ## 5 · Measured on an H100: packing against equal lengths and against padding
#
# The record times the 64k-token batch of section 1 (H = 16, D = 128, fp16), forward and backward,
# causal and not, with both schedules, against:
# - **our dense kernel** (`cu.flash_attention`, chapter 07's persistent forward and chapter 08's
#   backward) on the same number of tokens in sequences of *equal* length L, with
#   L = Σ len² / Σ len so that the FLOPs match too: the target is 0.9× its TFLOP/s (the claims
#   below print whether this record meets it). On Hopper the packed forward is chapter 07's
#   persistent kernel whatever the schedule (its work list is made on the device), and the backward
#   chapter 08's. A bound computed on the CPU (the useful fraction of the tiles' FLOPs and the tail on
#   132 SMs; `docs/varlen_and_decoding.md`) says the tiling of this batch costs it only a few percent
#   against the dense batch: the rest of any gap is the loops;
# - **SDPA's FlashAttention-2 and cuDNN** on the batch padded to its longest sequence (causal only:
#   then the padding needs no mask). Their TFLOP/s count the useful FLOPs, those of the packed batch.

# %%
rec_v = cu.measured("ch09_varlen_h100", RECORDS["ch09_varlen_h100"], pending_ok=True)
if rec_v is not None:
    rows_v = rec_v["results"]
    # The peers are not ours to check; the dense kernel is checked by chapter 07's records and the GPU tests.
    check_stored_errors(rows_v, "ch09 varlen record (O, LSE, gradients)",
                        unchecked=tuple({r["impl"] for r in rows_v if "SDPA" in r["impl"]}) + (DENSE_EQUAL,))
    print(f"equal lengths for the dense comparison: {rows_v[0]['dense_batch']} × {rows_v[0]['dense_seq']}")
    SHORT_V = {PACKED_LIST: "list", PACKED_GRID: "grid", DENSE_EQUAL: "dense", f"{FA2}, padded": "FA2 pad",
               f"{CUDNN}, padded": "cuDNN pad"}
    table = [dict(r, impl=SHORT_V[r["impl"]], case=f"{r['mode']} {'causal' if r['causal'] else 'full'}") for r in rows_v]
    print("TFLOP/s: ours packed (list, grid schedules), ours dense on equal lengths, SDPA on the padded batch")
    print(plots.text_table(table, index="impl", columns="case", value="tflops", fmt="{:.0f}", width=12))

# %%
if rec_v is not None:
    def ms_of(impl, mode, causal):
        return next(r["ms"] for r in rows_v if r["impl"] == impl and r["mode"] == mode and r["causal"] == causal)


    def tf_of(impl, mode, causal):
        return next(r["tflops"] for r in rows_v if r["impl"] == impl and r["mode"] == mode and r["causal"] == causal)


    DENSE, LIST, GRID = DENSE_EQUAL, PACKED_LIST, PACKED_GRID
    modes_v = [m for m in ("fwd", "bwd") if any(r["mode"] == m for r in rows_v)]
    for causal in (True, False):
        for mode in modes_v:
            best = min((LIST, GRID), key=lambda i: ms_of(i, mode, causal))
            line = (f"{mode} {'causal' if causal else 'full  '}: packed/dense TFLOP/s = "
                    f"{tf_of(LIST, mode, causal) / tf_of(DENSE, mode, causal):.2f} (list), "
                    f"{tf_of(GRID, mode, causal) / tf_of(DENSE, mode, causal):.2f} (grid); faster schedule: "
                    f"{best.split('(')[-1][:-1]}")
            if causal:
                line += ", padded SDPA takes " + ", ".join(
                    f"{ms_of(p, mode, True) / ms_of(best, mode, True):.1f}× ({p.split(' ')[0]})"
                    for p in (r["impl"] for r in rows_v if r["impl"].endswith("padded") and r["mode"] == mode
                              and r["causal"]))
            print(line)
    for packed, says in ((GRID, "met"), (LIST, "partly met")):
        cu.claim_ratio(f"packed ({packed.split('(')[-1][:-1]}) ÷ dense TFLOP/s, forward and backward",
                       {(m, c): tf_of(packed, m, c) / tf_of(DENSE, m, c) for m in modes_v for c in (True, False)},
                       target=0.9, says=says)
    grid_vs_dense = {(m, c): tf_of(GRID, m, c) / tf_of(DENSE, m, c) for m in modes_v for c in (True, False)}
    cu.claim_ratio("packed (grid) ÷ dense, backward", {c: r for (m, c), r in grid_vs_dense.items() if m == "bwd"},
                   target=0.9, says="met")
    cu.claim_ratio("packed (grid) ÷ dense, forward", {c: r for (m, c), r in grid_vs_dense.items() if m == "fwd"},
                   target=0.9, says="met")
    cu.claim_ratio("the forward's margin: packed (grid) ÷ dense ÷ the 0.9 target",
                   {c: r / 0.9 for (m, c), r in grid_vs_dense.items() if m == "fwd"}, says="near 1", near=0.03)
    cu.claim_ratio("list ÷ grid time, backward", {c: ms_of(LIST, "bwd", c) / ms_of(GRID, "bwd", c)
                                                  for c in (True, False)}, says="near 1")
    cu.claim_ratio("list ÷ grid time, forward", {c: ms_of(LIST, "fwd", c) / ms_of(GRID, "fwd", c)
                                                 for c in (True, False)}, says="above 1")
    cu.claim_ratio("padded SDPA time ÷ our faster schedule's (causal)",
                   {(p, m): ms_of(p, m, True) / min(ms_of(LIST, m, True), ms_of(GRID, m, True))
                    for m in modes_v for p in (f"{FA2}, padded", f"{CUDNN}, padded")}, says="above 1")

# %%
if rec_v is not None:
    cases = [(m, c) for c in (True, False) for m in modes_v]
    impls = list(dict.fromkeys(r["impl"] for r in rows_v))
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        xs = [i + (n - (len(impls) - 1) / 2) * width for i, case in enumerate(cases)
              if any(r["impl"] == impl and (r["mode"], r["causal"]) == case for r in rows_v)]
        ys = [tf_of(impl, *case) for case in cases if any(r["impl"] == impl and (r["mode"], r["causal"]) == case
                                                         for r in rows_v)]
        ax.bar(xs, ys, width, label=impl.replace(OURS, "ours"), color=plots.COLORS[n % len(plots.COLORS)])
    ax.set_xticks(range(len(cases)), [f"{m} {'causal' if c else 'full'}" for m, c in cases])
    r0 = rows_v[0]
    ax.set(ylabel="TFLOP/s (useful FLOPs)", title=f"{sum(r0['lengths'])} tokens in {len(r0['lengths'])} sequences of "
           f"{min(r0['lengths'])}–{max(r0['lengths'])} tokens, H={r0['heads']}, D={r0['dim']}, {r0['dtype']}")
    ax.legend(fontsize=8, ncol=2)
    fig.text(0.01, -0.03, plots.record_caption(rec_v), fontsize=7)
    plots.save(fig, "ch09_varlen");

# %% [markdown]
# Reading the record (the claims above check each judgement): with the default schedule, `"grid"`,
# the packed batch meets the 0.9× target in all four cases. The forward meets it
# by a narrow margin (the claim above): its kernel is the one of an earlier record in which one mask
# missed the target by about as little, and which mask missed changed from record to record, as the
# dense kernel's own speed moves by about as much (`docs/varlen_and_decoding.md`). The packed forward
# stores O as the dense kernel does, by TMA, on every tile that is all one sequence's. The packed
# backward runs chapter 08's step with the dense kernel's choices at D = 128: dV issued under dSᵀ,
# and dK and dV written by TMA where a key tile
# is all one sequence's (a sequence's last, ragged tile row by row); measured against the plain step
# they lifted it from below the target to above it (`docs/varlen_and_decoding.md`). At every head dim it
# waits for dQ's reduce-add where the dense kernel does (chapter 08's version 22), so that packed and
# dense run the same step, and with the causal mask at D = 128 it takes 80 query rows per step, as the
# dense kernel does since chapter 08's version 23: with 64 rows the packed causal backward fell below
# the target once the dense kernel took 80 (`docs/varlen_and_decoding.md`). The dense kernel's longest-first
# launch order is not used here: launched as the dense kernel launches it (per sequence) it gained
# too little to tell from noise, and with key block 0 of every sequence and head first no two running
# blocks shared their queries, and the causal backward took far longer. The `"list"` schedule is slower in the forward although the
# persistent forward ignores the schedule: the list is made on the host from `cu_seqlens`, a read
# back to the host (and a wait for the GPU) in every call, which the grid never does. Against the
# padded batch, SDPA pays for the padding's FLOPs and is far behind either schedule.
#
# ## 6 · Decoding is a memory read
#
# One decoding step brings one new query token per sequence (S_new = 1; a few with speculative
# decoding) and attends over the sequence's whole cache of L keys and values. Per sequence and K/V
# head, the work is 4 · group · S_new · L · D FLOPs (group = H / H_kv query heads share the K/V head)
# and the bytes are the cache, 2 · L · D elements. Their ratio, the *arithmetic intensity*, does not
# depend on L:
#
# $$\frac{\text{FLOPs}}{\text{bytes}} = \frac{4 \cdot \text{group} \cdot S_\text{new} \cdot L D}{2 \cdot 2 \cdot L D}
#   = \text{group} \cdot S_\text{new} \quad \text{(2-byte elements)}.$$
#
# For gpt-oss (64 query heads, 8 K/V heads) that is 8 FLOP per byte. The H100 reaches its 989 TFLOP/s
# only above about 300 FLOP/byte (989 TFLOP/s ÷ 3.35 TB/s): decoding sits far left on the roofline,
# where time = bytes ÷ bandwidth. A training forward at S = 4096 sits far right.

# %%
# NBVAL_CHECK_OUTPUT
PEAK_TFLOPS, HBM_TBS = 989, 3.35  # H100 SXM datasheet: dense fp16/bf16 matmul, HBM3 bandwidth


def intensity(heads, heads_kv, seq_new, seq_k, dim, seq_q=None, dtype_bytes=2):
    """FLOP per byte of K/V read, for attention of seq_new queries per sequence over seq_k keys."""
    flops = 4 * heads * seq_new * seq_k * dim
    return flops / (2 * heads_kv * seq_k * dim * dtype_bytes)


decode_i = intensity(64, 8, 1, 32768, 64)
prefill_i = cu.attention_flops(1, 64, 4096, 4096, 64, causal=True) / ((2 * 64 + 2 * 8) * 4096 * 64 * 2)
print(f"decode, gpt-oss (64/8 heads), 1 new token: {decode_i:.0f} FLOP/byte; ridge {PEAK_TFLOPS / HBM_TBS:.0f}")
print(f"decode, multi-head attention (group 1): {intensity(64, 64, 1, 32768, 64):.0f} FLOP/byte")
print(f"training forward, S=4096, causal: about {prefill_i:.0f} FLOP/byte of Q, K, V and O")

# %%
rec_d = cu.measured("ch09_decode_h100", RECORDS["ch09_decode_h100"], pending_ok=True)
if rec_d is not None:
    rows_d = rec_d["results"]
    ours_d = [r for r in rows_d if r["impl"] == OURS and r["dim"] == 64 and r["batch"] == 64]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plots.roofline(ax, peak_tflops=PEAK_TFLOPS, bandwidth_tbs=HBM_TBS, xlim=(1, 3e3),
                   title="Decoding on the roofline (gpt-oss shape, D=64, B=64)")
    plots.roofline_series(ax, OURS, [r["heads"] / r["heads_kv"] for r in ours_d],
                          [r["tflops"] for r in ours_d], [plots.seq_label(r["context"]) for r in ours_d])
    ax.axvline(prefill_i, color="gray", linestyle="--", lw=1)
    ax.text(prefill_i * 1.1, 2, "training forward\n(S=4096)", fontsize=8, color="gray")
    fig.text(0.01, -0.03, plots.record_caption(rec_d), fontsize=7)
    plots.save(fig, "ch09_decode_roofline");

# %% [markdown]
# ## 7 · Split-KV: enough blocks to read the cache at full speed
#
# Chapter 03's grid gives one thread block per (query block, head, sequence). For decoding that is
# one block per (K/V head, sequence): 8 blocks for one sequence of gpt-oss, on a GPU with 132 SMs.
# The cure is to split each sequence's cache into ranges and give each range its own block; each
# block runs the usual loop over *its* keys and writes a partial result, O normalised over its keys
# and their LSE. A second, small kernel merges the partials with chapter 02's rule for combining
# softmax states: with LSE = log Σ_s e^{LSE_s}, the share of split s is e^{LSE_s − LSE}, and
# O = Σ_s e^{LSE_s − LSE} O_s. A sink (chapter 06) is one more partial state, with LSE = its logit
# and O = 0, so only the merge knows about it.

# %%
fig, ax = plt.subplots(figsize=(11, 3))
varlen_diagrams.split_kv(ax, 2048, 4, 128)

# %% [markdown]
# Here are the two kernels taken apart. The split kernel writes `O_part [B, S_new, H, splits, D]` and
# `LSE_part`; we merge them in PyTorch with `merge_attention_states` (`course_utils.kernels.softmax`, the
# chapter 02 exercise generalised to any number of parts), the sink as one more part, and compare
# with the merge kernel and with the float64 reference.

# %%
D_H, D_HKV, D_D = cu.pick(cpu=(4, 2, 16), gpu=(64, 8, 64))
D_DTYPE = cu.pick(cpu=torch.float32, gpu=torch.bfloat16)
D_LENGTHS = cu.pick(cpu=[0, 1, 16, 17, 40], gpu=[0, 1, 127, 128, 129, 3000, 8192, 5000])
S_MAX, PAGE = cu.pick(cpu=(48, 16), gpu=(8192, 256))
lengths_d = torch.tensor(D_LENGTHS, dtype=torch.int32, device=cu.DEVICE)
q_d = torch.randn(len(D_LENGTHS), 1, D_H, D_D, device=cu.DEVICE, dtype=D_DTYPE)
k_d, v_d = (torch.randn(len(D_LENGTHS), S_MAX, D_HKV, D_D, device=cu.DEVICE, dtype=D_DTYPE) for _ in range(2))
for t in (k_d, v_d):
    for b, n in enumerate(D_LENGTHS):
        t[b, n:] = float("nan")  # never-written cache slots: whatever they hold must not reach a result
sinks_d = torch.randn(D_H, device=cu.DEVICE)
split, merge, config = decode_kernels(q_d, k_d)
SPLITS = 3
o_part = torch.empty(len(D_LENGTHS), 1, D_H, SPLITS, D_D, device=cu.DEVICE)
lse_part = torch.empty(len(D_LENGTHS), 1, D_H, SPLITS, device=cu.DEVICE)
no_table = torch.zeros(len(D_LENGTHS), 1, dtype=torch.int32, device=cu.DEVICE)
split(q_d, k_d, v_d, no_table, lengths_d, o_part, lse_part)
sink_part = sinks_d.view(1, 1, D_H, 1).expand(len(D_LENGTHS), 1, D_H, 1)
o_torch, lse_torch = merge_attention_states(torch.cat([o_part, torch.zeros_like(o_part[..., :1, :])], dim=3),
                                            torch.cat([lse_part, sink_part], dim=3), dim=3)
o_kernel, lse_kernel = merge(o_part, lse_part, sinks_d)
refs_d = decode_references(q_d, k_d, v_d, lengths_d, sinks=sinks_d)
print(f"{SPLITS} splits, cache lengths {D_LENGTHS}, {D_DTYPE}")
cu.check_close(o_kernel.float(), o_torch, "merge kernel vs merge_attention_states: O", dtype=D_DTYPE)
cu.check_close(lse_kernel, lse_torch.transpose(1, 2), "merge kernel vs merge_attention_states: LSE")
check_forward(q_d, k_d, v_d, o_kernel, lse_kernel, refs=refs_d, name="split + merge");

# %% [markdown]
# The split kernel's loop is chapter 03's, over this split's key blocks; the range is the packed
# tile's key range cut into `splits` nearly equal parts (they differ by at most one key block). The
# merge kernel is exercise (c): you write it, and its source follows the exercise.

# %%
show_source(flash_decode_kernel, "this split's key blocks")

# %% [markdown]
# ## 8 · GQA packing, and the paged cache
#
# **GQA packing.** The 8 query heads of a gpt-oss K/V group read the same keys and values. One block
# per *K/V head* whose query tile holds all 8 heads (and all new tokens) reads each K/V tile once for
# the group; one block per query head would read the cache 8 times. The rows are padded to the
# tensor cores' 16; the padding rows are computed and never stored.
#
# **Two K/V heads per block at D = 64.** A token's cache row holds its 8 K/V heads side by side
# (`[B, S, H_kv, D]`): at D = 64, one head's share of each 1 KiB row is a 128-byte piece. A block may own
# c neighbouring K/V heads instead (`kv_heads_per_block`): it reads the cache as `[B, S, H_kv / c, c·D]`
# (the same bytes), so the rows of its tiles are c · 128 contiguous bytes, and its query tile is
# block-diagonal: the rows of head slot j hold their queries in columns j·D … (j+1)·D − 1 and zeros
# elsewhere, so one Q·Kᵀ gives each row the scores of its own head only; P·V computes c·D columns per
# row, and a row keeps its own head's D. The tensor cores, idle here, do c× the work; the loads get
# wider. The default is c = 128 ÷ D: on an H100 and an H200 (`docs/varlen_and_decoding.md`; no record of
# `figures/` holds this), two heads per block read a few percent faster at D = 64 with B = 8 or 64 and 8k–128k keys; at D = 128, whose
# rows are 256 bytes already, two were slightly slower than one.

# %%
fig, ax = plt.subplots(figsize=(8, 4.2))
varlen_diagrams.gqa_tile(ax, 64, 8, 1, 16)
show_source(flash_decode_kernel, "packed query tile")

# %% [markdown]
# **The paged cache.** A server holding many conversations cannot give each one a contiguous
# region of its longest possible length. vLLM's PagedAttention cuts the cache into fixed-size pages
# from one shared pool, and a *block table* `[B, max_pages]` lists each sequence's pages in order.
# The kernel changes in one place: a key tile of `block_N` keys lies inside one page (`block_N`
# divides the page size), so loading it is a lookup in the block table followed by the same
# contiguous copy from that page (exercise (d) has you write it).

# %%
fig, ax = plt.subplots(figsize=(12, 3.2))
example_table = torch.tensor([[5, 2, 10, -1], [7, 0, 3, 9], [1, -1, -1, -1]])
varlen_diagrams.paged_cache(ax, [40, 60, 10], 16, example_table, 12)

# %% [markdown]
# The same cache as shuffled pages (unused block-table entries are −1), checked against the
# reference and against the contiguous cache, with the split count `flash_decode` picks itself:

# %%
pages_per_seq = S_MAX // PAGE
order = torch.randperm(len(D_LENGTHS) * pages_per_seq, device=cu.DEVICE)
table = order.view(len(D_LENGTHS), pages_per_seq).to(torch.int32)
used = torch.arange(pages_per_seq, device=cu.DEVICE)[None] < ((lengths_d + PAGE - 1) // PAGE)[:, None]
table = torch.where(used, table, -1)
k_pages, v_pages = (t.view(-1, PAGE, D_HKV, D_D)[torch.argsort(order)].contiguous() for t in (k_d, v_d))
out_paged, lse_paged = cu.flash_decode(q_d, k_pages, v_pages, lengths_d, block_table=table, sinks=sinks_d,
                                       return_lse=True)
check_forward(q_d, k_d, v_d, out_paged, lse_paged, refs=refs_d, name="paged")
cu.check_close(out_paged, cu.flash_decode(q_d, k_d, v_d, lengths_d, sinks=sinks_d), "paged vs contiguous");

# %% [markdown]
# A block table that points at the wrong page must fail the check, and indices that cannot be right
# are refused before anything runs:

# %%
wrong_table = table.clone()
wrong_table[-1, 0] = table[-2, 0]  # the last sequence's first page read from the one before
cu.expect_failure("a page from another sequence", lambda: check_forward(
    q_d, k_d, v_d, cu.flash_decode(q_d, k_pages, v_pages, lengths_d, block_table=wrong_table, sinks=sinks_d),
    refs=refs_d, quiet=True))

# %%
# NBVAL_CHECK_OUTPUT
q_bad, cache_bad = torch.zeros(2, 1, 4, 16), torch.zeros(6, 16, 2, 16)  # 6 pages of 16 keys; checked before compiling
table_bad, lengths_bad = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), torch.tensor([40, 9], dtype=torch.int32)
bad = {
    "a page number past the pool": dict(block_table=torch.tensor([[0, 1, 2], [6, 4, 5]], dtype=torch.int32)),
    "cache_seqlens longer than the pages": dict(cache_seqlens=torch.tensor([49, 9], dtype=torch.int32)),
    "cache_seqlens as int64": dict(cache_seqlens=lengths_bad.long()),
}
for what, change in bad.items():
    args = dict(block_table=table_bad, cache_seqlens=lengths_bad) | change
    try:
        cu.flash_decode(q_bad, cache_bad, cache_bad, args.pop("cache_seqlens"), **args)
        raise cu.CheckFailed(f"{what}: no error raised")
    except ValueError as exc:
        print(f"{what:36} → ValueError: {exc}")

# %% [markdown]
# ## 9 · How many splits?
#
# Too few splits leave SMs idle; too many cut each block's loop short (its pipeline never fills) and
# give the merge more partials to read. `choose_num_splits` gives every SM one block: with
# n = B · H_kv / c blocks before splitting (c K/V heads per block), it takes ⌊SMs ÷ n⌋ splits (each
# with a few key tiles at least), and when n already covers the SMs it does not split (one kernel, no
# merge). A short cache is not split either: up to `ONE_SPLIT_TILES` key tiles, one block streams
# them in less time than the merge's extra launch costs a call issued from Python (the sweep below
# has the 1k and 2k caches). In a CUDA graph, where launches cost nothing, splitting would pay sooner.
# Two blocks fit on an SM here (by shared memory), and an earlier version filled that whole
# *wave*; on the H100, with one K/V head per block, one block per SM read as fast at B = 1 (16 splits
# against 33) and slightly faster at B = 8 (2 against 4; `docs/varlen_and_decoding.md`). Like FlashAttention's heuristic, it looks at shapes only (the cache's
# capacity), so choosing costs no wait for the GPU.

# %%
show_source(choose_num_splits)

# %%
# NBVAL_CHECK_OUTPUT
h100 = decode_config("cuda", 64, 8, 64, 1)
print(f"H100 (132 SMs), gpt-oss D=64: {blocks_per_sm(h100, 64)} blocks fit per SM; one kernel up to "
      f"{ONE_SPLIT_TILES} key tiles of {h100.block_N}; splits chosen:")
print("   B  " + "".join(f"{plots.seq_label(s):>7}" for s in (1024, 8192, 32768, 131072)))
for batch in (1, 8, 64):
    chosen = [choose_num_splits(batch, 8, s, num_sms=132, config=h100) for s in (1024, 8192, 32768, 131072)]
    print(f"{batch:>4}  " + "".join(f"{c:>7}" for c in chosen))

# %% [markdown]
# The sweep below times one decoding step for every split count on the H100, and marks the one the
# rule picks (checked: every split count gives the same O).

# %%
rec_s = cu.measured("ch09_decode_splits_h100", RECORDS["ch09_decode_splits_h100"], pending_ok=True)
if rec_s is not None:
    rows_s = rec_s["results"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for n, case in enumerate(dict.fromkeys((r["batch"], r["context"]) for r in rows_s)):
        pts = sorted((r["splits"], r["gbps"], r["chosen"]) for r in rows_s if (r["batch"], r["context"]) == case)
        color = plots.COLORS[n % len(plots.COLORS)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=color,
                label=f"B={case[0]}, context {plots.seq_label(case[1])}")
        ax.scatter([p[0] for p in pts if p[2]], [p[1] for p in pts if p[2]], s=120, facecolors="none", edgecolors=color)
    ax.set(xscale="log", xlabel="splits per sequence and K/V head", ylabel="K/V read bandwidth (GB/s)",
           title="Split count (circled: the one choose_num_splits picks)")
    ax.legend(fontsize=8)
    fig.text(0.01, -0.03, plots.record_caption(rec_s), fontsize=7)
    for case in dict.fromkeys((r["batch"], r["context"]) for r in rows_s):
        rs = [r for r in rows_s if (r["batch"], r["context"]) == case]
        best, pick = max(rs, key=lambda r: r["gbps"]), next(r for r in rs if r["chosen"])
        print(f"B={case[0]:>2} context {plots.seq_label(case[1]):>4}: picked {pick['splits']:>3} splits "
              f"({pick['gbps']:.0f} GB/s), best {best['splits']:>3} ({best['gbps']:.0f} GB/s): "
              f"{pick['gbps'] / best['gbps']:.0%} of the best")

# %% [markdown]
# ## 10 · Measured on an H100: decoding bandwidth
#
# One decoding step at the gpt-oss attention shape (64 query heads, 8 K/V heads, sinks; D = 64 and
# 128; bf16), for B ∈ {1, 8, 64} and contexts of 1k to 128k keys. Each time becomes the bandwidth
# at which K and V were read (their bytes ÷ time), set against:
# - **a plain large read**: `torch.sum` over the same bytes, in the same run: what a simple
#   memory-bound kernel reaches on this GPU (the target is 85% of it);
# - **SDPA's four backends** at a query length of 1 on the same contiguous cache, read in place
#   through a transposed view, with `enable_gqa`, and with the group folded into the query length
#   (`[B, H_kv, 8, D]`), which is the same attention for one new token and which every backend
#   takes without copying K and V; a form a backend refuses is recorded with its error;
# - **our paged cache**: the same bytes as 256-key pages in shuffled order (target: ≤ 5% slower).

# %%
if rec_d is not None:
    def decode_rows(impl, **where):
        return [r for r in rows_d if r["impl"] == impl and "error" not in r
                and all(r[k] == v for k, v in where.items())]


    sdpa_impls = sorted({r["impl"] for r in rows_d} - {OURS, PAGED, SUM})
    check_stored_errors([r for r in rows_d if r["impl"] in (OURS, PAGED)], "ch09 decode record (O, LSE)")
    print("Fraction of torch.sum's bandwidth, ours (paged):")
    for dim in (64, 128):
        table = [dict(r, batch=f"B={r['batch']}", frac=f"{r['fraction_of_sum']:.0%} ({p['fraction_of_sum']:.0%})")
                 for r in decode_rows(OURS, dim=dim)
                 for p in decode_rows(PAGED, dim=dim, batch=r["batch"], context=r["context"])]
        print(f"D={dim}\n" + plots.text_table(table, index="context", columns="batch", value="frac", fmt="{}",
                                              width=13))
    cu.claim_ratio("ours, fraction of torch.sum's bandwidth, caches of a GiB or more",
                   [r["fraction_of_sum"] for r in decode_rows(OURS) if r["bytes"] >= 2**30], target=0.85, says="met")
    cu.claim_versus("the paged cache against the contiguous one",
                    {(r["dim"], r["batch"], r["context"]): cu.speed_ratio(p, r) for r in decode_rows(OURS)
                     for p in decode_rows(PAGED, dim=r["dim"], batch=r["batch"], context=r["context"])},
                    says="mixed")

# %%
if rec_d is not None:
    print("time of the fastest SDPA form ÷ ours, and which it was:")
    for dim in (64, 128):
        for r in decode_rows(OURS, dim=dim):
            peers = [p for i in sdpa_impls for p in decode_rows(i, dim=dim, batch=r["batch"], context=r["context"])]
            fastest = min(peers, key=lambda p: p["ms"], default=None)
            print(f"D={dim:>3} B={r['batch']:>2} context {plots.seq_label(r['context']):>4}: " + (
                  f"{fastest['ms'] / r['ms']:5.2f}× ({fastest['impl']})" if fastest else "every SDPA form refused") +
                  "; paged costs "
                  f"{decode_rows(PAGED, dim=dim, batch=r['batch'], context=r['context'])[0]['ms'] / r['ms'] - 1:+.1%}")
    by_case = [(dim, r) for dim in (64, 128) for r in decode_rows(OURS, dim=dim)]
    label_of = lambda dim, r: f"D={dim} B={r['batch']} {plots.seq_label(r['context'])}"  # noqa: E731
    paged_ms = {label_of(dim, r): decode_rows(PAGED, dim=dim, batch=r["batch"], context=r["context"])[0]["ms"]
                for dim, r in by_case}
    cu.claim_ratio("paged ÷ contiguous time", {label_of(dim, r): paged_ms[label_of(dim, r)] / r["ms"]
                                               for dim, r in by_case}, target=None)
    cu.claim_ratio("paged ÷ contiguous time, caches of a GiB or more",
                   {label_of(dim, r): paged_ms[label_of(dim, r)] / r["ms"] for dim, r in by_case
                    if r["bytes"] >= 2**30}, says="near 1", near=0.03)
    sdpa_fastest = {label_of(dim, r): min((p for i in sdpa_impls
                                           for p in decode_rows(i, dim=dim, batch=r["batch"], context=r["context"])),
                                          key=lambda p: p["ms"], default=None) for dim, r in by_case}
    cu.claim_versus("ours against the fastest SDPA form",
                    {label_of(dim, r): cu.speed_ratio(r, sdpa_fastest[label_of(dim, r)]) for dim, r in by_case
                     if sdpa_fastest[label_of(dim, r)] is not None})
    cudnn_best = {label_of(dim, r): min(p["ms"] for i in sdpa_impls if i.startswith(CUDNN)
                                        for p in decode_rows(i, dim=dim, batch=r["batch"], context=r["context"]))
                  for dim, r in by_case}
    cu.claim_ratio("cuDNN's time ÷ ours (target: ours at least as fast)",
                   {label_of(dim, r): cudnn_best[label_of(dim, r)] / r["ms"] for dim, r in by_case}, target=1.0,
                   says="partly met")
    refusals = sorted({(r["impl"], r["error"][:70]) for r in rows_d if "error" in r})
    print("\nrefused:", *([f"  {i}: {e}" for i, e in refusals] or ["  none"]), sep="\n")

# %%
if rec_d is not None:
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5), sharey=True)
    for ax, dim in zip(axes, (64, 128)):
        for n, batch in enumerate((1, 8, 64)):
            color = plots.COLORS[n]
            for impl, style in ((OURS, "-o"), (PAGED, ":"), (SUM, "--")):
                pts = decode_rows(impl, dim=dim, batch=batch)
                ax.plot([r["context"] for r in pts], [r["gbps"] for r in pts], style, color=color,
                        label=f"B={batch} {impl.replace(OURS, 'ours')}")
            best_sdpa = [min((p for i in sdpa_impls for p in decode_rows(i, dim=dim, batch=batch, context=r["context"])),
                             key=lambda p: p["ms"], default=None) for r in decode_rows(OURS, dim=dim, batch=batch)]
            best_sdpa = [p for p in best_sdpa if p is not None]
            ax.plot([r["context"] for r in best_sdpa], [r["gbps"] for r in best_sdpa], "-x", color=color, alpha=0.5,
                    label=f"B={batch} fastest SDPA")
        contexts = sorted({r["context"] for r in rows_d})
        ax.set(xscale="log", title=f"one decoding step, gpt-oss heads, D={dim}", xlabel="context (keys)",
               ylabel="K/V read bandwidth (GB/s)" if dim == 64 else None)
        ax.set_xticks(contexts, [plots.seq_label(c) for c in contexts])
        ax.minorticks_off()
    axes[1].legend(fontsize=7, ncol=2)
    fig.text(0.01, -0.03, plots.record_caption(rec_d), fontsize=7)
    plots.save(fig, "ch09_decode_bandwidth");

# %% [markdown]
# How to read it. Small problems (B = 1 with a short context: a few megabytes, under a microsecond
# of reading at 3 TB/s) cost about as much as launching a kernel or two and the Python around them, for
# every implementation; bandwidth there says little (`flash_decode` launches one kernel where one split
# suffices and two, splits then merge, otherwise: the record's `kernels` column). The large ones are a read of gigabytes, and the
# fraction of `torch.sum`'s bandwidth is the measure of the kernel. The paged cache reads the same
# bytes, a tile from one looked-up page at a time; the block-table lookups it adds cost nothing
# measurable: from a GiB up it is within a few percent of the contiguous cache (the claim above). Below
# that the times are the host's, not the GPU's (the record's timing issues calls back to back, so a
# call that the host needs longer to issue than the GPU to run is timed at the host's pace), and the
# two caches differ there by the host's jitter. An earlier record had the paged cache faster in most
# cases, most of all at B = 1 and 128k keys (D = 64): `flash_decode` then spent more time in Python per
# call than the GPU's work took up to that size, so the two were timed by the host; the generated code
# of the two differs only in the tile's address, and timed on the GPU alone (`triton.testing.do_bench`)
# they ran alike (`docs/varlen_and_decoding.md`). `flash_decode` now keeps what
# its checks concluded for each signature of its arguments (shapes, dtypes, devices, options) and
# calls the compiled launcher directly, which shortens the host's time per call. The table above says where
# cuDNN is still faster: the large caches, by at most a few percent (the range of the claim above),
# where the time is the GPU's read of the cache and ours reads at `torch.sum`'s pace; cuDNN reads a
# little faster than that sum, so a plain read is not the ceiling, but we have not found what it does
# differently. Tried on the H100 and not kept (`docs/varlen_and_decoding.md`): four K/V heads
# per block, smaller or larger key tiles with more or fewer stages, twice the splits, and an L2 hint that
# marks the cache's lines first to evict; none closed the gap at every shape. The best of them (tiles of
# 128 keys, two stages) came closer at D = 64 with 64 sequences, by about the spread between two runs.

# %% [markdown]
# ## Takeaways
# - **Packing** replaces padding with `cu_seqlens`: each sequence's tiles start where it starts, so
#   the kernel spends nothing on padding. The kernels are the course's, with a per-sequence prelude
#   (`with_lengths`: lengths read at run time) and three guards: the mask hides the next sequence's
#   keys, stores skip its rows, and its value rows are zeroed before P·V (0 · NaN = NaN).
# - Blocks can be handed out by a **grid** sized for the longest sequence (idle blocks exit at
#   once) or a **work list** made on the host (no idle blocks, heaviest first). On the H100 the two
#   are level in the backward, and the grid is ahead in the forward, where the list costs a read back
#   to the host in every call (section 5's claims); the grid is the default.
# - **Decoding** does group · S_new FLOPs per byte of cache: it is a memory read, and the measure of
#   a decoding kernel is the bandwidth it reaches against a plain read.
# - **Split-KV** gives each sequence several blocks; chapter 02's merge of softmax states combines
#   their partial results (a sink is one more state). **GQA packing** reads each K/V tile once for
#   the whole group. A **paged cache** adds a block-table lookup per tile; from a GiB of cache up it
#   is within a few percent of the contiguous cache, and below that the two are level except where
#   section 10's claim names a case (there the host's pace, not the lookup, sets the time).
# - The split count comes from the shapes and the SM count: one block per SM, although two fit
#   (section 9).

# %% [markdown]
# ## Exercises
#
# Stuck on one? `hint("09", "a", 1)` names the idea, `hint("09", "a", 2)` the functions to use;
# `solution("09", "a")` shows the answer (the same for the other letters).

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) Pack a padded batch
#
# Write `pack(padded, lengths)`: `padded` is `[B, S_max, H, D]` (sequence b's tokens are its first
# `lengths[b]` rows, the rest padding), `lengths` an int tensor `[B]`. Return the packed tokens
# `[total, H, D]` and `cu_seqlens`, int32 `[B + 1]`, as `flash_attention_varlen` takes them.

# %% tags=["solution", "ex-a"]
def pack(padded, lengths):
    ### BEGIN SOLUTION
    packed = torch.cat([padded[b, :n] for b, n in enumerate(lengths.tolist())])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return packed, cu_seqlens
    ### END SOLUTION


# %%
from course_utils.exercises.ch09 import check_merge_with_sink, check_pack

check_pack(pack)

# %% [markdown]
# ### (b) The merge, with a sink
#
# `o` `[splits, rows, D]` and `lse` `[splits, rows]` are the partial results of the splits of a
# decoding step (a split that saw no key for a row has LSE = −∞ there), `sink` `[rows]` each row's sink
# logit. Return the final O `[rows, D]` and LSE `[rows]`, as the merge kernel computes them.

# %% tags=["solution", "ex-b"]
def merge_with_sink(o, lse, sink):
    ### BEGIN SOLUTION
    lse_all = torch.cat([lse, sink[None]])  # the sink: one more state, LSE = its logit …
    total = torch.logsumexp(lse_all, dim=0)
    return (torch.exp(lse - total)[..., None] * o).sum(dim=0), total  # … and O = 0
    ### END SOLUTION


# %%
check_merge_with_sink(merge_with_sink)

# %% [markdown]
# ### (c) The merge kernel, in TileLang
#
# Section 7 merged the splits' partial results in PyTorch. Write the merge as a kernel: one block
# per row, which reads the row's `splits` partial states `O_part [rows, splits, D]` (each normalised
# over its own keys) and `LSE_part [rows, splits]` (natural log), and writes the merged `O [rows, D]`
# and `LSE [rows]`. Section 7's rule, computed so that nothing overflows:
#
# $$m = \max_s \mathrm{LSE}_s,\qquad \ell = \sum_s e^{\mathrm{LSE}_s - m},\qquad
#   \mathrm{LSE} = m + \log \ell,\qquad O = \sum_s e^{\mathrm{LSE}_s - \mathrm{LSE}}\, O_s .$$
#
# A split that saw no key of the row has LSE<sub>s</sub> = −∞ (and contributes nothing); a row that
# no split saw must come out as O = 0, LSE = −∞, without a NaN. The skeleton gives the kernel and the
# per-row scalars `shift` (m) and `l` (ℓ); you write `merge_row`. The checker runs it on TileLang's
# C backend with 3 and 5 splits and a row from each class a merge can get wrong: a row no split saw, the first or
# the last split empty, the largest LSE first, in the middle or last by more than 88, a tie, and LSEs all past
# float32's e<sup>88</sup> or all below e<sup>−104</sup> (where float32's exp is 0).
#
# Stuck? `hint("09", "c", 1)`, then `hint("09", "c", 2)`; `solution("09", "c")` shows the answer.

# %%
import tilelang.language as T

from course_utils.kernels.tiles import TileBackend

NEG_INF = -T.infinity("float32")


def merge_kernel(rows, splits, dim, *, target=None):
    """Merge split states: O_part [rows, splits, D], LSE_part [rows, splits] -> O [rows, D], LSE [rows]."""
    tb = TileBackend(target)
    merge_row = merge_macros(tb, splits, dim)

    @T.prim_func
    def merge(O_part: T.Tensor([rows, splits, dim], "float32"), LSE_part: T.Tensor([rows, splits], "float32"),
              O: T.Tensor([rows, dim], "float32"), LSE: T.Tensor([rows], "float32")):
        with tb.kernel(rows, threads=dim) as r:
            acc = tb.fragment([dim], "float32")
            shift = T.alloc_local([1], "float32")  # m, the row's largest LSE_s (0 when every LSE_s is −∞)
            l = T.alloc_local([1], "float32")  # noqa: E741  ℓ = Σ_s e^(LSE_s − m)
            merge_row(O_part, LSE_part, O, LSE, acc, shift, l, r)

    return merge


# %% tags=["solution", "ex-c"]
def merge_macros(tb, splits, dim):
    @T.macro
    def merge_row(O_part, LSE_part, O, LSE, acc, shift, l, r):
        ### BEGIN SOLUTION
        shift[0] = NEG_INF
        for s in T.serial(splits):
            shift[0] = T.max(shift[0], LSE_part[r, s])
        shift[0] = T.if_then_else(shift[0] == NEG_INF, 0, shift[0])  # no split saw the row: no −∞ − (−∞)
        l[0] = 0
        for s in T.serial(splits):
            l[0] += T.exp(LSE_part[r, s] - shift[0])
        LSE[r] = T.if_then_else(l[0] > 0, shift[0] + T.log(l[0]), NEG_INF)
        T.clear(acc)
        for s in T.serial(splits):
            for d in tb.parallel(dim):
                acc[d] += T.if_then_else(l[0] > 0, T.exp(LSE_part[r, s] - LSE[r]), 0) * O_part[r, s, d]
        for d in tb.parallel(dim):
            O[r, d] = acc[d]
        ### END SOLUTION

    return merge_row


# %%
from course_utils.exercises import ch09

ch09.check_merge_kernel(merge_kernel)

# %% [markdown]
# ### (d) The paged-cache lookup, in TileLang
#
# Section 8's paged cache stores each sequence's keys in pages of `page_size` keys, anywhere in a
# shared pool `Pages [num_pages, page_size, D]`; `BlockTable [B, max_pages]` lists sequence b's pages
# in order. The kernel below reads sequence b's keys tile by tile (`block_N` keys, a divisor of
# `page_size`) and writes the scores q<sub>b</sub> · k of its first `Lengths[b]` keys (−∞ past them).
# Write the two pieces that touch the cache: how many tiles sequence b has, and where tile `kb` of it
# lies in the pool. The checker uses pages of 8 keys in tiles of 4 and pages of 6 in tiles of 2, a
# shuffled pool, and lengths drawn to end at every edge of a tile and of a page (one key past it, one key
# short of the next), past a page, below a tile, and empty; unused block-table entries point at a page
# of NaN, as a never-written page would hold garbage.
#
# Stuck? `hint("09", "d", 1)`, then `hint("09", "d", 2)`; `solution("09", "d")` shows the answer.

# %%
def paged_scores(batch, max_pages, num_pages, page_size, dim, block_N, *, target=None):
    """S [B, max_pages · page_size]: q_b · k for sequence b's first Lengths[b] keys, −∞ past them."""
    tb = TileBackend(target)
    num_key_tiles, load_key_tile = paged_macros(page_size, block_N)

    @T.prim_func
    def scores(Q: T.Tensor([batch, dim], "float32"), Pages: T.Tensor([num_pages, page_size, dim], "float32"),
               BlockTable: T.Tensor([batch, max_pages], "int32"), Lengths: T.Tensor([batch], "int32"),
               S: T.Tensor([batch, max_pages * page_size], "float32")):
        with tb.kernel(batch, threads=block_N) as b:
            K_s = tb.shared([block_N, dim], "float32")
            for p in T.serial(max_pages * page_size):
                S[b, p] = NEG_INF
            for kb in T.serial(num_key_tiles(Lengths[b])):
                load_key_tile(Pages, BlockTable, K_s, b, kb)
                for j in tb.parallel(block_N):
                    if kb * block_N + j < Lengths[b]:  # the last tile may run past the sequence's end
                        S[b, kb * block_N + j] = 0
                        for d in T.serial(dim):
                            S[b, kb * block_N + j] += Q[b, d] * K_s[j, d]

    return scores


# %% tags=["solution", "ex-d"]
def paged_macros(page_size, block_N):
    def num_key_tiles(length):
        ### BEGIN SOLUTION
        return T.ceildiv(length, block_N)
        ### END SOLUTION

    @T.macro
    def load_key_tile(Pages, BlockTable, tile, b, kb):
        ### BEGIN SOLUTION
        page = BlockTable[b, kb * block_N // page_size]
        first = kb * block_N % page_size
        T.copy(Pages[page, first:first + block_N, :], tile)
        ### END SOLUTION

    return num_key_tiles, load_key_tile


# %%
from course_utils.exercises import ch09

ch09.check_paged_scores(paged_scores)

# %% [markdown]
# The course's kernels, for comparison: the merge of `flash_decode_merge_kernel` (in base 2, with the
# sink as one more state) and the key-tile load of `flash_decode_kernel`.

# %%
show_source(flash_decode_merge_kernel, "merge")
show_source(flash_decode_kernel, "load a key tile")
