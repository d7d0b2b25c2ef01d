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
# # 11 · Your own attention: score and mask modifiers compiled into the kernels
#
# **Question.** Every model changes attention a little. Gemma 2 caps its logits with a `tanh`;
# ALiBi adds a penalty that grows with the distance to the key; packed pretraining hides the keys
# of other documents; a vision-language model lets its image prefix attend both ways; long-context
# models mix a sliding window with a few global tokens. Writing a FlashAttention kernel for each is
# how chapters 03–08 would do it. Can a user instead write *two small Python functions* — one that
# changes a score, one that says which keys a query sees — and get one fused kernel, forward and
# backward, that skips the work the mask hides?
#
# PyTorch's FlexAttention answered yes: `score_mod(score, b, h, q_idx, kv_idx)` and
# `mask_mod(b, h, q_idx, kv_idx)` are traced by `torch.compile` into a Triton template, and a
# `BlockMask` says which tiles to skip. This chapter builds the same thing on the course's TileLang
# kernels (`course_utils/api/flex.py` for the API, `course_utils/kernels/flex_trace.py` for the tracer, `course_utils/kernels/flash_flex.py` for the kernels): the modifiers
# are applied to the kernel's index and score *expressions* while the kernel is built, so their
# formulas are inlined into the generated C or CUDA.
#
# *Credit.* Dong, Feng, Guessous, Liang, He, [Flex Attention: A Programming Model for Generating
# Optimized Attention Kernels](https://arxiv.org/abs/2412.05496) (2024), and PyTorch's
# `torch.nn.attention.flex_attention`, whose conventions we follow. Soft-capping: Gemma Team,
# [Gemma 2](https://arxiv.org/abs/2408.00118) (2024). ALiBi: Press, Smith, Lewis,
# [Train Short, Test Long](https://arxiv.org/abs/2108.12409) (2022). Window + global tokens:
# Beltagy et al., [Longformer](https://arxiv.org/abs/2004.05150) (2020). Prefix-LM: Raffel et al.,
# [T5](https://arxiv.org/abs/1910.10683) (2020).

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import math
import re

import matplotlib.pyplot as plt
import torch
from tilelang import tvm

from course_utils.api import flex
from course_utils.pictures import plots
from course_utils.measure.benchmarks import RECORDS
from course_utils.measure.benchmarks.ch11_flex import (OURS_CAUSAL, OURS_NO_SKIP, OURS_ROTATED_FORWARD, OURS_SM80_BWD,
                                                        OURS_SM80_FORWARD, SDPA_MASKED, TORCH_FLEX, TORCH_FLEX_FA4,
                                                        UNCHECKED)
from course_utils.kernels.flash_flex import flex_bwd_kernel, flex_fwd_kernel
from course_utils.kernels.flash_flex_hopper import flex_fwd_hopper_kernel
from course_utils.kernels.flex_pieces import modify_scores
from course_utils.api.flex import (Dual, Sym, causal_mask, create_block_mask, flex_attention, flex_backward, flex_forward,
                                   flex_forward_kernel, prefix_lm, soft_cap)
from course_utils.checking.flex_reference import flex_references
from course_utils.core.labels import OURS
from course_utils.core.source import cuda_source, grep, show_source
from course_utils.checking.validation import backward_bugs, check_stored_errors, forward_bugs

torch.manual_seed(0)
print("device:", cu.DEVICE, "| tile target:", cu.TILE_TARGET)

# %% [markdown]
# ## 1 · Two small functions
#
# A `score_mod` receives the scaled score $s = q_i \cdot k_j \,/\sqrt{D}$ and the indices of the
# pair (batch `b`, query head `h`, query `q_idx`, key `kv_idx`) and returns a new score. A
# `mask_mod` receives the indices and returns whether the key is visible. Soft-capping, a
# prefix-LM and a causal sliding window with global tokens, as the course writes them:

# %%
show_source(flex.soft_cap)
show_source(flex.prefix_lm)
show_source(flex.window_with_globals)

# %% [markdown]
# Nothing in them is TileLang, or torch: ordinary operators, and `tanh` from `course_utils.api.flex`
# (the helpers `where`, `tanh`, `exp`, `log`, `sqrt`, `abs`, `minimum`, `maximum` dispatch on what
# they receive). On torch tensors of indices, broadcast against each other, they compute the whole
# score or mask matrix: that is how the float64 reference (`flex_reference`, in `course_utils/checking/`) and
# `create_block_mask` use them.

# %%
s = torch.linspace(-200, 200, 9, dtype=torch.float64)
capped = soft_cap(50.0)(s, 0, 0, 0, 0)
print("scores:", s.tolist(), "\ncapped:", [round(x, 2) for x in capped.tolist()])
cu.check_close(capped, 50 * torch.tanh(s / 50), "soft-cap on tensors = 50·tanh(s/50)")
positions = torch.arange(6)
print(prefix_lm(2)(0, 0, positions[:, None], positions[None, :]).int())

# %% [markdown]
# ## 2 · The same function on three kinds of values
#
# Inside a kernel factory the same function receives `Sym`s: thin wrappers around TileLang
# expressions whose operators build expressions. Calling `soft_cap` on the symbolic score returns
# the formula the kernel will compute, not a number:

# %%
score, q_idx, kv_idx = (Sym(tvm.tirx.Var(n, dt)) for n, dt in (("score", "float32"), ("q_idx", "int32"),
                                                                  ("kv_idx", "int32")))
print("soft-cap      :", soft_cap(50.0)(score, 0, 0, q_idx, kv_idx).expr)
print("prefix-LM mask:", prefix_lm(2)(0, 0, q_idx, kv_idx).expr)

# %% [markdown]
# Why a wrapper rather than TileLang's expressions themselves? They have Python operators too, but
# TVM's `~` on a boolean is a *bitwise* not, and C evaluates `~1` to −2, which is true: a mask
# written `~(kv_idx > q_idx)` would hide nothing. `Sym` makes `~`, `&`, `|` logical, and refuses
# Python's `if`/`and`/`or`, which would silently trace one branch:

# %%
raw = ~(kv_idx.expr > q_idx.expr)
print("TVM's ~ :", raw, "\nSym's ~ :", (~(kv_idx > q_idx)).expr)
cu.check_true("bitwise_not" in str(raw) and "bitwise" not in str((~(kv_idx > q_idx)).expr),
              "Sym turns ~ into a logical not")

# %% [markdown]
# The backward needs $\partial\,\mathrm{score\_mod}/\partial s$ (section 6). A third kind of value
# gives it without asking the user: a **dual number** `Dual(value, derivative)` whose operators
# apply the chain rule (forward-mode differentiation). `score_mod(Dual(s, 1), …)` returns the
# modified score and its derivative at once — on tensors here, on kernel expressions in the
# backward kernel. Checked against PyTorch's autograd:

# %%
s = torch.linspace(-150, 150, 301, dtype=torch.float64, requires_grad=True)
dual = soft_cap(50.0)(Dual(s.detach(), torch.ones_like(s)), 0, 0, 0, 0)
(autograd_slope,) = torch.autograd.grad(soft_cap(50.0)(s, 0, 0, 0, 0).sum(), s)
cu.check_close(dual.value, 50 * torch.tanh(s.detach() / 50), "Dual value")
check_slope = lambda slope: cu.check_close(slope, autograd_slope, "Dual derivative vs autograd")  # noqa: E731
check_slope(dual.deriv)
cu.expect_failure("derivative without tanh′ (chain rule dropped)", lambda: check_slope(torch.ones_like(s)))

# %% [markdown]
# Tensors a modifier reads — ALiBi's slopes, the document id of each token — become kernel inputs.
# A tensor the modifier closes over and indexes with `b`, `h`, `q_idx` or `kv_idx` (`slopes[h]`) is
# found as it is read; `flex.captured(tensor)` declares one explicitly, with a name and a handle
# indexed like the tensor (`doc[q_idx]`). In a kernel every one is packed into one float32 and one
# int32 input; a negative index counts from the end, as in torch, an index the host can bound past
# the end is an error, and a row past the end of the sequence reads a clamped entry (the mask hides
# it anyway). New values of the same shapes reuse the compiled kernel: kernels are cached on the
# formula a modifier traces to, so changing a global it reads compiles a new one. `torch.tanh`,
# `torch.where`, `torch.exp` and the other torch functions of the helpers work on kernel values
# too, so a modifier written for PyTorch's `flex_attention` runs unchanged.
#
# A modifier the kernel cannot run gets an error that names it:

# %%
def uses_math(score, b, h, q_idx, kv_idx):
    return math.sin(score)


def uses_and(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and kv_idx > 2


def distance(b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def three_args(score, q_idx, kv_idx):
    return score


q_small = torch.randn(1, 1, 16, 16)
for what, mods in {"math.sin": dict(score_mod=uses_math), "Python `and`": dict(mask_mod=uses_and),
                   "mask not boolean": dict(mask_mod=distance), "wrong arity": dict(score_mod=three_args)}.items():
    try:
        flex_attention(q_small, q_small, q_small, **mods)
        raise cu.CheckFailed(f"{what}: no error raised")
    except TypeError as exc:
        print(f"{what:17} → TypeError: {str(exc)[:150]}…")

# %% [markdown]
# ## 3 · Block masks: the tiles a mask hides are never loaded
#
# A masked pair still costs its share of two matrix products unless the kernel skips it. The
# kernels work on tiles of `block_M` queries × `block_N` keys (128 × 128 on the H100), so
# `create_block_mask` evaluates `mask_mod` once, on every pair, and sorts the tiles into three kinds:
#
# - **empty**: no visible pair — never loaded, no product, no softmax;
# - **full**: every pair visible — computed without evaluating the mask at all;
# - **partial**: the rest — computed, then masked pair by pair with `mask_mod`.
#
# (A tile that runs past the end of the sequence is never full: the kernel must mask its missing
# keys.) Chapters 03 and 06 derived these ranges by hand for causal masks and windows
# (`key_block_range`); here they are *computed* from any mask. Four masks at S = 4096, 128 × 128
# tiles, with the share of tiles skipped:

# %%
S_PICTURE, BLOCK = 4096, (128, 128)
picture_docs = flex.document_ids([700, 1500, 300, 1100, 496])
picture_masks = {
    "causal": causal_mask,
    "documents (causal)": flex.document_mask(picture_docs),
    "prefix-LM (1024)": prefix_lm(1024),
    "window 512 + 256 global": flex.window_with_globals(512, 256),
}
block_masks = {name: create_block_mask(m, None, None, S_PICTURE, S_PICTURE, block=BLOCK)
               for name, m in picture_masks.items()}
for name, bm in block_masks.items():
    print(f"{name:25} {bm.counts()}  skipped {bm.fraction_skipped():.1%}")

# %% [markdown]
# Check the summary against the mask itself, pair by pair: a tile is visited exactly when one of
# its pairs is visible, and full exactly when all of them are. (A negative control: the same
# check against the pairs of a slightly different mask, documents without causality, must fail.)

# %%
def tiles_from_pairs(mask_mod, seq, block):
    """EMPTY/PARTIAL/FULL per tile from the dense [seq, seq] mask (an independent computation)."""
    i = torch.arange(seq)
    dense = mask_mod(0, 0, i[:, None], i[None, :]).reshape(seq // block[0], block[0], seq // block[1], block[1])
    return torch.where(dense.all(3).all(1), flex.FULL, torch.where(dense.any(3).any(1), flex.PARTIAL, flex.EMPTY))


def check_tiles(name, mask_mod, bm):
    cu.check_true(torch.equal(bm.state[0, 0], tiles_from_pairs(mask_mod, S_PICTURE, BLOCK).int()),
                  f"{name}: every tile's state agrees with its pairs")


for name, bm in block_masks.items():
    check_tiles(name, picture_masks[name], bm)
two_way = flex.document_mask(picture_docs, causal=False)
cu.expect_failure("the documents' tiles checked against the pairs of a two-way (non-causal) document mask",
                  lambda: check_tiles("documents", two_way, block_masks["documents (causal)"]))

# %%
fig, axes = plt.subplots(1, 4, figsize=(15, 4))
cmap = plt.matplotlib.colors.ListedColormap(["white", "#f4a261", "#2a9d8f"])
for ax, (name, bm) in zip(axes, block_masks.items()):
    ax.imshow(bm.state[0, 0].numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    ax.set_title(f"{name}\n{bm.fraction_skipped():.0%} of tiles skipped", fontsize=10)
    ax.set_xlabel("key block")
    ax.set_ylabel("query block")
handles = [plt.matplotlib.patches.Patch(color=c, label=lab) for c, lab in zip(cmap.colors, ("empty", "partial",
                                                                                            "full"))]
fig.legend(handles=handles, loc="lower center", ncol=3)
fig.suptitle(f"Block masks at S = {S_PICTURE}, {BLOCK[0]}×{BLOCK[1]} tiles")
fig.tight_layout(rect=(0, 0.06, 1, 1))
plots.save(fig, "ch11_block_masks")
plt.show()

# %% [markdown]
# ## 4 · How a modifier becomes code
#
# The forward kernel is chapter 03's, with three changes, all inside its key loop. The loop walks
# the block mask's list of non-empty key blocks (`KVList`) instead of a range; the score tile goes
# through `score_mod`; and only a partial tile goes through `mask_mod` (both in one piece,
# `modify_scores`). On a Hopper GPU the forward is one of chapter 07's kernels instead, with the same two changes
# swapped in: the step that picks the key block reads `KVList`, and the step between QKᵀ and the softmax is
# `modify_scores`. The rotated loop (`flex_fwd_hopper_kernel` calls its `rotated_loop`) serves any mask; the
# persistent kernel (`flex_fwd_hopper_persistent_kernel`) serves every mask at D = 128, its tiles in the order that
# suits the mask (section 7):

# %%
show_source(flex_fwd_kernel, "scores")
show_source(modify_scores, "score_mod")
show_source(modify_scores, "mask_mod")

# %% [markdown]
# `plan.score(...)` and `plan.mask(...)` call the user's functions on `Sym`s of `S[i, j] · scale`,
# `qb · block_M + i` and `kb · block_N + j` while TileLang runs the factory: what comes back is an
# expression, which TileLang compiles like any other. Here is the CUDA TileLang generates for the
# H100 (sm_90a, lowered on this machine without a GPU) for the causal forward, **before and after**
# adding soft-capping. Before, the scale is folded into the `exp2` of the online softmax (the
# constant is scale · log₂e, as in chapter 03); after, the softmax's constant is log₂e alone, and a
# new pass over the score tile computes the formula (one lane of four shown: the tile is processed
# as `float4`s):

# %%
def lowered_forward(score_mod):
    plan = flex.plan_modifiers(score_mod, causal_mask)
    return cuda_source(flex_fwd_hopper_kernel(1, 16, 2048, 2048, 128, plan, (1, 1, 16, 16), sm_scale=128 ** -0.5,
                                              dtype="bfloat16"))


before, after = lowered_forward(None), lowered_forward(soft_cap(50.0))
for label, source in (("before", before), ("after", after)):
    print(f"{label}:")
    grep(source, r"alpha\[i_\d+\] = exp2f", max_hits=1, width=130)
lines = after.splitlines()
first_tanh = next(n for n, line in enumerate(lines) if "tanhf" in line)
for n in range(first_tanh - 16, first_tanh + 9):
    if re.search(r"__\d+\.x = |float4 v__1 = |\*\(float4\*\)\(S ", lines[n]):
        print(f"{n + 1:4d} │ {lines[n].strip()[:130]}")
cu.check_true("tanhf" in after and "tanhf" not in before, "the soft-capped kernel computes tanh; the plain one does not")

# %% [markdown]
# Multiply by the scale, divide by the cap, `tanh`, multiply by the cap: the formula of `soft_cap`,
# inlined. On the CPU the same factory gives C; the same line, there:

# %%
q4, k4, v4 = (torch.randn(1, 2, 48, 32) for _ in range(3))
plan_cap = flex.plan_modifiers(soft_cap(50.0), causal_mask)
bm_causal = create_block_mask(causal_mask, None, None, 48, 48)
c_source = flex_forward_kernel(q4, k4, plan_cap, bm_causal, 32 ** -0.5).get_kernel_source()
print("\n".join(line.strip()[:150] for line in c_source.splitlines() if "tanh" in line))

# %% [markdown]
# ## 5 · Every modifier against float64
#
# Soft-capping (cap 50, on large scores so that the cap bends them), ALiBi with grouped-query heads,
# document masking of a packed batch, prefix-LM, a window with global tokens, and causal: forward
# and gradients of every head against the float64 reference (`flex_references` runs the same
# functions on float64 tensors).

# %%
P = cu.pick(cpu=dict(batch=1, heads=4, heads_kv=2, seq=80, dim=32, dtype=torch.float32),
            gpu=dict(batch=2, heads=16, heads_kv=4, seq=2048, dim=128, dtype=torch.bfloat16))
SEQ = P["seq"]


def problem(scale=1.0, seed=0):
    g = torch.Generator(device=cu.DEVICE).manual_seed(seed)
    shape = lambda h: (P["batch"], h, SEQ, P["dim"])  # noqa: E731
    q = torch.randn(shape(P["heads"]), generator=g, device=cu.DEVICE) * scale
    k, v = (torch.randn(shape(P["heads_kv"]), generator=g, device=cu.DEVICE) for _ in range(2))
    d_out = torch.randn(shape(P["heads"]), generator=g, device=cu.DEVICE)
    return [t.to(P["dtype"]) for t in (q, k, v, d_out)]


doc_lengths = [SEQ // 8, SEQ // 2 + 3, 1, SEQ - SEQ // 8 - SEQ // 2 - 4]
CASES = {
    "soft-cap 50": dict(score_mod=soft_cap(50.0), mask_mod=causal_mask, scale=5.0),
    "ALiBi (GQA)": dict(score_mod=flex.alibi(flex.alibi_slopes(P["heads"]).to(cu.DEVICE)), mask_mod=causal_mask),
    "documents": dict(mask_mod=flex.document_mask(flex.document_ids(doc_lengths, cu.DEVICE))),
    "prefix-LM": dict(mask_mod=prefix_lm(SEQ // 4)),
    "window + globals": dict(mask_mod=flex.window_with_globals(SEQ // 5, 3)),
    "causal": dict(mask_mod=causal_mask),
}


def run_case(case):
    mods = {k: v for k, v in CASES[case].items() if k != "scale"}
    q, k, v, d_out = problem(CASES[case].get("scale", 1.0))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, return_lse=True, **mods)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = flex_references(q, k, v, d_out=d_out, **mods)
    return (q, k, v, d_out), out.detach(), lse, grads, refs


results = {}
for case in CASES:
    results[case] = run_case(case)
    (q, k, v, d_out), out, lse, grads, refs = results[case]
    err = cu.check_forward(q, k, v, out, lse, refs=refs, name=case, quiet=True)
    err.update(cu.check_backward(q, k, v, d_out, grads, refs=refs, name=case, quiet=True))
    print(f"{case:17} checked: " + ", ".join(f"{n} {e['err']:.1e} ({e['err'] / e['allowed']:.0%})" for n, e in err.items()))

# %% [markdown]
# (Each error is followed by its share of the allowed error: float32 tolerance on the CPU,
# FlashAttention's 16-bit criterion on the GPU.) The same checks on planted bugs: the usual wrong
# indices and scales, and two bugs of this chapter's own — a block mask that calls every visited tile
# full (the kernel then never evaluates the mask), and Δ left out of the backward:

# %%
(q, k, v, d_out), out, lse, grads, refs = results["soft-cap 50"]
cu.show_bugs_caught(lambda o, l_: cu.check_forward(q, k, v, o, l_, refs=refs, quiet=True), forward_bugs(out, lse))
cu.show_bugs_caught(lambda *g: cu.check_backward(q, k, v, d_out, g, refs=refs, quiet=True), backward_bugs(grads))
plan = flex.plan_modifiers(soft_cap(50.0), causal_mask)
bm = create_block_mask(causal_mask, None, None, SEQ, SEQ, device=cu.DEVICE)
all_full = bm._replace(state=torch.where(bm.state == flex.PARTIAL, flex.FULL, bm.state).int())
scale = P["dim"] ** -0.5
cu.expect_failure("every visited tile called full", lambda: cu.check_forward(
    q, k, v, *flex_forward(q, k, v, plan, all_full, scale), refs=refs, quiet=True))
no_delta = torch.zeros(lse.shape, device=cu.DEVICE)
cu.expect_failure("Δ left out", lambda: cu.check_backward(
    q, k, v, d_out, flex_backward(q, k, v, out, lse, d_out, plan, bm, scale, delta=no_delta), refs=refs, quiet=True))

# %% [markdown]
# ### The causal mask_mod against `flash_attention(causal=True)`
#
# With no `score_mod`, the flex forward is chapter 03's kernel with the key range replaced by the
# block mask's list: the same tiles, visited in the same order, the same operations. On the CPU the
# two produce the same bits, forward and backward. On a Hopper GPU the flex forward runs one of chapter 07's
# kernels and `flash_attention` chapter 07's and 08's tuned Hopper kernels (other tiles, other orders of
# summation), so there the two agree to rounding, and both are checked against float64.

# %%
(q, k, v, d_out), out, lse, grads, refs = results["causal"]
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
flash_out, flash_lse = cu.flash_attention(*leaves, causal=True, return_lse=True)
flash_grads = torch.autograd.grad(flash_out, leaves, d_out)
pairs = {"O": (out, flash_out), "LSE": (lse, flash_lse), "dQ": (grads[0], flash_grads[0]),
         "dK": (grads[1], flash_grads[1]), "dV": (grads[2], flash_grads[2])}
diffs = {n: float((a.detach().float() - b.detach().float()).abs().max()) for n, (a, b) in pairs.items()}
print("max |flex − flash_attention|:", ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
if cu.DEVICE == "cpu":
    cu.check_true(all(torch.equal(a, b) for a, b in pairs.values()), "flex causal = flash_attention causal, bit for bit")
else:
    cu.check_forward(q, k, v, flash_out, flash_lse, refs=refs, name="flash_attention causal")

# %% [markdown]
# ## 6 · The backward through `score_mod`
#
# With $s_{ij}$ the scaled score and $s'_{ij} = \mathrm{score\_mod}(s_{ij})$ the one the softmax
# sees, chapter 05's backward gives $dS' = P \circ (dP - \Delta)$ with respect to $s'$. One more
# factor carries it back through the modifier, elementwise:
#
# $$dS_{ij} = dS'_{ij}\;\frac{\partial s'_{ij}}{\partial s_{ij}}, \qquad
#   dQ = \text{scale}\cdot dS\,K, \quad dK = \text{scale}\cdot dS^\top Q .$$
#
# For soft-capping, $\partial s'/\partial s = 1 - \tanh^2(s/c)$: large scores have almost no
# gradient. The backward kernel evaluates `score_mod` once on `Dual(s, 1)` while it is built and
# keeps the derivative in a tile `GT` next to $P^\top$:

# %%
show_source(flex_bwd_kernel, "chain rule")
value, slope = plan.score_and_derivative(None, tvm.tirx.Var("s", "float32"), 0, 0, 0, 0)
print("score_mod(s)  :", value, "\nscore_mod′(s) :", slope)

# %% [markdown]
# Soft-capping's gradients on every head against float64, on scores large enough that the cap
# matters (the queries are scaled by 5; the first line below says how large the scores get and how
# little gradient the largest one keeps), and the same gradients from a `score_mod` whose derivative
# was forced to 1 — the chain rule dropped — which the check must reject:

# %%
(q, k, v, d_out), out, lse, grads, refs = results["soft-cap 50"]
largest = (q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)).abs().max()
largest = float(largest) * scale
print(f"largest |score| {largest:.1f} → capped {50 * math.tanh(largest / 50):.1f}, "
      f"∂score′/∂score there {1 - math.tanh(largest / 50) ** 2:.2f}")
per_head = [(grads[0][:, h].double() - refs["grads"][0][:, h]).abs().max().item() for h in range(q.shape[1])]
print("dQ max error per head:", ", ".join(f"{e:.1e}" for e in per_head))
cu.check_backward(q, k, v, d_out, grads, refs=refs, name="soft-cap 50 (every head)")
cap = soft_cap(50.0)


def no_chain_rule(score, b, h, q_idx, kv_idx):
    out = cap(score, b, h, q_idx, kv_idx)
    return Dual(out.value, 1.0) if isinstance(out, Dual) else out


leaves = [t.clone().requires_grad_() for t in (q, k, v)]
wrong = torch.autograd.grad(flex_attention(*leaves, score_mod=no_chain_rule, mask_mod=causal_mask), leaves, d_out)
cu.expect_failure("chain rule dropped", lambda: cu.check_backward(q, k, v, d_out, wrong, refs=refs, quiet=True))

# %% [markdown]
# ## 7 · Measured on an H200: what the generality costs
#
# On a Hopper GPU the flex kernels are chapter 07's forwards and chapter 08's backward (`flash_flex_hopper_bwd`)
# with the modifiers' step in place of the mask. At D = 128 the forward is chapter 07's persistent kernel
# (`flash_flex_persistent`). Where a block mask's rows grow down (each query block lists at least as many key
# blocks as the one before: causal, prefix-LM, a window) it takes the tiles in the folded order, which pairs a long
# row with a short one; elsewhere (the documents) longest row first, by the mask's own counts. At D = 64 it is the
# rotated loop (`flash_flex_hopper`). The backward is the same `BackwardPieces`, whose `modifiers` field
# swaps the query walk, P's recomputation and dS's chain rule. The record also times chapter 03's and 05's loops
# with the same modifiers (`FlexConfig(fwd_kernel="sm80", bwd_kernel="sm80")`), and the rotated loop where the
# persistent kernel runs (`fwd_kernel="rotated"`), so it shows what each step buys.
#
# Why the order matters: a persistent block runs its tiles back to back, so the kernel ends when its busiest block
# does. Below, the documents' mask of the record (B = 2, H = 16, S = 8k, each row its own packing) on 132 persistent
# blocks, each block's work in the folded order and in the sorted one, computed by the kernel's own schedule
# functions (`persistent_schedule` with the folded order, `sorted_schedule` with the mask's `rows_by_cost`). A tile
# costs the key blocks its row lists (`KVCount`):

# %%
from course_utils.kernels.flash_fwd_hopper_persistent import H100_SMS, persistent_schedule
from course_utils.kernels.flash_flex_persistent import sorted_schedule
from course_utils.kernels.flash_pieces import prelude
from course_utils.measure.benchmarks.ch11_flex import packed_lengths

B, H, S = 2, 16, 8192
doc_ids = torch.stack([flex.document_ids(packed_lengths(S, seed)) for seed in range(B)])  # the record's packings
doc_mask = create_block_mask(flex.document_mask(doc_ids), B, None, S, S, block=(128, 128))
orders = {"folded (the causal mask's)": persistent_schedule(prelude(H, S, S, 128, causal=True), batch=B,
                                                             block_M=128, num_ctas=H100_SMS),
          "sorted (longest row first)": sorted_schedule(doc_mask.rows_by_cost, B, H, num_ctas=H100_SMS)}
every_tile = sorted((b, h, q) for b in range(B) for h in range(H) for q in range(S // 128))
work = {}
for name, lists in orders.items():
    cu.check_true(sorted(t for tiles in lists for t in tiles) == every_tile, f"{name}: every tile once")
    work[name] = [sum(int(doc_mask.kv_count[b, 0, q]) for b, _, q in tiles) for tiles in lists]
fig, ax = plt.subplots(figsize=(10, 3.2))
for name, loads in work.items():
    ax.plot(sorted(loads, reverse=True), label=f"{name}: busiest block {max(loads)} key blocks")
mean = sum(work[name]) / H100_SMS
ax.axhline(mean, color="gray", linestyle=":", label=f"all work spread evenly: {mean:.0f}")
ax.set(xlabel="persistent blocks, busiest first", ylabel="key blocks", title="documents' mask, 132 blocks")
ax.legend(fontsize=8)
plt.show()
folded, by_cost = (max(loads) for loads in work.values())
cu.check_true(not doc_mask.longest_rows_last and by_cost < folded,
              f"rows that do not grow down; the sorted order's busiest block has less work: {by_cost} against {folded}")

# %% [markdown]
# The folded order pairs each head's last query block with its first, expecting the last row to be the longest;
# with documents the long rows sit anywhere, and some blocks draw several. Sorted, the longest tiles go first and
# the short ones fill in at the end, close to an even spread. On one H200, in an A/B of the three forwards at the
# record's shape (each checked against float64 first), the claims below judge it:

# %%
ab = cu.bench.stored_record("flex_order_h200")
if ab is not None:
    ab_cases = ab["results"]["cases"]

    def ab_timing(case, variant):
        return {"ms": ab_cases[case]["ms"][variant], "ms_spread": ab_cases[case]["ms_spread"][variant]}

    cu.claim_versus("documents: the sorted persistent order against the folded one and the rotated loop",
                    {other: cu.speed_ratio(ab_timing("documents", "persistent_sorted"), ab_timing("documents", other))
                     for other in ("persistent", "rotated")}, says="ahead")
    cu.claim_versus("rows that grow down: the sorted order against the folded one",
                    {case: cu.speed_ratio(ab_timing(case, "persistent_sorted"), ab_timing(case, "persistent"))
                     for case in ("causal", "prefix-LM")}, says="level")

# %% [markdown]
# So `flex_attention` takes the sorted order where the rows do not grow down and keeps the folded one where they do
# (no gain there, the claims above). The record below times the kernel it picks.
#
# One shape (B = 2, H = 16, S = 8192, D = 128, bfloat16) and five modifiers: soft-capping (cap 50,
# causal), ALiBi (causal), document masking of a packed batch (lengths drawn from 128 to 8k tokens,
# each row packed on its own), prefix-LM (2048 tokens) and causal. Against:
#
# - **PyTorch's `flex_attention`**, `torch.compile`d, given the *same* Python functions (the helpers
#   dispatch on torch tensors, which is what `torch.compile` traces);
# - **SDPA with an explicit mask** where SDPA can express it (a dense bias for ALiBi, a boolean mask
#   otherwise; soft-capping it cannot express);
# - **our own kernel without block skipping** (every tile visited, empty ones fully masked): what
#   the block mask saves;
# - for causal, **our specialised `flash_attention(causal=True)`**;
# - **PyTorch's `flex_attention` on FlashAttention-4's kernels** (`kernel_options={"BACKEND": "FLASH"}`), in the
#   cases that backend runs.
#
# It was measured on an H200 (the same Hopper chip as the H100, with more memory bandwidth): the course's H100
# record of this section, `figures/ch11_flex_h100.json`, timed the flex kernels on chapter 03's and 05's loops,
# before the Hopper ones existed.
#
# TFLOP/s count the visible pairs exactly (4·D FLOPs per pair forward, 2.5× that backward).

# %%
rec = cu.measured("ch11_flex_h200", RECORDS["ch11_flex_h200"], pending_ok=True)
if rec is None:
    print("The measurement is pending: the cells below show it once figures/ch11_flex_h200.json exists.")
else:
    rows = rec["results"]
    check_stored_errors(rows, "ch11 flex record (O, LSE, dQ, dK, dV)", unchecked=UNCHECKED)
    short = {OURS: "ours", OURS_NO_SKIP: "ours, no skip", TORCH_FLEX: "torch flex", SDPA_MASKED: "SDPA+mask",
             OURS_CAUSAL: "flash causal", TORCH_FLEX_FA4: "torch flex FA4", OURS_SM80_FORWARD: "ours, ch03 loop",
             OURS_SM80_BWD: "ours, ch05 loop", OURS_ROTATED_FORWARD: "ours, rotated"}
    shape = {key: rows[0][key] for key in ("batch", "heads", "seq", "dim", "dtype")}
    print("share of tiles skipped: " + ", ".join(f"{r['case']} {r['skipped']:.0%}" for r in rows
                                                 if r["impl"] == OURS and r["mode"] == "fwd"))
    for mode in ("fwd", "bwd"):
        table = [dict(r, impl=short[r["impl"]]) for r in rows if r["mode"] == mode]
        print(f"{mode} ms ({shape})")
        print(plots.text_table(table, index="case", columns="impl", value="ms", fmt="{:.2f}", width=15), "\n")

# %%
if rec is not None:
    ms = {(r["case"], r["impl"], r["mode"]): r["ms"] for r in rows}
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for ax, mode in zip(axes, ("fwd", "bwd")):
        ratios = [ms[c, TORCH_FLEX, mode] / ms[c, OURS, mode] for c in cases]
        plots.speedup_bars(ax, cases, ratios, title=f"{mode}: PyTorch flex time / ours", ylabel="× (above 1: ours faster)")
    fig.suptitle(plots.record_caption(rec), fontsize=9)
    fig.tight_layout()
    plots.save(fig, "ch11_flex_vs_torch")
    plt.show()
    for mode in ("fwd", "bwd"):
        print(f"{mode}: ours vs PyTorch flex " + ", ".join(
            f"{c} {ms[c, TORCH_FLEX, mode] / ms[c, OURS, mode]:.2f}×" for c in cases))
        print(f"{mode}: block skipping saves " + ", ".join(
            f"{c} {1 - ms[c, OURS, mode] / ms[c, OURS_NO_SKIP, mode]:.0%}" for c in cases))
        print(f"{mode}: flex causal / flash_attention(causal=True) = "
              f"{ms['causal', OURS, mode] / ms['causal', OURS_CAUSAL, mode]:.2f}")
    print("fwd: chapter 03's loop time / the Hopper forward's " + ", ".join(
        f"{c} {ms[c, OURS_SM80_FORWARD, 'fwd'] / ms[c, OURS, 'fwd']:.2f}×" for c in cases))
    persistent = [c for c in cases if (c, OURS_ROTATED_FORWARD, "fwd") in ms]
    print("fwd: the rotated loop's time / the persistent kernel's " + ", ".join(
        f"{c} {ms[c, OURS_ROTATED_FORWARD, 'fwd'] / ms[c, OURS, 'fwd']:.2f}×" for c in persistent))
    print("bwd: chapter 05's loop time / chapter 08's Hopper loop's " + ", ".join(
        f"{c} {ms[c, OURS_SM80_BWD, 'bwd'] / ms[c, OURS, 'bwd']:.2f}×" for c in cases))

# %% [markdown]
# The chapter's targets, judged on the record: faster than PyTorch's FlexAttention in every case, forward and
# backward, on its default (Triton) backend and on FlashAttention-4's; and within 5% of our specialised causal
# kernel (its time ÷ the flex kernel's at least 0.95). The Hopper loops are judged against chapter 03's and 05's
# loops with the same modifiers.
# PyTorch's FlexAttention also runs on FlashAttention-4's kernels (`kernel_options={"BACKEND": "FLASH"}`,
# with `flash-attn-4` installed) for the variants those kernels take; the last claims count ours against
# it in the cases it ran.

# %%
if rec is not None:
    for mode, says in (("fwd", "met"), ("bwd", "met")):
        cu.claim_ratio(f"{mode}: PyTorch flex time ÷ ours (target: ours faster)",
                       {c: ms[c, TORCH_FLEX, mode] / ms[c, OURS, mode] for c in cases}, target=1.0, says=says)
    cu.claim_ratio("flash_attention(causal=True) time ÷ the causal flex kernel's, fwd and bwd",
                   {mode: ms["causal", OURS_CAUSAL, mode] / ms["causal", OURS, mode] for mode in ("fwd", "bwd")},
                   target=0.95, says="not met")
    by_row = {(r["case"], r["impl"], r["mode"]): r for r in rows}
    for mode, loop, says in (("fwd", OURS_SM80_FORWARD, "ahead or level"), ("bwd", OURS_SM80_BWD, "ahead")):
        cu.claim_versus(f"{mode}: the Hopper loop against chapter {'03' if mode == 'fwd' else '05'}'s, same modifiers",
                        {c: cu.speed_ratio(by_row[c, OURS, mode], by_row[c, loop, mode]) for c in cases}, says=says)
    cu.claim_versus("fwd: the persistent kernel against the rotated loop, where flex_attention picks it",
                    {c: cu.speed_ratio(by_row[c, OURS, "fwd"], by_row[c, OURS_ROTATED_FORWARD, "fwd"])
                     for c in persistent}, says="ahead or level")
    for mode, says in (("fwd", "ahead"), ("bwd", "ahead or level")):
        cu.claim_versus(f"{mode}: ours against PyTorch's FlexAttention",
                        {c: cu.speed_ratio(by_row[c, OURS, mode], by_row[c, TORCH_FLEX, mode]) for c in cases},
                        says=says)
    on_fa4 = [c for c in cases if (c, TORCH_FLEX_FA4, "fwd") in by_row]
    if on_fa4:  # PyTorch's FlexAttention on its FLASH backend (FlashAttention-4), where it runs the variant
        for mode, says in (("fwd", "mixed"), ("bwd", "behind or level")):
            cu.claim_versus(f"{mode}: ours against PyTorch's FlexAttention on FlashAttention-4",
                            {c: cu.speed_ratio(by_row[c, OURS, mode], by_row[c, TORCH_FLEX_FA4, mode]) for c in on_fa4},
                            says=says)
        print("cases the FLASH backend did not run: " + (", ".join(c for c in cases if c not in on_fa4) or "none"))
    else:
        print("no rows of PyTorch's FlexAttention on FlashAttention-4 in this record")

# %% [markdown]
# ## Takeaways
# - A `score_mod` and a `mask_mod` are plain Python functions. Run on torch tensors they define the
#   float64 reference and the block mask; run on `Sym`s while a kernel is built they become its
#   code; run on `Dual`s they give the derivative the backward needs. One definition, no drift.
# - The block mask turns any mask into chapter 03's tile skipping: empty tiles are never loaded,
#   full tiles never evaluate the mask, only partial tiles pay for it.
# - Tensors a modifier reads (closed over, or `captured`) become kernel inputs; their values can change
#   without a recompilation.
# - The backward adds one factor, $\partial s'/\partial s$, to $dS$; forward-mode differentiation
#   of the modifier supplies it. For soft-capping it is $1 - \tanh^2(s/c)$.
# - On a Hopper GPU the flex kernels are chapter 07's forwards and chapter 08's backward with the modifiers as one
#   more piece (the score step of `rotated_loop` and of the persistent kernel's loop, `BackwardPieces.modifiers`).
#   Against chapter 03's and 05's loops with the same modifiers they are ahead or level forward and ahead backward;
#   the persistent forward is ahead of or level with the rotated loop where it runs (section 7's claims name the
#   cases).
# - The causal flex kernel still trails `flash_attention(causal=True)` (the target claim of section 7: not met),
#   though both now run the persistent ping-pong forward: the flex one pays for its block-mask lists and modifier
#   step, and its backward walks the mask's 128-row query blocks in 64-row steps where the dense one takes 80.
# - Against PyTorch's FlexAttention on its default backend ours is ahead or level everywhere. On FlashAttention-4's
#   kernels PyTorch's is ahead in two of five cases forward (level in a third) and four of five backward (level in
#   the fifth); section 7's last claims name them: that is the bar the flex kernels have yet to clear.

# %% [markdown]
# ## Exercises
#
# Stuck on one? `hint("11", "a", 1)` names the idea, `hint("11", "a", 2)` the functions to use;
# `solution("11", "a")` shows the answer (the same for the other letters).

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) ALiBi as a score_mod
#
# ALiBi lowers every score in proportion to how far back its key lies: a key $d$ positions before
# its query loses $\text{slope}_h \cdot d$ (head $h$'s slope), a key on the diagonal nothing (it is
# used with a causal mask). Complete
# `make_alibi`: `slope` is the captured handle of the slopes, one per query head; return a
# `score_mod`. The checker compares it with the definition on tensors, then compiles it into the
# forward and backward kernels and checks O, LSE and the gradients against float64.
#
# Stuck? `hint("11", "a", 1)`, then `hint("11", "a", 2)`; `solution("11", "a")` shows the answer.

# %% tags=["solution", "ex-a"]
def make_alibi(slopes):
    slope = flex.captured(slopes, "slopes")
    ### BEGIN SOLUTION
    def alibi_score(score, b, h, q_idx, kv_idx):
        return score + slope[h] * (kv_idx - q_idx)
    ### END SOLUTION
    return alibi_score


# %%
from course_utils.exercises.ch11 import check_alibi, check_document_mask, check_skipped_fraction  # noqa: E402

check_alibi(make_alibi)

# %% [markdown]
# ### (b) Document masking as a mask_mod
#
# A packed row holds several documents back to back; `doc_ids[t]` is the document of token `t`
# (`flex.document_ids(lengths)` makes it). Complete `make_document_mask`: a query sees a key when
# both are in the same document and the key is not after the query.
#
# Stuck? `hint("11", "b", 1)`, then `hint("11", "b", 2)`; `solution("11", "b")` shows the answer.

# %% tags=["solution", "ex-b"]
def make_document_mask(doc_ids):
    doc = flex.captured(doc_ids, "doc")
    ### BEGIN SOLUTION
    def same_document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    ### END SOLUTION
    return same_document


# %%
check_document_mask(make_document_mask)

# %% [markdown]
# ### (c) Predict the share of skipped tiles
#
# Without evaluating the mask pair by pair, predict the share of `block × block` tiles that a causal
# document mask over documents of `lengths` (packed in one row) leaves empty — what
# `create_block_mask(...).fraction_skipped()` measures. (A tile whose last query is before its first
# key is empty by causality; a tile below the diagonal is empty when its queries and keys share no
# document.)
#
# Stuck? `hint("11", "c", 1)`, then `hint("11", "c", 2)`; `solution("11", "c")` shows the answer.

# %% tags=["solution", "ex-c"]
def skipped_fraction(lengths, block):
    ### BEGIN SOLUTION
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    seq = sum(lengths)
    n = -(-seq // block)
    empty = 0
    for qb in range(n):
        q0, q1 = qb * block, min(seq, (qb + 1) * block) - 1  # first and last query of the tile
        for kb in range(n):
            k0, k1 = kb * block, min(seq, (kb + 1) * block) - 1
            # Some document d must hold a query in [q0, q1] and a key in [k0, q] for that query.
            visible = any(max(q0, s) <= min(q1, s + n_d - 1) and max(k0, s) <= min(k1, q1, s + n_d - 1)
                          for s, n_d in zip(starts, lengths))
            empty += not visible
    return empty / (n * n)
    ### END SOLUTION


# %%
check_skipped_fraction(skipped_fraction)
