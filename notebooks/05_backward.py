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
# # 05 · The backward pass
#
# **Question.** Training needs the gradients $dQ$, $dK$, $dV$ of a loss, given $dO$, the gradient
# with respect to the attention output. The forward of chapter 03 kept only $O$ and one number per
# query row, the log-sum-exp; it never stored the $S_q \times S_k$ matrix of probabilities. How can
# the backward produce exact gradients without that matrix, and how do thread blocks share the work
# when every query's gradient depends on every key and every key's gradient on every query?
#
# The plan:
# 1. derive the five gradient formulas and check each one against `torch.autograd`;
# 2. see why $P$ is recomputed from the LSE rather than stored;
# 3. split the work: one thread block per **key** block, and atomic adds for $dQ$;
# 4. read the three TileLang kernels (a Δ pre-pass, the main kernel, a dQ post-pass), run them on
#    this machine and watch a wrong kernel fail;
# 5. read what the atomic adds become in CUDA for an H100, and a layout trick from upstream TileLang;
# 6. the H100 measurements: a tiling sweep, and the backward next to FlashAttention-2 and cuDNN.
#
# The algorithm is the backward of FlashAttention-2 (Tri Dao, [*FlashAttention-2: Faster Attention
# with Better Parallelism and Work Partitioning*](https://arxiv.org/abs/2307.08691), 2023); the kernel
# follows the structure of the FlashAttention backward examples that ship with TileLang.

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from course_utils.pictures import diagrams, plots
from course_utils.api.attention import BackwardConfig, default_backward_config
from course_utils.measure.benchmarks import CH05_BACKWARD_CONFIG, RECORDS, comparison_shapes
from course_utils.kernels.flash_bwd import flash_bwd_kernel, flash_bwd_postprocess_kernel, flash_bwd_preprocess_kernel
from course_utils.kernels.flash_pieces import query_block_range, store_dkv
from course_utils.core.labels import CUDNN, FA2, OURS, PEERS, SHORT
from course_utils.checking.validation import check_stored_errors
from course_utils.core.source import count, cuda_source, grep, show_source
from course_utils.kernels.tiles import Tiling, compile_kernel

torch.manual_seed(0);

# %% [markdown]
# ## 1 · The gradients, derived and checked
#
# Take one (batch, head): $Q$ is $S_q \times D$, $K$ and $V$ are $S_k \times D$, and $s$ is the
# softmax scale ($1/\sqrt{D}$ by default). The forward computes
#
# $$S = s\,QK^\top, \qquad P = \mathrm{softmax}(S) \text{ row by row}, \qquad O = PV ,$$
#
# with masked scores set to $-\infty$, so their probability is 0. Given $dO = \partial L/\partial O$,
# walk back through the three steps.
#
# **$O = PV$** is a matrix product, so $\;dV = P^\top dO\;$ and $\;dP = dO\,V^\top$.
#
# **The softmax.** In row $i$, $P_{ij} = e^{S_{ij}} / \sum_k e^{S_{ik}}$, whose derivative is
# $\partial P_{ij}/\partial S_{il} = P_{ij}(\delta_{jl} - P_{il})$. Summing over $j$:
#
# $$dS_{il} = \sum_j dP_{ij}\, P_{ij}(\delta_{jl} - P_{il}) = P_{il}\,\big(dP_{il} - \Delta_i\big),
# \qquad \Delta_i = \sum_j P_{ij}\, dP_{ij} .$$
#
# **$S = s\,QK^\top$** is a product again: $\;dQ = s\; dS\,K\;$ and $\;dK = s\; dS^\top Q$.
#
# **Why Δ is cheap.** As written, $\Delta_i$ needs a whole row of $P$ and of $dP$. Substitute
# $dP_{ij} = \sum_d dO_{id} V_{jd}$ and swap the sums:
#
# $$\Delta_i = \sum_j P_{ij} \sum_d dO_{id} V_{jd} = \sum_d dO_{id} \underbrace{\sum_j P_{ij} V_{jd}}_{O_{id}}
# = \sum_d dO_{id}\, O_{id} .$$
#
# So $\Delta = \mathrm{rowsum}(dO \circ O)$: $D$ products per row, from two tensors the backward
# receives anyway, and no $P$ at all. A small kernel computes it before the main one.
#
# Now check every formula numerically, in float64, on a small causal problem with $S_q \ne S_k$.
# The reference gradients come from `torch.autograd` through `cu.attention_reference`.

# %%
B, H, S_q, S_k, D = 1, 2, 12, 20, 8
causal = True  # bottom-right aligned: query i sees keys j <= i + (S_k - S_q)
q, k, v = (torch.randn(B, H, n, D, dtype=torch.float64, requires_grad=True) for n in (S_q, S_k, S_k))
d_out = torch.randn(B, H, S_q, D, dtype=torch.float64)
out = cu.attention_reference(q, k, v, causal=causal)
out.backward(d_out)  # autograd fills q.grad, k.grad, v.grad: the answers to match

scale = 1 / math.sqrt(D)
Q, K, V, O = q.detach(), k.detach(), v.detach(), out.detach()
visible = cu.reference.visibility_mask(S_q, S_k, causal=causal)
S = (scale * Q @ K.transpose(-1, -2)).masked_fill(~visible, -math.inf)
P = torch.softmax(S, dim=-1)
cu.check_close(P @ V, O, "O = P V, by hand");

# %% [markdown]
# $dV$ against autograd, and $dP$ against autograd through $O = PV$ alone (a copy of $P$ made a leaf):

# %%
dV = P.transpose(-1, -2) @ d_out
cu.check_close(dV, v.grad, "dV = Pᵀ dO")
dP = d_out @ V.transpose(-1, -2)
P_leaf = P.clone().requires_grad_()
(P_leaf @ V).backward(d_out)
cu.check_close(dP, P_leaf.grad, "dP = dO Vᵀ");

# %% [markdown]
# Δ both ways, then $dS$ against autograd through the softmax (a copy of $S$ made a leaf; its
# masked entries are $-\infty$ and get gradient 0, as $P = 0$ there makes $dS = 0$ in the formula):

# %%
delta_from_P = (P * dP).sum(-1)  # needs S_q × S_k matrices
delta = (d_out * O).sum(-1)  # needs only O and dO
cu.check_close(delta, delta_from_P, "Δ = rowsum(dO∘O) = rowsum(P∘dP)")
dS = P * (dP - delta[..., None])
S_leaf = S.clone().requires_grad_()
(torch.softmax(S_leaf, dim=-1) @ V).backward(d_out)
cu.check_close(dS, S_leaf.grad, "dS = P∘(dP − Δ)");

# %%
cu.check_close(scale * dS @ K, q.grad, "dQ = scale · dS K")
cu.check_close(scale * dS.transpose(-1, -2) @ Q, k.grad, "dK = scale · dSᵀ Q");

# %% [markdown]
# ### Recompute $P$, do not store it
#
# Every formula needs $P$. The forward could have saved it, but $P$ has $S_q \cdot S_k$ entries
# per head, while everything else the backward touches has $S \cdot D$. What chapter 02 set up
# instead is the LSE: one float per query row, with which any tile of $P$ comes back exactly, with
# no row maximum and no sum:
#
# $$P_{ij} = e^{S_{ij} - \mathrm{LSE}_i}, \qquad \mathrm{LSE}_i = \log \sum_j e^{S_{ij}} .$$

# %%
lse = torch.logsumexp(S, dim=-1)
cu.check_close(torch.exp(S - lse[..., None]), P, "P = exp(S − LSE)");

# %% [markdown]
# What storing $P$ would cost, per attention layer, at the comparison shapes of chapter 03
# (B·S = 16k tokens, H = 16, D = 128, fp16 tensors, float32 LSE):

# %%
# NBVAL_CHECK_OUTPUT
MiB = 2**20
print(f"{'S':>6} {'B':>3} {'P (fp16)':>11} {'LSE (fp32)':>11} {'Q,K,V,O,dO (fp16)':>18}")
for shape in comparison_shapes(dim=128):
    b, h, s, d = shape["batch"], shape["heads"], shape["seq"], shape["dim"]
    print(f"{s:>6} {b:>3} {b * h * s * s * 2 / MiB:>7.0f} MiB {b * h * s * 4 / MiB:>7.2f} MiB "
          f"{5 * b * h * s * d * 2 / MiB:>14.0f} MiB")

# %% [markdown]
# With the number of tokens fixed, $P$ grows linearly with $S$ while the five $S \times D$ tensors
# stay the same size; from $S = 1\text{k}$ on, $P$ alone is larger than all five together, and a
# model keeps one per layer for its backward. The LSE is a rounding error next to them.
#
# The price of recomputing is one extra matrix product. The backward then runs five products of
# $2\,S_q S_k D$ FLOPs each ($S = QK^\top$ again, $dP = dO\,V^\top$, $dV = P^\top dO$,
# $dQ = dS\,K$, $dK = dS^\top Q$) against the forward's two: this is where the course's convention
# "backward = 2.5 × forward" comes from.

# %%
b, h, s, d = 4, 16, 4096, 128
five_products = 5 * 2 * b * h * s * s * d
cu.check_true(cu.attention_flops(b, h, s, s, d, mode="bwd") == five_products,
              "attention_flops(mode='bwd') = 5 products of 2·S_q·S_k·D = 2.5 × forward")

# %% [markdown]
# ## 2 · Splitting the work: one thread block per key block
#
# Look at the sums. $dV_j = \sum_i P_{ij}\, dO_i$ and $dK_j$ sum over **queries**; $dQ_i$ sums
# over **keys**. Whichever way the score matrix is cut into tiles, one of the three gradients is a
# sum over tiles that different thread blocks compute.
#
# FlashAttention-2 parallelises over **key blocks**; our grid is `(⌈S_k / block_N⌉, H, B)`. Thread
# block `bx` loads its `block_N` keys and values once and keeps them resident, then walks down its
# column of tiles, one query block per step. $dK$ and $dV$ of its keys accumulate in registers
# and are written once at the end: one writer each. $dQ$ rows get a partial sum from every key
# block that sees them, so they are accumulated in a float32 buffer with **atomic adds**.
# Causal masking skips the tiles above the diagonal, as in the forward, so the early query rows
# have fewer writers.

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4.3))
for ax, causal_ in zip(axes, (False, True)):
    diagrams.backward_grid(ax, 64, 64, 16, 16, causal=causal_)
fig.tight_layout()
plt.show()

# %% [markdown]
# **The alternative, and the trade-off.** $dQ$ could instead come from a second kernel with a grid
# over *query* blocks, like the forward: each block walks over the key blocks and keeps $dQ$ in
# registers. No atomics, and the result is bitwise reproducible (with atomics the order in which
# the partial sums land changes from run to run, and float addition is not associative). But that
# pass needs $P$ and $dP$ again, so it recomputes $QK^\top$ and $dO\,V^\top$, and reads $K$ and $V$
# once more: seven products instead of five. The atomic version pays with a float32 $dQ$ buffer
# that must start at zero, a small kernel to scale and cast it, and contention when blocks add
# into the same rows at the same time. How many adds is that at the H100 tiling?

# %%
config = CH05_BACKWARD_CONFIG
print(config)
b, h, s, d = 4, 16, 4096, 128
for causal_ in (False, True):
    tiles = int((diagrams.tile_classes(s, s, config.block_M, config.block_N, causal=causal_) != diagrams.SKIPPED).sum())
    adds = b * h * tiles * config.block_M * d
    print(f"causal={causal_!s:5}: {tiles} tiles per head, {adds / 1e6:.0f} M float32 atomic adds into "
          f"{b * h * s * d / 1e6:.1f} M dQ entries ({adds / (b * h * s * d):.1f} per entry)")
print(f"separate dQ pass instead: 7 products instead of 5, {7 / 5:.1f}× the backward's matrix FLOPs")

# %% [markdown]
# ### Why the kernel computes $S^\top$: keys as rows
#
# A thread block of the backward owns keys, and two of its outputs, $dV$ and $dK$, have one row per
# key. A tensor-core product `T.gemm(A, B, C)` can take its first operand `A` straight from
# registers when `A` is laid out with the rows of `C`. So the kernel computes every score tile
# transposed, $S^\top = K Q^\top$ (`block_N × block_M`, keys as rows): then $P^\top$ and $dS^\top$,
# produced in registers by element-wise code, feed the $dV$ and $dK$ products without a trip
# through shared memory. Only $dQ$ has queries as rows, and its product reads $dS^\top$ transposed
# from shared memory.
#
# | product (one step) | result `[rows × cols]` | A operand | A comes from |
# |---|---|---|---|
# | $S^\top = K\,Q^\top$ | `[block_N × block_M]` | `K_s` | shared memory |
# | $dP^\top = V\,dO^\top$ | `[block_N × block_M]` | `V_s` | shared memory |
# | $dV \mathrel{+}= P^\top dO$ | `[block_N × D]` | `PT_cast` | **registers** |
# | $dK \mathrel{+}= dS^\top Q$ | `[block_N × D]` | `dST_cast` | **registers** |
# | $dQ_\text{part} = (dS^\top)^\top K$ | `[block_M × D]` | `dST_s`, transposed | shared memory |
#
# Section 5 checks this table against the CUDA TileLang generates.

# %% [markdown]
# ## 3 · The three kernels
#
# All three live in `course_utils/kernels/flash_bwd.py` and, like every kernel of the course, are written
# once through `TileBackend` (chapter 00).
#
# ### 3.1 Δ, the pre-pass
#
# One thread block per `block` query rows of one (batch, head): load $O$ and $dO$ as float32
# tiles, multiply element by element, sum each row.
#
# *The listings of these pieces are at the end of the chapter, after the exercises, so that they do not
# give the exercises away; here the text and the formulas describe each piece.*
# %% [markdown]
# ### 3.2 The main kernel
#
# The grid is over key blocks. The buffers: the resident `K_s` and `V_s`; per step a query block
# `Q_s`, `dO_s` and its `lse` and `delta`; the transposed tiles `PT`, `dPT` (float32) and their
# copies in the input dtype for the tensor cores (16-bit on a GPU); and three float32 accumulators. `dv` and `dk` live for the
# whole kernel, `dq` for one step.

# %% [markdown]
# Which query blocks can see these keys? Causal masking (bottom-right aligned, `past = S_k − S_q`)
# lets key `j` be seen only by queries `i ≥ j − past`, so the walk starts at the first query block
# that holds such a query; a sliding window (chapter 06) also ends it early.

# %% [markdown]
# **Step 1: recompute $P^\top$.** One product gives $K Q^\top$ for this tile; the element-wise loop
# turns it into probabilities with the LSE, in the `exp2` form of chapter 02, and writes 0 where a
# (query, key) pair is masked or lies past the end of either sequence. `visible` is the same helper
# as in the forward.

# %% [markdown]
# **Step 2: $dP^\top$ and $dV$.** $dP^\top = V\,dO^\top$ from the two tiles in shared memory; then
# $P^\top$ is cast to 16 bits and multiplied by $dO$ into the register accumulator `dv`.

# %% [markdown]
# **Step 3: $dS^\top$ and $dK$.** The element-wise $dS^\top = P^\top \circ (dP^\top - \Delta)$, with
# $\Delta$ indexed by the query (the column `i`), then $dK \mathrel{+}= dS^\top Q$. The factor
# `sm_scale` is left out here and applied once at the end: one multiply per element of $dK$ instead
# of one per score.

# %% [markdown]
# **Step 4: this key block's share of $dQ$.** $dS^\top$ goes to shared memory, the product reads it
# transposed (`transpose_A=True`) to get $dS\,K$ for the `block_M` query rows, and every element is
# added atomically into the float32 buffer `dQ_acc`. Rows past the end of the queries are skipped.

# %% [markdown]
# **After the walk**, $dK$ gets its scale and both gradients are written once. (With grouped-query
# attention several query heads share one K/V head, and these writes become atomic adds too:
# chapter 06.)

# %% [markdown]
# ### 3.3 dQ, the post-pass
#
# When every key block has added its share, a last small kernel multiplies the float32 sums by
# `sm_scale` and casts them to the input dtype.

# %% [markdown]
# ### 3.4 Wired into autograd
#
# `cu.flash_attention` is a `torch.autograd.Function`. Its forward saves $Q, K, V, O$ and the LSE;
# its backward is `cu.attention_backward`, which runs the three kernels in order, on a zeroed
# float32 buffer for $dQ$. (A loss that also uses the returned LSE, such as a z-loss, sends a
# gradient `d_lse` to it; since $\partial\,\mathrm{LSE}_i / \partial s_{ij} = P_{ij}$, it simply
# joins $\Delta$ as $\Delta - d\mathrm{LSE}$.)

# %% [markdown]
# ## 4 · Run it, and check it
#
# On a CPU the kernels run through TileLang's C backend in float32 with 16 × 16 tiles; on a GPU,
# in fp16 at this chapter's tiling (`CH05_BACKWARD_CONFIG`; on an H100, `flash_attention` would
# otherwise run chapter 08's Hopper backward). The cases include sequences that are not a multiple
# of the block, causal and not, and $S_q \ne S_k$. Each backward compiles three kernels the first
# time a shape is seen, and is cached afterwards.
#
# `cu.check_backward` compares every gradient, on every batch entry and head, with autograd through
# the float64 reference. fp16 gradients are judged as in chapter 03, the way FlashAttention's tests
# judge them: at most 3× the error of the same backward computed by PyTorch in fp16, plus 10⁻⁵.

# %%
dtype = cu.pick(cpu=torch.float32, gpu=torch.float16)
bwd_config = cu.pick(cpu=default_backward_config("cpu"), gpu=CH05_BACKWARD_CONFIG)
print("tiling:", bwd_config)
# (batch, heads, S_q, S_k, head_dim, causal)
cases = cu.pick(cpu=[(1, 2, 40, 40, 32, False), (2, 2, 40, 40, 16, True), (1, 2, 24, 40, 16, True)],
                gpu=[(2, 8, 1024, 1024, 128, False), (2, 4, 1000, 1000, 64, True), (1, 4, 300, 1000, 128, True)])

# %%
for batch, heads, seq_q, seq_k, dim, causal in cases:
    q = torch.randn(batch, heads, seq_q, dim, device=cu.DEVICE, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, heads, seq_k, dim, device=cu.DEVICE, dtype=dtype, requires_grad=True)
            for _ in range(2))
    d_out = torch.randn(batch, heads, seq_q, dim, device=cu.DEVICE, dtype=dtype)
    out = cu.flash_attention(q, k, v, causal=causal, backward_config=bwd_config)
    out.backward(d_out)  # runs the three backward kernels
    print(f"B={batch} H={heads} S_q={seq_q} S_k={seq_k} D={dim} causal={causal}")
    grads = (q.grad, k.grad, v.grad)
    cu.check_backward(q, k, v, d_out, grads, causal=causal, name=" ")

# %% [markdown]
# (The `tiling:` line above is stored from this chapter's GPU run of 2026-11-26, before `BackwardConfig`
# gained its fields `policies`, `dkdv_by_tma`, `longest_first` and `defer_dq_wait`; today's code prints
# the same tiling followed by those fields at their defaults, `None` and `False`, which is what chapter
# 05's tiling uses.)
#
# **Would the check notice a wrong backward?** The same check on gradients with planted bugs:
# dV scaled by 0.9, dK scaled by 0.9, dQ of a neighbouring head, and the gradients the kernels
# really give when $\Delta$ is dropped from $dS = P \circ (dP - \Delta)$ (run with $\Delta = 0$).
# Every one must fail:

# %%
q_, k_, v_ = (t.detach() for t in (q, k, v))
out, lse = cu.flash_attention(q_, k_, v_, causal=causal, return_lse=True)
without_delta = cu.validation.backward_without_delta(q_, k_, v_, out, lse, d_out, causal=causal,
                                                     config=bwd_config)
refs = cu.validation.references(q_, k_, v_, d_out=d_out, causal=causal)
cu.show_bugs_caught(lambda *g: cu.check_backward(q_, k_, v_, d_out, g, causal=causal, refs=refs, quiet=True),
                    cu.backward_bugs(grads, grads_without_delta=without_delta))

# %% [markdown]
# **Gradients accumulate.** PyTorch *adds* each backward into `.grad` (that is how gradient
# accumulation over micro-batches works), so a second forward and backward on the same leaves must
# leave twice the gradients of one: exactly on a CPU; on a GPU up to rounding, since the atomic adds
# into dQ land in a different order each run.

# %%
single = [t.grad.clone() for t in (q, k, v)]
cu.flash_attention(q, k, v, causal=causal, backward_config=bwd_config).backward(d_out)  # cached: no compilation
for name, t, g in zip(("dQ", "dK", "dV"), (q, k, v), single):
    # Held to the tolerance of the gradients' own dtype: two runs' atomic sums may differ in the last bit.
    cu.check_close(t.grad, 2 * g, f"{name} after two backwards = 2 × one", dtype=t.grad.dtype)

# %% [markdown]
# ### The three kernels by hand, and a wrong one
#
# The same backward without autograd: `cu.backward_kernels` returns the three compiled kernels of
# the last case (from the cache `cu.flash_attention` filled); we call them in order.

# %%
kernels = cu.backward_kernels(q_, k_, causal=causal, config=bwd_config)


def backward_by_hand(main_kernel):
    delta = kernels.preprocess(out, d_out)
    dq_acc = torch.zeros(q_.shape, dtype=torch.float32, device=q_.device)  # atomics need a zeroed buffer
    dk, dv = torch.empty_like(k_), torch.empty_like(v_)
    main_kernel(q_, k_, v_, d_out, lse, delta, dq_acc, dk, dv)
    return kernels.postprocess_dq(dq_acc), dk, dv


cu.check_backward(q_, k_, v_, d_out, backward_by_hand(kernels.main), causal=causal, refs=refs,
                  name="kernels called by hand:");

# %% [markdown]
# A classic slip is scaling the scores by $1/D$ instead of $1/\sqrt{D}$. Build the main kernel
# with that scale and run it: the recomputed $P$ is then wrong, and so is every gradient. The check
# raises `CheckFailed`; `cu.expect_failure` catches it to print the message (a notebook would stop
# at this cell) and would raise if the wrong kernel passed.

# %%
dtype_name = str(dtype).removeprefix("torch.")
wrong_main = compile_kernel(
    flash_bwd_kernel(batch, heads, seq_q, seq_k, dim, causal=causal, sm_scale=1.0 / dim, dtype=dtype_name,
                     tiling=Tiling(**bwd_config.tiling())),
    out_idx=[], dtype=dtype_name)
cu.expect_failure("sm_scale = 1/D", lambda: cu.check_backward(q_, k_, v_, d_out, backward_by_hand(wrong_main),
                                                                causal=causal, refs=refs, quiet=True))

# %% [markdown]
# ## 5 · What the atomic adds become on an H100
#
# Lower the main kernel at the H100 tiling (D = 128, `block_M = 64` queries per step, `block_N =
# 128` resident keys, 256 threads, fp16, causal) to CUDA for `sm_90a`, without a GPU. First the
# five products: which are `wgmma_ss` (both operands from shared memory) and which `wgmma_rs`
# (first operand from registers), and which accumulator each one writes.

# %%
import re

h100_shape = dict(batch=4, heads=16, seq_q=4096, seq_k=4096, dim=128)
h100_main = flash_bwd_kernel(*h100_shape.values(), causal=True, dtype="float16", target="cuda",
                             tiling=Tiling(**config.tiling()))
src_90 = cuda_source(h100_main, arch="sm_90a")
grep(src_90, r"__global__ void __launch_bounds__", max_hits=1)
for line in src_90.splitlines():
    if m := re.search(r"(wgmma_(?:ss|rs))<", line):
        a = re.search(r"const uint32_t\*>\((\w+)", line)
        acc = re.findall(r"(\w+) \+ 0\)", line)[-1]
        print(f"{m.group(1)}: A = {a.group(1) + ' (registers)' if a else 'shared memory'}, accumulates into {acc}")

# %% [markdown]
# As the table of section 2 said: the $dV$ and $dK$ products take $P^\top$ and $dS^\top$ from
# registers, the other three read shared memory. (384 threads: TileLang added a producer
# warpgroup for the TMA copies, as in the forward of chapter 03.) Now the atomic adds into `dQ_acc`:

# %%
atomics = {"AtomicAdd (1 float)": r"\bAtomicAdd\(", "AtomicAddx2 (2 floats)": r"\bAtomicAddx2\(",
           "AtomicAddx4 (4 floats)": r"\bAtomicAddx4\("}
print(count(src_90, atomics))
loop = src_90.splitlines()
start = next(n for n, line in enumerate(loop) if "AtomicAddx2" in line)
print("\n".join(line.strip() for line in loop[start - 2:start]))
print(re.sub(r"\(\(int\)threadIdx\.x\)", "t", loop[start].strip()))

# %% [markdown]
# Our kernel asks for one `T.atomic_add` per element, in a parallel loop. TileLang distributed the
# loop over the threads following the layout of the `dq` accumulator that `wgmma` produced, then
# *vectorised* it. Read the index, with `t` the thread (128 to 383: the 256 consumer threads) and
# `i_13` the loop counter: within the 64 × 128 tile, the row is `16·((t % 128) / 32) + 8·(i_13 % 2)
# + (t % 32) / 4` and the column `64·(t / 128 − 1) + 8·(i_13 / 2) + 2·(t % 4)`. So a thread's 32
# values are 16 pairs of **adjacent** columns, and each pair became one `AtomicAddx2`, which
# TileLang's header implements on sm_90 as a single `atomicAdd(float2*, float2)`: a vector atomic
# that CUDA offers on global memory from compute capability 9.0. What is *not* vectorised: nothing
# wider than two floats, because a thread's next pair is 8 columns away; and one warp instruction
# still touches 8 different rows of `dQ_acc`, 32 bytes in each.
#
# Earlier GPUs have no vector float atomic. Lowering the kernel for an A100 (`sm_80`) and for
# `sm_90a` at one smaller tiling (D = 64, to keep lowering short here), and counting the source
# lines that call each kind of atomic:

# %%
small = Tiling(block_M=64, block_N=64, num_stages=1, threads=128)
for arch in ("sm_80", "sm_90a"):
    src = cuda_source(flash_bwd_kernel(1, 16, 4096, 4096, 64, causal=True, dtype="float16", target="cuda",
                                       tiling=small), arch=arch)
    print(f"{arch:>6}: {count(src, atomics)}")

# %% [markdown]
# On `sm_80` every element is its own scalar `atomicAdd` (two lines, because that source handles
# the last query block of the walk after the main loop).
#
# ### The layout trick in TileLang's examples
#
# TileLang's FlashAttention backward examples attack the same cost from the other side. Their
# comment reads "atomicAdd can not be vectorized, so we need to reorder dq to match the 8x8 gemm
# fragment", and they give `dQ` a permuted layout with `T.annotate_layout` in the main kernel
# (and the same layout in the post-process, which reads it back):
#
# ```python
# def make_dq_layout(dQ):  # dQ: [batch, heads, seq, dim]
#     return T.Layout(dQ.shape, lambda b, h, l, d: [b, h, l // 8, d // 8, d % 2, 4 * (l % 8) + (d % 8) // 2])
# ```
#
# Within every 8 × 8 tile of $dQ$ (rows $l$, columns $d$), element $(l, d)$ goes to offset
# $32\,(d \bmod 2) + 4\,(l \bmod 8) + (d \bmod 8)/2$. In a tensor-core accumulator, an 8 × 8 tile
# is held by the 32 lanes of one warp, lane $4\,(l \bmod 8) + (d \bmod 8)/2$ holding two adjacent
# columns in its registers 0 and 1. So the new offset is just **32 · register + lane**. Checked
# with TileLang's own layout objects (its `T.Layout`, and the accumulator fragment of its Hopper
# gemm from `course_utils.pictures.layouts`), then drawn:

# %%
import tilelang.language as T

from course_utils.pictures import layouts

tile_layout = T.Layout([8, 8], lambda l, d: [l // 8, d // 8, d % 2, 4 * (l % 8) + (d % 8) // 2])  # one 8 × 8 tile
offsets = layouts.layout_offsets(tile_layout)
_, fragments = layouts.gemm_fragments(64, 64, 16, 128, transpose_b=False, hopper=True)
lanes, registers = (table[:8, :8] for table in layouts.fragment_tables(fragments["C"]))
cu.check_true(np.array_equal(offsets, 32 * (registers % 2) + lanes),
              "make_dq_layout offset = 32 · register + lane, for all 64 elements of the tile")
fig, (ax_tile, ax_memory) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw=dict(width_ratios=[1, 2.2]))
diagrams.dq_layout_map(ax_tile, ax_memory, offsets, lanes, registers)
fig.tight_layout()
plt.show()

# %% [markdown]
# With this layout, when the 32 lanes of a warp each add their register 0, they hit 32
# **consecutive** floats: one 128-byte line (top row on the right). Register 1 fills the next
# line. In the plain row-major `dQ_acc` the same instruction is spread over 8 rows. The price: the
# index arithmetic assumes whole 8 × 8 tiles (the sequence length must be a multiple of 8), and
# `dQ_acc` is no longer an ordinary tensor until the post-process has read it back.
#
# The two tricks pull in different directions. The permuted layout puts a thread's two values 32
# floats apart, so they can no longer be merged into one `float2` atomic; the row-major layout
# keeps them adjacent, which is what lets TileLang emit `AtomicAddx2` on `sm_90a`. Both fill whole
# 32-byte memory sectors. Our kernel keeps the plain layout, which works for any sequence length
# and keeps `dQ_acc` readable; we have not measured the permuted variant against it on the H100.

# %% [markdown]
# ## 6 · Measured on an H100
#
# ### Tiling sweep
#
# The record below timed the backward (three kernels, the forward excluded) for every tiling in a
# grid: `block_M` queries per step, `block_N` resident keys, pipeline stages and threads, fp16,
# B = 4, H = 16, S = 4096, D = 128. Each configuration's gradients were first checked against the
# float64 reference on every head, as in section 4. TFLOP/s use the backward convention, 2.5 × the
# forward's FLOPs (halved for causal).

# %%
sweep = cu.measured("ch05_backward_sweep_h100", RECORDS["ch05_backward_sweep_h100"])
rows = sweep["results"]
ok = [r for r in rows if r["error"] is None]
check_stored_errors(rows, "ch05 sweep")
failed = [r for r in rows if r["error"] is not None]
print(f"{len(failed)} of {len(rows)} (tiling, causal) pairs did not compile, all with "
      f"block_N = {sorted({r['block_N'] for r in failed})} and threads = {sorted({r['threads'] for r in failed})}:")
print("  ", failed[0]["error"][:100], "…")

# %%
tilings = sorted({(r["block_M"], r["block_N"]) for r in rows})
schedules = sorted({(r["num_stages"], r["threads"]) for r in rows})
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, causal_ in zip(axes, (False, True)):
    grid = np.full((len(tilings), len(schedules)), np.nan)
    for r in ok:
        if r["causal"] == causal_:
            grid[tilings.index((r["block_M"], r["block_N"])), schedules.index((r["num_stages"], r["threads"]))] = r["tflops"]
    plots.heatmap(ax, grid, annotate=True, colorbar=False, vmin=0, title=f"backward TFLOP/s, causal={causal_}",
                  xlabel="(num_stages, threads)", ylabel="block_M × block_N")
    ax.set_xticks(range(len(schedules)), [f"{s}, {t}" for s, t in schedules])
    ax.set_yticks(range(len(tilings)), [f"{m} × {n}" for m, n in tilings])
    for (i, j), value in np.ndenumerate(grid):
        if np.isnan(value):
            ax.text(j, i, "fails", ha="center", va="center", fontsize=8, color="gray")
fig.suptitle(plots.record_caption(sweep), fontsize=8, y=0.01)
fig.tight_layout(rect=(0, 0.04, 1, 1))
plt.show()

# %% [markdown]
# Three things stand out. The cells marked "fails" did not compile: with `block_N = 64` and 256
# threads, TileLang's layout inference found no register layout for the `[block_N, block_M]`
# tiles (the error printed above). With `block_N = 128`, 128 threads are far slower than 256: the
# two register accumulators `dk` and `dv` alone would need more registers per thread than a thread
# can have (at most 255), so they cannot all stay in registers:

# %%
for block_N in (64, 128):
    for threads in (128, 256):
        print(f"block_N={block_N:>3}, threads={threads}: dK and dV accumulators = "
              f"{2 * block_N * 128 // threads:>3} float32 registers per thread (D = 128)")

# %% [markdown]
# And a second pipeline stage does not help at the best tiling. The best keeps many keys resident
# (`block_N = 128`), walks the queries in smaller steps (`block_M = 64`) with 256 threads and one
# stage. That is this chapter's tiling, `CH05_BACKWARD_CONFIG`:

# %%
for causal_ in (False, True):
    best = max((r for r in ok if r["causal"] == causal_), key=lambda r: r["tflops"])
    best_config = BackwardConfig(best["block_M"], best["block_N"], best["num_stages"], best["threads"])
    print(f"causal={causal_!s:5}: best {best_config}, {best['tflops']:.0f} TFLOP/s")
    cu.check_true(best_config == CH05_BACKWARD_CONFIG, "the best tiling of the sweep is CH05_BACKWARD_CONFIG")

# %% [markdown]
# ### Next to FlashAttention-2 and cuDNN
#
# The same comparison as chapter 03, for the backward: this chapter's kernel
# (`CH05_BACKWARD_CONFIG`) against PyTorch's SDPA backends FlashAttention-2 and cuDNN, each timed
# on `torch.autograd.grad` of its own forward, fp16, D = 64 and 128, B·S = 16k tokens and H·D =
# 2048. Our gradients were checked on every head first; the record keeps each error and its bound.

# %%
peers = cu.measured("ch05_backward_vs_peers_h100", RECORDS["ch05_backward_vs_peers_h100"])
prow = [r for r in peers["results"] if r.get("mode", "bwd") == "bwd"]
check_stored_errors(prow, "ch05 backward record", legacy_tolerance=2e-2)
cu.check_true(all({**CH05_BACKWARD_CONFIG._asdict(), **r["config"]} == CH05_BACKWARD_CONFIG._asdict()
                  for r in prow if r["impl"] == OURS),
              f"every row of ours measured chapter 05's kernel: {CH05_BACKWARD_CONFIG}")
bwd = {(r["impl"], r["dim"], r["causal"], r["seq"]): r for r in prow}
dims, seqs = sorted({r["dim"] for r in prow}), sorted({r["seq"] for r in prow})

# %%
fig, axes = plt.subplots(len(dims), 2, figsize=(10, 3.2 * len(dims)), squeeze=False)
for row_axes, dim_ in zip(axes, dims):
    for ax, causal_ in zip(row_axes, (False, True)):
        plots.line_chart(ax, [r for r in prow if r["dim"] == dim_ and r["causal"] == causal_], x="seq",
                         y="tflops", title=f"backward, fp16, D={dim_}, {'causal' if causal_ else 'non-causal'}",
                         xlabel="sequence length S", ylabel="TFLOP/s")
        ax.set_ylim(bottom=0)
        ax.get_legend().remove()
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9,
           bbox_to_anchor=(0.5, 0.025))
fig.suptitle(plots.record_caption(peers), fontsize=8, y=0.005)
fig.tight_layout(rect=(0, 0.06, 1, 1))
plots.save(fig, "ch05_backward_vs_peers")
plt.show()

# %% [markdown]
# The ratio of our TFLOP/s to each peer's at every shape (above 1: ours is faster; it is also the
# ratio of their times to ours):

# %%
for peer in PEERS:
    ratio_rows = [dict(seq=s, case=f"D{d} {'causal' if c else 'full'}",
                       ratio=bwd[OURS, d, c, s]["tflops"] / bwd[peer, d, c, s]["tflops"])
                  for d in dims for c in (False, True) for s in seqs if (peer, d, c, s) in bwd]
    print(f"ours / {SHORT[peer]}")
    print(plots.text_table(ratio_rows, index="seq", columns="case", value="ratio", fmt="{:.2f}", width=14), "\n")
for peer in PEERS:
    pairs = [(d, c, s) for d in dims for c in (False, True) for s in seqs if (peer, d, c, s) in bwd]
    cu.claim_versus(f"ours against {SHORT[peer]}", {key: cu.speed_ratio(bwd[(OURS, *key)], bwd[(peer, *key)])
                                                     for key in pairs}, cases="shapes",
                    says="ahead" if peer == FA2 else "behind")
for c in (False, True):
    r4k = {impl: bwd[impl, 128, c, 4096]["tflops"] for impl in (OURS, FA2, CUDNN)}
    print(f"S=4k D=128 {'causal' if c else 'non-causal':>10}: ours {r4k[OURS]:.0f} TFLOP/s = "
          f"{r4k[OURS] / r4k[FA2]:.2f}× FA2 ({r4k[FA2]:.0f}), {r4k[OURS] / r4k[CUDNN]:.2f}× cuDNN ({r4k[CUDNN]:.0f})")

# %% [markdown]
# The counts above give the order: FlashAttention-2 was written for the A100; on the H100 it uses
# neither TMA nor `wgmma`, which TileLang emits for us (section 5). cuDNN's attention kernels are
# written for Hopper. Our kernel is the same short program for every GPU, with one pipeline stage,
# atomics for dQ, and TileLang's automatic choices; chapter 08 rebuilds it for Hopper.
#
# ### Forward + backward: one training step of attention
#
# A training step runs both passes. The same record timed one forward and one backward together
# (`mode="fwd+bwd"`), for each implementation in the same run: ours is `flash_attention`'s default
# forward of the record's date (on an H100, chapter 07's kernel as it was then; chapter 07's own record
# times today's) followed by this chapter's backward. Its FLOPs are 3.5 × the
# forward's (`attention_flops(mode="fwd+bwd")`).

# %%
both = [r for r in peers["results"] if r.get("mode") == "fwd+bwd"]
if not both:
    print("This record has no forward+backward rows yet (it was measured before they were added); on a GPU, "
          "`python -m course_utils.measure.benchmarks ch05_backward_vs_peers_h100` measures them.")
else:
    fig = plots.forward_comparison_panels(dict(peers, results=both), dims=sorted({r["dim"] for r in both}),
                                          dtypes=("float16",))
    plt.show()
    step = {(r["impl"], r["dim"], r["causal"], r["seq"]): r["tflops"] for r in both}
    step_row = {(r["impl"], r["dim"], r["causal"], r["seq"]): r for r in both}
    for peer in PEERS:
        pairs = [key[1:] for key in step if key[0] == OURS and (peer, *key[1:]) in step]
        cu.claim_versus(f"fwd+bwd: ours against {SHORT[peer]}",
                        {key: cu.speed_ratio(step_row[(OURS, *key)], step_row[(peer, *key)]) for key in pairs},
                        cases="shapes")
    for c in (False, True):
        ours = step[OURS, 128, c, 4096]
        print(f"S=4k D=128 {'causal' if c else 'non-causal':>10}, fwd+bwd: ours {ours:.0f} TFLOP/s = "
              f"{ours / step[FA2, 128, c, 4096]:.2f}× FA2, {ours / step[CUDNN, 128, c, 4096]:.2f}× cuDNN")

# %% [markdown]
# ## Takeaways
# - The backward of attention is five matrix products: $dV = P^\top dO$, $dP = dO\,V^\top$,
#   $dS = P \circ (dP - \Delta)$, $dQ = s\,dS\,K$, $dK = s\,dS^\top Q$, and
#   $\Delta = \mathrm{rowsum}(dO \circ O)$ costs $D$ products per row.
# - $P$ is recomputed tile by tile as $e^{S - \mathrm{LSE}}$: one extra product (2.5 × the forward's
#   FLOPs in all) instead of $S_q \cdot S_k$ stored values per head.
# - The grid runs over key blocks: $K$, $V$ stay resident, $dK$ and $dV$ accumulate in registers
#   and are written once, and $dQ$ collects every key block's share by float32 atomic adds, scaled
#   and cast by a last small kernel. Computing $S^\top$ (keys as rows) lets $P^\top$ and $dS^\top$
#   feed the $dV$ and $dK$ products straight from registers.
# - On `sm_90a` TileLang turns our per-element atomics into `float2` vector atomics; on `sm_80`
#   they stay scalar. TileLang's examples instead permute the $dQ$ buffer so that each warp's
#   atomics hit one contiguous 128-byte line.
# - Next, chapter 06 applies forward and backward to gpt-oss attention: grouped-query heads
#   (where $dK$ and $dV$ need atomic adds too), sliding windows and attention sinks.

# %% [markdown]
# ## Exercises
#
# Both exercises work on one (batch, head) in float64: `q` is `[S_q, D]`, `k` and `v` are
# `[S_k, D]`, `lse` and `delta` are `[S_q]` (the natural-log LSE and Δ), `d_out` is `[S_q, D]`, no
# mask. Block sizes need not divide the lengths. Use tiles only: no softmax and no `S_q × S_k`
# matrix.

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) The main kernel, in PyTorch
#
# Write `blockwise_backward`, which returns `(dq, dk, dv)` with the loop structure of the main
# kernel: an outer loop over key blocks (the grid) and an inner loop over query blocks (the walk).
# For each tile, recompute $P^\top$ from the LSE, accumulate $dV$ and $dK$ of the key block, and
# add the tile's share of $dQ$ into the query block's rows (the atomic add).
#
# Stuck? `hint("05", "a", 1)`, then `hint("05", "a", 2)`; `solution("05", "a")` shows the answer.

# %% tags=["solution", "ex-a"]
def blockwise_backward(q, k, v, lse, delta, d_out, scale, block_M, block_N):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    ### BEGIN SOLUTION
    for n0 in range(0, k.shape[0], block_N):
        keys = slice(n0, n0 + block_N)
        for m0 in range(0, q.shape[0], block_M):
            rows = slice(m0, m0 + block_M)
            pt = torch.exp(scale * k[keys] @ q[rows].T - lse[rows])  # Pᵀ: keys as rows
            dpt = v[keys] @ d_out[rows].T  # dPᵀ
            dv[keys] += pt @ d_out[rows]
            dst = pt * (dpt - delta[rows])  # dSᵀ
            dk[keys] += scale * dst @ q[rows]
            dq[rows] += scale * dst.T @ k[keys]  # this key block's share of dQ
    ### END SOLUTION
    return dq, dk, dv


# %%
# NBVAL_CHECK_OUTPUT
from course_utils.exercises.ch05 import check_blockwise_backward

check_blockwise_backward(blockwise_backward)

# %% [markdown]
# ### (b) dQ without atomics
#
# Section 2's alternative: a separate pass with the loops swapped, as in the forward. Write
# `dq_query_major`, returning `dq` only: an outer loop over query blocks, an inner loop over key
# blocks, the query block's $dQ$ accumulated in a local tile and written once after the inner
# loop. Which products from (a) do you need again, and which not at all?
#
# Stuck? `hint("05", "b", 1)`, then `hint("05", "b", 2)`; `solution("05", "b")` shows the answer.

# %% tags=["solution", "ex-b"]
def dq_query_major(q, k, v, lse, delta, d_out, scale, block_M, block_N):
    dq = torch.empty_like(q)
    ### BEGIN SOLUTION
    for m0 in range(0, q.shape[0], block_M):
        rows = slice(m0, m0 + block_M)
        acc = torch.zeros_like(q[rows])
        for n0 in range(0, k.shape[0], block_N):
            keys = slice(n0, n0 + block_N)
            p = torch.exp(scale * q[rows] @ k[keys].T - lse[rows, None])  # P again (queries as rows)
            dp = d_out[rows] @ v[keys].T  # dP again
            acc += scale * (p * (dp - delta[rows, None])) @ k[keys]
        dq[rows] = acc  # one plain write: no other block touches these rows
    ### END SOLUTION
    return dq


# %%
# NBVAL_CHECK_OUTPUT
from course_utils.exercises.ch05 import check_dq_query_major

check_dq_query_major(dq_query_major)

# %% [markdown]
# (b) recomputes $QK^\top$ and $dO\,V^\top$ and needs neither $dV$ nor $dK$. A backward built this
# way runs (a) without its $dQ$ product (four products per tile) and then (b) (three): seven
# instead of five, as section 2 said.
#
# ### (c) One step of the main kernel, in TileLang
#
# Now write (a)'s tile step as the kernel does it. The factory below is given: one thread block per
# key block, `K` and `V` resident, the walk over the query blocks that can see them, the copies of
# `Q`, `dO`, the LSE and Δ, the atomic add of your `dq` tile into `dQ`, and the stores of `dK` and
# `dV`. Inputs and outputs are float32; `dQ` must be zero on entry.

# %%
import tilelang.language as T

from course_utils.kernels.flash_pieces import LOG2E
from course_utils.kernels.tiles import TileBackend


def flash_backward(batch, heads, seq_q, seq_k, dim, *, causal=False, block_M=16, block_N=16, target=None):
    """dK, dV (returned) and dQ (added into the zeroed dQ) of softmax(Q Kᵀ/√D) V, float32."""
    tb, f32 = TileBackend(target), "float32"
    step, finish = backward_step_macros(tb, seq_q, seq_k, dim, causal=causal, block_M=block_M, block_N=block_N)
    q_shape, k_shape = [batch, heads, seq_q, dim], [batch, heads, seq_k, dim]

    @T.prim_func
    def backward(Q: T.Tensor(q_shape, f32), K: T.Tensor(k_shape, f32), V: T.Tensor(k_shape, f32),
                 dO: T.Tensor(q_shape, f32), LSE: T.Tensor(q_shape[:3], f32), Delta: T.Tensor(q_shape[:3], f32),
                 dQ: T.Tensor(q_shape, f32), dK: T.Tensor(k_shape, f32), dV: T.Tensor(k_shape, f32)):
        with tb.kernel(T.ceildiv(seq_k, block_N), heads, batch, threads=128) as (kb, h, b):
            K_s, V_s = tb.shared([block_N, dim], f32), tb.shared([block_N, dim], f32)
            Q_s, dO_s = tb.shared([block_M, dim], f32), tb.shared([block_M, dim], f32)
            lse, delta = tb.shared([block_M], f32), tb.shared([block_M], f32)
            PT, dPT = tb.fragment([block_N, block_M], f32), tb.fragment([block_N, block_M], f32)  # Sᵀ→Pᵀ, dPᵀ
            PT_s, dST = tb.shared([block_N, block_M], f32), tb.shared([block_N, block_M], f32)  # gemm operands
            dv, dk = tb.fragment([block_N, dim], f32), tb.fragment([block_N, dim], f32)
            dq = tb.fragment([block_M, dim], f32)
            T.copy(K[b, h, kb * block_N:(kb + 1) * block_N, :], K_s)
            T.copy(V[b, h, kb * block_N:(kb + 1) * block_N, :], V_s)
            T.clear(dv)
            T.clear(dk)
            start = T.max(0, (kb * block_N - (seq_k - seq_q)) // block_M) if causal else 0
            for qb in T.Pipelined(start, T.ceildiv(seq_q, block_M), num_stages=1):
                T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
                T.copy(dO[b, h, qb * block_M:(qb + 1) * block_M, :], dO_s)
                T.copy(LSE[b, h, qb * block_M:(qb + 1) * block_M], lse)
                T.copy(Delta[b, h, qb * block_M:(qb + 1) * block_M], delta)
                step(K_s, V_s, Q_s, dO_s, lse, delta, PT, PT_s, dPT, dST, dv, dk, dq, qb, kb)
                for i, d in tb.parallel(block_M, dim):
                    if qb * block_M + i < seq_q:
                        T.atomic_add(dQ[b, h, qb * block_M + i, d], dq[i, d])
            finish(dk)
            T.copy(dv, dV[b, h, kb * block_N:(kb + 1) * block_N, :])
            T.copy(dk, dK[b, h, kb * block_N:(kb + 1) * block_N, :])

    return backward


# %% [markdown]
# Write the two macros. `step`, for one (key block, query block) tile, keys as rows as in section 3:
# $S^\top = K Q^\top$ (clear `PT` first: `T.gemm` accumulates); $P^\top$ recomputed from the
# natural-log LSE, `exp2(Sᵀ·scale_log2 − lse·log2 e)` where `visible`, 0 elsewhere;
# $dP^\top = V\,dO^\top$; $dV \mathrel{+}= P^\top dO$, with $P^\top$ copied to `PT_s` first (on the GPU a
# float32 gemm operand cannot keep the accumulator's register layout);
# $dS^\top = P^\top \circ (dP^\top - \Delta)$ (Δ indexed by query); $dK \mathrel{+}= dS^\top Q$; and this
# tile's share of $dQ$ in `dq`, $dS\,K$ times the softmax scale (`T.gemm(dST, K_s, dq, transpose_A=True)`
# reads `dST` as $dS$). `finish` applies what $dK$ still lacks after the walk.
#
# Stuck? `hint("05", "c", 1)`, then `hint("05", "c", 2)`; `solution("05", "c")` shows the answer.

# %% tags=["solution", "ex-c"]
def backward_step_macros(tb, seq_q, seq_k, dim, *, causal, block_M, block_N):
    sm_scale = 1 / math.sqrt(dim)
    scale_log2 = sm_scale * LOG2E
    past = seq_k - seq_q

    def visible(q, k):  # query q may see key k: both inside their sequences, and causal bottom-right
        inside = T.And(q < seq_q, k < seq_k)
        return T.And(inside, k <= q + past) if causal else inside

    @T.macro
    def step(K_s, V_s, Q_s, dO_s, lse, delta, PT, PT_s, dPT, dST, dv, dk, dq, qb, kb):
        ### BEGIN SOLUTION
        T.clear(PT)
        T.gemm(K_s, Q_s, PT, transpose_B=True)
        for j, i in tb.parallel(block_N, block_M):
            PT[j, i] = T.if_then_else(visible(qb * block_M + i, kb * block_N + j),
                                      T.exp2(PT[j, i] * scale_log2 - lse[i] * LOG2E), 0)
        T.clear(dPT)
        T.gemm(V_s, dO_s, dPT, transpose_B=True)
        T.copy(PT, PT_s)
        T.gemm(PT_s, dO_s, dv)
        for j, i in tb.parallel(block_N, block_M):
            dST[j, i] = PT[j, i] * (dPT[j, i] - delta[i])
        T.gemm(dST, Q_s, dk)
        T.clear(dq)
        T.gemm(dST, K_s, dq, transpose_A=True)
        for i, d in tb.parallel(block_M, dim):
            dq[i, d] *= sm_scale
        ### END SOLUTION

    @T.macro
    def finish(dk):
        ### BEGIN SOLUTION
        for j, d in tb.parallel(block_N, dim):
            dk[j, d] *= sm_scale
        ### END SOLUTION

    return step, finish


# %%
from course_utils.exercises.ch05 import check_flash_backward

check_flash_backward(flash_backward)

# %% [markdown]
# ## Capstone: your own FlashAttention, forward and backward
#
# The last four exercises build the whole backward from empty kernels and wrap it, with your
# forward from chapter 03, into a `torch.autograd.Function`: *your* `flash_attention`, which
# PyTorch can differentiate. Every kernel is float32 and runs here on TileLang's C backend; each
# checker also lowers it for the A100 and the H100.
#
# ### (d) Δ, the preprocessing kernel
#
# $\Delta_i = \sum_d dO_{id}\,O_{id}$ for every query row: one thread block per block of rows,
# an elementwise product and a row sum (section 2 says why the backward needs it).
#
# Stuck? `hint("05", "d", 1)`, then `hint("05", "d", 2)`; `solution("05", "d")` shows the answer.

# %% tags=["solution", "ex-d"]
def my_delta(batch, heads, seq, dim, *, block_M=16, target=None):
    """Δ [B, H, S] = rowsum(dO ∘ O), float32."""
    tb, f32 = TileBackend(target), "float32"

    @T.prim_func
    def delta_kernel(O: T.Tensor([batch, heads, seq, dim], f32), dO: T.Tensor([batch, heads, seq, dim], f32),
                     Delta: T.Tensor([batch, heads, seq], f32)):
        with tb.kernel(T.ceildiv(seq, block_M), heads, batch, threads=128) as (qb, h, b):
            # Tiles: o, do [block_M, dim] and delta [block_M] (tb.fragment).
            ### BEGIN SOLUTION
            o, do, delta = tb.fragment([block_M, dim], f32), tb.fragment([block_M, dim], f32), tb.fragment([block_M], f32)
            T.copy(O[b, h, qb * block_M:(qb + 1) * block_M, :], o)
            T.copy(dO[b, h, qb * block_M:(qb + 1) * block_M, :], do)
            for i, d in tb.parallel(block_M, dim):
                o[i, d] *= do[i, d]
            T.reduce_sum(o, delta, dim=1)
            T.copy(delta, Delta[b, h, qb * block_M:(qb + 1) * block_M])
            ### END SOLUTION

    return delta_kernel


# %%
from course_utils.exercises import ch05

ch05.check_my_delta(my_delta)

# %% [markdown]
# ### (e) The dK/dV kernel
#
# One thread block per key block, keys as rows, as in (c): K and V stay, the query blocks that can
# see them stream past. This time the whole kernel is yours, and it does **not** touch dQ (that is
# (f)'s job, without atomics): the tiles, the copies, the causal start of the walk, $P^\top$ from the
# LSE with the mask, $dV \mathrel{+}= P^\top dO$, $dS^\top = P^\top \circ (dP^\top - \Delta)$,
# $dK \mathrel{+}= dS^\top Q$, the scale, the stores.
#
# Stuck? `hint("05", "e", 1)`, then `hint("05", "e", 2)`; `solution("05", "e")` shows the answer.

# %% tags=["solution", "ex-e"]
def my_dkdv(batch, heads, seq_q, seq_k, dim, *, causal=False, block_M=16, block_N=16, target=None):
    """dK, dV [B, H, S_k, D] of softmax(Q Kᵀ/√D) V from Q, K, V, dO, the LSE and Δ, float32."""
    tb, f32 = TileBackend(target), "float32"
    sm_scale, scale_log2 = 1 / math.sqrt(dim), LOG2E / math.sqrt(dim)
    past, q_shape, k_shape = seq_k - seq_q, [batch, heads, seq_q, dim], [batch, heads, seq_k, dim]  # q sees k <= q + past

    @T.prim_func
    def dkdv(Q: T.Tensor(q_shape, f32), K: T.Tensor(k_shape, f32), V: T.Tensor(k_shape, f32),
             dO: T.Tensor(q_shape, f32), LSE: T.Tensor(q_shape[:3], f32), Delta: T.Tensor(q_shape[:3], f32),
             dK: T.Tensor(k_shape, f32), dV: T.Tensor(k_shape, f32)):
        with tb.kernel(T.ceildiv(seq_k, block_N), heads, batch, threads=128) as (kb, h, b):
            # Tiles: K_s, V_s [block_N, dim], Q_s, dO_s [block_M, dim], lse, delta [block_M], PT_s, dST
            # [block_N, block_M] (tb.shared); PT, dPT [block_N, block_M], dk, dv [block_N, dim] (tb.fragment).
            ### BEGIN SOLUTION
            K_s, V_s, Q_s, dO_s = (tb.shared([n, dim], f32) for n in (block_N, block_N, block_M, block_M))
            lse, delta, PT_s, dST = (tb.shared(s, f32) for s in ([block_M], [block_M], [block_N, block_M], [block_N, block_M]))
            PT, dPT, dk, dv = (tb.fragment(s, f32) for s in ([block_N, block_M], [block_N, block_M], [block_N, dim], [block_N, dim]))
            T.copy(K[b, h, kb * block_N:(kb + 1) * block_N, :], K_s)
            T.copy(V[b, h, kb * block_N:(kb + 1) * block_N, :], V_s)
            T.clear(dk)
            T.clear(dv)
            start = T.max(0, (kb * block_N - past) // block_M) if causal else 0
            for qb in T.Pipelined(start, T.ceildiv(seq_q, block_M), num_stages=1):
                T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
                T.copy(dO[b, h, qb * block_M:(qb + 1) * block_M, :], dO_s)
                T.copy(LSE[b, h, qb * block_M:(qb + 1) * block_M], lse)
                T.copy(Delta[b, h, qb * block_M:(qb + 1) * block_M], delta)
                T.clear(PT)
                T.gemm(K_s, Q_s, PT, transpose_B=True)
                for j, i in tb.parallel(block_N, block_M):
                    q, k = qb * block_M + i, kb * block_N + j
                    visible = T.And(T.And(q < seq_q, k < seq_k), k <= q + past) if causal else T.And(q < seq_q, k < seq_k)
                    PT[j, i] = T.if_then_else(visible, T.exp2(PT[j, i] * scale_log2 - lse[i] * LOG2E), 0)
                T.clear(dPT)
                T.gemm(V_s, dO_s, dPT, transpose_B=True)
                T.copy(PT, PT_s)
                T.gemm(PT_s, dO_s, dv)
                for j, i in tb.parallel(block_N, block_M):
                    dST[j, i] = sm_scale * PT[j, i] * (dPT[j, i] - delta[i])  # dK = scale · dSᵀ Q
                T.gemm(dST, Q_s, dk)
            T.copy(dv, dV[b, h, kb * block_N:(kb + 1) * block_N, :])
            T.copy(dk, dK[b, h, kb * block_N:(kb + 1) * block_N, :])
            ### END SOLUTION

    return dkdv


# %%
from course_utils.exercises import ch05

ch05.check_my_dkdv(my_dkdv)

# %% [markdown]
# ### (f) The dQ kernel
#
# Exercise (b) as a kernel: one thread block per query block, the key blocks up to the causal stop
# streaming past, $P$ and $dP$ recomputed, $dS\,K$ accumulated in registers and written once.
# No atomics: no other thread block writes these rows.
#
# Stuck? `hint("05", "f", 1)`, then `hint("05", "f", 2)`; `solution("05", "f")` shows the answer.

# %% tags=["solution", "ex-f"]
def my_dq(batch, heads, seq_q, seq_k, dim, *, causal=False, block_M=16, block_N=16, target=None):
    """dQ [B, H, S_q, D] of softmax(Q Kᵀ/√D) V from Q, K, V, dO, the LSE and Δ, float32."""
    tb, f32 = TileBackend(target), "float32"
    sm_scale, scale_log2 = 1 / math.sqrt(dim), LOG2E / math.sqrt(dim)
    past, q_shape, k_shape = seq_k - seq_q, [batch, heads, seq_q, dim], [batch, heads, seq_k, dim]  # q sees k <= q + past

    @T.prim_func
    def dq_kernel(Q: T.Tensor(q_shape, f32), K: T.Tensor(k_shape, f32), V: T.Tensor(k_shape, f32),
                  dO: T.Tensor(q_shape, f32), LSE: T.Tensor(q_shape[:3], f32), Delta: T.Tensor(q_shape[:3], f32),
                  dQ: T.Tensor(q_shape, f32)):
        with tb.kernel(T.ceildiv(seq_q, block_M), heads, batch, threads=128) as (qb, h, b):
            # Tiles: Q_s, dO_s [block_M, dim], K_s, V_s [block_N, dim], lse, delta [block_M], dS_s
            # [block_M, block_N] (tb.shared); S, dP [block_M, block_N], dq [block_M, dim] (tb.fragment).
            ### BEGIN SOLUTION
            Q_s, dO_s, K_s, V_s = (tb.shared([n, dim], f32) for n in (block_M, block_M, block_N, block_N))
            lse, delta, dS_s = tb.shared([block_M], f32), tb.shared([block_M], f32), tb.shared([block_M, block_N], f32)
            S, dP, dq = tb.fragment([block_M, block_N], f32), tb.fragment([block_M, block_N], f32), tb.fragment([block_M, dim], f32)
            T.copy(Q[b, h, qb * block_M:(qb + 1) * block_M, :], Q_s)
            T.copy(dO[b, h, qb * block_M:(qb + 1) * block_M, :], dO_s)
            T.copy(LSE[b, h, qb * block_M:(qb + 1) * block_M], lse)
            T.copy(Delta[b, h, qb * block_M:(qb + 1) * block_M], delta)
            T.clear(dq)
            num_k_blocks = T.ceildiv(seq_k, block_N)
            stop = T.min(num_k_blocks, T.ceildiv((qb + 1) * block_M + past, block_N)) if causal else num_k_blocks
            for kb in T.Pipelined(stop, num_stages=1):
                T.copy(K[b, h, kb * block_N:(kb + 1) * block_N, :], K_s)
                T.copy(V[b, h, kb * block_N:(kb + 1) * block_N, :], V_s)
                T.clear(S)
                T.gemm(Q_s, K_s, S, transpose_B=True)
                T.clear(dP)
                T.gemm(dO_s, V_s, dP, transpose_B=True)
                for i, j in tb.parallel(block_M, block_N):
                    q, k = qb * block_M + i, kb * block_N + j
                    visible = T.And(T.And(q < seq_q, k < seq_k), k <= q + past) if causal else T.And(q < seq_q, k < seq_k)
                    p = T.exp2(S[i, j] * scale_log2 - lse[i] * LOG2E)
                    dS_s[i, j] = T.if_then_else(visible, p * (dP[i, j] - delta[i]), 0)
                T.gemm(dS_s, K_s, dq)
            for i, d in tb.parallel(block_M, dim):
                dq[i, d] *= sm_scale
            T.copy(dq, dQ[b, h, qb * block_M:(qb + 1) * block_M, :])
            ### END SOLUTION

    return dq_kernel


# %%
from course_utils.exercises import ch05

ch05.check_my_dq(my_dq)

# %% [markdown]
# ### (g) Your `flash_attention`, differentiable
#
# Wrap it up. `forward` runs your chapter-03 forward and saves what the backward needs (Q, K, V, O
# and the LSE, never P); `backward` runs your three kernels: Δ, then dK/dV, then dQ. The next cell
# fetches your forward from your copy of chapter 03 (or the course's, if yours is not finished, and
# says so); `ch05.compiled(factory, *shape, out_idx=..., **options)` returns the kernel, compiled once
# per shape when first called (for the C backend on CPU tensors). The checker runs a gradient check
# against the float64 reference: causal and not, a ragged S, S_q ≠ S_k.
#
# Stuck? `hint("05", "g", 1)`, then `hint("05", "g", 2)`; `solution("05", "g")` shows the answer.

# %%
from course_utils.exercises import your_solution

my_flash_forward = your_solution("03", "d", "my_flash_forward")

# %% tags=["solution", "ex-g"]
import torch

from course_utils.exercises.ch05 import compiled


class MyFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal):
        ### BEGIN SOLUTION
        (batch, heads, seq_q, dim), seq_k = q.shape, k.shape[2]
        out, lse = compiled(my_flash_forward, batch, heads, seq_q, seq_k, dim, causal=causal, out_idx=[3, 4])(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, d_out):
        ### BEGIN SOLUTION
        q, k, v, out, lse = ctx.saved_tensors
        (batch, heads, seq_q, dim), seq_k = q.shape, k.shape[2]
        d_out = d_out.contiguous()
        delta = compiled(my_delta, batch, heads, seq_q, dim, out_idx=[2])(out, d_out)
        shape = (batch, heads, seq_q, seq_k, dim)
        dk, dv = compiled(my_dkdv, *shape, causal=ctx.causal, out_idx=[6, 7])(q, k, v, d_out, lse, delta)
        dq = compiled(my_dq, *shape, causal=ctx.causal, out_idx=[6])(q, k, v, d_out, lse, delta)
        return dq, dk, dv, None
        ### END SOLUTION


def my_flash_attention(q, k, v, causal=False):
    return MyFlashAttention.apply(q, k, v, causal)


# %%
from course_utils.exercises import ch05

ch05.check_my_flash_attention(my_flash_attention)

# %% [markdown]
# ### Your training step against the course's and SDPA's
#
# As at the end of chapter 03's exercises, on a GPU the cell below times your kernels: one training
# step, the forward and then the backward of your `my_flash_attention` (your chapter-03 forward and your
# three kernels above, which `ch05.compiled` builds for CUDA when it is called with GPU tensors, with
# 64 × 64 float32 tiles), next to the course's `flash_attention` and SDPA's FlashAttention-2 and cuDNN
# backends in fp16, in one call of the course's timing helper, after O and the three gradients of each
# have been checked against the float64 reference. Without a GPU it shows the stored H100 record of the
# course's training step at the nearest shape and times nothing.

# %%
from course_utils.exercises.timing import time_your_training

time_your_training(my_flash_attention, record="ch05_backward_vs_peers_h100");

# %% [markdown]
# **Stale output.** The stored output above is a live timing from an older run of this chapter
# (2026-11-26), before chapter 07's and 08's kernels reached their present versions and before the
# host's work per call was cut (chapter 07, section 6); it is in no record, and the course's kernels
# now run ahead of or level with cuDNN (the README's claims, computed from chapter 07's and 08's
# records). It is kept until the chapter is executed on a GPU again; for speed, trust the records.

# %% [markdown]
# ## The course's kernels, listed (read after the exercises)
#
# The course's own code for what the exercises above asked you to write, kept until after them so that
# it cannot give the answer away. Compare it with yours: the same steps, sometimes written as shared
# pieces (`course_utils/kernels/flash_pieces.py`) that several kernels use.

# %% [markdown]
# From section 3 · The three kernels:

# %%
show_source(flash_bwd_preprocess_kernel)

# %%
show_source(flash_bwd_kernel, "launch")
show_source(flash_bwd_kernel, "setup")

# %%
show_source(query_block_range)

# %%
show_source(flash_bwd_kernel, "recompute P")

# %%
show_source(flash_bwd_kernel, "dV")

# %%
show_source(flash_bwd_kernel, "dK")

# %%
show_source(flash_bwd_kernel, "dQ")

# %%
show_source(flash_bwd_kernel, "store")
show_source(store_dkv)

# %%
show_source(flash_bwd_postprocess_kernel)

# %%
show_source(cu.attention_backward, "three kernels")
