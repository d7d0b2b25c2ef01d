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
# # 00 · Setup: your machine, TileLang, and a first kernel
#
# **Question.** What does this machine give us, and how can one course run the same
# GPU kernels on a laptop without a GPU?
#
# This course builds FlashAttention, forward and backward, in [TileLang](https://github.com/tile-ai/tilelang),
# a Python language for tile programs. Each chapter asks a question, explains the idea,
# draws it, writes the code, **checks it against a reference**, and measures it.
#
# | chapter | what you build |
# |---|---|
# | 00 | this setup and a first kernel |
# | 01 | naive attention, and why it is slow |
# | 02 | online softmax: one pass over the keys |
# | 03 | the tiled FlashAttention forward in TileLang |
# | 04 | pipelining, swizzled layouts, tuning |
# | 05 | the backward pass |
# | 06 | GQA, sliding windows and attention sinks (gpt-oss) |
# | 07 | Hopper: the softmax overlapped with the tensor cores (FlashAttention-3's forward) |
# | 08 | Hopper backward: five async matmuls per step, a deterministic mode |
# | 09 | packed variable-length batches and decoding with a paged KV cache |
# | 10 | ring attention: one sequence across several GPUs |
# | 11 | your own attention: score and mask modifiers compiled into the kernels |
# | 12 | FP8 attention: block scales, descales in the exponent, a Hadamard rotation (built on the CPU) |

# %%
# %config InlineBackend.figure_format = "png"
import torch
import tilelang.language as T

import course_utils as cu
from course_utils.kernels.tiles import TileBackend, compile_kernel

cu.describe_machine()

# %% [markdown]
# **Stale output.** The printout above comes from the H100 run of this chapter on 2026-11-24, and its
# last line is what the code printed then. On a GPU the chapters show the stored records, as on a CPU,
# and re-measure them only with `COURSE_REFRESH_RECORDS=1` (which `run_notebooks --refresh` sets).

# %% [markdown]
# ## One kernel source, two targets
#
# A TileLang kernel says *where* each tile lives and *how* a loop over a tile is split among
# threads. On a GPU a tile lives in **shared memory** (visible to the whole thread block) or in
# **registers** spread over the threads (a *fragment*), and `T.Parallel` hands the elements of a
# tile to the threads. TileLang's C backend runs each block as one CPU thread, so there it takes
# plain local arrays and ordinary nested loops, and the launch has no thread count.
# Nothing else changes: copies, matrix products, reductions and pipelined loops are written the same.
# `course_utils.kernels.tiles.TileBackend` holds exactly these four differences, so every kernel in the
# course is written once and runs on both:

# %%
import inspect

for method in ("shared", "fragment", "parallel", "kernel"):
    print(inspect.getsource(getattr(TileBackend, method)))

# %% [markdown]
# ## A first kernel: vector add
#
# The grid has one block per `block` elements. Each block copies its slice of `A` and `B` into
# tiles, adds them element by element, and copies the result out. `T.copy` guards the last,
# partial block, so `n` need not be a multiple of `block`.

# %%
def vector_add(n, block=256, dtype="float32", target=None):
    tb = TileBackend(target)

    @T.prim_func
    def add(A: T.Tensor([n], dtype), B: T.Tensor([n], dtype), C: T.Tensor([n], dtype)):
        with tb.kernel(T.ceildiv(n, block), threads=128) as bx:
            a = tb.fragment([block], dtype)
            b = tb.fragment([block], dtype)
            T.copy(A[bx * block:(bx + 1) * block], a)
            T.copy(B[bx * block:(bx + 1) * block], b)
            for i in tb.parallel(block):
                a[i] += b[i]
            T.copy(a, C[bx * block:(bx + 1) * block])

    return add


# %% [markdown]
# Compile it for this machine (`out_idx=[2]`: the kernel allocates and returns `C`), run it on
# tensors that live here, and check it. Every check in the course prints its error and raises if
# the result is wrong.

# %%
n = 1000  # deliberately not a multiple of the block
add = compile_kernel(vector_add(n), out_idx=[2])
a, b = torch.randn(n, device=cu.DEVICE), torch.randn(n, device=cu.DEVICE)
cu.check_close(add(a, b), a + b, "vector add");

# %% [markdown]
# ## CUDA without a GPU
#
# TileLang can *generate* CUDA for any GPU architecture on any machine. Here is the kernel for
# an H100 (`sm_90a`): the `T.Parallel` loop became per-thread code, and the tiles became
# per-thread registers.

# %%
import tilelang
from tilelang import tvm

with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
    cuda_source = tilelang.lower(vector_add(n, target="cuda")).kernel_source
body = cuda_source[cuda_source.index('extern "C" __global__'):]
print(body[:900])

# %% [markdown]
# ## Takeaways
# - `course_utils` decides CPU or GPU once; kernels ask a `TileBackend` where tiles live.
# - Every result is checked in the cell that produces it; a wrong kernel stops the notebook.
# - Without a GPU you still run every kernel (small sizes, C backend) and read the CUDA it would
#   run; GPU measurements come from stored H100 records, with machine and date printed.

# %% [markdown]
# ## Exercises

# %%
from course_utils.exercises import hint, solution  # noqa: F401  (help in tiers: the idea, the API, the answer)

# %% [markdown]
# ### (a) `axpy`
#
# Write `axpy(n, alpha)`, a kernel factory for `C = alpha * A + B`, by copying `vector_add` and
# changing one line. The checker runs your kernel on this machine and compares it with PyTorch.
#
# Stuck? `hint("00", "a", 1)`, then `hint("00", "a", 2)`; `solution("00", "a")` shows the answer.

# %% tags=["solution", "ex-a"]
def axpy(n, alpha, block=256, dtype="float32", target=None):
    tb = TileBackend(target)

    @T.prim_func
    def kernel(A: T.Tensor([n], dtype), B: T.Tensor([n], dtype), C: T.Tensor([n], dtype)):
        with tb.kernel(T.ceildiv(n, block), threads=128) as bx:
            a = tb.fragment([block], dtype)
            b = tb.fragment([block], dtype)
            T.copy(A[bx * block:(bx + 1) * block], a)
            T.copy(B[bx * block:(bx + 1) * block], b)
            for i in tb.parallel(block):
                ### BEGIN SOLUTION
                a[i] = alpha * a[i] + b[i]
                ### END SOLUTION
            T.copy(a, C[bx * block:(bx + 1) * block])

    return kernel


# %%
from course_utils.exercises import check_exercise
from course_utils.exercises.kernels import lower_for_gpus


def run_axpy(n, alpha):
    x, y = torch.linspace(-1, 1, n, device=cu.DEVICE), torch.linspace(2, 3, n, device=cu.DEVICE)
    return compile_kernel(axpy(n, alpha), out_idx=[2])(x, y).cpu()


def expected_axpy(n, alpha):
    return alpha * torch.linspace(-1, 1, n) + torch.linspace(2, 3, n)


check_exercise("axpy", run_axpy, expected_axpy, [(300, 2.0), (77, -0.5)], solutions=[axpy],
               hint="C should be alpha * A + B, element by element.")
lower_for_gpus("axpy", axpy, (4096, 2.0), {})  # the same kernel, lowered for the A100 and the H100 (no GPU needed)
print("axpy also lowers for sm_90a and sm_80 (lower_for_gpus raises with the compiler's message otherwise)")
