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
import functools
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


def make_runner(name, q, k, v, lengths, table, sinks):
    """dec3.make_runner, with the split count of the sp candidates doubled."""
    splits = None
    if name in SPLIT_FACTOR:
        splits = SPLIT_FACTOR[name] * va.decode_num_splits(q, k, block_table=table)
    va.decode_config = dec3._config_fn(name)
    try:
        plan = va._decode_plan(q, k, v, lengths, table, False, None, None, sinks, splits, None)
    finally:
        va.decode_config = dec3._plain_config
    tab = plan.no_table if table is None else table

    def run(return_lse=False):
        out = va.torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
        lse = va.torch.empty(plan.lse_shape, dtype=va.torch.float32, device=plan.device)
        if plan.merge is None:
            plan.launch(q, k, v, tab, lengths, sinks, out, lse)
        else:
            o_part = va.torch.empty(plan.part_shape, dtype=va.torch.float32, device=plan.device)
            lse_part = va.torch.empty(plan.part_shape[:-1], dtype=va.torch.float32, device=plan.device)
            plan.launch(q, k, v, tab, lengths, o_part, lse_part)
            plan.merge(o_part, lse_part, sinks, out, lse)
        return (out, lse) if return_lse else out
    return run, plan.splits


dec3.make_runner = make_runner
dec3._config_fn = functools.lru_cache(maxsize=None)(dec3._config_fn.__wrapped__)

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
