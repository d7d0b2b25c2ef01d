"""Issue 27, decode5: an L2 eviction hint on the K/V loads, and more splits where one wave is not whole
(one device call; the machinery is decode3's: each candidate through flash_decode's own plan, checked against
float64 on every head before it is timed, time_side_by_side against cuDNN, FA2 and torch.sum).

Question: at the nine memory-bound shapes where cuDNN was 0.2-1.6 % faster in the kept record
(figures/ch09_decode_h100.json, 2026-11-27 11:25 UTC), does any of these read faster than the default?
  ef        the default with every K/V TMA load hinted EVICT_FIRST (a stream read once: leave L2 to the rest)
  n128s2ef  128-key tiles, two stages, one block per SM, EVICT_FIRST (decode4's n128s2 was -0.3...+1.1 %)
  sp2       the default kernels with twice the default split count (B = 64, D = 128: 512 blocks are 1.94 waves
            of two blocks per SM; 1024 are 3.88)
  sp2ef     sp2 with EVICT_FIRST

Run: python dec5.py precompile | check | bench DIM BATCHES CONTEXTS  (rows to $OUT/<part>.jsonl)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "decode3"))
import dec3  # noqa: E402

import course_utils.api.varlen_api as va  # noqa: E402

EF = "evict_first"
dec3.CANDIDATES.clear()
dec3.CANDIDATES.update({"ef": dict(kv_heads_per_block=None, kv_eviction=EF),
                        "n128s2ef": dict(kv_heads_per_block=None, block_N=128, num_stages=2, min_blocks=1,
                                         kv_eviction=EF),
                        "sp2": dict(kv_heads_per_block=None),
                        "sp2ef": dict(kv_heads_per_block=None, kv_eviction=EF)})
SPLIT_FACTOR = {"sp2": 2, "sp2ef": 2}
dec3.candidates_for = lambda dim: list(dec3.CANDIDATES)
dec3.CALL = 1


_default_runner = dec3.make_runner


def make_runner(name, q, k, v, lengths, table, sinks):
    """dec3.make_runner, with the split count of the sp candidates doubled."""
    splits = SPLIT_FACTOR[name] * va.decode_num_splits(q, k, block_table=table) if name in SPLIT_FACTOR else None
    return _default_runner(name, q, k, v, lengths, table, sinks, num_splits=splits)


dec3.make_runner = make_runner

if __name__ == "__main__":
    dec3.main(sys.argv)
