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
# # 06 · GQA, sliding windows and attention sinks: the attention of gpt-oss
#
# **Question.** The attention layers of gpt-oss differ from the plain causal attention of
# chapters 03–05 in three ways: many query heads share a few key/value heads, every other layer
# looks only at a short window of recent tokens, and each head has a learned "sink" logit that
# can soak up probability. What does each change do to the forward and backward kernels, and
# what must we be careful about so that none of them breaks the numerics?
#
# The [gpt-oss model card](https://arxiv.org/abs/2508.10925) (OpenAI, 2025) describes 64 query
# heads of dimension 64 sharing 8 key/value heads, layers that alternate between full causal
# attention and a 128-token sliding window, and one learned sink per head. Our kernels
# (`course_utils.kernels.flash_fwd`, `course_utils.kernels.flash_bwd`) already take all three options; this
# chapter reads the lines that implement them, derives the one new gradient, checks everything
# against the float64 reference, and ends with measurements at the gpt-oss shape on an H100.
#
# *Credit.* Grouped-query attention: Ainslie et al., [GQA](https://arxiv.org/abs/2305.13245)
# (2023). Sliding-window attention: Beltagy et al., [Longformer](https://arxiv.org/abs/2004.05150)
# (2020), and Jiang et al., [Mistral 7B](https://arxiv.org/abs/2310.06825) (2023). Attention sinks:
# Xiao et al., [Efficient Streaming Language Models with Attention Sinks](https://arxiv.org/abs/2309.17453)
# (2023), and the learned per-head sink of gpt-oss. TileLang's
# [attention_sink examples](https://github.com/tile-ai/tilelang/tree/main/examples/attention_sink)
# implement the same three features; chapter 03's errata list their sinks-buffer sizing bug.

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import itertools
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils.pictures import diagrams, plots
from course_utils.api.attention import attention_backward
from course_utils.measure.benchmarks import GPT_OSS_SHAPE, RECORDS, gqa_backward_strategies
from course_utils.kernels.flash_bwd import flash_bwd_kernel
from course_utils.kernels.flash_fwd import flash_fwd_kernel
from course_utils.kernels.flash_pieces import (init_running_max, key_block_range, normalise_rows, online_softmax,
                                       query_block_range, store_dkv, visible)
from course_utils.core.reference import visibility_mask
from course_utils.kernels.softmax import safe_shift
from course_utils.core.labels import CUDNN, FA2, FA4, NAIVE, OURS, PEERS
from course_utils.core.source import show_source
from course_utils.checking.validation import check_stored_errors

torch.manual_seed(0)
print("device:", cu.DEVICE, "| tile target:", cu.TILE_TARGET)

# %% [markdown]
# ## 1 · Grouped-query attention
#
# In multi-head attention (MHA) every query head has its own key and value heads. During text
# generation the keys and values of all past tokens are kept in memory (the *KV cache*), and
# reading that cache is usually what limits the speed of each decoding step. GQA lets a **group** of query heads share
# one K/V head: with $H_q$ query heads and $H_{kv}$ K/V heads, each group has
# $H_q / H_{kv}$ members and the cache shrinks by that factor (8× for gpt-oss's 64 and 8).
# Multi-query attention (MQA) is the extreme case of a single K/V head. The queries stay
# per-head, so each head still computes its own attention pattern.

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 2.4))
for ax, (kv, name) in zip(axes, ((8, "MHA"), (2, "GQA"), (1, "MQA"))):
    diagrams.gqa_heads(ax, 8, kv, title=f"{name}: 8 query heads, {kv} K/V head{'s' if kv > 1 else ''}")
fig.tight_layout()

# %% [markdown]
# ### The forward: one index changes
#
# The forward grid is still one thread block per (query block, **query** head, batch entry).
# Query head `by` simply reads K and V from head `by // group`. Nothing else in the loop
# changes: the prelude computes the group size once (`Prelude.group`, chapter 03), the setup maps
# the query head to its K/V head, and the two tile loads use it. Exercise (e) makes that change in
# your own kernel, so the course's lines are listed at the end of the chapter, after the exercises.

# %% [markdown]
# ### The backward: a sum over the group
#
# K/V head $g$ is used by every query head $h$ of its group, so by the chain rule its gradient
# is the **sum** of what each of those heads contributes:
#
# $$dK_g = \sum_{h:\ \lfloor h / \text{group} \rfloor = g} dK^{(h)}, \qquad
#   dV_g = \sum_{h:\ \lfloor h / \text{group} \rfloor = g} dV^{(h)},$$
#
# where $dK^{(h)}, dV^{(h)}$ are the MHA gradients of head $h$ (chapter 05). Two ways to get it:
#
# - **split then sum**: copy K and V to $H_q$ heads (`repeat_interleave`), run the MHA backward,
#   then add the $H_q$ per-head gradients group by group. Simple, but it writes $H_q$ heads of dK
#   and dV to memory only to reduce them again.
# - **atomic adds** (ours): the backward grid is one thread block per (key block, query head).
#   Each block accumulates its $dK^{(h)}, dV^{(h)}$ tile in registers as before, and at the end
#   *adds* it into the shared head's float32 buffer with atomic adds. A small kernel then casts the
#   float32 sums to the input dtype. With group = 1 the kernel writes dK and dV directly.

# %%
show_source(flash_bwd_kernel, "gqa accumulators")
show_source(flash_bwd_kernel, "store")
show_source(store_dkv)
print()
show_source(attention_backward, "gqa")

# %% [markdown]
# The shared accumulators are float32: with 16-bit atomic adds, every one of the group's
# contributions would be rounded to 16 bits as it lands. Thread blocks finish in no fixed order,
# so on the GPU the additions happen in a different order from run to run and dK, dV can differ
# in their last bits (floating-point addition is not associative).
#
# ### Checking GQA against the reference
#
# `compare_with_reference` runs our kernels (forward, then backward through autograd) and
# autograd through the float64 reference on the same inputs, and checks O, the LSE and every
# gradient on every head (`cu.check_forward`, `cu.check_backward`: 16-bit results by chapter 03's
# criterion). On the CPU the shapes are tiny and S is not a multiple of the 16-row blocks.

# %%
B, H, H_KV, S, D = cu.pick(cpu=(2, 4, 2, 40, 16), gpu=(2, 8, 2, 1000, 64))
DTYPE = cu.pick(cpu=torch.float32, gpu=torch.float16)
q = torch.randn(B, H, S, D, device=cu.DEVICE, dtype=DTYPE)
k, v = (torch.randn(B, H_KV, S, D, device=cu.DEVICE, dtype=DTYPE) for _ in range(2))
d_out = torch.randn(B, H, S, D, device=cu.DEVICE, dtype=DTYPE)
sinks = torch.randn(H, device=cu.DEVICE)  # one logit per query head, float32


def compare_with_reference(label, q, k, v, d_out, sinks=None, **mask):
    """Check O, the LSE and every gradient of our kernels against the float64 reference, on every head."""
    names = ["q", "k", "v"] + (["sinks"] if sinks is not None else [])
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)[:len(names)]]
    out, lse = cu.flash_attention(*leaves[:3], sinks=leaves[3] if sinks is not None else None, return_lse=True,
                                  **mask)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = cu.validation.references(q, k, v, d_out=d_out, sinks=sinks, **mask)
    cu.check_forward(q, k, v, out.detach(), lse, sinks=sinks, refs=refs, name=f"{label}:", **mask)
    cu.check_backward(q, k, v, d_out, grads, sinks=sinks, refs=refs, name=f"{label}:", **mask)
    return out, dict(zip(names, grads)), dict(zip(names, refs["grads"]))


print(f"q {tuple(q.shape)}, k/v {tuple(k.shape)}, group {H // H_KV}, {DTYPE}")
out, grads, ref_grads = compare_with_reference(f"GQA {H}/{H_KV}, causal", q, k, v, d_out, causal=True)

# %% [markdown]
# The reference itself computes GQA by *split then sum*: it expands K and V with
# `repeat_interleave`, and autograd's backward of that expansion adds the copies' gradients. So
# the check above already compared our atomic adds with split-then-sum. Done by hand, with an
# MHA reference on the expanded heads, the sum over each group gives the same dK and dV:

# %%
group = H // H_KV
k_rep, v_rep = (t.detach().double().repeat_interleave(group, dim=1).requires_grad_() for t in (k, v))
cu.attention_reference(q.double(), k_rep, v_rep, causal=True).backward(d_out.double())
print(f"per-query-head dK: {tuple(k_rep.grad.shape)} → summed over groups of {group}")
cu.check_close(k_rep.grad.view(B, H_KV, group, S, D).sum(dim=2), ref_grads["k"], "split then sum: dK",
               dtype=torch.float64)
cu.check_close(v_rep.grad.view(B, H_KV, group, S, D).sum(dim=2), ref_grads["v"], "split then sum: dV",
               dtype=torch.float64);

# %% [markdown]
# ## 2 · Sliding windows
#
# With a window of $W$ tokens, query $i$ sees only keys $i - W + 1, \dots, i$: the last $W$ keys,
# itself included, so a window implies causal masking (the gpt-oss convention; see the top of
# `course_utils/core/reference.py`). A window layer does $O(S \cdot W)$ work instead of $O(S^2)$. Stacked
# layers still pass information further back: each layer reaches $W - 1$ tokens further.
#
# For the kernel, a window is one more mask, and it makes many tiles entirely empty. Which tiles
# the forward visits, for S = 128, 16 × 16 tiles and W = 23 (not a multiple of 16):

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 5))
for ax, kw in zip(axes, (dict(causal=True), dict(window_size=23))):
    handles = diagrams.tile_visits(ax, 128, 128, 16, 16, **kw)
fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=9)
fig.tight_layout(rect=(0, 0.07, 1, 1))

# %%
diagrams.visit_table(128, 128, 16, 16, window_size=23)

# %% [markdown]
# Every query block visits at most three key blocks, however long the sequence: the band's width
# is set by W and the tile sizes, not by S. A window edge cuts through tiles, so the two or three
# tiles of each row of the band all need the mask.
#
# ### Skipping key blocks outside the window
#
# The forward's loop over key blocks gets a **start** as well as an end. `past` aligns the
# diagonal when S_k > S_q (it is 0 for self-attention). The first row of query block `qb`,
# `qb·block_M`, has the earliest window, starting at key `qb·block_M + past − W + 1`, so the
# loop starts at that key's block; the last row has the latest causal limit, so the loop
# ends after its block. Exercises (d) and (e) write that start in TileLang; the course's
# `key_block_range` is listed after the exercises.

# %% [markdown]
# The backward walks the other way: each thread block holds one key block and loops over query
# blocks. Causal masking skips the query blocks *above* the diagonal (`q_start`), and a window
# also skips those more than `W − 1` rows *below* it (`q_end`): the last key of the block,
# `(bx+1)·block_N − 1`, is last seen by query `(bx+1)·block_N − 1 + W − 1`.

# %%
show_source(query_block_range)

# %% [markdown]
# Are these bounds tight, that is, do they visit exactly the tiles that hold at least one visible
# (query, key) pair? Here are the same formulas in Python (self-attention, so `past = 0`),
# compared with `diagrams.tile_classes` for many lengths, windows and tile shapes:

# %%
# NBVAL_CHECK_OUTPUT
def key_blocks(qb, seq, window, block_M, block_N):
    """The forward's loop over key blocks of query block qb (flash_fwd: k_start, k_end)."""
    k_end = min(math.ceil(seq / block_N), math.ceil((qb + 1) * block_M / block_N))
    k_start = max(0, (qb * block_M - window + 1) // block_N)
    return range(k_start, k_end)


def query_blocks(kb, seq, window, block_M, block_N):
    """The backward's loop over query blocks of key block kb (flash_bwd: q_start, q_end)."""
    q_start = max(0, kb * block_N // block_M)
    q_end = min(math.ceil(seq / block_M), math.ceil(((kb + 1) * block_N + window - 1) / block_M))
    return range(q_start, q_end)


configs = list(itertools.product((40, 100, 1000), (1, 5, 16, 23, 128, 300, 2000),
                                 ((16, 16), (16, 32), (64, 128), (128, 64), (128, 128))))
wrong = []
for seq, window, (bm, bn) in configs:
    needed = diagrams.tile_classes(seq, seq, bm, bn, window_size=window) != diagrams.SKIPPED
    fwd, bwd = np.zeros_like(needed), np.zeros_like(needed)
    for qb in range(needed.shape[0]):
        fwd[qb, list(key_blocks(qb, seq, window, bm, bn))] = True
    for kb in range(needed.shape[1]):
        bwd[list(query_blocks(kb, seq, window, bm, bn)), kb] = True
    if not ((fwd == needed).all() and (bwd == needed).all()):
        wrong.append((seq, window, bm, bn))
cu.check_true(not wrong, f"forward and backward bounds visit exactly the needed tiles in all {len(configs)} "
              "(S, W, tile) configurations")

# %% [markdown]
# Inside a visited tile, the mask does the rest: after the `Q Kᵀ` product, `mask_scores` selects
# $-\infty$ for every pair that is not visible (chapter 03), on the tiles that cross a boundary.
# The window adds one condition to the causal one, which exercise (e) adds to your mask (the course's
# `visible` is listed after the exercises).

# %% [markdown]
# ### The row that has seen nothing yet: `check_inf`
#
# A query block starts at the key block of its *first* row's window. Its later rows have later
# windows, so for them that first key block can be **entirely** masked. After it, such a row
# still has running max $m = -\infty$, and the update computes $e^{s - m} = e^{-\infty - (-\infty)}$
# and $\alpha = e^{m_\text{old} - m} = e^{-\infty - (-\infty)}$: both NaN, and a NaN in $\ell$ or
# in the accumulator never goes away. Plain causal attention never meets this (key 0 is visible
# to every query), which is how the bug hides in kernels tested only without windows.
#
# A PyTorch simulation of one head shows it. It runs the kernel's loop (same `key_blocks`
# bounds, same update) with the shift either guarded by `safe_shift` (chapter 02: subtract 0
# while the max is still $-\infty$) or not:

# %%
def windowed_forward(q, k, v, window, *, block_M=16, block_N=16, check_inf=True):
    """One head [S, D] of the windowed forward, block by block, as the kernel loops."""
    seq, scale = q.shape[0], 1 / math.sqrt(q.shape[-1])
    visible = visibility_mask(seq, seq, window_size=window)
    out = torch.empty_like(q)
    for qb in range(math.ceil(seq / block_M)):
        rows = slice(qb * block_M, (qb + 1) * block_M)
        m = torch.full((q[rows].shape[0],), -math.inf, dtype=q.dtype)
        l, o = torch.zeros_like(m), torch.zeros_like(q[rows])
        for kb in key_blocks(qb, seq, window, block_M, block_N):
            cols = slice(kb * block_N, (kb + 1) * block_N)
            s = (q[rows] @ k[cols].T * scale).masked_fill(~visible[rows, cols], -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1))
            shift = safe_shift(m_new) if check_inf else m_new
            alpha, p = torch.exp(m - shift), torch.exp(s - shift[:, None])
            l, o, m = l * alpha + p.sum(dim=-1), o * alpha[:, None] + p @ v[cols], m_new
        out[rows] = o / l[:, None]
    return out


# %%
# NBVAL_CHECK_OUTPUT
q1, k1, v1 = (torch.randn(40, 16, dtype=torch.float64) for _ in range(3))  # the CPU test's S and D
ref1 = cu.attention_reference(q1[None, None], k1[None, None], v1[None, None], window_size=23)[0, 0]
cu.check_close(windowed_forward(q1, k1, v1, 23), ref1, "simulation with check_inf, W=23", quiet=True)
print("with check_inf: matches the reference")
broken = windowed_forward(q1, k1, v1, 23, check_inf=False)
nan_rows = torch.isnan(broken).any(dim=-1).nonzero().flatten().tolist()
cu.check_true(nan_rows == [38, 39], f"without check_inf, rows {nan_rows} are NaN")
print("query block 2 starts at key block", key_blocks(2, 40, 23, 16, 16).start,
      "| row 38 sees keys", visibility_mask(40, 40, window_size=23)[38].nonzero()[[0, -1]].flatten().tolist())

# %% [markdown]
# Rows 38 and 39 belong to query block 2 (rows 32–39). Row 32's window reaches back to key 10,
# so the loop starts at key block 0 (keys 0–15); row 38's window starts at key 16, so for it block
# 0 is fully masked. The kernel has the same guard: `shift` is 0 while `m` is $-\infty$, both in
# the loop and in the epilogue (where a row that saw nothing at all keeps $\ell = 0$, and gets output 0).
# The course's `online_softmax` is listed after the exercises.

# %% [markdown]
# ### Checking windows on our kernels
#
# Forward and backward with W = 23 (not a multiple of the CPU's 16-row blocks; on the GPU a
# larger W that is not a multiple of 64 or 128), then W = 1, where each query sees only itself so
# the output must be exactly its own value row. (With W = 1 and square tiles the backward's loop
# provably runs once per key block, and TileLang 0.1.15's loop simplifier rejects a loop over
# `qb` itself; `flash_bwd_kernel` counts its steps from 0 in that one case.)

# %%
W = cu.pick(cpu=23, gpu=300)
compare_with_reference(f"GQA, window {W}", q, k, v, d_out, window_size=W)
out_w1, _, _ = compare_with_reference("GQA, window 1", q, k, v, d_out, window_size=1)
cu.check_close(out_w1, v.repeat_interleave(group, dim=1), "window 1: O = own value row");

# %% [markdown]
# **A race, found and fixed.** On an H100 the W = 1 backward once gave wrong dQ and dK in some runs
# and right ones in others. The cause: with one query block per key block the
# backward's loop runs once, TileLang unrolls it, and its memory planner then placed dSᵀ over LSE/Δ
# and dQ's staging tile over K and V, while our own barriers (chapter 08) no longer protected the
# reuse. Chapter 08's kernel now forbids shared-memory reuse (`TL_DISABLE_SHARED_MEMORY_REUSE`), the
# cell above runs the default kernel on every device, and a GPU stress test repeats the one-step
# shapes 20 times each (`tests/test_gpu.py`; `docs/hopper_backward.md` tells the diagnosis).

# %% [markdown]
# ## 3 · Attention sinks
#
# Softmax forces every query to hand out a total weight of exactly 1. A head that has nothing
# useful to read must still put that weight somewhere. Xiao et al. (2023) observed that trained
# models park it on the first tokens of the sequence, and that a sliding window which drops those
# tokens degrades badly; keeping them ("attention sinks") fixes it. gpt-oss makes the sink
# explicit: each head $h$ has a learned logit $z_h$ that joins the softmax denominator but has
# **no value row**. For one row of scaled scores $s_j$ (masked ones $-\infty$):
#
# $$p_j = \frac{e^{s_j}}{e^{z_h} + \sum_k e^{s_k}}, \qquad
#   p_\text{sink} = \frac{e^{z_h}}{e^{z_h} + \sum_k e^{s_k}}, \qquad
#   O = \sum_j p_j v_j, \qquad \sum_j p_j = 1 - p_\text{sink} .$$
#
# The sink's share simply disappears from the output: a head can now say "nothing here" by
# making its output small. With the log-sum-exp that includes the sink,
# $\mathrm{LSE} = \log\big(e^{z_h} + \sum_k e^{s_k}\big)$, both are one exponential away:
# $p_j = e^{s_j - \mathrm{LSE}}$ and $p_\text{sink} = e^{z_h - \mathrm{LSE}}$.
#
# How much mass goes to the sink depends on the sink logit and on how many keys compete with it.
# With causal masking, row $i$ has $i + 1$ keys, so early rows give the sink more:

# %%
Sp, Dp = 64, 16
qp, kp = (torch.randn(1, 1, Sp, Dp, dtype=torch.float64) for _ in range(2))
scores = (qp @ kp.transpose(-1, -2) / math.sqrt(Dp)).masked_fill(~visibility_mask(Sp, Sp, causal=True), -math.inf)
z_values = torch.linspace(-4, 8, 49, dtype=torch.float64)
p_sink = []
for z in z_values:
    _, lse = cu.attention_reference(qp, kp, kp, causal=True, sinks=z.reshape(1), return_lse=True)  # V unused
    p_sink.append(torch.exp(z - lse.double())[0, 0])  # [rows]
    keys_mass = torch.exp(scores - lse.double()[..., None]).sum(dim=-1)[0, 0]
    cu.check_close(keys_mass + p_sink[-1], torch.ones(Sp, dtype=torch.float64), "keys' mass + sink mass = 1",
                   atol=1e-6, rtol=1e-6, quiet=True)  # the LSE is stored in float32
p_sink = torch.stack(p_sink)  # [z, rows]
z_show = 1.0
_, lse = cu.attention_reference(qp, kp, kp, causal=True, sinks=torch.tensor([z_show], dtype=torch.float64),
                                return_lse=True)
probs = torch.exp(scores - lse.double()[..., None])[0, 0, :16, :16]
with_sink = torch.cat([probs, torch.exp(z_show - lse.double())[0, 0, :16, None]], dim=1)
print("checked: keys' mass + sink mass = 1 on every row, for every sink logit")

# %%
fig, (ax_h, ax_c) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw=dict(width_ratios=[1, 1.2]))
plots.heatmap(ax_h, with_sink, title=f"probabilities, first 16 rows, sink logit z = {z_show:g}",
              xlabel="key j (last column: the sink)", vmin=0, vmax=1)
ax_h.axvline(15.5, color="white", lw=2)
ax_h.set_xticks(list(range(0, 16, 5)) + [16], [str(j) for j in range(0, 16, 5)] + ["sink"])
for row in (0, 3, 15, 63):
    ax_c.plot(z_values, p_sink[:, row], label=f"row {row} ({row + 1} key{'s' if row else ''})")
ax_c.plot(z_values, p_sink.mean(dim=1), "k--", label="mean over the 64 rows")
ax_c.set(title="share of the probability that goes to the sink", xlabel="sink logit z", ylabel="$p_{sink}$",
         ylim=(0, 1))
ax_c.legend(fontsize=8)
fig.tight_layout()

# %% [markdown]
# The sink competes with $\sum_k e^{s_k}$, which grows with the number of visible keys: row 0
# (one key) gives the sink half its weight at $z = s_0$, a late row needs a much larger $z$. In a
# sliding-window layer every late row has exactly W keys, so one learned $z_h$ means about the
# same thing for all of them.
#
# ### The forward: one term in the epilogue
#
# The sink has no value row, so the main loop does not change at all. Two things do. Before the
# loop, the sink's logit starts the running max (in raw score units, $z_h / \text{scale}$), instead
# of $-\infty$: every exponential is then at most 1 whatever the sink, so a sink of logit 100, or
# a sink that dominates scores of −100, cannot overflow. And once, after the last key block, the
# denominator gets the sink's term, $\ell \mathrel{+}= e^{z_h - m}$, written with `exp2` and the
# same guarded `shift` as the scores. The LSE written for the backward is then the $\log_2$-based
# $m + \log \ell$ converted to natural log, and it includes the sink. Exercise (d) writes that
# epilogue; the course's `init_running_max` and `normalise_rows` are listed after the exercises.

# %% [markdown]
# The sink logit is read straight from the `Sinks` tensor, one value per head. (TileLang's
# example copies it into a buffer of `heads` entries with a loop over `block_M` rows, which
# overflows the buffer whenever `block_M > heads`.) "No sink" is the same kernel with
# $z = -\infty$, whose term is $e^{-\infty} = 0$:

# %%
show_source(cu.attention.sink_logits)

# %% [markdown]
# ### The backward: the gradient of the sink logit
#
# Take one row (drop the batch and head indices) and write $\Delta = dO \cdot O$, the per-row
# quantity the backward's preprocessing kernel already computes. Differentiate the definitions
# above with respect to $z$:
#
# $$\frac{\partial\, \mathrm{LSE}}{\partial z} = \frac{e^{z}}{e^{z} + \sum_k e^{s_k}} = p_\text{sink},
# \qquad
# \frac{\partial p_j}{\partial z} = \frac{\partial}{\partial z} e^{s_j - \mathrm{LSE}}
#   = -p_j\, p_\text{sink} .$$
#
# With $dO = \partial L / \partial O$ and $O = \sum_j p_j v_j$, the chain rule gives
#
# $$\frac{\partial L}{\partial z} = \sum_j (dO \cdot v_j)\, \frac{\partial p_j}{\partial z}
#   = -p_\text{sink} \sum_j p_j\, (dO \cdot v_j) = -p_\text{sink}\, \Big(dO \cdot \sum_j p_j v_j\Big)
#   = -p_\text{sink}\, \Delta .$$
#
# Every query row $i$ of every batch entry $b$ uses head $h$'s sink, so the contributions add:
#
# $$\boxed{\ \frac{\partial L}{\partial z_h} = -\sum_{b,\,i} P_\text{sink}[b,h,i]\;\Delta[b,h,i],
#   \qquad P_\text{sink}[b,h,i] = e^{z_h - \mathrm{LSE}[b,h,i]}\ }$$
#
# **dQ, dK, dV do not change.** Treat the sink as one more key whose value row is 0. Its
# $dP_\text{sink} = dO \cdot 0 = 0$, so the softmax backward for a real key,
# $dS_j = p_j\big(dP_j - \sum_k p_k\, dP_k - p_\text{sink} \cdot 0\big) = p_j (dP_j - \Delta)$, is
# chapter 05's formula; only $p_j$ must be the probabilities *with* the sink, and recomputing
# them as $e^{s_j - \mathrm{LSE}}$ from the saved LSE gives exactly that. (The same formula for the
# sink itself, $p_\text{sink}(0 - \Delta)$, is the boxed result again.) So the backward kernels
# are untouched, and dsinks is a few PyTorch operations on two $[B, H, S]$ tensors (exercise (b);
# the course's lines are listed after the exercises).

# %% [markdown]
# Checked two ways: our kernels (dsinks included) against autograd through the float64 reference,
# which only knows the forward definition; and the reference's own dsinks against a central finite
# difference of $L(z) = \langle O(z), dO \rangle$, one head at a time. Then the check must catch a
# planted bug in dsinks and in the other gradients.

# %%
_, grads, ref_grads = compare_with_reference("GQA + sinks, causal", q, k, v, d_out, sinks=sinks, causal=True)
q64, k64, v64, d64 = (t.double() for t in (q, k, v, d_out))


def loss(z):
    return (cu.attention_reference(q64, k64, v64, causal=True, sinks=z) * d64).sum()


eps, z64 = 1e-6, sinks.double()
unit = torch.eye(H, dtype=torch.float64, device=cu.DEVICE)
finite_diff = torch.stack([(loss(z64 + eps * e) - loss(z64 - eps * e)) / (2 * eps) for e in unit])
cu.check_close(ref_grads["sinks"], finite_diff, "reference dsinks vs finite difference", atol=1e-6, rtol=1e-6)
refs = cu.validation.references(q, k, v, d_out=d_out, sinks=sinks, causal=True)
cu.show_bugs_caught(lambda *g: cu.check_backward(q, k, v, d_out, g, sinks=sinks, causal=True, refs=refs, quiet=True),
                    cu.backward_bugs(tuple(grads.values())))

# %% [markdown]
# ## 4 · All of it at once, and bad input
#
# `cu.flash_attention(q, k, v, causal=…, window_size=…, sinks=…)` takes any combination, and
# autograd differentiates it with respect to q, k, v **and** sinks. gpt-oss's window layers use
# all three: GQA, a window and sinks.

# %%
compare_with_reference(f"GQA {H}/{H_KV} + window {W} + sinks", q, k, v, d_out, sinks=sinks, window_size=W);

# %% [markdown]
# Inputs the kernels cannot take are rejected before anything is compiled, with a message that
# says what is wrong (`course_utils.core.reference.validate_attention_inputs`):

# %%
# NBVAL_CHECK_OUTPUT
q_bad, kv_bad = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)  # GQA 4/2; checked before any compilation
bad_inputs = {
    "sinks of the wrong shape": lambda: cu.flash_attention(q_bad, kv_bad, kv_bad, causal=True, sinks=torch.zeros(3)),
    "window_size=0": lambda: cu.flash_attention(q_bad, kv_bad, kv_bad, window_size=0),
    "H_q not a multiple of H_kv": lambda: cu.flash_attention(q_bad[:, :3], kv_bad, kv_bad, causal=True),
}
for what, call in bad_inputs.items():
    try:
        call()
        raise cu.CheckFailed(f"{what}: no error raised")
    except ValueError as exc:
        print(f"{what:28} → ValueError: {exc}")

# %% [markdown]
# ## 5 · Measured on an H100: gpt-oss attention
#
# The record below times one attention layer at the gpt-oss shape (batch 1, 64 query heads,
# 8 K/V heads, S = 4096, bfloat16, with sinks), for head dimensions 64 and 128, on the
# full-causal layers and on the 128-token window layers, forward and backward:
#
# - **TileLang (ours)**: `cu.flash_attention(q, k, v, causal=True, window_size=…, sinks=…)`;
# - **naive PyTorch**: the reference with sinks, computed in float32 (it builds the S × S scores);
# - **FlashAttention-2 and cuDNN** through PyTorch's SDPA, on the full-causal layers only and
#   *without* sinks (SDPA has neither sinks nor sliding windows), with K/V expanded to 64 heads.
#   They show what a sink-free kernel does on the same work: an upper bound, not a like-for-like
#   comparison.
#
# FLOPs: causal counts half the pairs, a window counts exactly its visible pairs, and the
# backward counts 2.5 times the forward (`cu.attention_flops`). At S = 4096 a 128-token window
# leaves far fewer pairs than full causal attention:

# %%
g = GPT_OSS_SHAPE
full = cu.attention_flops(g["batch"], g["heads"], g["seq"], g["seq"], g["dim"], causal=True)
band = cu.attention_flops(g["batch"], g["heads"], g["seq"], g["seq"], g["dim"], window_size=g["window"])
print(f"shape {g}\nforward FLOPs at D={g['dim']}: full causal {full:.3e}, window {g['window']} {band:.3e} "
      f"({full / band:.1f}× fewer)")

# %%
rec = cu.measured("ch06_gpt_oss_h100", RECORDS["ch06_gpt_oss_h100"])
rows = rec["results"]
check_stored_errors(rows, "ch06 gpt-oss record (O, LSE, dQ, dK, dV, dsinks)",
                    unchecked=(NAIVE, FA4) + tuple(f"{p}, no sinks" for p in PEERS))
SHORT_NAMES = {OURS: "ours", NAIVE: "naive", f"{FA2}, no sinks": "FA2*", f"{CUDNN}, no sinks": "cuDNN*", FA4: "FA4"}


def layer(r):
    return f"D={r['dim']} " + ("causal" if r["window"] is None else f"W={r['window']}")


for mode in ("fwd", "bwd"):
    table = [dict(r, impl=SHORT_NAMES[r["impl"]], layer=layer(r)) for r in rows if r["mode"] == mode]
    print(f"{mode} TFLOP/s (* = no sinks, K/V expanded)")
    print(plots.text_table(table, index="impl", columns="layer", value="tflops", fmt="{:.3g}", width=14), "\n")
print("ours, error of O and dQ vs the float64 reference (share of the allowed error): " + ", ".join(
    f"{layer(r)} {r['errors']['O']['err']:.1e} ({r['errors']['O']['err'] / r['errors']['O']['allowed']:.0%}), "
    f"{r['errors']['dQ']['err']:.1e} ({r['errors']['dQ']['err'] / r['errors']['dQ']['allowed']:.0%})"
    for r in rows if r["impl"] == OURS and r["mode"] == "fwd"))

# %%
layers = list(dict.fromkeys(layer(r) for r in rows))
impls = list(dict.fromkeys(r["impl"] for r in rows))
ms = {(r["impl"], r["mode"], layer(r)): r["ms"] for r in rows}
tf = {(r["impl"], r["mode"], layer(r)): r["tflops"] for r in rows}
colors = dict(plots.IMPL_COLORS, **{n: plots.IMPL_COLORS[n.replace(", no sinks", "")] for n in impls
                                    if n.endswith(", no sinks")})
fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), sharey=True)
for ax, mode in zip(axes, ("fwd", "bwd")):
    for x, lay in enumerate(layers):
        present = [impl for impl in impls if (impl, mode, lay) in tf]
        width = 0.8 / len(present)
        for n, impl in enumerate(present):
            xn = x + (n - (len(present) - 1) / 2) * width
            ax.bar(xn, tf[impl, mode, lay], width, color=colors.get(impl), label=impl,
                   hatch="//" if "no sinks" in impl else None)
            if impl == OURS:
                speedup = ms[NAIVE, mode, lay] / ms[impl, mode, lay]
                ax.text(xn, tf[impl, mode, lay], f"{speedup:.0f}×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(layers)), layers)
    ax.set(title=f"gpt-oss attention, {'forward' if mode == 'fwd' else 'backward'} (on ours: speedup vs naive)",
           ylabel="TFLOP/s" if mode == "fwd" else None)
handles, labels = axes[0].get_legend_handles_labels()
by_label = dict(zip(labels, handles))
fig.legend(by_label.values(), by_label.keys(), loc="lower center", ncol=4, fontsize=9, bbox_to_anchor=(0.5, 0.04))
fig.suptitle(plots.record_caption(rec), fontsize=8, y=0.01)
fig.tight_layout(rect=(0, 0.1, 1, 1))
plots.save(fig, "ch06_gpt_oss");

# %%
for mode in ("fwd", "bwd"):
    for lay in layers:
        line = f"{mode} {lay:>11}: ours {ms[OURS, mode, lay]:.3f} ms = {ms[NAIVE, mode, lay] / ms[OURS, mode, lay]:.1f}× naive"
        for peer in [f"{p}, no sinks" for p in PEERS] + [FA4]:
            if (peer, mode, lay) in ms:
                line += f", {ms[peer, mode, lay] / ms[OURS, mode, lay]:.2f}× {SHORT_NAMES[peer]}"
        print(line)

# %%
by_row = {(r["impl"], r["mode"], layer(r)): r for r in rows}
against_fa4 = {f"{mode} {lay}": cu.speed_ratio(by_row[OURS, mode, lay], by_row[FA4, mode, lay])
               for mode in ("fwd", "bwd") for lay in layers if (FA4, mode, lay) in by_row}
if against_fa4:
    cu.claim_versus("ours against FlashAttention-4 on the same layers (GQA, sinks, window)", against_fa4,
                    cases="layer passes")
    print("FlashAttention-4's O against ours, max |difference|: " + ", ".join(
        f"{layer(r)} {r['max_diff_vs_ours']:.1e}" for r in rows if r["impl"] == FA4 and r["mode"] == "fwd"))
else:
    print("no FlashAttention-4 rows: flash-attn-4 was not installed where this record was measured")

# %% [markdown]
# A later run on an H200 (the same SM90 tensor cores and 132 SMs as the H100, more memory bandwidth) timed the same layers
# the same way with FlashAttention-4 installed. Its record's ratios, ours against FlashAttention-4 (above 1: ours
# ahead), and the claim that counts them beyond the spread:

# %%
rec_fa4 = cu.bench.stored_record("ch06_gpt_oss_h200")
if rec_fa4 is not None:
    check_stored_errors(rec_fa4["results"], "ch06 gpt-oss record on the H200",
                        unchecked=(NAIVE, FA4) + tuple(f"{p}, no sinks" for p in PEERS))
    on_h200 = {(r["impl"], r["mode"], layer(r)): r for r in rec_fa4["results"]}
    versus = {f"{mode} {lay}": cu.speed_ratio(on_h200[OURS, mode, lay], on_h200[FA4, mode, lay])
              for mode in ("fwd", "bwd") for lay in layers}
    print(", ".join(f"{case} {float(ratio):.2f}×" for case, ratio in versus.items()))
    cu.claim_versus("H200: ours against FlashAttention-4 on the same layers", versus, cases="layer passes",
                    says="mixed")

# %% [markdown]
# How to read it. Each ratio compares times on the same layer; above 1, ours is faster. The
# SDPA kernels run without sinks on K/V expanded to 64 heads, and their times include that
# expansion (a copy of K and V, and in the backward the sum of the expanded gradients): on the
# full-causal layers they are a reference point for a sink-free kernel, not an exact competitor.
# FlashAttention-4 (`pip install flash-attn-4`) runs the very same layers, sinks, window and GQA included:
# it is the exact competitor, and the claim above counts the layer passes where ours is ahead of it, level
# with it (within the spread of the rounds) or behind. Its output agrees with ours to the printed difference.
#
# The window layers do not speed up in proportion to their FLOPs. The next cell compares each
# window layer with the full-causal layer of the same head dimension, and counts the key tiles
# each query block of our forward visits with its GPU tiling (section 2's bounds):

# %%
cfg = cu.ForwardConfig(**next(r["config"] for r in rows if r["impl"] == OURS and r["window"] is not None))
print("the forward the record measured on the window layers:", cfg)
classes = diagrams.tile_classes(g["seq"], g["seq"], cfg.block_M, cfg.block_N, window_size=g["window"])
visited = (classes != diagrams.SKIPPED).sum(axis=1)
print(f"GPU forward tiles {cfg.block_M}×{cfg.block_N}: {classes.shape[0]} query blocks per head; with the window "
      f"each visits {visited.min()}–{visited.max()} key tiles (full causal: 1–{classes.shape[1]})")
for mode in ("fwd", "bwd"):
    for d in sorted({r["dim"] for r in rows}):
        causal_l, window_l = f"D={d} causal", f"D={d} W={g['window']}"
        t_causal, t_window = ms[OURS, mode, causal_l], ms[OURS, mode, window_l]
        flop_ratio = tf[OURS, mode, causal_l] * t_causal / (tf[OURS, mode, window_l] * t_window)
        print(f"ours {mode} D={d:>3}: window layer has {flop_ratio:.1f}× fewer FLOPs, takes {t_causal / t_window:.1f}× "
              f"less time ({t_window:.3f} ms)")
dims = sorted({r["dim"] for r in rows})
window_fwd = {d: ms[OURS, "fwd", f"D={d} W={g['window']}"] for d in dims}
flops_fwd = {d: tf[OURS, "fwd", f"D={d} W={g['window']}"] * window_fwd[d] for d in dims}
cu.claim_change("ours, window layer forward, ms", window_fwd[dims[0]], window_fwd[dims[-1]],
                names=(f"D={dims[0]}", f"D={dims[-1]}"), says="higher")
time_growth, flop_growth = window_fwd[dims[-1]] / window_fwd[dims[0]], flops_fwd[dims[-1]] / flops_fwd[dims[0]]
cu.check_true(time_growth < flop_growth, f"the time grows {time_growth:.2f}×, less than the FLOPs ({flop_growth:.1f}×)")

# %% [markdown]
# With the window, every thread block streams only one or two key tiles, so the costs that do
# not shrink with the work are no longer hidden behind the matrix products: launching the kernel
# and the Python code around it, and per-block work such as loading Q and writing O. The forward
# of a window layer takes longer at D = 128 than at D = 64, but its time grows less than its FLOPs
# (both checked above), which fits that reading; a GPU profile would split those costs exactly. (The
# backward runs several kernels and a few PyTorch operations, so it has more such fixed costs.)
# Naive PyTorch gains nothing from the window: it computes the whole S × S score matrix and then
# masks it.
#
# ### GQA backward: atomic adds or split then sum?
#
# The second record times the two backward strategies of section 1 on the full-causal gpt-oss
# layer (D = 64, with sinks, no window), each through `cu.flash_attention`:

# %%
show_source(gqa_backward_strategies, "split then sum")
rec_gqa = cu.measured("ch06_gqa_backward_h100", RECORDS["ch06_gqa_backward_h100"])
check_stored_errors(rec_gqa["results"], "ch06 GQA strategies record (dQ, dK, dV)")
for r in rec_gqa["results"]:
    print(f"{r['strategy']:>14}: {r['ms']:.3f} ms, {r['tflops']:.0f} TFLOP/s (full-causal FLOPs)")
t = {r["strategy"]: r["ms"] for r in rec_gqa["results"]}
cu.claim_change(f"GQA backward (group {GPT_OSS_SHAPE['heads'] // GPT_OSS_SHAPE['heads_kv']}), ms",
                t["atomic adds"], t["split then sum"], names=("atomic adds", "split then sum"), says="about the same")
rec_layer = cu.measured("ch06_gpt_oss_h100", RECORDS["ch06_gpt_oss_h100"])
same_layer = [r for r in rec_layer["results"] if r["impl"] == OURS and r["mode"] == "bwd" and r["window"] is None
              and all(r[k] == rec_gqa["results"][0][k] for k in ("batch", "heads", "heads_kv", "seq", "dim", "dtype"))]
cu.check_true(len(same_layer) == 1, "the newer record times this layer's backward once")
cu.claim_change(f"this layer's backward (atomic adds), ms, in the record of {rec_gqa['machine']['date'][:10]} and in "
                f"the newer one of {rec_layer['machine']['date'][:10]}", t["atomic adds"], same_layer[0]["ms"],
                names=("older", "newer"), says="lower");

# %% [markdown]
# Split-then-sum moves more memory: it expands K and V to 64 heads, writes 64 heads of dK and
# dV, and lets autograd add them in groups of 8. The atomic version instead has the 8 query heads
# of a group add into the same float32 tiles, and then casts them. In this record the two took
# about the same time (the first claim above): either extra cost was small next to the backward's matrix
# products. The record is older than section 5's and timed the backward kernels of its date: the second
# claim sets its atomic-adds time beside the same layer's backward in section 5's newer record, and
# today's kernel is much faster. Whether the two strategies still tie on it is not measured until this
# record is measured again (`run_notebooks --refresh` on a GPU). The atomic version's lasting advantage is
# memory: it never allocates the expanded K, V, dK, dV.

# %% [markdown]
# ## 6 · The tile walk, step by step
#
# Which tiles does the forward compute, in which order, and which K/V head does each thread block
# read? The figure shows the finished walk for causal attention, a window of 20 keys, and GQA with
# 4 query heads on 2 K/V heads (S = 56, 16 × 16 tiles): full tiles in blue, tiles that need the
# mask in orange, skipped tiles hatched; the numbers give the order in which one head's thread
# blocks compute them (with a mask, the last query block starts first). In JupyterLab a stepper
# follows: pick a walk and move tile by tile.

# %%
from course_utils.pictures import steppers

walk_configs = {
    "causal": dict(seq_q=56, seq_k=56, block_M=16, block_N=16, causal=True),
    "window 20": dict(seq_q=56, seq_k=56, block_M=16, block_N=16, window_size=20),
    "GQA 4 → 2, causal": dict(seq_q=56, seq_k=56, block_M=16, block_N=16, causal=True, heads=4, heads_kv=2),
}
walks = steppers.tile_walk_stepper(walk_configs)
for name, walk in walks.items():
    classes = diagrams.tile_classes(56, 56, 16, 16, causal=True, window_size=walk_configs[name].get("window_size"))
    heads = walk_configs[name].get("heads", 1)
    cu.check_true(len(walk) == heads * int((classes != diagrams.SKIPPED).sum()),
                  f"{name}: {len(walk)} tiles computed = {heads} head(s) × the visited tiles")

# %% [markdown]
# ## Takeaways
# - **GQA** changes one index in the forward (`kv_head = by // group`); in the backward each
#   K/V head's gradient is the sum over its group, which our kernel accumulates with float32
#   atomic adds and a cast, instead of expanding K/V and summing afterwards.
# - **Sliding windows** give the forward's key loop a start (`k_start`) and the backward's query
#   loop an end (`q_end`); the bounds visit exactly the tiles with a visible pair, and the mask
#   handles the edges, for any W.
# - A window makes rows whose first visited key block is fully masked: without the `check_inf`
#   guard (shift by 0 while the running max is $-\infty$) they become NaN.
# - An **attention sink** is one extra term in the softmax denominator, added in the forward's
#   epilogue and included in the LSE. With that LSE, the recomputed P already leaves out the sink's
#   share, so dQ, dK, dV are unchanged, and $\partial L / \partial z_h = -\sum_{b,i} P_\text{sink}\,\Delta$.
# - `cu.flash_attention` supports all three together, differentiably in q, k, v and sinks.

# %% [markdown]
# ## Exercises

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) Attention with a sink, in PyTorch
#
# Write `sink_attention(q, k, v, sinks)`: non-causal attention for q, k, v of shape
# [B, H, S, D] (same number of heads) with one sink logit per head, `sinks` of shape [H]. Do it
# the way the gpt-oss reference code does: append the sink logit as one extra column of the
# scaled score matrix, take the softmax, drop that column, multiply by V.
#
# Stuck? `hint("06", "a", 1)`, then `hint("06", "a", 2)`; `solution("06", "a")` shows the answer.

# %% tags=["solution", "ex-a"]
def sink_attention(q, k, v, sinks):
    ### BEGIN SOLUTION
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    sink_column = sinks[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    return probs @ v
    ### END SOLUTION


# %%
from course_utils.exercises.ch06 import check_sink_attention

check_sink_attention(sink_attention)

# %% [markdown]
# ### (b) The sink gradient from P_sink and Δ
#
# Given `p_sink` $= e^{z_h - \mathrm{LSE}}$ and `delta` $= \Delta = \mathrm{rowsum}(dO \circ O)$,
# both of shape [B, H, S], return the gradient of the loss with respect to the sink logits, shape [H]
# (section 3's boxed formula).
#
# Stuck? `hint("06", "b", 1)`, then `hint("06", "b", 2)`; `solution("06", "b")` shows the answer.

# %% tags=["solution", "ex-b"]
def dsinks(p_sink, delta):
    ### BEGIN SOLUTION
    return -(p_sink * delta).sum(dim=(0, 2))
    ### END SOLUTION


# %%
from course_utils.exercises.ch06 import check_dsinks

check_dsinks(dsinks)

# %% [markdown]
# ### (c) How much work does a window leave?
#
# Write `visible_pairs(seq, window)`: the number of (query, key) pairs of self-attention over `seq`
# tokens that a sliding window of `window` keys leaves visible (query $i$ sees keys
# $i - W + 1, \dots, i$ that exist). This is what `cu.attention_flops` counts for a window layer.
# A closed form exists; a loop is fine too.
#
# Stuck? `hint("06", "c", 1)`, then `hint("06", "c", 2)`; `solution("06", "c")` shows the answer.

# %% tags=["solution", "ex-c"]
def visible_pairs(seq, window):
    ### BEGIN SOLUTION
    w = min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w  # rows 0..w-1 see i+1 keys, every later row sees w
    ### END SOLUTION


# %%
from course_utils.exercises.ch06 import check_visible_pairs

check_visible_pairs(visible_pairs)

# %% [markdown]
# ### (d) The window's key blocks and the sink, in the TileLang forward
#
# The kernel below is chapter 03's forward with grouped-query heads, a causal sliding window and
# sinks. Its key-tile loop body is given (it is chapter 03's exercise 3, with the window in its mask);
# two pieces are yours:
# - `window_block_range`: the key blocks `[start, stop)` that query block `qb` visits. `stop` is
#   the causal bound of chapter 03; `start` is the block that holds the first key in the window of
#   the block's **first** row, never below 0. Visiting fewer blocks loses keys; visiting more costs
#   time (the checker fills the keys no query can see with NaN, so it notices).
# - the epilogue: add the sink's term to `l` with `exp2` and the guarded `shift` (the sink has no
#   value row), then the LSE and the one division, as in chapter 03.
#
# As in section 3, the skeleton starts the running max at the sink's logit (in raw score units), so every
# exponential, the sink's included, is at most 1. (Started at −∞ with the sink added last, ℓ overflows
# once the sink exceeds the row's largest scaled score by about 88: run on the C backend with a sink logit
# of 100, that kernel returned LSE = +∞ where the answer is 100.) A head without a sink has z = −∞: its
# rows that see no key still end with m = −∞, which is what the guarded `shift` above your lines is for.

# %%
import tilelang.language as T

from course_utils.exercises.kernels import forward_tile_step
from course_utils.kernels.flash_pieces import LOG2E
from course_utils.kernels.tiles import TileBackend


def gpt_oss_forward(batch, heads, heads_kv, seq_q, seq_k, dim, *, window, block_M=16, block_N=8, target=None):
    """O and LSE of causal sliding-window attention with GQA and one sink logit per query head, float32."""
    tb, f32 = TileBackend(target), "float32"
    tile_step = forward_tile_step(tb, seq_q, seq_k, dim, block_M=block_M, block_N=block_N, window=window)
    epilogue = sink_epilogue(tb, dim, block_M=block_M)
    group = heads // heads_kv
    q_shape, kv_shape = [batch, heads, seq_q, dim], [batch, heads_kv, seq_k, dim]

    @T.prim_func
    def forward(Q: T.Tensor(q_shape, f32), K: T.Tensor(kv_shape, f32), V: T.Tensor(kv_shape, f32),
                Sinks: T.Tensor([heads], f32), O: T.Tensor(q_shape, f32), LSE: T.Tensor(q_shape[:3], f32)):
        with tb.kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=128) as (qb, h, b):
            Q_s, K_s, V_s = tb.shared([block_M, dim], f32), tb.shared([block_N, dim], f32), tb.shared([block_N, dim], f32)
            S, P = tb.fragment([block_M, block_N], f32), tb.shared([block_M, block_N], f32)
            acc_o = tb.fragment([block_M, dim], f32)
            m, m_prev, shift, alpha, l, row_sum, lse = (tb.fragment([block_M], f32) for _ in range(7))
            T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            for i in tb.parallel(block_M):  # m starts at the sink (raw score units), as in section 3: every e^x ≤ 1
                m[i] = Sinks[h] * math.sqrt(dim)
            start, stop = window_block_range(qb, block_M=block_M, block_N=block_N, seq_q=seq_q, seq_k=seq_k,
                                             window=window)
            for kb in T.Pipelined(start, stop, num_stages=1):
                T.copy(K[b, h // group, kb * block_N:(kb + 1) * block_N, :], K_s)
                T.copy(V[b, h // group, kb * block_N:(kb + 1) * block_N, :], V_s)
                tile_step(Q_s, K_s, V_s, S, P, acc_o, m, m_prev, shift, alpha, l, row_sum, qb, kb)
            epilogue(acc_o, m, shift, l, lse, Sinks[h])
            T.copy(acc_o, O[b, h, qb * block_M:(qb + 1) * block_M, :])
            T.copy(lse, LSE[b, h, qb * block_M:(qb + 1) * block_M])

    return forward

# %% [markdown]
# Stuck? `hint("06", "d", 1)`, then `hint("06", "d", 2)`; `solution("06", "d")` shows the answer.


# %% tags=["solution", "ex-d"]
def window_block_range(qb, *, block_M, block_N, seq_q, seq_k, window):
    """The key blocks [start, stop) that query block qb visits (TileLang expressions of qb)."""
    past = seq_k - seq_q  # query q sees key k iff q + past - window < k <= q + past
    ### BEGIN SOLUTION
    start = T.max(0, (qb * block_M + past - window + 1) // block_N)
    stop = T.min(T.ceildiv(seq_k, block_N), T.ceildiv((qb + 1) * block_M + past, block_N))
    ### END SOLUTION
    return start, stop


def sink_epilogue(tb, dim, *, block_M):
    scale_log2 = LOG2E / math.sqrt(dim)
    neg_inf = -T.infinity("float32")

    @T.macro
    def epilogue(acc_o, m, shift, l, lse, sink):  # sink: this head's logit (natural log units)
        for i in tb.parallel(block_M):
            shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
        ### BEGIN SOLUTION
        for i in tb.parallel(block_M):
            l[i] += T.exp2(sink * LOG2E - shift[i])
            lse[i] = T.if_then_else(l[i] > 0, (shift[i] + T.log2(l[i])) / LOG2E, neg_inf)
        for i, j in tb.parallel(block_M, dim):
            acc_o[i, j] = T.if_then_else(l[i] > 0, acc_o[i, j] / l[i], 0)
        ### END SOLUTION

    return epilogue


# %%
from course_utils.exercises.ch06 import check_gpt_oss_forward

check_gpt_oss_forward(gpt_oss_forward)

# %% [markdown]
# ### (e) GQA, the window and sinks in your own kernel
#
# Exercise (d) filled two holes in the course's kernel. Now add all three features to **your**
# forward of chapter 03, exercise (d): the cell below prints it, its two cells, (the course's, if yours is not
# finished; it says which). Copy its body into the skeleton and change three things:
# - **GQA**: query head `h` reads K/V head `h // group`;
# - **the window**: the key loop starts at the block of the first row's first key, and the mask
#   also hides keys with `k <= q + past − window` (the kernel is causal);
# - **sinks**: the running max starts at the sink's logit instead of −∞ (as in (d)'s skeleton, and for
#   the reason given there), and the epilogue adds the sink's term to `ℓ`, with the guarded shift,
#   before the LSE and the division.
#
# The checker runs (d)'s cases, then one more: sinks of 100 and −100 that exceed every score of
# their rows by about 100, where a kernel that starts the running max at −∞ overflows.
#
# Stuck? `hint("06", "e", 1)`, then `hint("06", "e", 2)`; `solution("06", "e")` shows the answer.

# %%
from course_utils.exercises import your_code

your_code("03", "d")

# %% tags=["solution", "ex-e"]
def my_softmax_step(tb, dim, *, block_M, block_N):
    """Your chapter-03 step: for one tile of masked scores S, the online softmax, the rescale, acc_o += P V."""
    scale_log2 = LOG2E / math.sqrt(dim)
    neg_inf = -T.infinity("float32")

    @T.macro
    def softmax_step(S, P, V_s, acc_o, m, m_prev, shift, alpha, l, row_sum):
        ### BEGIN SOLUTION
        T.copy(m, m_prev)
        T.reduce_max(S, m, dim=1, clear=False)
        for i in tb.parallel(block_M):
            shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
            alpha[i] = T.exp2(m_prev[i] * scale_log2 - shift[i])
        for i, j in tb.parallel(block_M, block_N):
            S[i, j] = T.exp2(S[i, j] * scale_log2 - shift[i])
        T.reduce_sum(S, row_sum, dim=1)
        for i in tb.parallel(block_M):
            l[i] = l[i] * alpha[i] + row_sum[i]
        for i, j in tb.parallel(block_M, dim):
            acc_o[i, j] *= alpha[i]
        T.copy(S, P)
        T.gemm(P, V_s, acc_o)
        ### END SOLUTION

    return softmax_step


# %% tags=["solution", "ex-e"]
def my_gpt_oss_forward(batch, heads, heads_kv, seq_q, seq_k, dim, *, window, block_M=16, block_N=8, target=None):
    """O and LSE of causal sliding-window attention with GQA and one sink logit per query head, float32."""
    tb, f32 = TileBackend(target), "float32"
    softmax_step = my_softmax_step(tb, dim, block_M=block_M, block_N=block_N)
    scale_log2, past, neg_inf = LOG2E / math.sqrt(dim), seq_k - seq_q, -T.infinity(f32)  # q sees k: k <= q + past
    group, q_shape, kv_shape = heads // heads_kv, [batch, heads, seq_q, dim], [batch, heads_kv, seq_k, dim]

    @T.prim_func
    def forward(Q: T.Tensor(q_shape, f32), K: T.Tensor(kv_shape, f32), V: T.Tensor(kv_shape, f32),
                Sinks: T.Tensor([heads], f32), O: T.Tensor(q_shape, f32), LSE: T.Tensor(q_shape[:3], f32)):
        with tb.kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=128) as (qb, h, b):
            # Tiles as in chapter 03 (d).
            ### BEGIN SOLUTION
            Q_s, K_s, V_s = tb.shared([block_M, dim], f32), tb.shared([block_N, dim], f32), tb.shared([block_N, dim], f32)
            S, P, acc_o = tb.fragment([block_M, block_N], f32), tb.shared([block_M, block_N], f32), tb.fragment([block_M, dim], f32)
            m, m_prev, shift, alpha, l, row_sum, lse = (tb.fragment([block_M], f32) for _ in range(7))
            T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.fill(acc_o, 0)
            T.fill(l, 0)
            for i in tb.parallel(block_M):  # the sink's logit in raw score units: every e^x ≤ 1
                m[i] = Sinks[h] * math.sqrt(dim)
            start = T.max(0, (qb * block_M + past - window + 1) // block_N)
            stop = T.min(T.ceildiv(seq_k, block_N), T.ceildiv((qb + 1) * block_M + past, block_N))
            for kb in T.Pipelined(start, stop, num_stages=1):
                T.copy(K[b, h // group, kb * block_N:(kb + 1) * block_N, :], K_s)
                T.copy(V[b, h // group, kb * block_N:(kb + 1) * block_N, :], V_s)
                T.clear(S)
                T.gemm(Q_s, K_s, S, transpose_B=True)
                for i, j in tb.parallel(block_M, block_N):
                    q, k = qb * block_M + i, kb * block_N + j
                    visible = T.And(T.And(k < seq_k, k <= q + past), k > q + past - window)
                    S[i, j] = T.if_then_else(visible, S[i, j], neg_inf)
                softmax_step(S, P, V_s, acc_o, m, m_prev, shift, alpha, l, row_sum)
            for i in tb.parallel(block_M):
                shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
                l[i] += T.exp2(Sinks[h] * LOG2E - shift[i])
                lse[i] = T.if_then_else(l[i] > 0, (shift[i] + T.log2(l[i])) / LOG2E, neg_inf)
            for i, j in tb.parallel(block_M, dim):
                acc_o[i, j] = T.if_then_else(l[i] > 0, acc_o[i, j] / l[i], 0)
            T.copy(acc_o, O[b, h, qb * block_M:(qb + 1) * block_M, :])
            T.copy(lse, LSE[b, h, qb * block_M:(qb + 1) * block_M])
            ### END SOLUTION

    return forward


# %%
from course_utils.exercises.ch06 import check_my_gpt_oss_forward

check_my_gpt_oss_forward(my_gpt_oss_forward)


# %% [markdown]
# ## The course's kernels, listed (read after the exercises)
#
# The course's own code for what the exercises above asked you to write, kept until after them so that
# it cannot give the answer away.

# %% [markdown]
# From section 1 · Grouped-query attention: the forward's K/V head.

# %%
show_source(flash_fwd_kernel, "setup")
show_source(flash_fwd_kernel, "scores")
show_source(flash_fwd_kernel, "pv")

# %% [markdown]
# From section 2 · Sliding windows: the forward's key blocks, the mask, the guarded online softmax.

# %%
show_source(key_block_range)

# %%
show_source(visible)

# %%
show_source(online_softmax)

# %% [markdown]
# From section 3 · Attention sinks: the running max started at the sink, the epilogue, and dsinks.

# %%
show_source(init_running_max)
show_source(normalise_rows)

# %%
show_source(attention_backward, "dsinks")
