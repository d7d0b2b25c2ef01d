"""Run a function on several CPU processes joined by a torch.distributed process group (gloo).

Chapter 10 runs ring attention, written for GPUs talking over NCCL, on a laptop: the same code with
the gloo backend, one process per "GPU". ``run_on_ranks(fn, world, *args)`` starts ``world``
processes, joins them into one gloo group, calls ``fn(*args)`` on each and returns what every rank
returned, in rank order. ``fn`` must be importable (defined in a module, not in a notebook cell):
the processes are started with the "spawn" method, which is safe wherever the parent runs
(Jupyter, pytest, a script) but imports ``fn`` afresh in each process.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_on_ranks"]


def _rank_main(rank, world, folder, timeout_s, fn, args):
    # One thread per process: `world` processes share the machine's cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        dist.barrier()  # no rank leaves while another may still be talking to it
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    # Leave without running the libraries' static destructors: on a loaded machine one of them (a thread pool still
    # joinable) sometimes ended a finished rank with std::terminate and SIGABRT, which failed the whole run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, world, *args, timeout_s=300):
    """``[fn(*args) on rank 0, …, on rank world − 1]``, each in its own process of one gloo group.

    Inside ``fn``, ``torch.distributed.get_rank()`` tells the rank. A rank that raises makes this
    raise too (``torch.multiprocessing.ProcessRaisedException``, with that rank's traceback).
    ``timeout_s`` bounds how long a collective may wait for the others.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int; got {world!r}")
    with tempfile.TemporaryDirectory(prefix="gloo-") as folder:
        mp.spawn(_rank_main, args=(world, folder, timeout_s, fn, args), nprocs=world, join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]
