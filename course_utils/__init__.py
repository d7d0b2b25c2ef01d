"""Shared code of the course "FlashAttention in TileLang": references, checks, kernels, plots."""

import logging
import warnings

# Keep notebook outputs about the course, not about the tools: tqdm warns about a missing widget
# library inside Jupyter, and TileLang logs every compilation at INFO.
warnings.filterwarnings("ignore", message="IProgress not found")
# `python -m course_utils.<module>` runs a module the package has already imported; that is intended.
warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)

import tilelang  # noqa: E402

tilelang.set_log_level("WARNING")
# attention.py keeps its own cache of compiled kernels, so TileLang's hint to use @tilelang.jit
# instead (printed when two variants share a helper kernel) is noise here.
logging.getLogger("tilelang.cache.kernel_cache").addFilter(lambda record: "in memory cache" not in record.getMessage())

# The modules this file imported before the layers were folders were attributes of the package, and
# the chapters read them so (`cu.attention.sink_logits`, `cu.validation.references`): they still are.
from .api import attention as attention
from .api import decode_api as decode_api
from .api import fp8 as fp8
from .api import ring as ring
from .api import varlen_api as varlen_api
from .api.attention import (
                        SUPPORTED,
                        BackwardConfig,
                        ForwardConfig,
                        attention_backward,
                        backward_kernels,
                        flash_attention,
                        forward_kernel,
)
from .api.decode_api import flash_decode
from .api.flex import create_block_mask, flex_attention
from .api.fp8 import flash_attention_fp8
from .api.ring import ring_attention, shard_sequence, shard_zigzag, unshard_sequence, unshard_zigzag
from .api.varlen_api import flash_attention_varlen
from .checking import checks as checks
from .checking import validation as validation
from .checking.checks import CheckFailed, check_attention_error, check_close, check_true, expect_failure
from .checking.validation import backward_bugs, check_backward, check_forward, forward_bugs, show_bugs_caught
from .core import device as device
from .core import reference as reference
from .core.device import DEVICE, HAS_GPU, TILE_TARGET, describe_machine, pick
from .core.reference import attention_reference
from .kernels import tiles as tiles
from .kernels.tiles import TileBackend, compile_kernel
from .measure import bench as bench
from .measure.bench import attention_flops, measured, tflops, time_cuda
from .measure.claims import claim_change, claim_count, claim_order, claim_ratio, claim_versus, speed_ratio

__all__ = [
    "SUPPORTED", "ForwardConfig", "BackwardConfig", "flash_attention", "attention_backward", "forward_kernel",
    "backward_kernels", "attention_flops", "measured", "time_cuda", "tflops", "CheckFailed", "check_close",
    "check_true", "check_attention_error", "expect_failure", "DEVICE", "HAS_GPU", "TILE_TARGET",
    "describe_machine", "pick", "attention_reference", "TileBackend", "compile_kernel", "check_forward",
    "check_backward", "forward_bugs", "backward_bugs", "show_bugs_caught", "flash_attention_varlen", "flash_decode",
    "ring_attention", "shard_sequence", "unshard_sequence", "shard_zigzag", "unshard_zigzag",
    "claim_count", "claim_ratio", "claim_versus", "speed_ratio", "claim_change", "claim_order", "flex_attention",
    "create_block_mask", "flash_attention_fp8",
]
