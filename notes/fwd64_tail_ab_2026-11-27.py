"""Fourteenth session's A/B (issue 26): is the D=64, S=1k forward's last gap the persistent schedule's last round?

The shipped D=64 S=1k non-causal tiling runs 64-row tiles in 2 x 132 = 264 persistent blocks. With H = 16 and S = 1k
a batch of B sequences has 256 B tiles: B = 31 -> 30.06 rounds, 32 -> 31.03, 33 -> 32.00, 34 -> 32.97. If the last,
nearly empty round costs what the notes estimate, ours' time grows by about a round from B = 31 to 32 but hardly from
32 to 33, and ours ÷ cuDNN is best at B = 33 and 34. Each case checked against float64 on every batch element and
head before timing; timed beside SDPA's cuDNN and FA2 backends in changing orders, three blocks.
"""
import sys
import time

import torch

sys.path.insert(0, "notes")
from device_ab import blocks, machine, save  # noqa: E402

from course_utils import flash_attention  # noqa: E402
from course_utils.checking.validation import check_forward  # noqa: E402
from course_utils.measure.benchmarks.common import CUDNN, FA2, SDPA_PEERS, in_parallel, sdpa  # noqa: E402

out_path = sys.argv[1]
result = dict(machine=machine(), F=[])
t0 = time.time()
BATCHES, HEADS, SEQ = (31, 32, 33, 34), 16, 1024
inputs = {}
for b in BATCHES:
    g = torch.Generator(device="cuda").manual_seed(b)
    inputs[b] = [torch.randn(b, HEADS, SEQ, 64, device="cuda", dtype=torch.float16, generator=g) for _ in range(3)]
in_parallel(lambda b: flash_attention(*inputs[b]), BATCHES)  # compiles each shape
print(f"compiled {time.time() - t0:.0f}s", flush=True)
for b in BATCHES:
    q, k, v = inputs[b]
    out, lse = flash_attention(q, k, v, return_lse=True)
    for i in range(0, b, 4):
        check_forward(q[i:i + 4], k[i:i + 4], v[i:i + 4], out[i:i + 4], lse[i:i + 4], quiet=i > 0, name=f"B={b} b={i}")
    fns = {"ours": lambda q=q, k=k, v=v: flash_attention(q, k, v)}
    for peer in (CUDNN, FA2):
        fns[peer] = lambda q=q, k=k, v=v, peer=peer: sdpa(q, k, v, False, SDPA_PEERS[peer])
    result["F"] += blocks(fns, label=f"fp16 D64 S=1k H=16 B={b} ({256 * b / 264:.2f} rounds)", base=CUDNN)
    save(out_path, **result)
print(f"done {time.time() - t0:.0f}s", flush=True)
