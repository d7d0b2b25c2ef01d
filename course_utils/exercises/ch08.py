"""Checkers for the exercises of chapter 08 (the Hopper backward).

Exercise (d), one step of the Hopper backward written by the learner, is checked like chapter 07's
rotated loop: on TileLang's C backend (matmuls synchronous, waits and barriers no-ops: this checks
the order of the mathematics) against float64 and PyTorch models of the usual mistakes; then lowered
for sm_90a, where each property of the schedule (every result read only after a wait that retires
its batch, the overlaps kept, a barrier between the shared dSᵀ and dQ tiles and their readers, the
stage released after the last wait) is checked on the generated consumer loop; last, nvcc compiles it, and
serialised wgmmas, a wait ptxas injects, or a register spill fail it too.

Exercise (e) draws no shapes from ``shapes`` (the other checkers' index classes): its step has no index arithmetic to
get wrong. Every index is in code the exercise gives: ``key_block_backward`` places the key block, walks every
query block and copies the tiles (no mask, so no causal offset; S a multiple of both tiles by its contract, so no
ragged tile), and ``add_dq`` places dQ's tile from the ``b`` and ``qb`` the kernel passes. The step only orders the
given pieces' calls, waits and barriers on tiles whose shapes the kernel fixes, and the size of the scores cannot
reach its arithmetic (``probabilities`` subtracts the forward's LSE). What it can get wrong is that order: the C
case checks it in the mathematics (16 queries × 32 keys, four query blocks, two batches: a piece skipped, repeated
or fed a tile of other values changes dQ, dK or dV), the sm_90a lowering in the schedule.
"""

import random

import torch

from .common import ExerciseIncomplete, ExerciseWrong, check_exercise
from .kernels import KernelCase, Suspect, check_kernel, same_outputs
from .late_tools import c_lowering, loop_steps, lowered_source, ptxas_verdict, surfacing_warnings

__all__ = ["check_dq_reduce_bytes", "check_fixed_order_sum", "check_wait_before_dq_store", "check_backward_step",
           "check_reduce_wait", "NEXT_STEP", "HINTS"]

HINTS = {
    "a": ["Every key block adds a float32 contribution to every element of dQ.",
          "A ceiling division counts the key blocks; each sends one float32 (4-byte) value for every element of dQ, "
          "which has batch · heads · S_q · D of them."],
    "b": ["Float addition is not associative: the bits depend on the order. Add in a fixed order, whatever "
          "the arrival order.",
          "sorted with a key= function puts the pairs in key-block order whatever the arrival order; then add the "
          "tensors one by one in that order (clone the first so the caller's tensor is not changed)."],
    "c": ["wait_group n lets the n newest batches keep running; dQ must be finished before it is stored.",
          "Exercise 07 (b)'s rule: n is the number of batches issued after the one you read; list them."],
    "d": ["One thread issued the reduce-add and only that thread can wait for it; the other 255 write their parts "
          "of dq_s too. How can they know that the copy engine has finished reading it?",
          "They learn it only at a barrier that all of them pass after the issuing thread's wait and before any of "
          "them writes dq_s. Read NEXT_STEP from the store of dq_s backwards: which barriers could carry that news? "
          "The later the wait, the longer the copy engine's read runs under the step."],
    "e": ["Section 3's step: issue Sᵀ and dPᵀ together, wait only for Sᵀ and compute Pᵀ while dPᵀ runs, wait for "
          "dPᵀ before forming dSᵀ. dQ reads dSᵀ from shared memory, half of it written by the other consumer: "
          "store, then meet, then issue. Issue dV, dQ, dK together and wait for dQ only; the copy engine reads dq_s, "
          "half of it the other consumer's: store, meet, reduce-add. Last, wait for everything and read Q_s and "
          "dO_s so the stage is released after that wait.",
          "wait(n) lets the n newest batches run on: choose n from what the next statement reads (exercise 07 (b)). "
          "barrier(id) goes where a shared tile changes hands: after the T.copy that writes it and before the "
          "statement that reads the other half; DS_BARRIER guards dST_s, DQ_BARRIER dq_s. The read of Q_s and dO_s "
          "into stage_in_use comes after the last wait."],
}


# --- Exercise (a): the bytes of dQ's reduction ------------------------------------------------------

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


# --- Exercise (b): a sum with the same bits whatever the arrival order ------------------------------

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


# --- Exercise (c): the wait before dQ is stored ------------------------------------------------------

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


# --- Exercise (d): where the copy engine's read of dq_s is waited for ----------------------------------

# The consumer threads' events in one step, in order (section 3); the reduce-add of the step before is in flight.
NEXT_STEP = ("issue Sᵀ and dPᵀ", "exponentials", "form dSᵀ", "store dSᵀ", "dSᵀ barrier", "issue dV, dQ, dK",
             "wait for dQ", "store dQ to dq_s", "dQ barrier", "reduce-add")


def check_reduce_wait(fn):
    """``fn() -> event``: the event of ``NEXT_STEP`` that the issuing thread's wait for the last reduce-add's read
    must come directly before, as late as is safe (chapter 08's version 22)."""
    try:
        got = fn()
    except NotImplementedError:
        raise ExerciseIncomplete("reduce_wait_before: not written yet — replace the `raise NotImplementedError` "
                                 "line with your code and run the cell again.") from None
    if got not in NEXT_STEP:
        raise ExerciseWrong(f"reduce_wait_before: got {got!r}; return one of the events of NEXT_STEP: "
                            + ", ".join(repr(e) for e in NEXT_STEP))
    at, barrier, store = (NEXT_STEP.index(e) for e in (got, "dSᵀ barrier", "store dQ to dq_s"))
    if at < barrier:
        raise ExerciseWrong(f"reduce_wait_before: {got!r} is safe but earlier than it needs to be: the copy engine's "
                            f"read could still run under every event from {got!r} to the dSᵀ barrier. Which is the "
                            "last event that every thread passes before any of them writes dq_s?")
    if barrier < at <= store:
        raise ExerciseWrong(f"reduce_wait_before: a race. Only the issuing thread waits; the others learn that the "
                            f"read has ended only at a barrier they pass after that wait, and between {got!r} and "
                            "'store dQ to dq_s' there is none: they may overwrite dq_s while the engine reads it.")
    if at > store:
        raise ExerciseWrong(f"reduce_wait_before: too late — dq_s has already been rewritten at 'store dQ to dq_s', "
                            f"before {got!r}, while the copy engine may still be reading the last step's tile.")
    print("✓ reduce_wait_before: the issuing thread waits right before the dSᵀ barrier; every thread passes that "
          "barrier after the wait and before it writes dq_s, and the engine's read runs under Sᵀ, dPᵀ and the "
          "exponentials (version 22)")


# --- Exercise (e): one step of the Hopper backward, its waits and barriers ----------------------------

def _backward_model(q, k, v, d_out, *, ds_before_p=False, dk_from_p=False, dv_from_ds=False):
    """dQ, dK, dV in float64 ([B, S, D] inputs, no mask), with one bug: dSᵀ (and the Pᵀ copy dV reads)
    formed from the raw scores before the exponentials, dK multiplied with Pᵀ, or dV with dSᵀ."""
    q, k, v, d_out = (t.double() for t in (q, k, v, d_out))
    scale = 1 / q.shape[-1] ** 0.5
    scores = q @ k.transpose(1, 2)
    lse = torch.logsumexp(scores * scale, dim=-1, keepdim=True)
    p = torch.exp(scores * scale - lse)
    delta = ((p @ v) * d_out).sum(-1, keepdim=True)
    if ds_before_p:
        p = scores
    ds = p * (d_out @ v.transpose(1, 2) - delta)
    d_v = (ds if dv_from_ds else p).transpose(1, 2) @ d_out
    d_k = (p if dk_from_p else ds).transpose(1, 2) @ q * scale
    return {"dQ": (ds @ k * scale)[:, None], "dK": d_k[:, None], "dV": d_v[:, None]}


def _step_case():
    g = torch.Generator().manual_seed(8)
    batch, seq, dim, block_M, block_N = 2, 64, 16, 16, 32
    q, k, v, d_out = (torch.randn(batch, seq, dim, generator=g) for _ in range(4))
    qd, kd, vd = (t.double() for t in (q, k, v))
    scores = qd @ kd.transpose(1, 2) / dim ** 0.5
    lse = torch.logsumexp(scores, dim=-1)
    delta = ((torch.softmax(scores, -1) @ vd) * d_out.double()).sum(-1)

    def run(kernel):
        dq_acc = torch.zeros(batch, seq, dim)
        d_k, d_v = kernel(q, k, v, d_out, lse.float(), delta.float(), dq_acc)
        return {"dQ": (dq_acc / dim ** 0.5)[:, None], "dK": d_k[:, None], "dV": d_v[:, None]}

    return [KernelCase(f"B={batch}, S={seq}, D={dim}, {block_M} queries × {block_N} keys per step (C backend: "
                       "matmuls synchronous)", (batch, seq, dim), dict(block_M=block_M, block_N=block_N,
                                                                       dtype="float32"), [7, 8], run,
                       _backward_model(q, k, v, d_out), data=dict(q=q, k=k, v=v, d_out=d_out), rows="row")]


def _step_suspect(message, **bug):
    def test(case, got, kernel):
        d = case.data
        return same_outputs(got, _backward_model(d["q"], d["k"], d["v"], d["d_out"], **bug), rtol=1e-3, atol=1e-3)
    return Suspect(message, test)


_STEP_SUSPECTS = [
    _step_suspect("dSᵀ is formed before the exponentials: form_ds reads Pᵀ, so probabilities(PT, lse) must run "
                  "first (and the Pᵀ that dV multiplies is copied there too).", ds_before_p=True),
    _step_suspect("dK is multiplied with Pᵀ: dK += dSᵀ Q takes the 16-bit dSᵀ in registers (dST).", dk_from_p=True),
    _step_suspect("dV is multiplied with dSᵀ: dV += Pᵀ dO takes the 16-bit Pᵀ (PT_cast).", dv_from_ds=True),
]

_STEP_LABELS = {  # (label, regex): the first that matches a line names it (order matters)
    "issue Sᵀ": r"tl::wgmma_\w+<.*\(PT \+",
    "issue dPᵀ": r"tl::wgmma_\w+<.*\(dPT \+",
    "issue dV": r"tl::wgmma_\w+<.*\(dv \+",
    "issue dQ": r"tl::wgmma_\w+<.*\(dq \+",
    "issue dK": r"tl::wgmma_\w+<.*\(dk \+",
    "wait({0})": r"wait_wgmma<(\d)>",
    "exp2": r"exp2f",
    "read dPᵀ": r"=.*\bdPT\b",
    "reduce-add dQ": r"tma_store_add",
    "bulk wait": r"tma_store_wait<",
    "store dSᵀ": r"^(?!.*initialize_wgmma_descriptor).*dST_s\)\[",
    "store dQ": r"^(?!.*initialize_wgmma_descriptor).*\(\(float\*\)dq_s\)",
    "barrier": r"__sync_thread_partial\(",
    "release a stage": r"\]\.arrive\(\)",
}
_STEP_GPU_SHAPE = (1, 1024, 128)
_RACE = "(a race the CPU cannot show)"


def _done(steps, batch, at):
    """Whether the wgmma batch ``batch`` is certainly finished at position ``at``: some wait(n) between its
    issue and ``at`` has at least n batches issued after it (batches retire oldest first)."""
    issued = steps.index(batch)
    for w in range(issued + 1, at):
        if steps[w].startswith("wait("):
            n = int(steps[w][5])
            if sum(step.startswith("issue ") for step in steps[issued + 1:w]) >= n:
                return True
    return False


def _step_problem(steps):
    """The first property of the schedule that the sm_90a consumer loop breaks, as a message; None if none."""
    needed = ["issue Sᵀ", "issue dPᵀ", "issue dV", "issue dQ", "issue dK", "exp2", "read dPᵀ", "store dSᵀ",
              "store dQ", "reduce-add dQ"]
    missing = [step for step in needed if step not in steps]
    if missing:
        return f"the step has no {', '.join(missing)}: every piece of the step must run once"
    at = {step: steps.index(step) for step in needed}
    waits = [i for i, step in enumerate(steps) if step.startswith("wait(")]
    barriers = [i for i, step in enumerate(steps) if step == "barrier"]

    def between(first, last, kind):
        return [i for i in (waits if kind == "wait" else barriers) if first < i < last]

    if between(min(at["issue Sᵀ"], at["issue dPᵀ"]), max(at["issue Sᵀ"], at["issue dPᵀ"]), "wait"):
        return ("a wait sits between the issues of Sᵀ and dPᵀ: dPᵀ starts only after Sᵀ is done and nothing "
                "overlaps. Issue both, then wait")
    if not _done(steps, "issue Sᵀ", at["exp2"]):
        return (f"the exponentials read Sᵀ while its wgmma batch may still be running {_RACE}: "
                + ("dPᵀ was issued first, so wait(1) leaves Sᵀ running. Issue Sᵀ first" if at["issue dPᵀ"] <
                   at["issue Sᵀ"] else "wait(1) before probabilities"))
    if _done(steps, "issue dPᵀ", at["exp2"]):
        return ("the exponentials wait for dPᵀ too (wait(0) before them): they no longer overlap it. wait(1) "
                "retires Sᵀ and leaves dPᵀ running")
    if not _done(steps, "issue dPᵀ", at["read dPᵀ"]):
        return f"dSᵀ reads dPᵀ while its batch may still be running {_RACE}: wait(0) before form_ds"
    if at["store dSᵀ"] > at["issue dQ"] and not _done(steps, "issue dQ", at["store dSᵀ"]):
        return (f"dSᵀ is stored into dST_s while the dQ wgmma that reads it may still be running {_RACE}: an operand "
                "of an asynchronous matmul is written before the wait that retires it. Store dSᵀ, barrier, then "
                "issue dQ")
    if not between(at["store dSᵀ"], at["issue dQ"], "barrier"):
        return ("no barrier between the store of dSᵀ and the dQ issue: dQ = dS K reads all of dST_s, half of it "
                f"written by the other consumer warpgroup, which may not have stored it yet {_RACE}. Store, "
                "barrier(DS_BARRIER), then issue dQ")
    issues = sorted(at[f"issue {x}"] for x in ("dV", "dQ", "dK"))
    if between(issues[0], issues[-1], "wait"):
        return ("a wait sits between the issues of dV, dQ and dK: the later ones start only after it and the "
                "batches no longer overlap. Issue all three, then wait")
    if not _done(steps, "issue dQ", at["store dQ"]):
        return (f"dQ is stored to shared memory while its batch may still be running {_RACE}: "
                + ("dK was issued before it, so dQ is the newest batch and wait(1) leaves it running; issue dQ "
                   "before dK" if at["issue dK"] <
                   at["issue dQ"] else "wait(1) before T.copy(dq, dq_s)"))
    if _done(steps, "issue dK", at["store dQ"]):
        return ("the store of dQ waits for dK too (wait(0) before it): dQ's trip through shared memory no longer "
                "runs under dK. wait(1) retires dQ and leaves dK running")
    if not between(at["store dQ"], at["reduce-add dQ"], "barrier"):
        return ("no barrier between the store of dQ and the reduce-add: the copy engine reads all of dq_s, half of "
                f"it the other consumer's, which may not be there yet {_RACE}. Store, barrier(DQ_BARRIER), "
                "then add_dq")
    if not any(step == "bulk wait" for step in steps[at["reduce-add dQ"]:]) and \
            not any(step == "bulk wait" for step in steps[:at["store dQ"]]):
        return ("nothing waits for the copy engine's reduce-add of dq_s before the next step stores into dq_s again: "
                f"the bulk copy may still be reading it {_RACE}")
    last_issue = max(i for i, step in enumerate(steps) if step.startswith("issue "))
    if not any(steps[w] == "wait(0)" for w in waits if w > last_issue):
        return ("no wait(0) after the last issue: the next step clears Pᵀ and dPᵀ and overwrites the Pᵀ and dSᵀ "
                f"copies that dV and dK may still be reading {_RACE}")
    if not any(step == "release a stage" and i > max(waits) for i, step in enumerate(steps)):
        return ("the Q/dO stage is released before the last wait: TileLang frees a stage after the last statement "
                "that reads it, here an issue, so TMA may overwrite Q or dO while a wgmma still reads them. Read "
                "Q_s and dO_s after wait(0) (stage_in_use[0] = Q_s[0, 0] + dO_s[0, 0])")
    return None


def check_backward_step(factory):
    """Run the learner's ``key_block_backward`` (its ``backward_step``) on the C backend against float64,
    then lower it for sm_90a (with chapter 08's ``PASS_CONFIGS``: the learner's barriers are the only ones,
    TileLang adds none) and check the schedule property by property on the generated consumer loop."""
    import contextlib
    import io

    from ..kernels.flash_bwd_hopper import PASS_CONFIGS

    name = "backward step"

    def run():
        with contextlib.redirect_stdout(io.StringIO()):
            check_kernel(name, factory, _step_case, suspects=_STEP_SUSPECTS,
                         hint="Hint: probabilities before form_ds; dV takes Pᵀ (PT_cast), dK takes dSᵀ (dST); dQ "
                              "reads dSᵀ from dST_s, so store it before issuing dQ; add_dq reads dq_s.")
        source = lowered_source(name, factory, _STEP_GPU_SHAPE, pass_configs=PASS_CONFIGS)
        steps = loop_steps(source, r"for \(int qb_1 = ", _STEP_LABELS)
        problem = _step_problem(steps)
        shown = " → ".join(step for step in steps if step != "release a stage")
        if problem:
            raise ExerciseWrong(f"✗ {name}: right on the CPU, but in the sm_90a code ({shown}) {problem}.")
        compiled = ptxas_verdict(name, source)
        print(f"✓ {name}: dQ, dK, dV right on the C backend; sm_90a consumer loop: {shown}; {compiled}")

    surfacing_warnings(run, c_lowering(factory, 2, 64, 16, block_M=16, block_N=32, dtype="float32"))
