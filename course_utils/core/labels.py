"""The names of the implementations the course compares, as they appear in records, tables and plots."""

__all__ = ["OURS", "FA2", "CUDNN", "FA4", "NAIVE", "PEERS", "SHORT"]

OURS = "TileLang (ours)"
FA2 = "FlashAttention-2 (SDPA flash)"
CUDNN = "cuDNN (SDPA cudnn)"
# FlashAttention-4 (`pip install flash-attn-4`, CuTe DSL): the fastest attention a user can install for the H100.
# Records measured where it was installed carry it; older records and machines without it do not.
FA4 = "FlashAttention-4 (flash-attn-4)"
NAIVE = "naive PyTorch"
PEERS = (FA2, CUDNN)  # the fast implementations every speed claim is measured against
SHORT = {OURS: "ours", FA2: "FA2", CUDNN: "cuDNN", FA4: "FA4", NAIVE: "naive"}  # for table columns and legends
