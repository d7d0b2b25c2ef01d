"""The GPU measurements behind the course's records, by chapter, and their registry.

Each chapter's module times ours next to SDPA's FlashAttention-2 and cuDNN backends in the same
process, on the same inputs, after checking our results on every head against the float64
reference. ``RECORDS`` maps a record's name to the function that measures it; a notebook shows a
record with ``cu.measured(name, RECORDS[name])``, and on a GPU machine

    python -m course_utils.measure.benchmarks NAME ...      # (no NAME: every record of one GPU)

re-measures records in one go and writes ``figures/NAME.json``.
"""

from ...api.attention import TUNED_FORWARD_CONFIG, BackwardConfig, ForwardConfig
from .ch01_naive import naive_attention, naive_vs_sdpa
from .ch03_forward import forward_config_sweep, forward_vs_peers
from .ch05_backward import backward_config_sweep, backward_vs_peers
from .ch06_gpt_oss import GPT_OSS_SHAPE, gpt_oss_vs_peers, gqa_backward_strategies
from .ch07_hopper import forward_ablation, hopper_tiling_sweep, persistent_vs_rotated
from .ch08_hopper_backward import TIMING_ORDERS, backward_ablation, deterministic_cost, feature_checks, timing_order
from .ch09_varlen_decode import decode_bandwidth, decode_split_sweep, varlen_vs_dense
from .ch10_ring import RECORD as CH10_RING_RECORD
from .ch10_ring import ring_vs_one_gpu
from .ch11_flex import flex_vs_peers
from .ch12_fp8 import fp8_vs_peers
from .common import SDPA_PEERS, comparison_shapes

__all__ = ["RECORDS", "MULTI_GPU_RECORDS", "CH03_FORWARD_CONFIG", "CH05_BACKWARD_CONFIG", "SDPA_PEERS",
           "comparison_shapes", "naive_attention", "naive_vs_sdpa", "forward_vs_peers", "forward_config_sweep",
           "backward_config_sweep", "backward_vs_peers", "GPT_OSS_SHAPE", "gpt_oss_vs_peers", "gqa_backward_strategies",
           "forward_ablation", "hopper_tiling_sweep", "persistent_vs_rotated", "backward_ablation",
           "deterministic_cost", "feature_checks", "timing_order", "TIMING_ORDERS", "CH08_SEQS", "decode_bandwidth",
           "decode_split_sweep", "varlen_vs_dense", "ring_vs_one_gpu", "flex_vs_peers", "fp8_vs_peers"]

# Chapter 03's kernel as the chapter writes it (two pipeline stages), and chapter 05's backward.
CH03_FORWARD_CONFIG = ForwardConfig(128, 128, 2, 256)
CH05_BACKWARD_CONFIG = BackwardConfig(64, 128, 1, 256)
_CH07_SEQS = (1024, 2048, 4096, 8192, 16384)
_CH05_SEQS = (1024, 4096, 16384)
CH08_SEQS = _CH07_SEQS

RECORDS = {
    "ch01_naive_vs_sdpa_h100": naive_vs_sdpa,
    "ch03_forward_vs_peers_h100": lambda: forward_vs_peers(config=CH03_FORWARD_CONFIG),
    "ch04_forward_sweep_h100": forward_config_sweep,
    "ch04_forward_final_h100": lambda: forward_vs_peers(
        shapes=comparison_shapes(dim=64) + comparison_shapes(dim=128), dtypes=("float16", "bfloat16"),
        include_naive_up_to=0, config=TUNED_FORWARD_CONFIG),
    "ch05_backward_sweep_h100": backward_config_sweep,
    "ch05_backward_vs_peers_h100": lambda: backward_vs_peers(
        shapes=comparison_shapes(seq_lens=_CH05_SEQS, dim=64) + comparison_shapes(seq_lens=_CH05_SEQS, dim=128),
        config=CH05_BACKWARD_CONFIG),
    "ch06_gpt_oss_h100": gpt_oss_vs_peers,
    "ch06_gqa_backward_h100": gqa_backward_strategies,
    "ch07_forward_ablation_h100": forward_ablation,
    # Old code: measured before chapter 07's kernels took their present form, shown in no chapter and
    # cited as evidence nowhere; re-measure it before using it for anything.
    "ch07_overlap_sweep_h100": hopper_tiling_sweep,
    "ch07_persistent_vs_rotated_h100": persistent_vs_rotated,
    "ch07_forward_vs_peers_h100": lambda: forward_vs_peers(
        shapes=comparison_shapes(seq_lens=_CH07_SEQS, dim=64) + comparison_shapes(seq_lens=_CH07_SEQS, dim=128),
        dtypes=("float16", "bfloat16"), include_naive_up_to=0),
    "ch08_feature_checks_h100": feature_checks,
    "ch08_backward_ablation_h100": backward_ablation,
    "ch08_deterministic_h100": deterministic_cost,
    "ch08_timing_order_h100": timing_order,
    "ch08_backward_vs_peers_h100": lambda: backward_vs_peers(
        shapes=comparison_shapes(seq_lens=CH08_SEQS, dim=128) + comparison_shapes(seq_lens=CH08_SEQS, dim=64),
        dtypes=("float16", "bfloat16"), modes=("bwd",)),
    "ch09_decode_h100": decode_bandwidth,
    "ch09_decode_splits_h100": decode_split_sweep,
    "ch09_varlen_h100": varlen_vs_dense,
    CH10_RING_RECORD: ring_vs_one_gpu,
    "ch11_flex_h100": flex_vs_peers,
    # The flex kernels on chapter 07's and 08's Hopper loops, measured on an H200.
    "ch11_flex_h200": flex_vs_peers,
    # Measured on an H200 (chapter 12's first GPU run); an H100 run would be ch12_fp8_h100.
    "ch12_fp8_h200": fp8_vs_peers,
}
# Records that need a machine with several GPUs (nvidia-h200-x2): measured only when named, and
# never re-measured by a notebook (chapter 10 shows the stored one).
MULTI_GPU_RECORDS = {CH10_RING_RECORD: 2}
