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
# # 04 · Pipelining, swizzled layouts and tuning
#
# **Question.** Chapter 03's kernel is correct and already fast. Three lines of it were taken on
# trust: `T.Pipelined(..., num_stages=...)`, shared tiles that TileLang lays out for us, and two
# `T.gemm` calls whose result tiles live in registers. What do these do on the GPU, what are they
# worth, and which tiling should the kernel use?
#
# | section | idea | evidence |
# |---|---|---|
# | 1 | software pipelining: copy the next K/V tile while computing on this one | timeline model, generated code (sm_80, sm_90a), H100 sweep |
# | 2 | shared-memory banks and swizzling | bank conflicts counted from TileLang's layouts, H100 ablation |
# | 3 | register fragments: who holds which score | TileLang's inferred layouts, checked element by element |
# | 4 | tuning `block_M`, `block_N`, `num_stages`, `threads` | H100 sweep |
# | 5 | the final forward against FlashAttention-2 and cuDNN | H100 record, roofline |
#
# *Credit.* Software pipelining of tile copies follows CUTLASS's multistage GEMMs; the scheduling
# of attention follows Tri Dao, [FlashAttention-2](https://arxiv.org/abs/2307.08691) (2023) and
# Jay Shah et al., [FlashAttention-3](https://arxiv.org/abs/2407.08608) (2024), which introduced
# warp-specialised TMA producers on Hopper. The XOR swizzle is the one CUTLASS/CuTe calls
# `Swizzle<3,3,3>`; the layouts and the pipeliner are [TileLang](https://github.com/tile-ai/tilelang)'s.

# %%
# %config InlineBackend.figure_format = "png"
import course_utils as cu

import matplotlib.pyplot as plt
import numpy as np
from tilelang.layout import make_linear_layout, make_swizzled_layout

from course_utils.pictures import banks, layouts, plots, schedules
from course_utils.api.attention import TUNED_FORWARD_CONFIG, ForwardConfig
from course_utils.measure.benchmarks import RECORDS
from course_utils.core.labels import CUDNN, FA2, OURS, PEERS, SHORT
from course_utils.checking.validation import check_stored_errors
from course_utils.kernels.flash_fwd import ForwardTiling, flash_fwd_kernel
from course_utils.core.source import grep, loop_skeleton, lowering_error

print("device:", cu.DEVICE, "| tile target:", cu.TILE_TARGET)

# %% [markdown]
# ## 1 · Software pipelining
#
# One thread block of the forward runs this loop over key blocks: copy K<sub>j</sub> from HBM to
# shared memory, S = Q K<sub>j</sub>ᵀ on the tensor cores, the online softmax, copy V<sub>j</sub>,
# O += P V<sub>j</sub>. A copy from HBM takes far longer to *arrive* than to issue, so a loop that
# waits for each copy leaves the tensor cores idle most of the time.
#
# `T.Pipelined(start, end, num_stages=s)` rewrites the loop so copies run ahead. Reading the code
# TileLang generates for our kernel (below) shows exactly what it does for this loop: K and V each
# get **s shared buffers**; the first s tiles are requested before the loop; and as soon as the
# gemm reading a buffer is done, the copy of the tile s iterations ahead is issued into it. With
# s = 1 the K copy of block j+1 already overlaps the softmax and the PV gemm of block j; with
# s = 2 or 3 it has one or two more iterations to arrive.
#
# A **model** makes this concrete. The durations are illustrative units, not measurements: each
# gemm and the softmax take 1, a copy takes 4 from issue to arrival (copies can overlap each other).

# %%
MODEL = dict(load=4, qk=1, softmax=1, pv=1)  # illustrative units, not measured
runs = {s: schedules.pipeline_schedule(s, 6, **MODEL) for s in (0, 1, 2, 3)}
fig, axes = plt.subplots(4, 1, figsize=(11, 7.4), sharex=True)
for ax, (s, (events, total)) in zip(axes, runs.items()):
    name = "plain loop (no pipelining)" if s == 0 else f"num_stages={s}: {s} buffer{'s' * (s > 1)} each for K and V"
    schedules.pipeline_timeline(ax, events, title=f"{name} — 6 key blocks in {total:g} units", xmax=runs[0][1])
axes[-1].set_xlabel("time (model units)")
fig.tight_layout()
totals = [total for _, total in runs.values()]
print(f"model totals for 0-3 stages (units, illustrative): {totals}")

# %% [markdown]
# Reading the picture: with one stage the compute lane still waits before every QKᵀ, because a K
# copy has only the softmax and PV (2 units) to hide its 4 units. Two stages give it 5 units: the
# stalls vanish after the start-up. A third stage changes nothing: once the copy latency is
# hidden, more buffers only cost shared memory.
#
# ### What TileLang generates
#
# The same kernel source lowers to different machinery per architecture (no GPU needed; see
# chapter 00). On **Ampere (sm_80)** every thread issues `cp.async` copies of 16 bytes, groups
# them with `commit`, and `cp_async_wait<N>` blocks until at most N groups are still in flight.
# Here is the main loop of the 2-stage kernel, reduced to its copy, wait and compute steps.
# (We lower the non-causal kernel: TileLang 0.1.15 fails to lower sm_80 + causal + 2 stages.)

# %%
sweep = cu.measured("ch04_forward_sweep_h100", RECORDS["ch04_forward_sweep_h100"])
shape = {key: sweep["results"][0][key] for key in ("batch", "heads", "seq", "dim")}


def forward(num_stages=1, causal=False, block_M=128, block_N=128, threads=256):
    return flash_fwd_kernel(shape["batch"], shape["heads"], shape["seq"], shape["seq"], shape["dim"],
                            causal=causal, target="cuda", tiling=ForwardTiling(block_M, block_N, num_stages, threads))


ampere = layouts.lower_with_layouts(forward(num_stages=2), "sm_80")
AMPERE_STEPS = {
    "wait until at most {0} copy groups are in flight": r"cp_async_wait<(\d+)>",
    "__syncthreads()": r"__syncthreads",
    "ldmatrix{0} {1} → registers, mma.sync": r"ldmatrix_x4(_trans)?\(\(&\(\(\(half_t\*\)(\w+)\)",
    "cp.async 16 B → {0}: refill the buffer just read": r"cp_async_gs<16>\(\(&\(\(\(half_t\*\)(\w+)\)",
    "commit the copy group": r"cp_async_commit",
    "row {0} over the 4 lanes of a quad": r"AllReduce<tl::(\w+)Op",
    "exp2 (softmax)": r"exp2f",
}
for line, step in loop_skeleton(ampere.source, r"for \(int kb = 0", AMPERE_STEPS):
    print(f"{line:4d} │ {step}")
print("-- one of those lines in full (the K_s index starts with the buffer number, kb & 1):")
grep(ampere.source, r"cp_async_gs<16>.*K_s\)\[\(+kb", max_hits=1, width=100)
cu.check_true("(kb & 1) * 16384" in ampere.source, "K_s and V_s have 2 buffers, picked by kb & 1")

# %% [markdown]
# On **Hopper (sm_90a)** the kernel changes shape. TileLang splits the thread block into a
# *producer* warpgroup of 128 threads that only issues **TMA** bulk copies, and the 256 *consumer*
# threads that compute (the warp specialisation of FlashAttention-3). They hand buffers to each
# other through **mbarriers** in shared memory: the producer arms a barrier with the bytes it
# expects, the TMA unit signals arrival, the consumers wait on it, and when a gemm is done they
# `arrive` on an "empty" barrier so the producer may refill that buffer.

# %%
hopper = {s: layouts.lower_with_layouts(forward(num_stages=s), "sm_90a") for s in (1, 2, 3)}
HOPPER_STEPS = {
    "wait on an mbarrier": r"mbarrier\[[^\]]*\]\.wait",
    "arm the barrier: expect {0} bytes": r"arrive_and_expect_tx\((\d+)",
    "TMA copy → {0}": r"tma_load\(\w+_desc, [^,]+, \(&\(\(\(half_t\*\)(\w+)\)",
    "wgmma_{0} (tensor cores)": r"wgmma_(ss|rs)<",
    "arrive: this buffer may be refilled": r"\]\.arrive\(\)",
    "row {0} over the 4 lanes of a quad": r"AllReduce<tl::(\w+)Op",
    "exp2 (softmax)": r"exp2f",
}
grep(hopper[2].source, r"__launch_bounds__", max_hits=1, width=60)
for role, header in (("producer", r"for \(int kb = 0"), ("consumers", r"for \(int kb_1 = 0")):
    print(f"-- {role} loop")
    for line, step in loop_skeleton(hopper[2].source, header, HOPPER_STEPS):
        print(f"{line:4d} │ {step}")
print("-- one of those lines in full:")
grep(hopper[2].source, r"tma_load\(K_desc", max_hits=1, width=100)
cu.check_true("tma_load" in hopper[2].source and "wgmma_rs" in hopper[2].source, "sm_90a uses TMA and wgmma")

# %% [markdown]
# Each stage costs shared memory: one more K tile and one more V tile. The lowered kernels say how
# much each block asks for. An H100 SM has 228 KB of shared memory (at most 227 KB per block), and
# 65,536 32-bit registers.

# %%
# NBVAL_CHECK_OUTPUT
tile_bytes = 128 * shape["dim"] * 2  # one 128-row fp16 tile
print("num_stages  shared memory per block   K/V buffers")
for s, low in hopper.items():
    buffers = (low.shared_bytes - tile_bytes) // (2 * tile_bytes)  # Q (shared with O) + s × (K + V)
    print(f"{s:>10}  {low.shared_bytes // 1024:>14} KB  {buffers:>12}")
    cu.check_true(buffers == s, f"num_stages={s} gives {s} buffer(s) each for K and V")

# %% [markdown]
# **Measured.** The chapter 04 sweep timed every tiling on the H100; here are the rows with
# 128 × 128 tiles and 256 threads, for one, two and three stages.

# %%
rows_128 = [r for r in sweep["results"] if (r["block_M"], r["block_N"], r["threads"]) == (128, 128, 256)]
print(plots.text_table(rows_128, index="num_stages", columns="causal", value="tflops", width=12))
for causal in (False, True):
    by_stage = {r["num_stages"]: r["tflops"] for r in rows_128 if r["causal"] == causal}
    print(f"causal={causal!s:5}: relative to 1 stage " + ", ".join(f"{s}: {t / by_stage[1]:.2f}" for s, t in by_stage.items()))
    cu.claim_order(f"causal={causal!s:5}, TFLOP/s by num_stages", dict(sorted(by_stage.items())), says="decreasing")
fig, ax = plt.subplots(figsize=(6, 3))
for offset, causal in ((-0.2, False), (0.2, True)):
    pts = sorted((r["num_stages"], r["tflops"]) for r in rows_128 if r["causal"] == causal)
    ax.bar([s + offset for s, _ in pts], [t for _, t in pts], width=0.4, label=f"causal={causal}")
ax.set(xticks=[1, 2, 3], xlabel="num_stages", ylabel="TFLOP/s", title="128×128 tiles, 256 threads, fp16")
ax.legend(fontsize=8)
fig.text(0.01, -0.04, plots.record_caption(sweep), fontsize=7)
cu.check_true(len(rows_128) == 6, "one row per (num_stages, causal)")

# %% [markdown]
# In this record one stage is the fastest, causal and not, and each added stage is slower than the
# one before (the checked order above; the ratios say by how little). That is what the model predicts once a copy fits behind the rest
# of an iteration: with 128 × 128 tiles each iteration does two 128 × 128 × 128 gemms and a
# softmax over 16,384 scores before it needs the next K tile, and the TMA producer runs ahead on
# its own. Extra buffers then buy nothing. Nor do they cost occupancy here: shared memory is not
# what limits it. Section 3 shows each consumer thread holds 64 fp32 registers of S and 64 of the
# output; two blocks of 256 such threads would need 2 × 256 × 128 = 65,536 registers, the whole
# register file, before P, the row statistics and addresses. One block per SM it is.
#
# ## 2 · Shared-memory banks and swizzling
#
# Shared memory is split into **32 banks**, 4 bytes wide, dealt out word by word: successive 4-byte
# words sit in successive banks, and after bank 31 the next word is in bank 0 again (exercise (a) turns
# this into the bank of any byte address). A warp's request is served in **wavefronts** of up to
# 128 bytes; two threads that need *different* 4-byte words of the *same* bank must wait for separate
# wavefronts (a **bank conflict**). Reading the same word is free (a broadcast).
#
# The gemms read their operands from shared memory with `ldmatrix`: each phase of it reads
# **8 rows × 16 bytes** (8 fp16 of one row each). In a row-major K tile of 128 fp16 per row, a row
# is 256 bytes, a multiple of 128: every row's chunk *c* falls in the same 4 banks, and the
# 8 rows of a phase need 8 wavefronts instead of 1.
#
# The cure is to **swizzle**: store 16-byte chunk *c* of row *r* at chunk position *c* XOR (*r* mod 8)
# within its 128-byte line. Rows keep their chunks together (copies in stay fast), but the
# 8 rows of a column now land in 8 different bank groups. We do not draw this by hand: TileLang
# gives the layouts of a shared tile as `Layout` objects, and `course_utils.pictures.layouts` evaluates
# them element by element.

# %%
tile = layouts.shared_tile((128, shape["dim"]), "float16")  # a K tile, as the kernel declares it
smem_layouts = {"row-major": make_linear_layout(tile), "swizzled": make_swizzled_layout(tile)}
offsets = {name: layouts.layout_offsets(layout) for name, layout in smem_layouts.items()}
print("swizzled layout:", smem_layouts["swizzled"])
for kernel, low in (("sm_80, 2 stages", ampere), ("sm_90a, 1 stage", hopper[1])):
    for name in ("K_s", "V_s"):  # with s stages the kernel's layout covers s buffers, one after another
        per_buffer = layouts.layout_offsets(low.layouts[name]).reshape(-1, 128, shape["dim"])
        same = all((buf - v * buf.size == offsets["swizzled"]).all() for v, buf in enumerate(per_buffer))
        cu.check_true(same, f"{kernel}: every buffer of {name} uses exactly this swizzled layout")
for name, off in offsets.items():
    cu.check_true(sorted(off.ravel().tolist()) == list(range(off.size)), f"{name}: every element has its own slot")

# %% [markdown]
# The picture: each cell is one 16-byte chunk of the tile (8 fp16), coloured by the group of 4
# banks (0–7) it occupies. The framed cells are one `ldmatrix` phase: chunk 0 of rows 0–7.
# Below, the banks those 8 threads touch: each box is a distinct 4-byte word, so the height of a
# column is the number of wavefronts.

# %%
phase_cells = [(r, 0) for r in range(8)]
phase_addrs = {name: [int(off[i, j]) * 2 for i, j in phase_cells] for name, off in offsets.items()}
fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), gridspec_kw={"height_ratios": [3, 2]})
for col, (name, off) in enumerate(offsets.items()):
    banks.bank_map(axes[0, col], banks.bank_groups(off, 2)[:16], outline=phase_cells,
                   title=f"{name}: bank group of each 16-byte chunk (rows 0–15)")
    n = banks.wavefronts(phase_addrs[name], 16)
    banks.bank_hits_chart(axes[1, col], banks.bank_hits(phase_addrs[name], 16), ymax=8,
                          title=f"{name}: one ldmatrix phase (threads t0–t7) → {n} wavefront{'s' * (n > 1)}")
fig.tight_layout()
plots.save(fig, "ch04_bank_conflicts")
cu.check_true(banks.wavefronts(phase_addrs["row-major"], 16) == 8 * banks.wavefronts(phase_addrs["swizzled"], 16),
              "one ldmatrix phase: 8 wavefronts row-major, 1 swizzled")

# %% [markdown]
# Counting it for three warp-wide accesses a kernel makes to such a tile (the counts come from the
# model above: per phase, the largest number of distinct words one bank must serve):

# %%
# NBVAL_CHECK_OUTPUT
table = banks.conflict_table(offsets, banks.warp_access_patterns(shape["dim"]))
print(f"{'access by one warp':42}{'ideal':>7}{'row-major':>11}{'swizzled':>10}   (wavefronts)")
for row in table:
    print(f"{row['pattern']:42}{row['ideal']:>7}{row['row-major']:>11}{row['swizzled']:>10}")
ldm = table[1]
cu.check_true(ldm["swizzled"] == ldm["ideal"] and ldm["row-major"] == 8 * ldm["ideal"],
              "ldmatrix: swizzled is conflict-free, row-major is 8-way conflicted")
cu.check_true(table[0]["swizzled"] == table[0]["row-major"] == table[0]["ideal"],
              "copying rows in stays conflict-free with the swizzle")

# %% [markdown]
# The swizzle removes the 8-way conflict of `ldmatrix` and keeps the row-wise copies conflict-free.
# It even cuts a naive column walk from 32 wavefronts to 4 (not 1: this swizzle permutes 16-byte
# chunks among 8 positions, so 32 rows still share 8 banks).
#
# **Can we switch the swizzle off on the H100 and time it?** Not with this toolchain, and the reason
# is worth knowing. On Hopper, TileLang's `wgmma` gemm reads its operands from shared memory only
# through the hardware's swizzle modes, so asking for plain row-major tiles (a tiling with
# `linear_smem=True`: `flash_fwd_kernel(..., tiling=ForwardTiling(linear_smem=True))`) stops at
# layout inference — the next cell shows the error. The Ampere code path (sm_80: cp.async, ldmatrix,
# mma.sync) accepts both layouts, but a kernel built for sm_80 is machine code for compute
# capability 8.x, and the H100 (9.0) refuses to load it (the driver answers
# `CUDA_ERROR_NO_BINARY_FOR_GPU`: the binary holds sm_80 machine code and no PTX to recompile). On
# Hopper the swizzle is part of the instruction's contract, not an optimisation to turn off; the
# conflict counts above are what it buys.

# %%
message = lowering_error(flash_fwd_kernel(1, 1, 256, 256, 128, target="cuda", tiling=ForwardTiling(linear_smem=True)),
                         "sm_90a")
cu.check_true(message is not None and "different layout" in message,
              "TileLang refuses row-major operand tiles for wgmma: "
              + (message.splitlines()[0] if message else "it lowered them"))

# %% [markdown]
# ## 3 · Register fragments: who holds which score
#
# `S = T.alloc_fragment([block_M, block_N])` is a tile spread over the registers of all 256
# threads. Its layout is not ours to choose: `T.gemm` writes S with tensor-core instructions whose
# result registers belong to fixed lanes, so TileLang's layout inference gives S the
# **accumulator layout** of the gemm, for the warp policy we asked for (`FullRow`: the 8 warps
# stacked along the rows, 16 rows each). The layouts the kernel really got were saved while
# lowering it in section 1:

# %%
for arch, low in (("sm_80", ampere), ("sm_90a", hopper[1])):
    print(f"-- {arch}")
    for name in ("S", "P", "acc_o", "m"):
        frag = low.layouts[name]
        print(f"{name:>5} {list(frag.get_input_shape())}: thread = {frag.thread}, register = {frag.index[0]}"
              + (f", {frag.replicate_size} copies" if frag.replicate_size > 1 else ""))
s_threads, s_regs = layouts.fragment_tables(ampere.layouts["S"])
o_threads, o_regs = layouts.fragment_tables(ampere.layouts["acc_o"])
per_thread = int(ampere.layouts["S"].get_output_shape()[0])  # registers per thread
held = np.bincount(s_threads.ravel() * per_thread + s_regs.ravel(), minlength=256 * per_thread)
cu.check_true((held == 1).all(), f"S: each of the 256 threads holds {per_thread} scores, one per register")

# %% [markdown]
# Both architectures got the same layouts. (On sm_90a, thread 0 of these formulas is the first
# *consumer* thread, 128 in the block: the producer warpgroup comes first.)
#
# Left: which warp holds each element of S: eight bands of 16 whole rows. Middle: inside warp 0's
# band of the output accumulator (16 rows × D columns), the register each element sits in: the
# 64 registers of a lane sweep across the columns, 4 per group of 8 columns. Right: the corner
# rows 0–15 × columns 0–7 of S, each cell labelled *lane* over *register*. A lane holds two rows
# (*r* and *r* + 8) and two neighbouring columns of each group of 8. The four lanes of a **quad**
# (4r … 4r+3) share their rows, which is why `m` above has 4 copies and the generated code reduces
# a row with an `AllReduce` over 4 lanes.

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [1, 1.5, 0.7]})
layouts.fragment_map(axes[0], s_threads, title="S (acc_s), 128×128: warp of each element")
layouts.fragment_map(axes[1], o_threads, o_regs, rows=(0, 16), color_by="register",
                   title="acc_o, warp 0's rows: register of each element")
layouts.fragment_map(axes[2], s_threads, s_regs, rows=(0, 16), cols=(0, 8), color_by="lane", annotate=True,
                   title="S, rows 0–15 × cols 0–7:\nlane / register")
fig.tight_layout()
plots.save(fig, "ch04_fragments")
cu.check_true((s_threads // 32 == np.arange(128)[:, None] // 16).all(), "FullRow: warp w owns rows 16w … 16w+15")
cu.check_true((o_threads == s_threads).all() and (o_regs == s_regs).all(), "acc_o is laid out exactly like S")

# %% [markdown]
# **Why P never goes through shared memory.** The second gemm, O += P V, takes P as its A operand
# *from registers*. That only works if the lane that *produced* score (i, j) in gemm 1 is the lane
# that must *supply* element (i, j) of A in gemm 2, in the same register slot. Then
# `T.copy(S, P)` (float32 → fp16) is a per-thread conversion and nothing moves between threads.
# FlashAttention-2 relies on this property of the mma.sync layouts. We check it with TileLang's
# own gemm layout builders (`make_mma_store_layout` for C, `make_mma_load_layout` for A), for
# both instruction families, and against what layout inference chose for the kernel:

# %%
# NBVAL_CHECK_OUTPUT
tables = {}
for family, hopper_gemm in (("mma.sync", False), ("wgmma", True)):
    warps_1, gemm_1 = layouts.gemm_fragments(128, 128, shape["dim"], 256, transpose_b=True, hopper=hopper_gemm)
    warps_2, gemm_2 = layouts.gemm_fragments(128, shape["dim"], 128, 256, transpose_b=False, hopper=hopper_gemm)
    c1, a2 = layouts.fragment_tables(gemm_1["C"]), layouts.fragment_tables(gemm_2["A"])
    cu.check_true(all((x == y).all() for x, y in zip(c1, a2)),
                  f"{family}, warps {warps_1}: C of S = Q Kᵀ has the thread and register layout of A in O += P V")
    tables[family] = c1
for arch, low, family in (("sm_80", ampere, "mma.sync"), ("sm_90a", hopper[1], "wgmma")):
    same = all(all((x == y).all() for x, y in zip(layouts.fragment_tables(low.layouts[b]), tables[family]))
               for b in ("S", "P"))
    cu.check_true(same, f"{arch} kernel: S and P were given exactly that layout")

# %% [markdown]
# The generated code confirms it: between the two gemms, P is filled from S inside each thread
# (four floats → four halves), with no shared-memory access.

# %%
for arch, source in (("sm_80", ampere.source), ("sm_90a", hopper[1].source)):
    print(f"-- {arch}")
    grep(source, r"__float22half2_rn", max_hits=1)
    grep(source, r"\*\(uint2\*\)\(P \+", max_hits=1)

# %% [markdown]
# The check is specific to these shapes: it holds because FullRow gives each warp whole rows of
# S. Section 4 shows a tiling where it fails.
#
# ## 4 · Tuning the tiling
#
# Four knobs: `block_M` (query rows per block), `block_N` (keys per tile), `num_stages` and
# `threads`. Bigger tiles reuse each load more but need more registers and shared memory; more
# threads split a tile finer. The sweep compiled and timed all 24 combinations on the H100,
# non-causal and causal (fp16, the shape printed below). Grey cells failed to compile.

# %%
print("shape:", shape, "| dtype:", sweep["results"][0]["dtype"])
row_keys = sorted({(r["block_M"], r["block_N"]) for r in sweep["results"]})
col_keys = sorted({(r["num_stages"], r["threads"]) for r in sweep["results"]})
cmap = plt.get_cmap("viridis").copy()
cmap.set_bad("#d9d9d9")
fig, axes = plt.subplots(1, 2, figsize=(14, 3.8))
for ax, causal in zip(axes, (False, True)):
    grid = np.full((len(row_keys), len(col_keys)), np.nan)
    for r in sweep["results"]:
        if r["causal"] == causal and r["error"] is None:
            grid[row_keys.index((r["block_M"], r["block_N"])), col_keys.index((r["num_stages"], r["threads"]))] = r["tflops"]
    plots.heatmap(ax, grid, title=f"TFLOP/s, causal={causal}", xlabel="(num_stages, threads)",
                  ylabel="(block_M, block_N)", cmap=cmap, annotate=True)
    for i, j in zip(*np.where(np.isnan(grid))):
        ax.text(j, i, "failed", ha="center", va="center", fontsize=7, color="#555555")
    ax.set_xticks(range(len(col_keys)), labels=[f"{s}, {t}" for s, t in col_keys], fontsize=8)
    ax.set_yticks(range(len(row_keys)), labels=[f"{m}, {n}" for m, n in row_keys], fontsize=8)
fig.tight_layout()
fig.text(0.01, -0.03, plots.record_caption(sweep), fontsize=7)
plots.save(fig, "ch04_sweep")
cu.check_true(len(sweep["results"]) == 2 * len(row_keys) * len(col_keys), "one row per tiling and masking mode")
check_stored_errors(sweep["results"], "ch04 sweep: every tiling that ran")

# %% [markdown]
# **What the layouts predict.** For each tiling, TileLang's gemm layouts (Hopper's wgmma, as on
# the H100) tell us how FullRow splits the warps, how many fp32 accumulators each thread holds
# for S and for acc_o, and whether gemm 1's C layout matches gemm 2's A layout (section 3):

# %%
print("block_M  block_N  threads  warps (rows, cols)  S + acc_o per thread  C owner = A owner")
mismatched = set()
for bm, bn, nt in sorted({(r["block_M"], r["block_N"], r["threads"]) for r in sweep["results"]}):
    warps, gemm_1 = layouts.gemm_fragments(bm, bn, shape["dim"], nt, transpose_b=True, hopper=True)
    _, gemm_2 = layouts.gemm_fragments(bm, shape["dim"], bn, nt, transpose_b=False, hopper=True)
    regs = [int(g["C"].get_output_shape()[0]) for g in (gemm_1, gemm_2)]
    agree = (layouts.fragment_tables(gemm_1["C"])[0] == layouts.fragment_tables(gemm_2["A"])[0]).mean()
    if agree < 1:
        mismatched.add((bm, bn, nt))
    print(f"{bm:>7}  {bn:>7}  {nt:>7}  {str(warps):>18}  {regs[0]:>6} + {regs[1]:>3} = {sum(regs):>3}"
          f"{'  > 255' if sum(regs) > 255 else '       '}  {agree:>10.0%}")
failed = {(r["block_M"], r["block_N"], r["threads"]) for r in sweep["results"] if r["error"]}
cu.check_true(mismatched == failed, f"the tilings that failed on the H100 are exactly those where P would "
              f"have to change owners: {sorted(failed)}")

# %% [markdown]
# Two things stand out.
#
# - **block_M = 64 with 256 threads fails.** Eight warps cannot all stack along 64 rows (16 rows
#   each), so FullRow puts 4 warps on rows and 2 on columns, and each row of S is split between
#   two warps. The PV gemm needs each warp to hold whole rows of P (it sums over all keys), so
#   half of P would have to move to another warp, through shared memory. TileLang refuses
#   instead; lowering that tiling here reproduces the error.
# - **128 × 128 tiles with 128 threads are slow.** A CUDA thread can address at most 255
#   registers; here the scores and the output accumulator alone are 256 live fp32 values per
#   thread during the softmax, so the compiler must keep some in (slow) local memory. The sweep
#   shows what that costs.
#
# Everything else fits, and of those the largest tile wins: each K/V tile loaded is reused by
# more query rows, and each gemm is larger.

# %%
try:
    layouts.lower_with_layouts(forward(block_M=64, block_N=64), "sm_90a")
    raise AssertionError("expected a layout conflict")
except Exception as exc:  # TileLang's layout inference raises a TVM InternalError
    print("\n".join(line[:130] for line in str(exc).strip().splitlines()[:3]))
    cu.check_true("Layout infer conflict between S and P" in str(exc), "the failure is the S/P layout conflict")

# %% [markdown]
# The winner, per masking mode, and the tiling the course uses for this kernel on the GPU
# (`TUNED_FORWARD_CONFIG` in `course_utils/api/attention.py`; on Hopper GPUs `flash_attention` runs
# chapter 07's kernel by default):

# %%
best = {}
for causal in (False, True):
    ok = [r for r in sweep["results"] if r["causal"] == causal and r["error"] is None]
    top = max(ok, key=lambda r: r["tflops"])
    best[causal] = ForwardConfig(**{k: top[k] for k in ForwardConfig._fields if k in top})
    print(f"causal={causal!s:5}: best {best[causal]} at {top['tflops']:.0f} TFLOP/s")
default = TUNED_FORWARD_CONFIG
cu.check_true(best[False] == best[True] == default, f"the tuned tiling {default} is the sweep's best, causal and not")

# %% [markdown]
# ## 5 · The final forward against FlashAttention-2 and cuDNN
#
# With that tiling, our kernel against PyTorch SDPA's FlashAttention-2 backend and its cuDNN
# backend, on the usual shapes (B·S = 16k tokens, H·D = 2048), head dimensions 64 and 128, fp16
# and bf16, causal and not. Every implementation ran in the same process on the same inputs.

# %%
final = cu.measured("ch04_forward_final_h100", RECORDS["ch04_forward_final_h100"])
rows = final["results"]
panels = [(dim, causal) for dim in (64, 128) for causal in (False, True)]
fig = plots.forward_comparison_panels(final)
plots.save(fig, "ch04_forward_final")
ours_rows = [r for r in rows if r["impl"] == OURS]
check_stored_errors(rows, "ch04 final record")
cu.check_true(all(ForwardConfig(**r["config"]) == default for r in ours_rows), f"all of ours ran with {default}")

# %% [markdown]
# The same data as ratios (ours ÷ peer; above 1 means ours is faster):

# %%
combos = [(dtype, dim, causal) for dtype in ("float16", "bfloat16") for dim, causal in panels]
seqs = sorted({r["seq"] for r in rows})
tf = {(r["impl"], r["dtype"], r["dim"], r["causal"], r["seq"]): r["tflops"] for r in rows}
fig = plots.peer_ratio_heatmaps(rows, combos, seqs, PEERS)
plots.save(fig, "ch04_forward_ratios")
for causal in (False, True):
    key = ("float16", 128, causal, 4096)
    ours, fa2, cudnn = (tf[(impl, *key)] for impl in (OURS, FA2, CUDNN))
    print(f"S=4k, D=128, fp16, causal={causal!s:5}: ours {ours:.0f} TFLOP/s = {ours / fa2:.2f}× FA2, "
          f"{ours / cudnn:.2f}× cuDNN")
by_case = {(r["impl"], r["dtype"], r["dim"], r["causal"], r["seq"]): r for r in rows}
for peer, says in ((FA2, "ahead or level"), (CUDNN, "behind or level")):
    cu.claim_versus(f"ours against {SHORT[peer]}", {(*c, s): cu.speed_ratio(by_case[(OURS, *c, s)],
                                                                            by_case[(peer, *c, s)])
                                                    for c in combos for s in seqs}, says=says)
vs_cudnn = {s: [tf[(OURS, *c, s)] / tf[(CUDNN, *c, s)] for c in combos] for s in seqs}
for s in seqs:
    cu.claim_ratio(f"S={plots.seq_label(s):>3}: ours ÷ cuDNN over the {len(combos)} configurations", vs_cudnn[s])
cu.claim_order("ours ÷ cuDNN, worst configuration, S ≤ 4k", {s: min(vs_cudnn[s]) for s in seqs if s <= 4096},
               says="increasing");

# %% [markdown]
# Our kernel is ahead of SDPA's FlashAttention-2 backend in every case but the few the first claim
# names as level, and behind cuDNN in every case but the few the second names as level, by a margin
# that narrows as S grows to 4k (the checked order above) and then changes little (the ranges above it). Neither is surprising.
# FlashAttention-2 is written for Ampere's instructions (mma.sync, cp.async); on Hopper our
# TileLang kernel gets wgmma and TMA for free, and the FlashAttention-3 paper's abstract puts
# FlashAttention-2 at 35% utilisation of the H100. cuDNN is NVIDIA's own Hopper-tuned
# attention. At short sequences every kernel suffers: with B·S fixed at 16k tokens, S = 512 gives
# each (batch, head) only 4 query blocks of 128 rows and 4 K/V tiles, so the fixed start-up
# (loading Q, filling the pipeline, writing O) is a large share of each block's work.
#
# **Where it sits on the roofline.** The forward reads Q, K, V and writes O once: at least
# 4·B·H·S·D elements of HBM traffic, against 4·B·H·S²·D FLOPs (half with the causal mask). In
# fp16 (2 bytes) its arithmetic intensity is S/2 FLOP per byte (S/4 causal): it grows with the
# sequence, and beyond the H100's ridge point the tensor cores, not HBM, set the limit. The
# distance below the flat roof is what scheduling can still win. (Peak and bandwidth are NVIDIA's
# H100 SXM datasheet figures: 989 TFLOP/s dense fp16, 3.35 TB/s.)

# %%
PEAK_TFLOPS, HBM_TBS = 989, 3.35  # H100 SXM datasheet: dense fp16 tensor cores, HBM3 bandwidth
fig, ax = plt.subplots(figsize=(7, 4.5))
plots.roofline(ax, peak_tflops=PEAK_TFLOPS, bandwidth_tbs=HBM_TBS, xlim=(10, 2e4),
               title="fp16, D=128, non-causal: the forward on the H100 roofline")
for impl in (OURS, FA2, CUDNN):
    sel = sorted((r for r in rows if (r["impl"], r["dtype"], r["dim"], r["causal"]) == (impl, "float16", 128, False)),
                 key=lambda r: r["seq"])
    flops = [cu.attention_flops(r["batch"], r["heads"], r["seq"], r["seq"], r["dim"]) for r in sel]
    hbm_bytes = [4 * r["batch"] * r["heads"] * r["seq"] * r["dim"] * 2 for r in sel]
    plots.roofline_series(ax, impl, [f / b for f, b in zip(flops, hbm_bytes)], [r["tflops"] for r in sel],
                          labels=[f"S={r['seq'] // 1024}k" if impl == OURS and r["seq"] >= 1024 else ""
                                  for r in sel])
fig.text(0.01, -0.02, plots.record_caption(final), fontsize=7)
best_ours = max(r["tflops"] for r in rows if r["impl"] == OURS and r["dtype"] == "float16")
print(f"best fp16 forward of ours: {best_ours:.0f} TFLOP/s = {best_ours / PEAK_TFLOPS:.0%} of the dense peak")
cu.check_true(best_ours < PEAK_TFLOPS, "below the roof, as it must be")

# %% [markdown]
# ## Takeaways
# - `T.Pipelined(num_stages=s)` gives K and V s buffers each and refills a buffer as soon as the
#   gemm reading it is done: cp.async groups on Ampere, a TMA producer warpgroup with mbarriers on
#   Hopper. Once copies are hidden, more stages only cost shared memory; on the H100 one stage was best.
# - Shared tiles are swizzled (chunk XOR row) so that `ldmatrix` reads 8 rows without bank
#   conflicts while row-wise copies stay conflict-free; we counted it from TileLang's own layouts.
# - The scores S stay in registers in the accumulator layout of the gemm, and that layout is
#   exactly the A-operand layout of the PV gemm, so P never leaves its thread. Tilings that break
#   this (block_M = 64 with 8 warps) do not compile.
# - The sweep picked 128 × 128 tiles, one stage, 256 threads (`TUNED_FORWARD_CONFIG`).
# - With it, the forward is ahead of SDPA's FlashAttention-2 backend on the H100 (or level, in the
#   cases section 5's claim names) and behind cuDNN (or level, likewise);
#   at these lengths attention is compute-bound, so the gap to the roof is scheduling, not memory.
#   Chapter 07 changes the schedule to close it.
#
# ## Exercises

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) The bank of a byte
#
# Write `bank_of(byte_address)`: the shared-memory bank (0–31) that serves a byte.
#
# Stuck? `hint("04", "a", 1)`, then `hint("04", "a", 2)`; `solution("04", "a")` shows the answer.

# %% tags=["solution", "ex-a"]
def bank_of(byte_address):
    ### BEGIN SOLUTION
    return (byte_address // 4) % 32
    ### END SOLUTION


# %%
from course_utils.exercises import ch04

ch04.check_bank_of(bank_of)

# %% [markdown]
# ### (b) The swizzle
#
# Write the swizzle yourself. For an fp16 tile of 64 columns (128 bytes per row),
# return the element offset at which TileLang's swizzled layout stores element (i, j). The checker
# compares your function with `make_swizzled_layout` on every element and counts the wavefronts
# of every `ldmatrix` phase in your layout.
#
# Stuck? `hint("04", "b", 1)`, then `hint("04", "b", 2)`; `solution("04", "b")` shows the answer.

# %% tags=["solution", "ex-b"]
def swizzled_offset(i, j):
    ### BEGIN SOLUTION
    chunk = (j // 8) ^ (i % 8)
    return (i // 8) * 512 + (i % 8) * 64 + chunk * 8 + j % 8
    ### END SOLUTION


# %%
ch04.check_swizzle(swizzled_offset)

# %% [markdown]
# ### (c) Pipelining and layout in TileLang
#
# Make both decisions of this chapter yourself, in TileLang. The kernel below computes
# C = A Bᵀ (the shape of S = Q Kᵀ) one 64 × 64 tile of C per block, walking K in tiles of 64. Write its
# K loop, `k_loop`: copy the A and B tiles into shared memory and multiply them into `C_frag`, with
# - **two stages**: the copy of the next K tile in flight while the gemm reads this one (section 1), and
# - **swizzled shared tiles**, asked for explicitly with `T.annotate_layout` (section 2). Layouts exist
#   only on the GPU; the C backend's tiles are plain arrays, so annotate only when `tb.on_gpu`.
#
# The checker runs your kernel on the C backend against the float64 product, on ragged shapes whose
# three block sizes all differ (so an offset counted with the wrong block shows), then lowers it for sm_80
# and reads the generated code and the layouts TileLang kept: the buffers per tile, the `cp.async`
# waits, and the wavefronts one `ldmatrix.x4` needs in each shared tile (the bank model above). It
# also lowers it for sm_90a, where wgmma takes only swizzled operand tiles.
#
# Stuck? `hint("04", "c", 1)`, then `hint("04", "c", 2)`; `solution("04", "c")` shows the answer.

# %%
import tilelang.language as T

from course_utils.kernels.tiles import TileBackend


def pipelined_gemm(M, N, K, *, block_M=64, block_N=64, block_K=64, dtype="float16", target=None):
    """C = A Bᵀ (A [M, K], B [N, K], C [M, N] float32), one block per block_M × block_N tile of C."""
    tb = TileBackend(target)
    k_loop = k_loop_macro(tb, K, block_M, block_N, block_K)

    @T.prim_func
    def gemm(A: T.Tensor([M, K], dtype), B: T.Tensor([N, K], dtype), C: T.Tensor([M, N], "float32")):
        with tb.kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128) as (bx, by):
            A_s = tb.shared([block_M, block_K], dtype)
            B_s = tb.shared([block_N, block_K], dtype)
            C_frag = tb.fragment([block_M, block_N], "float32")
            T.clear(C_frag)
            k_loop(A, B, A_s, B_s, C_frag, bx, by)
            T.copy(C_frag, C[by * block_M, bx * block_N])

    return gemm


# %% tags=["solution", "ex-c"]
def k_loop_macro(tb, K, block_M, block_N, block_K):
    @T.macro
    def k_loop(A, B, A_s, B_s, C_frag, bx, by):
        ### BEGIN SOLUTION
        if tb.on_gpu:  # layouts exist only on the GPU: the C backend's tiles are plain arrays
            T.annotate_layout({A_s: make_swizzled_layout(A_s), B_s: make_swizzled_layout(B_s)})
        for ko in T.Pipelined(T.ceildiv(K, block_K), num_stages=2):
            T.copy(A[by * block_M, ko * block_K], A_s)
            T.copy(B[bx * block_N, ko * block_K], B_s)
            T.gemm(A_s, B_s, C_frag, transpose_B=True)
        ### END SOLUTION

    return k_loop


# %%
from course_utils.exercises import ch04

ch04.check_pipelined_gemm(pipelined_gemm)
