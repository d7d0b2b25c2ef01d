"""Checkers for the exercises of chapter 07 (the Hopper forward).

Exercise (c), the learner's rotated loop, is checked twice: on TileLang's C backend (the matmuls are
synchronous there, so this checks the loop's indices: the extra iteration, which block's K and V, P
taken after the exponentials) against float64 and PyTorch models of the usual mistakes; then lowered
for sm_90a, where the order of the wgmma issues, the waits and the exponentials in the generated
consumer loop is what makes the overlap, and a wait in the wrong place is a race or a lost overlap;
last, compiled by nvcc, where ptxas serialising the wgmmas (an operand or accumulator touched while a wgmma
runs) or spilling registers fails it too.
"""

import torch

from .common import ExerciseWrong, check_exercise
from .kernels import KernelCase, Suspect, check_kernel, same_outputs
from .late_tools import c_lowering, loop_steps, lowered_source, ptxas_verdict, surfacing_warnings
from .shapes import draw_whole_blocks

__all__ = ["check_wasted_share", "check_wait_count", "check_rotated_loop", "check_blocks_per_sm", "HINTS"]

HINTS = {
    "a": ["A query block that sees n key blocks runs n + 1 iterations of two matmuls; two of them (the first "
          "P·V, the last QKᵀ) do nothing. With the causal mask, n depends on the query block.",
          "A ceiling division (-(-a // b)) counts key blocks; with the causal mask a query block's count stops at the"
          " block holding its last row's diagonal (min with the full count). Add up the issued and the wasted matmuls"
          " over the query blocks in a loop over range(...), then divide."],
    "b": ["Batches finish oldest first: once at most N are running, the N newest may still be unfinished.",
          "list.index gives the position of the batch you need and len the number issued: count the batches that came"
          " after it."],
    "c": ["Iteration kb issues S = Q K_kbᵀ and acc += P V_(kb−1), both before any wait; waits for the scores "
          "only (P·V keeps running), computes the exponentials, then waits for P·V before P is overwritten. "
          "One extra iteration finishes the last block; clamp the block indices so every copy is valid.",
          "T.Pipelined(num_blocks + 1, num_stages=2) runs the extra iteration; T.min and T.max clamp the K and V "
          "block indices to valid blocks; wait(n) with exercise (b)'s n for the batch the next statement reads; the "
          "exponentials in a tb.parallel loop with T.exp2 and scale_log2; a T.copy hands them to P for the next "
          "iteration; one read of K_s and V_s into stage_in_use after the last wait keeps the stage."],
    "d": ["Each limit gives its own count of blocks (registers, threads, shared memory, and 32 blocks at most); the "
          "SM runs the smallest of them.",
          "The SM has 65,536 registers, handed to a warp in units of 256 (8 per thread), 228 KiB of shared "
          "memory of which each block also reserves 1 KiB, room for 2048 threads and for 32 blocks. Integer "
          "division turns each limit into a count of blocks (a partial warp is a whole one); min() of them."],
}


# --- Exercise (a): the matmuls the rotated loop issues for nothing ---------------------------------

def _wasted_share(seq, block_M, block_N, causal):
    issued = wasted = 0
    num_k_blocks = -(-seq // block_N)
    for qb in range(-(-seq // block_M)):
        n = min(num_k_blocks, -(-((qb + 1) * block_M) // block_N)) if causal else num_k_blocks
        issued += 2 * (n + 1)  # one extra iteration, two matmuls per iteration
        wasted += 2  # the first P·V (P = 0) and the last QKᵀ (its scores are never used)
    return wasted / issued


def check_wasted_share(fn):
    """Check ``fn(seq, block_M, block_N, causal)``: the share of issued matmuls that do nothing useful."""
    hint = ("A query block with n key blocks runs n + 1 iterations of two matmuls each, and exactly "
            "two of them are wasted. With the causal mask, n depends on the query block (chapter 03's "
            "kv_blocks_visited). Sum over the query blocks before dividing.")
    cases = [(4096, 128, 128, False), (4096, 128, 128, True), (1000, 128, 192, True), (100, 128, 128, False),
             (4096, 128, 192, True)]
    check_exercise("wasted_share", lambda *a: torch.tensor(float(fn(*a))), lambda *a: torch.tensor(_wasted_share(*a)),
                   cases, rtol=1e-9, hint=hint)
    for causal in (False, True):
        print(f"   S=1k, 128 × 128 tiles, causal={causal}: {_wasted_share(1024, 128, 128, causal):.1%} of the "
              "issued matmul work is wasted — the price of never branching around a wgmma")


# --- Exercise (b): how many wgmma batches may stay in flight --------------------------------------

def check_wait_count(fn):
    """Check ``fn(issued, needed) -> N`` for wgmma.wait_group N (batches retire in issue order)."""
    hint = ("Batches finish oldest first. Once at most N are still running, the N newest may be "
            "unfinished: N is the number of batches issued after the one you need.")
    cases = [(["QK0"], "QK0"), (["QK1", "PV0"], "QK1"), (["QK1", "PV0"], "PV0"),
             (["QK2", "PV1", "QK3"], "QK2"), (["A", "B", "C", "D"], "B")]
    check_exercise("wait_count", lambda issued, needed: torch.tensor(int(fn(list(issued), needed))),
                   lambda issued, needed: torch.tensor(len(issued) - 1 - issued.index(needed)), cases,
                   atol=0, rtol=0, hint=hint)


# --- Exercise (c): rotate the loop yourself ----------------------------------------------------------

def _chain_model(q, k, v, block_N, *, extra=True, same_block_v=False, p_before_exp=False):
    """The rotated loop's O in float64, with one bug: no extra iteration (the last block's P·V is never
    issued), P·V of block kb − 1 read with V of block kb, or P copied before the exponentials."""
    scale = 1 / q.shape[-1] ** 0.5
    q, k, v = q.double(), k.double(), v.double()
    num_blocks = k.shape[1] // block_N
    acc = torch.zeros_like(q)
    p = torch.zeros(q.shape[0], q.shape[1], block_N, dtype=torch.float64)
    for kb in range(num_blocks + 1 if extra else num_blocks):
        k_blk, v_blk = min(kb, num_blocks - 1), max(kb - 1, 0)
        if same_block_v:
            v_blk = k_blk
        s = q @ k[:, k_blk * block_N:(k_blk + 1) * block_N].transpose(1, 2)
        acc = acc + p @ v[:, v_blk * block_N:(v_blk + 1) * block_N]
        p = s if p_before_exp else torch.exp(s * scale)
    return acc


def _rotated_case():
    """One case per shape of ``shapes.draw_whole_blocks``: one, two and three key blocks (with one, the first and
    the extra iteration clamp to the same block), block_M > block_N first and then <, S not a multiple of block_M."""
    g = torch.Generator().manual_seed(7)
    batch, dim, cases = 2, 16, []
    for shape in draw_whole_blocks():
        seq, block_M, block_N = shape.seq_k, shape.block_M, shape.block_N
        q, k, v = (torch.randn(batch, seq, dim, generator=g) for _ in range(3))
        expected = torch.exp(q.double() @ k.double().transpose(1, 2) / dim ** 0.5) @ v.double()
        blocks = f"{seq // block_N} key block{'s' if seq > block_N else ''}"
        cases.append(KernelCase(
            f"B=2, S={seq} ({blocks}), D=16, {block_M} × {block_N} tiles (C backend: matmuls synchronous)",
            (batch, seq, dim), dict(block_M=block_M, block_N=block_N, dtype="float32"), [3],
            lambda kernel, q=q, k=k, v=v: {"O": kernel(q, k, v)[:, None]},  # [B, 1, S, D]: messages name query rows
            {"O": expected[:, None]}, data=dict(q=q, k=k, v=v, block_N=block_N), rows="query row"))
    return cases


def _model_suspect(message, **bug):
    def test(case, got, kernel):
        d = case.data
        model = _chain_model(d["q"], d["k"], d["v"], d["block_N"], **bug)[:, None]
        return same_outputs(got, {"O": model}, rtol=1e-3, atol=1e-3)
    return Suspect(message, test)


_ROTATED_SUSPECTS = [
    _model_suspect("the last block's P·V is never issued: the rotated loop needs one extra iteration "
                   "(num_blocks + 1), its QKᵀ on a clamped block and unused.", extra=False),
    _model_suspect("P·V of block kb − 1 is multiplied with V of block kb: the V tile of iteration kb is block "
                   "T.max(kb − 1, 0), one behind K.", same_block_v=True),
    _model_suspect("P is copied from S before the exponentials: compute e^(S·scale) in S, then T.copy(S, P).",
                   p_before_exp=True),
]

_STEPS = {
    "mbarrier wait": r"mbarrier\[[^\]]*\]\.wait",
    "issue QKᵀ": r"tl::wgmma_ss<",
    "issue P·V": r"tl::wgmma_rs<",
    "wait({0})": r"wait_wgmma<(\d)>",
    "exp2": r"exp2f",
    "write P": r"\(P \+ [^;]*\) = |\bP\[[^\]]*\] = ",  # a store into P (the P·V wgmma's register operand)
    "release K/V stage": r"\]\.arrive\(\)",
}
_GPU_SHAPE = (1, 1024, 128)


def _consumer_steps(source):
    return [step for step in loop_steps(source, r"for \(int kb_1 = ", _STEPS) if step != "mbarrier wait"]


def _order_problem(steps):
    """The first schedule property the sm_90a consumer loop breaks, as a message; None if it keeps all."""
    def first(step):
        return steps.index(step) if step in steps else None

    qk, pv, exp = first("issue QKᵀ"), first("issue P·V"), first("exp2")
    waits = [i for i, step in enumerate(steps) if step.startswith("wait(")]
    if None in (qk, pv, exp):
        return "the loop must issue QKᵀ (issue_scores), issue P·V (issue_update) and compute exp2 in every iteration"
    if not waits:
        return ("there is no wait at all: the exponentials read S while its wgmma batch may still be running (a race "
                "the CPU cannot show). Wait for the scores with wait(1) before touching S")
    if any(w < max(qk, pv) for w in waits):
        return ("a wait sits between the two issues, so the P·V batch starts only after the scores are done: the "
                "tensor cores idle during the wait and nothing overlaps. Issue both batches, then wait")
    if exp < waits[0]:
        return ("the exponentials come before any wait: they read S while its wgmma batch may still be running (a "
                "race the CPU cannot show). wait(1) first")
    if steps[waits[0]] != "wait(1)":
        return (f"the first wait is {steps[waits[0]]}: it waits for P·V too, so the exponentials no longer overlap "
                "it. wait(1) leaves the newest batch (P·V) running while the scores are ready")
    if pv < qk:
        return ("P·V is issued before QKᵀ, so the scores are the newest batch and wait(1) leaves exactly them "
                "running: the exponentials read S while its wgmma may still write it (a race the CPU cannot show). "
                "Issue QKᵀ first, then P·V")
    if not any(w > exp and steps[w] == "wait(0)" for w in waits):
        return ("no wait(0) after the exponentials: the next iteration issues P·V on a P that this one overwrites "
                "while the previous P·V may still read it, and accumulates into acc while it runs (a race the "
                "CPU cannot show)")
    writes = [i for i, step in enumerate(steps) if step == "write P"]
    if writes and not any(pv < w < writes[0] and steps[w] == "wait(0)" for w in waits):
        return ("P is written (T.copy(S, P)) while the P·V wgmma that reads it may still be running: an operand "
                "of an asynchronous matmul is overwritten before the wait(0) that retires it (a race the CPU cannot "
                "show; ptxas answers it by serialising every wgmma of the loop). wait(0), then T.copy(S, P)")
    last_wait = max(waits)
    if not any(step == "release K/V stage" and i > last_wait for i, step in enumerate(steps)):
        return ("the K/V stage is released before the last wait: TileLang frees a stage after the last statement "
                "that reads it, here the issue, so TMA may overwrite K or V while the wgmma still reads them. Read "
                "K_s and V_s after wait(0) (stage_in_use[0] = K_s[0, 0] + V_s[0, 0])")
    return None


def check_rotated_loop(factory):
    """Run the learner's ``weighted_sum`` (its ``rotated_loop``) on the C backend against float64, then lower it
    for sm_90a and check the order of issues, waits and exponentials in the generated consumer loop."""
    import contextlib
    import io

    name = "rotated loop"

    def run():
        with contextlib.redirect_stdout(io.StringIO()):
            check_kernel(name, factory, _rotated_case, suspects=_ROTATED_SUSPECTS,
                         hint="Hint: iteration kb multiplies P of block kb − 1 with V of block kb − 1, and the loop "
                              "runs num_blocks + 1 times.")
        source = lowered_source(name, factory, _GPU_SHAPE)
        steps = _consumer_steps(source)
        problem = _order_problem(steps)
        if problem:
            raise ExerciseWrong(f"✗ {name}: right on the CPU, but in the sm_90a code ({' → '.join(steps)}) {problem}.")
        compiled = ptxas_verdict(name, source)
        print(f"✓ {name}: right on the C backend; sm_90a consumer loop: {' → '.join(steps)}; {compiled}")

    surfacing_warnings(run, c_lowering(factory, 2, 18, 16, block_M=8, block_N=6, dtype="float32"))


# --- Exercise (d): how many blocks share an SM -------------------------------------------------------

def _blocks_per_sm(threads, registers, shared_kib, *, rounded=True, reserved=True, thread_cap=True, block_cap=True):
    warps = -(-threads // 32)
    per_warp = (-(-registers // 8) * 8 if rounded else registers) * 32
    counts = [65536 // (warps * per_warp), int(228 // (shared_kib + (1 if reserved else 0)))]
    counts += [2048 // threads] if thread_cap else []
    counts += [32] if block_cap else []
    return min(counts)


# Each likely slip, as the answers it gives (checked against every case below, so each one is told apart).
_OCCUPANCY_SUSPECTS = [
    ("registers not rounded: a warp gets them 256 at a time, so round each thread's count up to a multiple of 8",
     dict(rounded=False)),
    ("the 1 KiB every block reserves is missing from the shared memory", dict(reserved=False)),
    ("the limit of 2048 threads per SM is missing", dict(thread_cap=False)),
    ("the limit of 32 blocks per SM is missing", dict(block_cap=False)),
]


def check_blocks_per_sm(fn):
    """Check ``fn(threads, registers, shared_kib)``: the blocks one H100 SM runs at once; name the likely slip."""
    cases = [(128, 154, 72), (256, 128, 80), (128, 169, 10), (128, 64, 76), (512, 16, 1), (32, 16, 1), (384, 160, 112)]
    try:
        check_exercise("blocks_per_sm", lambda *a: torch.tensor(int(fn(*a))),
                       lambda *a: torch.tensor(_blocks_per_sm(*a)), cases, atol=0, rtol=0,
                       hint="Take the smallest of the four counts: registers, threads, shared memory, blocks.")
    except ExerciseWrong as exc:
        answers = [int(fn(*case)) for case in cases]
        for why, slip in _OCCUPANCY_SUSPECTS:
            if answers == [_blocks_per_sm(*case, **slip) for case in cases]:
                raise ExerciseWrong(f"{exc} Likely: {why}.") from None
        raise
    ways = {"persistent, 3 consumer warpgroups + producer": (512, 128, 112),
            "persistent, 1 consumer warpgroup + producer": (256, 128, 80),
            "1 warpgroup loading for itself (154 registers)": (128, 154, 72)}
    for name, (threads, registers, kib) in ways.items():
        print(f"   {name}: {threads} threads × {registers} registers at launch, {kib} KiB -> "
              f"{_blocks_per_sm(threads, registers, kib)} per SM")
