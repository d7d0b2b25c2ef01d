"""Where the course runs: one place that decides CPU vs GPU, TileLang target and problem sizes."""

from __future__ import annotations

import datetime
import functools
import platform
import subprocess

import torch

__all__ = ["HAS_GPU", "DEVICE", "TILE_TARGET", "pick", "is_hopper", "sm_count", "machine_info", "describe_machine"]

HAS_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_GPU else "cpu")
# TileLang's C backend runs the same tile programs on the CPU (see course_utils.kernels.tiles).
TILE_TARGET = "cuda" if HAS_GPU else "c"


def pick(*, cpu, gpu):
    """Return ``gpu`` on a CUDA machine and ``cpu`` otherwise (problem sizes, dtypes, …)."""
    return gpu if HAS_GPU else cpu


def is_hopper():
    """Whether the current CUDA GPU is sm_90 (H100/H200), where wgmma and TMA exist."""
    return HAS_GPU and _major_capability(torch.cuda.current_device()) == 9


@functools.cache
def _major_capability(device_index):  # asked once per GPU: the public API calls is_hopper at every backward
    return torch.cuda.get_device_capability(device_index)[0]


def sm_count(device):
    """The number of SMs of CUDA ``device`` (a ``torch.device``; without an index, the current GPU)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=8)
def _sm_count(device_index):  # asked once per GPU: the decoding and packed front doors ask at every call
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _nvidia_smi(query):
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def machine_info():
    """A dict describing this machine and the software versions, stored with every measurement."""
    import tilelang

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tilelang": tilelang.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    if HAS_GPU:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            sm_count=props.multi_processor_count,
            compute_capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            driver=_nvidia_smi("driver_version"),
            clocks_mhz=_nvidia_smi("clocks.sm,clocks.max.sm,clocks.mem"),
        )
        fa4 = _installed_version("flash-attn-4")
        if fa4 is not None:  # a peer in the records measured with it
            info["flash_attn_4"] = fa4
    return info


def _installed_version(distribution):
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe_machine():
    """Print what this machine is and how the course adapts to it."""
    info = machine_info()
    for key, value in info.items():
        print(f"{key:>18}: {value}")
    if HAS_GPU:
        print("\nGPU found: kernels compile for CUDA and run at full size; the chapters show the stored records"
              "\n(re-measured only with COURSE_REFRESH_RECORDS=1, which run_notebooks --refresh sets).")
    else:
        print("\nNo GPU: tile programs run through TileLang's C backend at small sizes;"
              "\nCUDA source is still generated for inspection; GPU results are the stored H100 records.")
