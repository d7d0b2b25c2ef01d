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
# # 01 · Naive attention, and why it is slow
#
# **Question.** Attention fits in three lines of PyTorch. Why, then, do the fast versions need
# a hand-written kernel?
#
# This chapter writes attention exactly as the formula reads, checks it against two references,
# and then counts what it costs: memory that grows with the *square* of the sequence length, and
# traffic to the GPU's main memory that keeps the arithmetic units waiting. FlashAttention exists
# to remove both costs; the rest of the course builds it.

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import inspect
import math
import statistics
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from course_utils.pictures import plots
from course_utils.measure.benchmarks import RECORDS, naive_attention
from course_utils.core.labels import FA2, NAIVE
from course_utils.checking.validation import check_stored_errors

# %% [markdown]
# ## The math
#
# Take one sequence and one attention head. The queries $Q$, keys $K$ and values $V$ are
# $S \times D$ matrices: one row per position in the sequence, $D$ numbers per row (the *head
# dimension*). Attention computes
#
# $$O = \mathrm{softmax}\!\left(Q K^\top \cdot \tfrac{1}{\sqrt{D}}\right) V .$$
#
# - The **scores** $s_{ij} = q_i \cdot k_j / \sqrt{D}$ form an $S \times S$ matrix: one number
#   for every (query, key) pair.
# - The **softmax** runs along each row: $p_{ij} = e^{s_{ij}} / \sum_{j'} e^{s_{ij'}}$. The
#   weights of a row are positive and sum to 1.
# - Row $i$ of the output is the weighted average $o_i = \sum_j p_{ij} v_j$ of the value rows.
#
# The scale $1/\sqrt{D}$ keeps the scores of order one: a dot product of $D$ independent
# unit-variance terms has standard deviation $\sqrt{D}$, and a softmax of very large scores
# would put almost all the weight on a single key.
#
# **Causal masking.** In a decoder, position $i$ may only look at positions $j \le i$. The
# scores of later keys are set to $-\infty$ before the softmax, so their weights are exactly 0.
#
# A batch holds $B$ sequences and $H$ heads, each an independent attention problem. The course
# stores them as tensors of shape `[B, H, S, D]`, the layout of PyTorch's
# `torch.nn.functional.scaled_dot_product_attention` (SDPA).

# %% [markdown]
# ## A picture: scores and probabilities
#
# A tiny example, $S = 6$ and $D = 4$, in float64. We compute the scores and the softmax by
# hand, with and without the causal mask, and check the result against the course's reference.

# %%
torch.manual_seed(0)
n, d = 6, 4
tq, tk, tv = (torch.randn(n, d, dtype=torch.float64) for _ in range(3))
scores = tq @ tk.T / math.sqrt(d)
future = ~torch.ones(n, n, dtype=torch.bool).tril()  # True where key j comes after query i

tiny = {}
for causal in (False, True):
    s = scores.masked_fill(future, float("-inf")) if causal else scores
    p = torch.softmax(s, dim=-1)
    expected = cu.attention_reference(tq[None, None], tk[None, None], tv[None, None], causal=causal)[0, 0]
    cu.check_close(p @ tv, expected, f"P @ V vs reference, causal={causal}")
    cu.check_close(p.sum(dim=-1), torch.ones(n, dtype=torch.float64), f"rows of P sum to 1, causal={causal}")
    tiny[causal] = (s, p)

# %%
fig, axes = plt.subplots(2, 2, figsize=(8, 5.8))
for row, causal in enumerate((False, True)):
    s, p = tiny[causal]
    label = "causal" if causal else "no mask"
    shown = s.masked_fill(s.isinf(), float("nan"))  # −∞ is drawn as a blank cell
    plots.heatmap(axes[row, 0], shown, title=f"scores $s_{{ij}}$ ({label})", annotate=True, fmt="{:.1f}")
    plots.heatmap(axes[row, 1], p, title=f"probabilities $p_{{ij}}$ ({label})", annotate=True,
                  fmt="{:.2f}")
fig.tight_layout()

# %% [markdown]
# Each row of the probability matrix is one query's distribution over the keys. With the causal
# mask the upper triangle is blank in the scores ($-\infty$) and exactly zero in the
# probabilities; the first query can only attend to itself, so its single weight is 1.
#
# Note the sizes: the scores and probabilities are $S \times S$, while $Q$, $K$, $V$ and $O$
# are only $S \times D$. For real models $S$ is in the thousands and $D$ is 64 or 128.

# %% [markdown]
# ## The PyTorch implementation
#
# `course_utils.measure.benchmarks.naive_attention` is the textbook version, and the one timed on the
# H100 later in this chapter. The softmax runs in float32 even for float16 inputs, as mixed
# precision training usually does, because the exponentials and the row sums lose accuracy in
# 16 bits. Exercise (b) asks you to write its causal version for `[B, H, S, D]` tensors, so its source
# is listed at the end of the chapter, after the exercises.
#
# Check it on random inputs, with and without the mask, against the float64 reference and
# against PyTorch's own fused attention (SDPA). On the CPU the inputs are float32; on the GPU they
# are float16 at a larger size.

# %%
shape = cu.pick(cpu=(2, 4, 256, 64), gpu=(4, 16, 1024, 64))
dtype = cu.pick(cpu=torch.float32, gpu=torch.float16)
gen = torch.Generator(device=cu.DEVICE).manual_seed(0)
q, k, v = (torch.randn(shape, dtype=dtype, device=cu.DEVICE, generator=gen) for _ in range(3))
print(f"q, k, v: {tuple(q.shape)} {dtype}")
for causal in (False, True):
    out = naive_attention(q, k, v, causal=causal)
    cu.check_close(out, cu.attention_reference(q, k, v, causal=causal), f"naive vs float64 reference, causal={causal}")
    cu.check_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal), f"naive vs SDPA, causal={causal}")

# %% [markdown]
# ## Why it is slow (1): the S×S matrix has to live somewhere
#
# `naive_attention` stores the whole score matrix, for every batch entry and head, in GPU memory.
# That is $B \cdot H \cdot S^2$ numbers. Reading the source line by line, its largest moment is
# the softmax: the float16 scores (still held by the variable `scores`), their float32 copy (the
# softmax's input) and the float32 softmax output are alive at once.
#
# We use the shape of the H100 measurement below, $B = 4$, $H = 16$, $D = 64$, and call an 80 GB
# card $80 \cdot 10^9$ bytes.

# %%
BATCH, HEADS, DIM = 4, 16, 64  # the shape of the H100 record below
CARD_BYTES = 80e9               # an "80 GB" card, GB = 10⁹ bytes
FP16, FP32 = torch.float16.itemsize, torch.float32.itemsize
NAIVE_PEAK_PER_SCORE = FP16 + FP32 + FP32  # scores, scores.float(), softmax output


def scores_bytes(batch, heads, seq, bytes_per_el):
    """Bytes of a [batch, heads, seq, seq] matrix with bytes_per_el bytes per entry."""
    return batch * heads * seq * seq * bytes_per_el


print(f"naive_attention's peak: {NAIVE_PEAK_PER_SCORE} bytes per score")

# %%
# NBVAL_CHECK_OUTPUT
seqs = [2**p for p in range(8, 17)]  # 256 … 64k
print(f"B={BATCH}, H={HEADS}, GB = 10⁹ bytes")
print(f"{'S':>6} {'scores fp16 (GB)':>17} {'naive peak (GB)':>16}   peak fits in 80 GB?")
for s in seqs:
    fp16_gb = scores_bytes(BATCH, HEADS, s, FP16) / 1e9
    peak_gb = scores_bytes(BATCH, HEADS, s, NAIVE_PEAK_PER_SCORE) / 1e9
    print(f"{s:>6} {fp16_gb:>17.3f} {peak_gb:>16.3f}   {'yes' if peak_gb * 1e9 <= CARD_BYTES else 'no'}")

# %%
mem_rows = [dict(what=what, seq=s, GB=scores_bytes(BATCH, HEADS, s, per) / 1e9)
            for what, per in (("score matrix, fp16", FP16),
                              ("naive_attention peak (fp16 + 2× fp32)", NAIVE_PEAK_PER_SCORE))
            for s in seqs]
fig, ax = plt.subplots(figsize=(7, 3.8))
plots.line_chart(ax, mem_rows, x="seq", y="GB", group="what", logy=True, xlabel="sequence length S",
                 ylabel="GB (log scale)", title=f"Memory of the S×S matrices, B={BATCH}, H={HEADS}")
ax.axhline(CARD_BYTES / 1e9, color="black", linestyle="--", linewidth=1)
ax.text(seqs[0], CARD_BYTES / 1e9 * 1.3, "80 GB card", fontsize=9)
fig.tight_layout()

# %% [markdown]
# Both lines have slope 2 on the log–log plot: doubling $S$ quadruples the memory. The inputs
# and the output, $4 \cdot B \cdot H \cdot S \cdot D$ numbers, grow only linearly. Long before
# the card is full, this memory also costs time, because every byte of it is written and read
# back. That is the second problem.

# %% [markdown]
# ## Why it is slow (2): traffic to HBM
#
# A GPU keeps tensors in HBM, its large off-chip memory. The arithmetic happens on chip, so a
# kernel that performs $F$ floating-point operations and moves $M$ bytes between HBM and the chip
# needs at least $\max(F / \text{peak},\; M / \text{bandwidth})$ seconds. The ratio $I = F/M$ is
# the kernel's **arithmetic intensity** in FLOP per byte. When $I$ is below
# $\text{peak}/\text{bandwidth}$ (the *ridge point*), bandwidth, not arithmetic, sets the speed.
#
# In PyTorch's eager mode, each operation in `naive_attention` is a separate kernel: it reads its
# inputs from HBM and writes its output back to HBM. Rather than count the bytes by hand, let
# PyTorch list the operations. We run the function on **meta** tensors (shapes and dtypes, no
# data, nothing computed) under a `TorchDispatchMode`, which sees every ATen operation PyTorch
# dispatches, and record the bytes of each one's tensor inputs (read) and outputs (written).

# %%
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _tensor_bytes(tree):
    return sum(t.nbytes for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


class CountTraffic(TorchDispatchMode):
    """Record (op, bytes read, bytes written) for every ATen op that makes a new tensor."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views (transpose, expand, reshape) move no data. matmul's `_unsafe_view` is a view too,
        # although its schema does not say so.
        is_view = any(r.alias_info is not None for r in func._schema.returns)
        if not is_view and func is not torch.ops.aten._unsafe_view.default:
            self.ops.append((func.overloadpacket.__name__, _tensor_bytes((args, kwargs)), _tensor_bytes(out)))
        return out


def traffic(fn, batch, heads, seq, dim, dtype=torch.float16, **kwargs):
    """The (op, read, written) list of fn(q, k, v, **kwargs) on [batch, heads, seq, dim] inputs."""
    q = torch.empty(batch, heads, seq, dim, dtype=dtype, device="meta")
    with CountTraffic() as counter:
        fn(q, q, q, **kwargs)
    return counter.ops


# %% [markdown]
# Here are the operations of `naive_attention` for float16 inputs at $S = 1024$, in bytes per
# entry of the score matrix ($B \cdot H \cdot S^2$ entries):

# %%
# NBVAL_CHECK_OUTPUT
S = 1024
ops = traffic(naive_attention, BATCH, HEADS, S, DIM)
entries = BATCH * HEADS * S * S
print(f"{'ATen op':>12} {'read':>7} {'written':>8}   (bytes per score entry)")
for name, read, written in ops:
    print(f"{name:>12} {read / entries:>7.3f} {written / entries:>8.3f}")
total = sum(read + written for _, read, written in ops)
print(f"{'total':>12} {total / entries:>16.3f}  = {total / 1e9:.3f} GB at S={S}")
causal_total = sum(r + w for _, r, w in traffic(naive_attention, BATCH, HEADS, S, DIM, causal=True))
print(f"with the causal mask: {causal_total / entries:.3f} bytes per score entry")

# %% [markdown]
# The first `bmm` ($QK^\top$) writes the matrix; the division by $\sqrt{D}$, the cast to float32,
# the softmax and the cast back each read it and write it again; the second `bmm` ($PV$) reads
# it once more. The causal mask adds its own passes, even though by the FLOP convention of the
# course (`cu.attention_flops`) causal attention does only half the useful work.
#
# An **ideal fused kernel** never stores the matrix: it reads $Q$, $K$, $V$ once and writes $O$
# once, $4 \cdot B \cdot H \cdot S \cdot D$ numbers. Its traffic grows like $S$ while its FLOPs
# grow like $S^2$, so its intensity grows with $S$; for naive attention both grow like $S^2$.

# %%
def naive_bytes(seq):
    return sum(read + written for _, read, written in traffic(naive_attention, BATCH, HEADS, seq, DIM))


def fused_bytes(seq, bytes_per_el=FP16):
    return 4 * BATCH * HEADS * seq * DIM * bytes_per_el  # read Q, K, V; write O


def flops(seq):
    return cu.attention_flops(BATCH, HEADS, seq, seq, DIM)


print(f"{'S':>6} {'GFLOP':>8} {'naive GB':>9} {'fused GB':>9} {'naive FLOP/B':>13} {'fused FLOP/B':>13}")
for s in seqs[:6]:
    print(f"{s:>6} {flops(s) / 1e9:>8.1f} {naive_bytes(s) / 1e9:>9.3f} {fused_bytes(s) / 1e9:>9.4f} "
          f"{flops(s) / naive_bytes(s):>13.2f} {flops(s) / fused_bytes(s):>13.1f}")

# %% [markdown]
# ## Measured on the H100
#
# The stored record times `naive_attention` and SDPA's FlashAttention-2 backend on an H100, in
# float16 without a mask, and records the peak memory each allocates beyond its inputs. Before
# timing, both outputs were checked on every head against the float64 reference; the record keeps
# the errors. First we check those and that the record has the shape used above.

# %%
rec = cu.measured("ch01_naive_vs_sdpa_h100", RECORDS["ch01_naive_vs_sdpa_h100"])
FLASH = FA2  # SDPA's FlashAttention-2 backend
rows = [dict(r, peak_GB=r["peak_extra_bytes"] / 1e9) for r in rec["results"]]
naive = {r["seq"]: r for r in rows if r["impl"] == NAIVE}
flash = {r["seq"]: r for r in rows if r["impl"] == FLASH}
seqs_rec = sorted(naive)

check_stored_errors(rec["results"], "ch01 record (naive and SDPA)", unchecked=())
cu.check_true(all((r["batch"], r["heads"], r["dim"]) == (BATCH, HEADS, DIM) for r in rows),
              f"every row of the record has B={BATCH}, H={HEADS}, D={DIM}")

# %% [markdown]
# The memory model of the previous sections should explain the measured peaks. Naive attention
# should need `NAIVE_PEAK_PER_SCORE` bytes per score. FlashAttention keeps no score matrix: its
# extra memory is the output $O$ plus one float32 per query row (the *log-sum-exp*, saved for the
# backward pass; chapter 02 explains it). Allocators round sizes up, so we allow 1 %.

# %%
naive_model = [scores_bytes(BATCH, HEADS, s, NAIVE_PEAK_PER_SCORE) for s in seqs_rec]
flash_model = [BATCH * HEADS * s * (DIM * FP16 + FP32) for s in seqs_rec]  # O and the log-sum-exp
for impl, runs, model in (("naive", naive, naive_model), ("FlashAttention-2", flash, flash_model)):
    peaks = torch.tensor([runs[s]["peak_extra_bytes"] for s in seqs_rec], dtype=torch.float64)
    cu.check_close(peaks, torch.tensor(model, dtype=torch.float64), f"{impl} peak extra memory vs model",
                   atol=0, rtol=0.01)

# %%
speedup = [naive[s]["ms"] / flash[s]["ms"] for s in seqs_rec]
computed = [dict(impl="S×S scores fp16 (computed)", seq=s, peak_GB=scores_bytes(BATCH, HEADS, s, FP16) / 1e9)
            for s in seqs_rec]
fig, axes = plt.subplots(1, 3, figsize=(13, 3.7))
plots.line_chart(axes[0], rows, x="seq", y="ms", logy=True, title="Forward time (fp16, no mask)",
                 xlabel="sequence length S", ylabel="ms (log scale)")
plots.speedup_bars(axes[1], [str(s) for s in seqs_rec], speedup, title="FlashAttention-2 speedup over naive")
axes[1].set_xlabel("sequence length S")
plots.line_chart(axes[2], rows + computed, x="seq", y="peak_GB", logy=True, title="Peak extra memory",
                 xlabel="sequence length S", ylabel="GB (log scale)")
axes[2].lines[-1].set(linestyle="--", color=plots.COLORS[1])  # the computed line
axes[2].legend(fontsize=8)
fig.suptitle(f"naive_attention vs SDPA FlashAttention-2, B={BATCH}, H={HEADS}, D={DIM}", y=1.02)
fig.text(0.5, -0.04, "measured on " + plots.record_caption(rec), ha="center", fontsize=8)
fig.tight_layout()
plots.save(fig, "ch01_naive_vs_sdpa");

# %% [markdown]
# The gap widens with $S$: naive attention's time follows its $S^2$ traffic, and its memory sits
# a constant factor above the score matrix itself, while FlashAttention's extra memory grows only
# linearly. The roofline shows why. Its two lines come from the H100 SXM's data sheet: the dense
# float16 tensor-core peak and the HBM bandwidth (the constants in the next cell).

# %%
PEAK_TFLOPS, HBM_TBS = 989, 3.35  # H100 SXM data sheet: dense fp16 tensor cores, HBM3 bandwidth
roof = {}
fig, ax = plt.subplots(figsize=(7.5, 4.5))
plots.roofline(ax, peak_tflops=PEAK_TFLOPS, bandwidth_tbs=HBM_TBS, title="Roofline of the H100 (fp16)")
ends = [""] * (len(seqs_rec) - 2)  # the naive points overlap: label only the shortest and longest S
for impl, runs, moved, labels, offset in (
        (NAIVE, naive, naive_bytes, [f"S={seqs_rec[0]}", *ends, f"S={seqs_rec[-1]}"], (6, -3)),
        (FLASH, flash, fused_bytes, [f"S={s}" for s in seqs_rec], (-5, 5))):
    intensity = [flops(s) / moved(s) for s in seqs_rec]
    roof[impl] = [min(PEAK_TFLOPS, HBM_TBS * i) for i in intensity]
    plots.roofline_series(ax, impl, intensity, [runs[s]["tflops"] for s in seqs_rec], labels=labels, offset=offset)
    print(f"{impl}:")
    for s, i, bound in zip(seqs_rec, intensity, roof[impl]):
        print(f"  S={s:>5}: {i:7.1f} FLOP/B, roof {bound:5.0f} TFLOP/s, measured {runs[s]['tflops']:5.1f}"
              f" ({runs[s]['tflops'] / bound:4.0%} of the roof)")
fig.text(0.5, -0.02, "points measured on " + plots.record_caption(rec), ha="center", fontsize=8)
fig.tight_layout()
cu.check_true(all(runs[s]["tflops"] <= bound for impl, runs in ((NAIVE, naive), (FLASH, flash))
                  for s, bound in zip(seqs_rec, roof[impl])), "every measurement lies under its roof")

# %% [markdown]
# Naive attention sits at almost the same intensity for every $S$, left of the ridge: it is
# memory-bound, and no sequence length moves it. Beyond the shortest sequence its measured speed
# is most of what the bandwidth allows (the fractions printed above), so the individual kernels
# are not the problem; the algorithm moves too many bytes. The fused kernel's intensity grows with $S$ and passes the ridge, so it can use the
# tensor cores. Its measured points are still far below the flat roof: how much of that gap a
# tiled kernel can close is the subject of chapters 03 and 04.

# %% [markdown]
# ## On this machine's CPU
#
# For a feel of the same effect without a GPU, here is a live timing on **this machine's CPU**
# (float32, one batch entry, 8 heads). These are not H100 numbers and nothing is compared with
# them; only the outputs are checked. PyTorch's CPU SDPA is also a fused, tiled kernel.

# %%
def median_ms(fn, reps=5):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


for s in (256, 512, 1024):
    cq, ck, cv = (torch.randn(1, 8, s, 64) for _ in range(3))
    cu.check_close(naive_attention(cq, ck, cv), F.scaled_dot_product_attention(cq, ck, cv), f"CPU S={s}", quiet=True)
    t_naive = median_ms(lambda: naive_attention(cq, ck, cv))
    t_sdpa = median_ms(lambda: F.scaled_dot_product_attention(cq, ck, cv))
    print(f"this CPU, S={s:>4}: naive {t_naive:7.1f} ms, SDPA {t_sdpa:6.1f} ms, ratio {t_naive / t_sdpa:4.1f}×")

# %% [markdown]
# **Stale output.** The stored lines above were timed on the CPU of the machine that last executed
# this chapter, not on yours, and they do not show the effect: their times do not grow with S, as a
# computation of S² scores per head must (naive and SDPA each take about the same time at every S), so on
# that machine something other than the arithmetic set them, and their ratio says nothing about the
# two methods. Run the cell to time this machine's CPU.
#
# ## Takeaways
# - Attention is two matrix products around a row-wise softmax; the causal mask sets the scores
#   of later keys to $-\infty$.
# - Written naively, it stores an $S \times S$ matrix per batch entry and head: memory grows like
#   $S^2$ and runs out long before the inputs do.
# - Every elementwise step reads and writes that matrix in HBM, so naive attention is
#   memory-bound at a fixed, low arithmetic intensity whatever the sequence length.
# - A fused kernel that never stores the matrix moves only $Q$, $K$, $V$ and $O$; its
#   intensity grows with $S$. Chapter 02 shows the trick that makes this possible: a softmax
#   computed in one pass over the keys.

# %% [markdown]
# ## Exercises
#
# Stuck on one? `hint("01", "a", 1)` names the idea, `hint("01", "a", 2)` the functions to use;
# `solution("01", "a")` shows the answer (the same for "b").

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) The longest sequence that fits
#
# Write `max_seq_len(batch, heads, bytes_per_el, capacity_bytes)`: the largest $S$ whose
# `[batch, heads, S, S]` matrix, at `bytes_per_el` bytes per entry, fits in `capacity_bytes`.
# The table above only tried powers of two; this gives the exact crossover.

# %% tags=["solution", "ex-a"]
def max_seq_len(batch, heads, bytes_per_el, capacity_bytes):
    """The largest S with batch * heads * S * S * bytes_per_el <= capacity_bytes."""
    ### BEGIN SOLUTION
    return math.isqrt(int(capacity_bytes) // (batch * heads * bytes_per_el))
    ### END SOLUTION


# %%
from course_utils.exercises.ch01 import check_causal_attention, check_max_seq_len

check_max_seq_len(max_seq_len)
for what, per in (("fp16 score matrix", FP16), ("naive_attention peak", NAIVE_PEAK_PER_SCORE)):
    print(f"{what}, B={BATCH}, H={HEADS}: fits in 80 GB up to S = {max_seq_len(BATCH, HEADS, per, CARD_BYTES)}")

# %% [markdown]
# ### (b) Causal attention by hand
#
# Write `causal_attention(q, k, v)` for `[B, H, S, D]` tensors without calling
# `naive_attention` or SDPA: scores, the causal mask with `masked_fill`, softmax, then $V$. The
# checker compares it with the float64 reference and names common mistakes.

# %% tags=["solution", "ex-b"]
def causal_attention(q, k, v):
    """softmax(Q Kᵀ / sqrt(D), keys after the query masked out) V."""
    ### BEGIN SOLUTION
    seq = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    future = ~torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
    ### END SOLUTION


# %%
check_causal_attention(causal_attention)

# %% [markdown]
# ## The course's code, listed (read after the exercises)
#
# `naive_attention`, the version timed in this chapter (section "The PyTorch implementation"): kept until
# after the exercises so that it cannot give exercise (b)'s answer away.

# %%
print(inspect.getsource(naive_attention))
