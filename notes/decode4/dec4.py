"""Issue 27, decode4: larger K/V tiles for flash_decode where it is memory-bound (one device call).

decode3 found that smaller TMA boxes lose badly (32-key tiles, six stages: 0.57-0.80 of the default) and left
the large caches at 0.98-1.00 of cuDNN. Question: do 128-key tiles (32 KiB boxes at 128 values a row, one block
per SM) read faster than the default's 64-key tiles (16 KiB, two blocks per SM), for the same bytes in flight
(three stages) or fewer (two)? The machinery (candidate configs through flash_decode's own plan, the float64
check of every head before timing, time_side_by_side against cuDNN, FA2 and torch.sum) is decode3's.

Run: python dec4.py precompile | check | bench DIM BATCHES CONTEXTS  (rows to $OUT/<part>.jsonl)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "decode3"))
import dec3  # noqa: E402

dec3.CANDIDATES.clear()
dec3.CANDIDATES.update({"base": dict(kv_heads_per_block=None),  # the default, launched as the others are
                        "n128": dict(kv_heads_per_block=None, block_N=128, min_blocks=1),
                        "n128s2": dict(kv_heads_per_block=None, block_N=128, num_stages=2, min_blocks=1)})
dec3.candidates_for = lambda dim: list(dec3.CANDIDATES)
dec3.CALL = 1  # no extra paged row in bench; check() covers paged for every candidate

if __name__ == "__main__":
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    part = sys.argv[1]
    if part == "precompile":
        dec3.precompile()
    elif part == "check":
        dec3.check()
    elif part == "bench":
        dec3.bench(int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], [int(x) for x in sys.argv[4].split(",")])
