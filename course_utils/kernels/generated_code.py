"""The one edit the course makes to the CUDA TileLang generates: a bulk reduce-add's wait, moved.

``T.atomic_add(dst, tile_in_shared_memory, use_tma=True)`` lowers (TileLang 0.1.15) to the copy engine's reduce-add
followed at once by the issuing thread's wait until the engine has read the tile (``tma_store_wait<0, true>``), so
that the tile may be written again. That thread's warp stalls there at every step. Chapter 08's backward writes
dQ's staging tile again only one step later, after the 256 consumer threads have met at the dSᵀ barrier: a kernel
built with ``defer_dq_wait`` waits there instead (``wait_for_reduce_read`` before that barrier; a thread with no
reduce in flight passes at once), so the copy engine's read runs under the next step's Sᵀ and dPᵀ products
(FlashAttention-3 gets the same overlap from a warp of its own for the reduce).

The wait right after the reduce is then redundant, and TileLang cannot be asked to leave it out: ``drop_early_waits``
deletes it from the generated CUDA, and only from a kernel that waits before a consumer barrier (the signature of
the moved wait). Other kernels' code is left exactly as TileLang wrote it. Without this edit a deferred kernel is
still correct: it waits twice.
"""
import re

import tilelang

__all__ = ["MOVED_WAIT", "drop_early_waits", "register"]

# The moved wait: every consumer thread, right before the proxy fence and the named barrier of ``consumer_barrier``
# (TileLang's own waits sit inside the branch of the one thread that issued the copy, and end it).
MOVED_WAIT = re.compile(r"tl::tma_store_wait<0, true>\(\);\s*tl::fence_proxy_async\(\);\s*tl::__sync_thread_partial\(")
# TileLang's wait after a bulk reduce-add (issued in a loop over the tile's boxes, or once).
_EARLY_WAIT = re.compile(r"(tl::tma_store_add\([^;]*\);\s*(?:\}\s*)?tl::tma_store_arrive\(\);)\s*"
                         r"tl::tma_store_wait<0, true>\(\);")


def drop_early_waits(code, target=None):
    """``code`` without the wait after each bulk reduce-add, if it has the moved wait; else ``code`` unchanged."""
    if not (MOVED_WAIT.search(code) and "tl::tma_store_add(" in code):
        return code
    edited, count = _EARLY_WAIT.subn(r"\1", code)
    if count == 0:
        raise RuntimeError("a kernel waits for its reduce-add before a consumer barrier, but the wait TileLang puts "
                           "after the reduce-add was not found: TileLang's output has changed (see "
                           "course_utils/kernels/generated_code.py)")
    return edited


def register():
    """Make ``drop_early_waits`` TileLang's CUDA post-processing step (one per process; it replaces any other)."""
    tilelang.register_cuda_postproc(drop_early_waits)
