"""Checkers for the exercises of chapter 08 (the Hopper backward)."""

import random

import torch

from .common import ExerciseIncomplete, ExerciseWrong, check_exercise

__all__ = ["check_dq_reduce_bytes", "check_fixed_order_sum", "check_wait_before_dq_store", "HINTS"]

HINTS = {
    "a": ["Every key block adds a float32 contribution to every element of dQ.",
          "⌈S_k / block_N⌉ · batch · heads · S_q · D · 4 bytes."],
    "b": ["Float addition is not associative: the bits depend on the order. Add in a fixed order, whatever "
          "the arrival order.",
          "sorted(parts, key=lambda p: p[0]), then add the tensors in that order, starting from the first."],
    "c": ["wait_group n lets the n newest batches keep running; dQ must be finished before it is stored.",
          "Count the batches issued after dQ in [dV, dQ, dK]: that is n, and they are the ones still running."],
}


# --- Exercise 1: the bytes of dQ's reduction ---------------------------------------------------------

def _dq_reduce_bytes(batch, heads, seq_q, seq_k, dim, block_N):
    return -(-seq_k // block_N) * batch * heads * seq_q * dim * 4


def check_dq_reduce_bytes(fn):
    """Check ``fn(batch, heads, seq_q, seq_k, dim, block_N)`` against the float32 dQ tiles added."""
    hint = ("Every key block (there are ⌈S_k / block_N⌉, the last one may be partial) adds a float32 "
            "(4-byte) contribution to every element of dQ: batch · heads · S_q · D elements.")
    cases = [(4, 16, 4096, 4096, 128, 128), (1, 1, 128, 128, 64, 128), (2, 8, 1000, 1000, 64, 128),
             (1, 64, 4096, 4096, 64, 128), (3, 2, 512, 2048, 128, 64)]
    check_exercise("dq_reduce_bytes", lambda *a: torch.tensor(float(fn(*a))),
                   lambda *a: torch.tensor(float(_dq_reduce_bytes(*a))), cases, rtol=0, atol=0, hint=hint)
    inputs = 5 * 4 * 16 * 4096 * 128 * 2
    print(f"   at S=4k, D=128: {_dq_reduce_bytes(4, 16, 4096, 4096, 128, 128) / inputs:.0f}× the bytes of "
          "Q, K, V, O and dO — most of it stays in the L2 cache, and it is why the copy engine adds it")


# --- Exercise 2: a sum with the same bits whatever the arrival order ---------------------------------

def check_fixed_order_sum(fn):
    """``fn(parts)`` must return the same bits for every arrival order of the (key_block, tensor) pairs."""
    hint = ("Float addition is not associative: (a + b) + c and a + (b + c) can differ in the last bit. "
            "Sort the parts by key block before adding, as the deterministic dQ kernel walks the key "
            "blocks in order.")
    g = torch.Generator().manual_seed(0)
    parts = [(kb, torch.randn(64, generator=g) * 10 ** torch.randint(-3, 4, (64,), generator=g)) for kb in range(16)]
    expected = parts[0][1].clone()
    for _, part in parts[1:]:
        expected = expected + part
    rng = random.Random(0)
    seen_different = False
    for trial in range(8):
        shuffled = parts[:]
        rng.shuffle(shuffled)
        naive = shuffled[0][1].clone()
        for _, part in shuffled[1:]:
            naive = naive + part
        seen_different |= not torch.equal(naive, expected)
        try:
            got = fn([(kb, t.clone()) for kb, t in shuffled])
        except NotImplementedError:
            raise ExerciseIncomplete("fixed_order_sum: not written yet — replace the `raise NotImplementedError` "
                                     "line with your code and run the cell again.") from None
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise ExerciseWrong(f"fixed_order_sum: expected a tensor of shape {tuple(expected.shape)}; got {got!r:.80}")
        if not torch.equal(got, expected):
            diff = float((got - expected).abs().max())
            raise ExerciseWrong(f"fixed_order_sum: arrival order {trial} gave different bits (max difference "
                                f"{diff:.1e}). Hint: {hint}")
    assert seen_different, "the test's shuffles should change a naive sum"
    print("✓ fixed_order_sum: the same bits for 8 arrival orders (adding in arrival order changes them)")


# --- Exercise 3: the wait before dQ is stored ---------------------------------------------------------

def check_wait_before_dq_store(fn):
    """``fn() -> (n, still_running)`` for batches issued in the order dV, dQ, dK."""
    try:
        got = fn()
    except NotImplementedError:
        raise ExerciseIncomplete("wait_before_dq_store: not written yet — replace the `raise NotImplementedError` "
                                 "line with your code and run the cell again.") from None
    issued = ["dV", "dQ", "dK"]
    n = len(issued) - 1 - issued.index("dQ")
    try:
        got_n, running = got
        ok = int(got_n) == n and sorted(running) == sorted(issued[len(issued) - n:])
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ExerciseWrong(f"wait_before_dq_store: got {got!r}. Hint: batches retire oldest first; wait_group n "
                            "lets the n newest keep running. Which batches were issued after dQ?")
    print(f"✓ wait_before_dq_store: wait_wgmma({n}); {issued[-1]} may still run while dQ is stored")
