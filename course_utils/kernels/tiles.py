"""One kernel source, two targets: the small switch between TileLang's CUDA and CPU backends.

A TileLang kernel says *where* each tile lives and *how* loops over a tile are split among
threads. On a GPU, tiles live in shared memory (``T.alloc_shared``) or in registers spread over
the threads (``T.alloc_fragment``), and ``T.Parallel`` hands the elements of a tile to the
threads of the block. TileLang 0.1.15's C backend runs one CPU thread per block instead, so it
accepts only plain local arrays (``T.alloc_local``) and ordinary nested loops (``T.grid``), and
``T.Kernel`` takes no ``threads=``. Everything else — ``T.copy``, ``T.gemm``, the reductions,
``T.Pipelined`` — is the same. A kernel factory asks a ``TileBackend`` for these four things, so
the algorithm is written once and the difference stays visible in one place.
"""

from __future__ import annotations

from typing import NamedTuple

import tilelang
import tilelang.language as T
import torch
from tilelang import tvm

from ..core.device import TILE_TARGET

__all__ = ["TileBackend", "Tiling", "compile_kernel", "launcher", "allocating_launcher", "attention_launcher"]

_TARGETS = ("cuda", "c")


class TileBackend:
    """Buffer scopes, tile loops and the launch for one TileLang target ("cuda" or "c")."""

    def __init__(self, target: str | None = None):
        target = TILE_TARGET if target is None else target
        if target not in _TARGETS:
            raise ValueError(f"target must be one of {_TARGETS}; got {target!r}")
        self.target = target
        self.on_gpu = target == "cuda"

    def __repr__(self):
        return f"TileBackend({self.target!r})"

    def shared(self, shape, dtype):
        """A tile every thread of the block can read: shared memory on the GPU."""
        return T.alloc_shared(shape, dtype) if self.on_gpu else T.alloc_local(shape, dtype)

    def fragment(self, shape, dtype):
        """A tile spread over the threads' registers on the GPU (an accumulator, a row statistic)."""
        return T.alloc_fragment(shape, dtype) if self.on_gpu else T.alloc_local(shape, dtype)

    def parallel(self, *extents):
        """Loop over every element of a tile: split among threads on the GPU, nested loops on the CPU."""
        return T.Parallel(*extents) if self.on_gpu else T.grid(*extents)

    def kernel(self, *grid, threads):
        """Launch one block per grid point; ``threads`` per block on the GPU, one CPU thread otherwise."""
        return T.Kernel(*grid, threads=threads) if self.on_gpu else T.Kernel(*grid)


class Tiling(NamedTuple):
    """A kernel's tiling: ``block_M`` query rows and ``block_N`` keys per tile, ``num_stages`` tiles in flight,
    ``threads`` per block (a ``ForwardConfig``'s or ``BackwardConfig``'s first four fields)."""

    block_M: int
    block_N: int
    num_stages: int
    threads: int


def compile_kernel(prim_func, *, out_idx, target: str | None = None, dtype: str = "float32", fast_math=True,
                   arch: str | None = None, pass_configs=None):
    """Compile a ``@T.prim_func`` for ``target`` into a callable that takes and returns torch tensors.

    ``out_idx`` lists the parameters the kernel allocates and returns. On the C backend, 16-bit
    inputs need vectorisation off (TileLang 0.1.15 cannot build its half-precision vector type).
    ``arch`` (e.g. "sm_80") builds CUDA for an older architecture than the GPU's own, to run the
    Ampere code path on a Hopper GPU. ``pass_configs`` adds TileLang pass options (chapter 07
    switches TMA and warp specialisation off with them).
    """
    backend = TileBackend(target)
    pass_configs = dict(pass_configs or {})
    if backend.on_gpu:
        pass_configs[tilelang.PassConfigKey.TL_ENABLE_FAST_MATH] = fast_math
    elif dtype in ("float16", "bfloat16"):
        pass_configs[tilelang.PassConfigKey.TIR_DISABLE_VECTORIZE] = True
    target = {"kind": "cuda", "arch": arch} if arch and backend.on_gpu else backend.target
    return tilelang.compile(prim_func, out_idx=out_idx, target=target, pass_configs=pass_configs)


def launcher(kernel):
    """The lowest-overhead way to call a compiled kernel that allocates nothing (``out_idx=[]``).

    On CUDA, TileLang 0.1.15 runs a kernel through TVM-FFI: ``kernel(*args)`` goes through the adapter's
    Python wrapper, and then ``Executable.__call__``, which walks the module's import tree and looks up
    ``main`` again at every call, before the compiled host function checks every argument (shape, dtype,
    device, strides) and launches. The host function is what does the checking; the steps before it only
    find it, so this returns it, found once. It takes the current PyTorch stream at each call, as the
    wrapper does (a CUDA graph captures it). Any other backend (the CPU's Cython one): the kernel itself.
    """
    adapter = getattr(kernel, "adapter", None)
    if type(adapter).__name__ != "TVMFFIKernelAdapter" or adapter.result_idx:
        return kernel
    return _ffi_main(adapter)


def _ffi_main(adapter):
    module = adapter.get_exportable_executable()
    if isinstance(module, tvm.runtime.Executable):  # compiled now; a kernel from the disk cache is a Module
        module = module.jit()
    return module.main  # what Executable.__call__ and Module.__call__ call


def allocating_launcher(kernel, allocate):
    """``launcher`` for a compiled kernel whose outputs are its last parameters: ``allocate(*inputs)`` returns
    them (a tuple) and the kernel's TVM-FFI ``main`` is called with the inputs and then the outputs, as TileLang's
    wrapper does after building them itself from the parameters' shapes; returns the output (or the outputs).
    Any other backend, or outputs that are not the trailing parameters: the kernel itself.
    """
    adapter = getattr(kernel, "adapter", None)
    if (type(adapter).__name__ != "TVMFFIKernelAdapter" or getattr(adapter, "_ffi_callee_allocated_output_abi", False)
            or list(adapter.result_idx) != list(range(len(adapter.params) - len(adapter.result_idx),
                                                       len(adapter.params)))):
        return kernel
    main = _ffi_main(adapter)

    def launch(*inputs):
        outputs = allocate(*inputs)
        main(*inputs, *outputs)
        return outputs[0] if len(outputs) == 1 else outputs
    return launch


def attention_launcher(kernel):
    """``allocating_launcher`` for a compiled attention forward, (Q, K, V, Sinks) -> (O, LSE) with O like Q and a
    float32 LSE [B, H, S_q] allocated here (the kernel's host function still checks every argument). Any other
    backend: a callable that runs the kernel as it is and returns the same tuple.
    """
    launch = allocating_launcher(kernel, lambda q, k, v, sinks: (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)))
    if launch is kernel:
        return lambda q, k, v, sinks: tuple(kernel(q, k, v, sinks))
    return launch
