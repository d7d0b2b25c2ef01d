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
# # 02 · Online softmax: one pass over the keys
#
# **Question.** A softmax needs the maximum and the sum of a whole row before it can produce a
# single probability. How can attention then stream the keys through a small on-chip tile, one
# block at a time, and never hold a row of scores?
#
# The answer is a pair of running statistics, the **maximum** $m$ and the **sum** $\ell$, that
# can be *corrected* when a later block brings a larger maximum. This chapter builds it step by
# step: the numerically safe softmax, the one-pass normaliser of Milakov & Gimelshein (2018),
# its block-wise form, the same trick applied to the output $PV$ (the heart of FlashAttention),
# the `exp2` and log-sum-exp details the kernels use, and finally two TileLang kernels.

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import math

import matplotlib.pyplot as plt
import torch

from course_utils.pictures import diagrams
from course_utils.kernels.softmax import (LOG2E, blockwise_attention, blockwise_softmax, naive_softmax,
                                  online_softmax_trace, safe_softmax, softmax_online_kernel,
                                  softmax_row_kernel)
from course_utils.core.source import cuda_source, grep, show_source
from course_utils.kernels.tiles import compile_kernel

torch.manual_seed(0)
print("device:", torch.cuda.get_device_name() if cu.HAS_GPU else "CPU (no GPU)", "| tile target:", cu.TILE_TARGET,
      "| torch", torch.__version__)

# %% [markdown]
# ## 1 · Safe softmax and overflow
#
# The softmax of a row $x_1, \dots, x_N$ is $p_i = e^{x_i} / \sum_j e^{x_j}$. Written exactly
# like that, it breaks as soon as one $e^{x_i}$ exceeds the largest number the format can hold.
# For 16-bit and 32-bit floats that happens at quite ordinary logits:

# %%
# NBVAL_CHECK_OUTPUT
for dtype in (torch.float16, torch.float32):
    largest = torch.finfo(dtype).max
    print(f"{str(dtype):14} largest finite value {largest:.4g}: exp(x) overflows for x > {math.log(largest):.2f}")

# %% [markdown]
# Here are two rows whose largest logit is just past that limit. `naive_softmax` computes
# `exp(x) / exp(x).sum()` as written: one term becomes `inf`, so does the sum, the finite terms
# divide to 0 and `inf / inf` is `NaN`.

# %%
rows = {torch.float16: torch.tensor([[3.0, 10.0, 12.0]], dtype=torch.float16),
        torch.float32: torch.tensor([[3.0, 88.0, 90.0]], dtype=torch.float32)}
for dtype, x in rows.items():
    print(f"{str(dtype):14} exp(x) = {torch.exp(x).tolist()[0]}")
    print(f"{'':14} naive softmax = {naive_softmax(x).tolist()[0]}")

# %% [markdown]
# **The fix.** Multiplying numerator and denominator by the same $e^{-c}$ changes nothing:
#
# $$p_i = \frac{e^{x_i}}{\sum_j e^{x_j}} = \frac{e^{x_i - c}}{\sum_j e^{x_j - c}}
# \quad\text{for any constant } c .$$
#
# Choose $c = m = \max_j x_j$. Every exponent is then $\le 0$, so every term lies in $(0, 1]$;
# the largest term is exactly $e^0 = 1$, so the denominator lies between 1 and $N$: no overflow
# and no division by zero. Terms that underflow to 0 are smaller than the rounding error of the
# sum anyway. This is the **safe softmax** every library uses:

# %%
show_source(safe_softmax)
for dtype, x in rows.items():
    cu.check_close(safe_softmax(x), torch.softmax(x.double(), dim=-1), f"safe softmax, {dtype}")
wide = torch.randn(64, 300) * 30  # logits far beyond both overflow limits
for dtype in (torch.float16, torch.float32):
    x = wide.to(dtype)
    cu.check_close(safe_softmax(x), torch.softmax(x.double(), dim=-1), f"safe softmax, wide logits, {dtype}")

# %% [markdown]
# **The price.** Safe softmax reads the row three times: once for the maximum, once for the
# sum of $e^{x_j - m}$, once more to write $e^{x_i - m} / \text{sum}$. On a GPU, where the scores
# of attention are far too many to keep on chip, every extra read of a row is a trip to main
# memory. Can the maximum and the sum be found together, in one read?

# %% [markdown]
# ## 2 · The online normaliser: running max and running sum
#
# Milakov & Gimelshein, [*Online normalizer calculation for softmax*](https://arxiv.org/abs/1805.02867)
# (2018), keep two numbers
# while they walk along the row. After the first $j$ elements,
#
# $$m_j = \max_{i \le j} x_i, \qquad \ell_j = \sum_{i \le j} e^{x_i - m_j} .$$
#
# **The update.** When $x_{j+1}$ arrives, $m_{j+1} = \max(m_j, x_{j+1})$ and
#
# $$\ell_{j+1} = \ell_j \, e^{m_j - m_{j+1}} + e^{x_{j+1} - m_{j+1}} .$$
#
# *Proof.* Split the sum that defines $\ell_{j+1}$ into the old terms and the new one, and write
# $e^{x_i - m_{j+1}} = e^{x_i - m_j} \, e^{m_j - m_{j+1}}$ in the old terms:
#
# $$\ell_{j+1} = \sum_{i \le j} e^{x_i - m_{j+1}} + e^{x_{j+1} - m_{j+1}}
#   = e^{m_j - m_{j+1}} \sum_{i \le j} e^{x_i - m_j} + e^{x_{j+1} - m_{j+1}}
#   = \ell_j \, e^{m_j - m_{j+1}} + e^{x_{j+1} - m_{j+1}} . \qquad\blacksquare$$
#
# The old sum was measured against the old maximum; the factor $e^{m_j - m_{j+1}}$ re-measures
# it against the new one. Both exponents are $\le 0$ because $m_{j+1}$ is at least $m_j$ and at
# least $x_{j+1}$, so the loop is as safe as the three-pass version. Starting from $m_0 = -\infty$,
# $\ell_0 = 0$, after the last element $m_N$ and $\ell_N$ are exactly the max and the sum the safe
# softmax needs, and $\log \sum_j e^{x_j} = m_N + \log \ell_N$.
#
# Element by element, in plain Python (float64):

# %%
def online_normaliser(row):
    """One pass over ``row``: the running max m and the running sum l of exp(x − m)."""
    m, l = -math.inf, 0.0
    for x in row.tolist():
        m_new = max(m, x)
        l = l * math.exp(m - m_new) + math.exp(x - m_new)
        m = m_new
    return m, l


row = torch.randn(2000, dtype=torch.float64) * 50
m, l = online_normaliser(row)
cu.check_close(torch.tensor(m, dtype=torch.float64), row.max(), "running max m")
cu.check_close(torch.tensor(m + math.log(l), dtype=torch.float64), torch.logsumexp(row, dim=0), "m + log l vs logsumexp");

# %% [markdown]
# The softmax itself now takes two reads of the row instead of three: one for $(m, \ell)$, one
# to write $e^{x_i - m}/\ell$.

# %% [markdown]
# ## 3 · Blocks of keys
#
# A kernel does not walk one element at a time: it loads a tile of `block_N` scores per row and
# reduces it in parallel. The proof above never used the fact that $x_{j+1}$ was a single
# number. With a block $B$ of scores,
#
# $$m_\text{new} = \max\big(m_\text{old}, \max_{x \in B} x\big), \qquad
#   \ell_\text{new} = \ell_\text{old}\, e^{m_\text{old} - m_\text{new}} + \sum_{x \in B} e^{x - m_\text{new}} .$$
#
# `course_utils.kernels.softmax` holds this step for every row at once; it also returns the factor
# $\alpha = e^{m_\text{old} - m_\text{new}}$ that rescaled the old state:

# %%
from course_utils.kernels.softmax import online_softmax_update, safe_shift

show_source(online_softmax_update)
show_source(safe_shift)

# %% [markdown]
# One subtlety: a masked score is $-\infty$ (a causal mask, a sliding window). While a row has
# seen nothing but masked scores its maximum is $-\infty$, and $e^{-\infty - (-\infty)}$ is
# `NaN`. `safe_shift` subtracts 0 instead in that case, so masked scores contribute
# $e^{-\infty} = 0$; the kernels of this course do the same. `blockwise_softmax` runs the update
# over the blocks of each row (pass 1), then writes the probabilities (pass 2):

# %%
show_source(blockwise_softmax)
x = torch.randn(256, 1000, dtype=torch.float64) * 5
x[:64, :300] = float("-inf")  # some rows start with fully masked blocks
for block_N in (64, 100, 1000):  # 100 does not divide 1000; 1000 is the whole row
    cu.check_close(blockwise_softmax(x, block_N), torch.softmax(x, dim=-1), f"blockwise softmax, block_N={block_N}")

# %% [markdown]
# ### The output too: softmax · V in one pass
#
# Softmax on its own still needs that second pass: the probability of an early key depends on
# the maximum and the sum over the *whole* row. Attention, though, never needs the
# probabilities themselves, only the weighted sum $O = \sum_j p_j v_j$. Keep a third running
# quantity, the unnormalised output
#
# $$o_j = \sum_{i \le j} e^{s_i - m_j}\, v_i ,$$
#
# which obeys the same identity as $\ell$ (replace each term $e^{s_i - m}$ by $e^{s_i - m} v_i$
# in the proof): $o_\text{new} = \alpha\, o_\text{old} + \sum_{s \in B} e^{s - m_\text{new}}\, v_s$.
# After the last block, $O = o / \ell$. Every key block is read exactly once, and a row of
# scores never exists in full. This is the loop of FlashAttention, in PyTorch:

# %%
show_source(blockwise_attention, "loop")

# %% [markdown]
# Checked against the float64 reference, with and without the causal mask, for block sizes that
# do and do not divide the number of keys, and once in float32:

# %%
q, k, v = (torch.randn(2, 3, 200, 64, dtype=torch.float64) for _ in range(3))
for causal in (False, True):
    for block_N in (32, 50, 200):
        o = blockwise_attention(q, k, v, block_N, causal=causal)
        cu.check_close(o, cu.attention_reference(q, k, v, causal=causal), f"blockwise PV, causal={causal}, block_N={block_N}")
q32, k32, v32 = q.float(), k.float(), v.float()
cu.check_close(blockwise_attention(q32, k32, v32, 64), cu.attention_reference(q32, k32, v32), "blockwise PV, float32");

# %% [markdown]
# ## 4 · A picture: the running max and the rescale factors
#
# How often does the correction actually happen? Take the scores of a few query rows of a
# random attention head, cut the 512 keys into blocks of 32, and follow $m$ and
# $\alpha = e^{m_\text{old} - m_\text{new}}$ block by block. (Block 0's $\alpha$ is always 0: it
# multiplies the empty starting state, so the plot on the right starts at block 1.)

# %%
S_k, D, block_N = 512, 64, 32
g = torch.Generator().manual_seed(0)
qh, kh = (torch.randn(n, D, generator=g, dtype=torch.float64) for n in (5, S_k))
scores = qh @ kh.T / math.sqrt(D)
maxima, alphas = online_softmax_trace(scores, block_N)  # each [num_blocks, rows]
cu.check_close(maxima[-1], scores.amax(dim=-1), "final running max = row max")
blocks = torch.arange(maxima.shape[0])
fig, (ax_m, ax_a) = plt.subplots(1, 2, figsize=(10, 3.4))
for r in range(scores.shape[0]):
    ax_m.step(blocks, maxima[:, r], where="post", marker="o", markersize=3, label=f"row {r}")
    ax_a.plot(blocks[1:], alphas[1:, r], marker="o", markersize=4, linewidth=0.8)
ax_m.set(title="running max $m$ after each key block", xlabel="key block $j$", ylabel="$m_j$")
ax_a.set(title=r"rescale factor $\alpha_j = e^{m_{j-1} - m_j}$ (block 0 left out)", xlabel="key block $j$",
         ylabel=r"$\alpha_j$")
for ax in (ax_m, ax_a):
    ax.set_xticks(blocks[::2].tolist())
ax_m.legend(fontsize=8, ncols=2)
plt.show()
moved = (alphas[1:] < 1).sum().item()
print(f"after block 0, the max moved in {moved} of {alphas[1:].numel()} (row, block) updates")

# %% [markdown]
# The maximum climbs in steps that grow rarer as more keys have been seen: when the scores come
# in random order, key $j$ is larger than all the keys before it with probability $1/j$. Each step up is one
# $\alpha < 1$ for that row at that block; everywhere else $\alpha = 1$ and the rescale changes
# nothing. It still costs a multiply per element of $o$, so some recent kernels skip it when the
# maximum did not move (or moved very little); ours always rescales.
#
# Which block updates which statistic: each key block $j$ meets the state left by block $j-1$,
# scales it by $\alpha_j$, and adds its own contribution.

# %%
fig, ax = plt.subplots(figsize=(10, 3.2))
diagrams.online_softmax_diagram(ax, num_blocks=4)
plt.show()

# %% [markdown]
# ## 5 · Two details of real kernels: `exp2`, and the log-sum-exp
#
# **`exp2`.** A GPU's special-function unit computes $2^x$ (the PTX instruction `ex2.approx`)
# and has no instruction for $e^x$: CUDA's fast `__expf` multiplies by $\log_2 e$ and then calls
# `ex2`. Attention already multiplies every score by the softmax scale, so the two constants fold
# into one:
#
# $$e^{\,\text{scale}\cdot(s - m)} = 2^{\,s\cdot c \;-\; m\cdot c}, \qquad c = \text{scale}\cdot\log_2 e ,$$
#
# one fused multiply-add and one `exp2` per score. `course_utils.kernels.flash_fwd` computes its
# probabilities exactly this way, with `scale_log2 = sm_scale * LOG2E`. The two forms agree:

# %%
sm_scale = 1 / math.sqrt(D)
s = qh @ kh.T  # unscaled scores
m = s.amax(dim=-1, keepdim=True)
scale_log2 = sm_scale * LOG2E
cu.check_close(torch.exp2(s * scale_log2 - m * scale_log2), torch.exp(sm_scale * (s - m)), "exp2 form vs exp form");

# %% [markdown]
# **The log-sum-exp.** At the end of the loop, $m$ and $\ell$ combine into one number per row,
#
# $$\mathrm{LSE} = m + \log \ell = \log \sum_j e^{s_j}, \qquad\text{so}\qquad p_j = e^{\,s_j - \mathrm{LSE}} .$$
#
# The forward kernel writes it out next to $O$. The backward pass (chapter 05) needs every
# probability $p_{ij}$ again, but storing the $S \times S$ matrix $P$ is exactly what
# FlashAttention avoids: with the LSE it recomputes any block of $P$ from $Q$, $K$ and one
# number per row, without a second pass for the maximum and sum. Both uses are checked here:

# %%
o, lse = blockwise_attention(q, k, v, 64, return_lse=True)
o_ref, lse_ref = cu.attention_reference(q, k, v, return_lse=True)
cu.check_close(o, o_ref, "blockwise O")
cu.check_close(lse.float(), lse_ref, "blockwise LSE vs reference")
scaled = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
cu.check_close(torch.exp(scaled - lse[..., None]), torch.softmax(scaled, dim=-1), "P recomputed from LSE");

# %% [markdown]
# ## 6 · A TileLang row softmax, single pass
#
# Now the same ideas as tile programs. First the plain version: each thread block owns
# `block_M` rows **and the whole row** of `N` columns in one tile, so one read of `X` is enough.
# `T.reduce_max` and `T.reduce_sum` reduce the tile along `dim=1`, and the exponential is the
# `exp2` form with `scale_log2` folded in. The kernel is written once through `TileBackend`
# (chapter 00) and runs on the GPU, or on this CPU through TileLang's C backend.

# %%
show_source(softmax_row_kernel)

# %%
M, N = cu.pick(cpu=(200, 512), gpu=(4096, 1024))  # M is not a multiple of block_M on the CPU
scale = 0.5
X = torch.randn(M, N, device=cu.DEVICE) * 4
row_softmax = compile_kernel(softmax_row_kernel(M, N, scale=scale, block_M=cu.pick(cpu=32, gpu=8)), out_idx=[1])
cu.check_close(row_softmax(X), torch.softmax(scale * X.double(), dim=-1), "TileLang single-pass softmax");

# %% [markdown]
# The catch is the tile: `block_M × N` floats per thread block. On a GPU a fragment lives in the
# registers of the block's threads, and a register file holds a fixed, small number of values,
# while an attention row has one score per key: tens of thousands and more. The row must be
# streamed.

# %% [markdown]
# ## 7 · A TileLang online softmax: stream the columns
#
# The online kernel keeps only a `block_M × block_N` tile of scores plus the per-row statistics
# `m`, `l` and `shift`. Pass 1 walks the column blocks with the running max and sum; pass 2 reads
# `X` again and writes the probabilities (a softmax alone cannot avoid that second read, as in
# section 3). `T.reduce_max(..., clear=False)` folds the block's maximum into the old `m`, so
# `m` is never reset between blocks. (Some widely copied FlashAttention kernels do reset it at
# every block and keep only the new block's maximum: then $\alpha$ can exceed 1, and a row whose
# first blocks are masked turns into `NaN`.) At the end the kernel also writes the LSE.
#
# *The listings of these pieces are at the end of the chapter, after the exercises, so that they do not
# give the exercises away; here the text and the formulas describe each piece.*
# %%
online_softmax = compile_kernel(softmax_online_kernel(M, N, scale=scale, block_N=64), out_idx=[1, 2])
X_masked = X.clone()
X_masked[: M // 4, :128] = float("-inf")  # rows whose first two column blocks are masked
for name, inp in (("random", X), ("masked", X_masked)):
    Y, lse = online_softmax(inp)
    cu.check_close(Y, torch.softmax(scale * inp.double(), dim=-1), f"TileLang online softmax, {name}")
    cu.check_close(lse, torch.logsumexp(scale * inp.double(), dim=-1), f"TileLang online LSE, {name}")

# %% [markdown]
# ### Where the running max lives on an H100
#
# Lowering the same factory for `sm_90a` (no GPU needed) shows the generated CUDA. The running
# statistics are small per-thread arrays, that is registers: each thread keeps `m`, `l` and
# `shift` for the rows whose elements it holds. The block's maximum is a local `max` over the
# thread's own elements, then a `tl::AllReduce<tl::MaxOp, …>` among the threads that share a row,
# then a `max` with the old `m`: `T.reduce_max(..., clear=False)`.

# %%
gpu_kernel = softmax_online_kernel(4096, 1024, scale=scale, block_N=64, target="cuda")  # the GPU size above
cuda = cuda_source(gpu_kernel, arch="sm_90a")
grep(cuda, r"^\s*float (m|l|shift)\[", max_hits=3)
grep(cuda, r"AllReduce<tl::MaxOp", max_hits=1)
grep(cuda, r"\bm\[i_\d+\] = max\(", max_hits=1);

# %% [markdown]
# ## 8 · Step through it
#
# The whole online normaliser on a small example, block by block: four rows of 32 scaled scores
# (row 1's first block fully masked), blocks of 8 keys, and a value row per key. For each block:
# the tile of scores read so far, the state $m$, $\ell$ and $\alpha$ of every row after it, and the
# output of row 0 so far, $o/\ell$, which is exactly attention over the keys seen and meets the
# reference at the last block. The static figure shows every step; in JupyterLab a slider follows
# it to replay one block at a time.

# %%
from course_utils.pictures import steppers

g = torch.Generator().manual_seed(2)
tile_scores = torch.randn(4, 32, generator=g, dtype=torch.float64) * 1.5
tile_scores[1, :8] = float("-inf")  # row 1 sees nothing in block 0: m stays −∞, the shift is 0
tile_values = torch.randn(32, 8, generator=g, dtype=torch.float64)
states = steppers.online_softmax_stepper(tile_scores, tile_values, block_N=8, row=0)
cu.check_close(states[-1]["out"], torch.softmax(tile_scores, dim=-1) @ tile_values, "o/ℓ after the last block")
cu.check_close(states[-1]["m"], tile_scores.amax(-1), "running max after the last block");

# %% [markdown]
# ## Takeaways
# - Safe softmax subtracts the row maximum: every exponent $\le 0$, no overflow, same result.
# - The online normaliser keeps a running max $m$ and sum $\ell$; when the max grows, the old sum
#   is rescaled by $\alpha = e^{m_\text{old} - m_\text{new}}$ (Milakov & Gimelshein, 2018).
# - FlashAttention applies the same $\alpha$ to the output accumulator $o$, so softmax · V takes
#   one pass over the keys, a block at a time, and divides by $\ell$ once at the end.
# - Kernels fold $\log_2 e$ into the softmax scale and call `exp2`; they write
#   $\mathrm{LSE} = m + \log \ell$ so the backward pass can rebuild $P$ without storing it.
# - A masked row needs care: shift by 0 while the running max is still $-\infty$.
# - Next, chapter 03 puts this loop inside a tiled TileLang kernel with `T.gemm` for $QK^\top$ and $PV$.

# %% [markdown]
# ## Exercises

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) Merge two softmax states
#
# Two thread blocks each process half of a row's keys (a *split-KV* schedule, used when there are
# too few rows to keep a GPU busy, as in decoding). Block A returns $(m_a, \ell_a)$ for its
# scores, block B returns $(m_b, \ell_b)$ for its own. Write `merge_softmax_states`, which
# returns $(m, \ell)$ for **all** the scores, row by row. The online update of section 3 is the
# special case where B is one block. Some rows may have $m_b = -\infty$, $\ell_b = 0$ (all of B's
# keys masked).
#
# Stuck? `hint("02", "a", 1)`, then `hint("02", "a", 2)`; `solution("02", "a")` shows the answer.

# %% tags=["solution", "ex-a"]
def merge_softmax_states(m_a, l_a, m_b, l_b):
    ### BEGIN SOLUTION
    m = torch.maximum(m_a, m_b)
    l = l_a * torch.exp(m_a - m) + l_b * torch.exp(m_b - m)
    ### END SOLUTION
    return m, l


# %%
# NBVAL_CHECK_OUTPUT
from course_utils.exercises.ch02 import check_merge_softmax_states

check_merge_softmax_states(merge_softmax_states)

# %% [markdown]
# ### (b) Combine two partial attention outputs with their LSE
#
# Now the two halves return *finished* attention results for their keys: block A returns
# $O_a = \mathrm{softmax}(S_A) V_A$ and $\mathrm{LSE}_a$, block B the same for its keys. This is
# how split-KV decoding kernels such as Flash-Decoding finish: a small second kernel merges the
# partial results. Write `combine_partial_attention`, returning $O$ and $\mathrm{LSE}$ over all
# the keys (`o_*` are `[B, H, S, D]`, `lse_*` are `[B, H, S]`). Hint: $e^{\mathrm{LSE}_a}$ is block
# A's softmax denominator; what share of the total denominator is it?
#
# Stuck? `hint("02", "b", 1)`, then `hint("02", "b", 2)`; `solution("02", "b")` shows the answer.

# %% tags=["solution", "ex-b"]
def combine_partial_attention(o_a, lse_a, o_b, lse_b):
    ### BEGIN SOLUTION
    lse = torch.logaddexp(lse_a, lse_b)
    o = o_a * torch.exp(lse_a - lse)[..., None] + o_b * torch.exp(lse_b - lse)[..., None]
    ### END SOLUTION
    return o, lse


# %%
from course_utils.exercises.ch02 import check_combine_partial_attention

check_combine_partial_attention(combine_partial_attention)

# %% [markdown]
# ### (c) The online update, in TileLang
#
# Now the kernel of section 7 with its heart left out. The factory below gives the tiles, the
# loops and pass 2; pass 1's body is yours. For the block of scores just copied into `x`, update
# the running max `m` (keep the old one in `m_prev`; `T.reduce_max` clears its output unless
# `clear=False`), the shift (`m · scale_log2`, or 0 while `m` is still $-\infty$), the
# exponentials with `exp2` and `log2 e` folded into `scale_log2`, this block's row sums, and
# `ℓ = ℓ·α + row_sum` with $\alpha = 2^{m_\text{prev}\cdot c - \text{shift}}$. Pass 2 relies on
# exactly these conventions for `shift` and `l`. The checker runs your kernel here, on rows chosen
# to expose the usual mistakes (masked leading blocks, a masked block in the middle, large logits,
# a max that grows at every block), and names the likely bug.
#
# Stuck? `hint("02", "c", 1)`, then `hint("02", "c", 2)`; `solution("02", "c")` shows the answer.

# %% tags=["solution", "ex-c"]
import tilelang.language as T

from course_utils.kernels.tiles import TileBackend


def online_softmax(M, N, *, scale=1.0, block_M=8, block_N=16, target=None):
    """Y = softmax(scale · X) and the natural-log LSE of each row, X [M, N] float32, N % block_N == 0."""
    tb = TileBackend(target)
    scale_log2 = scale * LOG2E  # exp(scale·x) = exp2(x·scale_log2)
    neg_inf = -T.infinity("float32")

    @T.prim_func
    def softmax(X: T.Tensor([M, N], "float32"), Y: T.Tensor([M, N], "float32"), LSE: T.Tensor([M], "float32")):
        with tb.kernel(T.ceildiv(M, block_M), threads=128) as bx:
            x = tb.fragment([block_M, block_N], "float32")
            # running max of the raw scores, its value before this block, m·scale_log2 (0 while m = −∞),
            # the running sum of exp2(x·scale_log2 − shift), and this block's row sums:
            m, m_prev, shift, l, row_sum = (tb.fragment([block_M], "float32") for _ in range(5))
            T.fill(m, neg_inf)
            T.fill(l, 0)
            for kb in T.serial(N // block_N):  # pass 1: the online normaliser
                T.copy(X[bx * block_M:(bx + 1) * block_M, kb * block_N:(kb + 1) * block_N], x)
                ### BEGIN SOLUTION
                T.copy(m, m_prev)
                T.reduce_max(x, m, dim=1, clear=False)
                for i in tb.parallel(block_M):
                    shift[i] = T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)
                for i, j in tb.parallel(block_M, block_N):
                    x[i, j] = T.exp2(x[i, j] * scale_log2 - shift[i])
                T.reduce_sum(x, row_sum, dim=1)
                for i in tb.parallel(block_M):
                    l[i] = l[i] * T.exp2(m_prev[i] * scale_log2 - shift[i]) + row_sum[i]
                ### END SOLUTION
            for kb in T.serial(N // block_N):  # pass 2: normalise
                T.copy(X[bx * block_M:(bx + 1) * block_M, kb * block_N:(kb + 1) * block_N], x)
                for i, j in tb.parallel(block_M, block_N):
                    x[i, j] = T.exp2(x[i, j] * scale_log2 - shift[i]) / l[i]
                T.copy(x, Y[bx * block_M:(bx + 1) * block_M, kb * block_N:(kb + 1) * block_N])
            for i in tb.parallel(block_M):
                if bx * block_M + i < M:
                    LSE[bx * block_M + i] = (shift[i] + T.log2(l[i])) / LOG2E

    return softmax


# %%
from course_utils.exercises.ch02 import check_online_softmax_kernel

check_online_softmax_kernel(online_softmax)

# %% [markdown]
# ## The course's online-softmax kernel, listed (read after the exercises)
#
# The course's own code for what the exercises above asked you to write, kept until after them so that
# it cannot give the answer away. Compare it with yours: the same steps, sometimes written as shared
# pieces (`course_utils/kernels/flash_pieces.py`) that several kernels use.

# %% [markdown]
# From section 7 · A TileLang online softmax: stream the columns:

# %%
show_source(softmax_online_kernel, "passes")
