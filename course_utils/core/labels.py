"""The names of the implementations the course compares, as they appear in records, tables and plots."""

__all__ = ["OURS", "FA2", "CUDNN", "NAIVE", "PEERS", "SHORT"]

OURS = "TileLang (ours)"
FA2 = "FlashAttention-2 (SDPA flash)"
CUDNN = "cuDNN (SDPA cudnn)"
NAIVE = "naive PyTorch"
PEERS = (FA2, CUDNN)  # the fast implementations every speed claim is measured against
SHORT = {OURS: "ours", FA2: "FA2", CUDNN: "cuDNN", NAIVE: "naive"}  # for table columns and legends
