"""Shared code of the course "FlashAttention in TileLang": references, checks, kernels, plots."""

import warnings

# Keep notebook outputs about the course, not about the tools: tqdm warns about a missing widget
# library inside Jupyter, and TileLang logs every compilation at INFO.
warnings.filterwarnings("ignore", message="IProgress not found")

import tilelang  # noqa: E402

tilelang.set_log_level("WARNING")

from .attention import SUPPORTED, ForwardConfig, flash_attention
from .bench import attention_flops, measured, time_cuda, tflops
from .checks import CheckFailed, check_close, check_true
from .device import DEVICE, HAS_GPU, TILE_TARGET, describe_machine, pick
from .reference import attention_reference
from .tiles import TileBackend, compile_kernel

__all__ = [
    "SUPPORTED", "ForwardConfig", "flash_attention", "attention_flops", "measured", "time_cuda",
    "tflops", "CheckFailed", "check_close", "check_true", "DEVICE", "HAS_GPU", "TILE_TARGET",
    "describe_machine", "pick", "attention_reference", "TileBackend", "compile_kernel",
]
