"""Checkers for chapter 03: which K/V blocks a query block visits, the FLOPs the kernel executes, and
the forward's key-tile loop written in TileLang (run on the C backend, bugs named by ``kernels``)."""

import math

import torch

from ..core.reference import attention_reference
from ..kernels.flash_pieces import LOG2E
from ..pictures.diagrams import SKIPPED, tile_classes
from .common import ExerciseWrong, check_exercise, needs
from .kernels import KernelCase, Suspect, check_kernel, learner_or_course, nearest_variant, same_outputs
from .shapes import HEAD_KINDS, attention_inputs, draw_shapes

__all__ = ["check_kv_blocks_visited", "check_kernel_flops", "check_flash_forward", "check_my_flash_forward",
           "forward_gpu_config", "forward_or_course", "needs"]

# (q_block, block_M, block_N, seq, causal): multiples and non-multiples of the blocks, one block,
# a sequence shorter than one block, block_M != block_N both ways.
_VISIT_CASES = [
    (0, 16, 16, 64, False), (3, 16, 16, 64, False), (2, 16, 16, 56, False),
    (0, 16, 16, 64, True), (1, 16, 16, 64, True), (3, 16, 16, 56, True), (0, 16, 16, 7, True),
    (0, 128, 64, 512, True), (3, 128, 64, 512, True), (1, 64, 128, 512, True), (2, 64, 128, 512, True),
    (4, 64, 128, 300, True), (2, 128, 128, 300, False),
]

_FLOP_CASES = [
    (1, 1, 64, 16, 16, 16, False), (1, 1, 64, 16, 16, 16, True), (2, 3, 56, 32, 16, 16, True),
    (4, 16, 4096, 128, 128, 128, True), (1, 16, 16384, 128, 128, 128, True),
    (2, 8, 1000, 64, 128, 64, True), (2, 8, 1000, 64, 64, 128, False),
]


def _drawn_visit_cases():
    """Every query block of self-attention shapes whose causal stops (q_block+1)·block_M meet every residue
    modulo block_N, with block_M < block_N and block_M > block_N, tiles that are not multiples of each other,
    one row, S below one block and ragged S (pure Python: hundreds of cases cost nothing)."""
    cases = []
    for block_M, block_N in ((3, 4), (6, 4), (4, 3), (4, 6), (16, 64), (64, 16)):
        for seq in sorted({1, max(1, block_M - 1), 2 * block_N + 1, 4 * block_M + block_N - 1}):
            for q_block in range(-(-seq // block_M)):
                cases += [(q_block, block_M, block_N, seq, True), (q_block, block_M, block_N, seq, False)]
    return cases


def _visited(q_block, block_M, block_N, seq, causal):
    row = tile_classes(seq, seq, block_M, block_N, causal=causal)[q_block]
    kbs = [kb for kb, c in enumerate(row) if c != SKIPPED]
    return kbs[0], kbs[-1] + 1


def _as_pair(result):
    if isinstance(result, range):
        if result.step != 1:
            raise ExerciseWrong(f"return consecutive key blocks (step 1); got {result}")
        return (result.start, result.stop)
    return tuple(int(x) for x in result)


def check_kv_blocks_visited(fn):
    """``fn(q_block, block_M, block_N, seq, causal)`` must return (first, stop) of the visited key blocks."""
    check_exercise(
        "kv_blocks_visited", lambda *a: torch.tensor(_as_pair(fn(*a))),
        lambda *a: torch.tensor(_visited(*a)), _VISIT_CASES + _drawn_visit_cases(), atol=0, rtol=0,
        hint="Which key does the query block's last row see last, and which key block holds it? The stop is the "
             "block after that one, and never past the last key block (hint(\"03\", \"a\", 1) says more).")


def _kernel_flops(batch, heads, seq, dim, block_M, block_N, causal):
    classes = tile_classes(seq, seq, block_M, block_N, causal=causal)
    return 4.0 * batch * heads * int((classes != SKIPPED).sum()) * block_M * block_N * dim


def check_kernel_flops(fn):
    """``fn(batch, heads, seq, dim, block_M, block_N, causal)`` must return the FLOPs of the two
    matmuls the kernel executes (whole tiles, masked parts included)."""
    check_exercise(
        "kernel_flops", lambda *a: torch.tensor(float(fn(*a)), dtype=torch.float64),
        lambda *a: torch.tensor(_kernel_flops(*a), dtype=torch.float64), _FLOP_CASES, atol=0, rtol=1e-12,
        hint="What does one visited tile cost, masked parts included, and how many tiles does each query block "
             "visit? (hint(\"03\", \"b\", 1) says more.)")


# --- Exercise (c): the forward's key-tile loop and epilogue, in TileLang ---------------------------

def _forward_case(label, batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, seed, logit_scale=(1.0,),
                  kinds=None):
    """Inputs (float32; head h of Q multiplied by logit_scale[h], or of kind ``kinds[h]`` as in
    ``shapes.attention_inputs``) and the float64 reference."""
    if kinds is not None:
        q, k, v = attention_inputs(batch, heads, seq_q, seq_k, dim, seed=seed, kinds=kinds)
    else:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(batch, heads, seq_q, dim, generator=g)
        q *= torch.tensor(logit_scale + (1.0,) * (heads - len(logit_scale)))[None, :, None, None]
        k, v = (torch.randn(batch, heads, seq_k, dim, generator=g) for _ in range(2))
    out, lse = attention_reference(q.double(), k.double(), v.double(), causal=causal, return_lse=True)
    kwargs = dict(causal=causal, block_M=block_M, block_N=block_N)

    def run(kernel):
        o, l = kernel(q, k, v)
        return {"O": o, "LSE": l}

    return KernelCase(label, (batch, heads, seq_q, seq_k, dim), kwargs, [3, 4], run,
                      {"O": out, "LSE": lse.double()}, data=dict(q=q, k=k, v=v, **kwargs), rows="query row")


_HEADS = "head 0 plain, 1 every score very negative, 2 large logits, 3 every score very large"


def drawn_forward_cases(seed=31, dim=16):
    """The forward's cases, drawn by ``shapes.draw_shapes``: causal shapes whose stops ⌈((qb+1)·block_M +
    past) / block_N⌉ meet every residue modulo block_N with block_M < block_N and block_M > block_N, rows that
    see no key, ragged S, then a non-causal shape below one block and a causal one of one row and one key;
    each with a head of every kind (plain, every score very negative, large, every score very large)."""
    return [_forward_case(f"{shape.label()}, {_HEADS}", 1, len(HEAD_KINDS), shape.seq_q, shape.seq_k, dim,
                          causal=shape.causal, block_M=shape.block_M, block_N=shape.block_N, seed=seed + i,
                          kinds=HEAD_KINDS)
            for i, shape in enumerate(draw_shapes("keys", seed=seed))]


def _forward_cases():
    """The cases of ``check_flash_forward``: ``drawn_forward_cases``, most revealing first."""
    return drawn_forward_cases(seed=31)


def _causal_stop(qb, block_M, block_N, past, bugs=()):
    """The key block a causal query block stops before, ⌈((qb+1)·block_M + past) / block_N⌉, or a known wrong
    version of it."""
    end = (qb + 1) * block_M + past
    if "stop one short at a block edge" in bugs:
        return -(-(end - 1) // block_N)
    if "stop rounded down" in bugs:
        return end // block_N
    if "stop split" in bugs:  # the query block's own tiles, then the offset's
        return (qb + 1) * block_M // block_N + -(-past // block_N)
    return -(-end // block_N)


def _simulate_forward(q, k, v, *, causal, block_M, block_N, bugs=(), dtype=torch.float64):
    """The exercise's kernel in PyTorch (float64, or float32 for a bug that overflows in the kernel), tile
    by tile, with some of the known bugs switched on."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, heads, seq_q, dim = q.shape
    seq_k = k.shape[2]
    sm_scale = 1.0 if "no sm_scale" in bugs else 1 / math.sqrt(dim)
    c = sm_scale * LOG2E
    c_step = sm_scale if "no log2e" in bugs else c
    past = seq_k - seq_q
    n_k = -(-seq_k // block_N)
    kp, vp = (torch.zeros(batch, heads, n_k * block_N, dim, dtype=dtype) for _ in range(2))
    kp[:, :, :seq_k], vp[:, :, :seq_k] = k, v
    out = torch.zeros_like(q)
    lse = torch.zeros(batch, heads, seq_q, dtype=dtype)
    inf = torch.tensor(-math.inf, dtype=dtype)
    for qb in range(-(-seq_q // block_M)):
        rows = torch.arange(qb * block_M, min((qb + 1) * block_M, seq_q))
        m = torch.full((batch, heads, len(rows)), 0.0 if "max from 0" in bugs else -math.inf, dtype=dtype)
        l, acc = torch.zeros_like(m), torch.zeros(batch, heads, len(rows), dim, dtype=dtype)
        stop = min(n_k, _causal_stop(qb, block_M, block_N, past, bugs)) if causal else n_k
        for kb in range(max(stop, 0)):
            keys = torch.arange(kb * block_N, (kb + 1) * block_N)
            k_tile = kp[:, :, keys]
            s = q[:, :, rows] @ (k_tile if "K not transposed" in bugs else k_tile.transpose(-1, -2))
            diag = rows[:, None] if "top-left" in bugs else rows[:, None] + past
            causal_ok = keys[None, :] < diag if "causal strict" in bugs else keys[None, :] <= diag
            if "causal one late" in bugs:
                causal_ok = keys[None, :] <= diag + 1
            in_bounds = torch.ones_like(causal_ok) if "no bounds" in bugs else keys[None, :] < seq_k
            visible = in_bounds & causal_ok if causal else in_bounds
            s = torch.where(visible, s, torch.zeros(()) if "mask zero" in bugs else inf)
            m_prev = m
            m = s.amax(-1) if "max reset" in bugs else torch.maximum(m_prev, s.amax(-1))
            shift = m * c_step if "no guard" in bugs else torch.where(m == -math.inf, 0.0, m * c_step)
            if "no max" in bugs:  # e^S summed as it comes, nothing subtracted
                m_prev, shift = torch.zeros_like(m), torch.zeros_like(m)
            alpha = torch.exp2(m_prev * c_step - shift)
            p = torch.exp2(s * c_step - shift[..., None])
            l = l + p.sum(-1) if "l not rescaled" in bugs else l * alpha + p.sum(-1)
            v_tile = vp[:, :, keys].transpose(-1, -2) if "V transposed" in bugs else vp[:, :, keys]
            acc = (acc if "acc not rescaled" in bugs else acc * alpha[..., None]) + p @ v_tile
        shift = torch.zeros_like(m) if "no max" in bugs else torch.where(m == -math.inf, 0.0, m * c)
        log_l = shift + torch.log2(l)
        lse[:, :, rows] = torch.where(l > 0, log_l if "lse base 2" in bugs else log_l / LOG2E, inf)
        out[:, :, rows] = acc / l[..., None] if "no div guard" in bugs else \
            torch.where(l[..., None] > 0, acc / l[..., None], 0.0)
    return {"O": out, "LSE": lse}


def _like(*bugs):
    """Whether the learner's outputs are the tile-by-tile model's with ``bugs``, in float64 or, where the bug
    overflows or underflows in the kernel, in float32."""
    def test(case, got, kernel):
        d = case.data
        return any(same_outputs(got, _simulate_forward(d["q"], d["k"], d["v"], causal=d["causal"],
                                                       block_M=d["block_M"], block_N=d["block_N"], bugs=bugs,
                                                       dtype=dtype))
                   for dtype in (torch.float64, torch.float32))
    return test


def _like_base2_softmax(case, got, kernel):
    d = case.data
    o = attention_reference(d["q"].double(), d["k"].double(), d["v"].double(), causal=d["causal"],
                            sm_scale=1 / (math.sqrt(d["q"].shape[-1]) * LOG2E))
    return same_outputs({"O": got["O"]}, {"O": o})


_FORWARD_SUSPECTS = [
    Suspect("NaN where a row has seen no key yet: m = −∞ there, and S·scale_log2 − m·scale_log2 is −∞ − (−∞). "
            "Guard the shift: shift = 0 while m = −∞ (T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)).",
            _like("no guard")),
    Suspect("rows that see no key have ℓ = 0, and acc_o / ℓ is 0/0 = NaN: divide only where ℓ > 0 and "
            "leave the other rows at 0 (their LSE is −∞).", _like("no div guard")),
    Suspect("the running max is reset at every key tile: T.reduce_max clears m first unless clear=False. "
            "After a tile in which a row sees no key, m = −∞, and the next α wipes what the row had "
            "gathered. Write T.reduce_max(S, m, dim=1, clear=False).", _like("max reset")),
    Suspect("acc_o is not rescaled: multiply it by α = exp2(m_prev·scale_log2 − shift) before adding this "
            "tile's P V, exactly as ℓ is.", _like("acc not rescaled")),
    Suspect("ℓ is not rescaled: ℓ = ℓ·α + rowsum(P), with α = exp2(m_prev·scale_log2 − shift).",
            _like("l not rescaled")),
    Suspect("log2(e) is missing: exp2(x·sm_scale) is 2^(x/√D), not e^(x/√D). Use scale_log2 = "
            "sm_scale·log2(e) in every exp2 and in the shift.",
            lambda case, got, kernel: _like("no log2e")(case, got, kernel) or _like_base2_softmax(case, got, kernel)),
    Suspect("the causal mask is off by one: query q sees key k when k <= q + (S_k − S_q), its own "
            "position included (you used <).", _like("causal strict")),
    Suspect("the causal diagonal is aligned top-left: with S_q ≠ S_k, query q sees key k iff "
            "k <= q + (S_k − S_q) (bottom-right, as course_utils.core.reference does).", _like("top-left")),
    Suspect("keys past the end of K are not masked: the last key tile holds zero-padded positions "
            "k >= S_k, which every row must skip (k < seq_k), causal or not.", _like("no bounds")),
    Suspect("masked scores were set to 0, not −∞: exp2(0 − shift) still gives those keys weight. "
            "Select −∞ (neg_inf) where a key is not visible.", _like("mask zero")),
    Suspect("the LSE is in base 2: shift + log2(ℓ) is log2 of the denominator; divide it by log2(e) "
            "for the natural-log LSE.", _like("lse base 2")),
]


def check_flash_forward(factory):
    """Check the learner's forward (``factory(batch, heads, seq_q, seq_k, dim, *, causal, block_M,
    block_N, target)`` returning a prim_func with outputs O and LSE) on the C backend."""
    check_kernel(
        "flash forward", factory, _forward_cases, suspects=_FORWARD_SUSPECTS + _BOUND_SUSPECTS[3:],
        hint="Compare your loop body with section 3: scores by selection after T.gemm, clear=False, the "
             "shift guard, α on both ℓ and acc_o, one division at the end, and the LSE in natural log.",
        summary="the causal stop at every residue of the tile, block_M ≶ block_N, rows that see no key, ragged S, "
                "scores all very negative or very large", gpu=forward_gpu_config(),
        learner=("forward_tile_macros",))



# --- Exercise (d): the whole forward kernel, from an empty body -----------------------------------

def _full_forward_cases():
    """Drawn cases (``drawn_forward_cases``), most revealing first (the checker stops at the first wrong one)."""
    return drawn_forward_cases(seed=41)


# A GPU-sized configuration, lowered for sm_80 and sm_90a on the CPU by the checkers.
def forward_gpu_config(causal=True):
    """Small enough to lower in seconds, large enough for the tensor-core gemm layouts of a real tiling."""
    return (1, 1, 64, 64, 32), dict(causal=causal, block_M=32, block_N=32)


def _course_forward(batch, heads, seq_q, seq_k, dim, *, causal=False, block_M=32, block_N=8, target=None):
    """The course's answer to exercise (d) (its solution cells), the stand-in for an unfinished forward: the same
    factory as the learner's, so whatever a later cell does with theirs (lower it for sm_90a, time it) works."""
    from .help import _load, solution_cells

    if "factory" not in _COURSE_FORWARD:
        _COURSE_FORWARD["factory"] = _load(solution_cells("03", "d"), "my_flash_forward", "the course's 03 (d)")
    return _COURSE_FORWARD["factory"](batch, heads, seq_q, seq_k, dim, causal=causal, block_M=block_M,
                                      block_N=block_N, target=target)


_COURSE_FORWARD = {}


def forward_or_course(my_flash_forward):
    """The learner's forward of exercise (d) if it builds, else the course's (saying so in one line)."""
    args, kwargs = forward_gpu_config()
    return learner_or_course("my_flash_forward", my_flash_forward, _course_forward,
                             lambda f: f(*args, **kwargs, target="c"), "exercise 03 (d)")


_NEAREST_FORWARD = (
    ("the softmax scale 1/√D is missing", ("no sm_scale",)),
    ("exp2 is used without log2(e) (a natural-log softmax computed in base 2)", ("no log2e",)),
    ("the causal mask is one key too strict (k < q + past)", ("causal strict",)),
    ("the causal mask lets one key too many through (k <= q + past + 1)", ("causal one late",)),
    ("K is not transposed in S = Q Kᵀ (T.gemm needs transpose_B=True)", ("K not transposed",)),
    ("V is transposed in acc_o += P V", ("V transposed",)),
    ("the running max is not carried from tile to tile", ("max reset",)),
)


def _nearest_forward(case, got):
    d = case.data
    variants = {}
    for what, bugs in _NEAREST_FORWARD:
        try:
            variants[what] = _simulate_forward(d["q"], d["k"], d["v"], causal=d["causal"], block_M=d["block_M"],
                                               block_N=d["block_N"], bugs=bugs)
        except RuntimeError:  # a transposed tile only multiplies when block_N == D
            continue
    return nearest_variant(got, variants, case.expected, outputs=("O", "LSE"))


# The causal stop and the running max's start: wrong only on shapes or scores a fixed list of cases may never draw.
_BOUND_SUSPECTS = [
    Suspect("the causal stop is one key block short when the last row's diagonal key is the first key of a block "
            "((qb+1)·block_M + past ≡ 1 mod block_N): that row sees keys up to (qb+1)·block_M − 1 + past, so the stop "
            "is T.ceildiv((qb + 1) * block_M + past, block_N), with no − 1.", _like("stop one short at a block edge")),
    Suspect("the causal stop is rounded down: a key block the last row sees only in part still has to be visited. "
            "Use T.ceildiv((qb + 1) * block_M + past, block_N).", _like("stop rounded down")),
    Suspect("the causal stop adds the query block's key blocks and the offset's separately: "
            "⌈(a + past)/block_N⌉ is not a/block_N + ⌈past/block_N⌉ when block_M is not a multiple of block_N "
            "(here block_M < block_N). One ceiling division: T.ceildiv((qb + 1) * block_M + past, block_N).",
            _like("stop split")),
    Suspect("the running max starts at 0, not −∞: in a row whose every score is very negative (about −700 here), "
            "exp2((S − 0)·scale_log2) underflows to 0, ℓ = 0 and the row is lost. Start m at −∞ "
            "(T.fill(m, neg_inf)), so that the max is the row's own.", _like("max from 0")),
    Suspect("nothing is subtracted before the exponential: in a row whose every score is very large (about +700 "
            "here), exp2(S·scale_log2) overflows to ∞. Subtract the running max (the shift) in every exp2.",
            _like("no max")),
]

_FULL_FORWARD_SUSPECTS = [
    Suspect("NaN where a row has seen no key yet: m = −∞ there, and S·scale_log2 − m·scale_log2 is −∞ − (−∞). "
            "Guard the shift: shift = 0 while m = −∞ (T.if_then_else(m[i] == neg_inf, 0, m[i] * scale_log2)).",
            _like("no guard")),
    Suspect("K is not transposed in S = Q Kᵀ: K_s is [block_N, D], so write T.gemm(Q_s, K_s, S, transpose_B=True).",
            _like("K not transposed")),
    Suspect("V is transposed in acc_o += P V: V_s is [block_N, D] and P is [block_M, block_N]: T.gemm(P, V_s, acc_o).",
            _like("V transposed")),
    Suspect("the softmax scale 1/√D is missing: scale_log2 = LOG2E / √D multiplies every score in the exponent.",
            _like("no sm_scale")),
] + _FORWARD_SUSPECTS + _BOUND_SUSPECTS


def check_my_flash_forward(factory):
    """Check the learner's whole forward kernel, ``factory(batch, heads, seq_q, seq_k, dim, *, causal,
    block_M, block_N, target)`` returning a prim_func Q, K, V -> O, LSE: on the C backend over
    property-named cases, then lowered for sm_80 and sm_90a."""
    check_kernel(
        "your flash forward", factory, _full_forward_cases, suspects=_FULL_FORWARD_SUSPECTS, nearest=_nearest_forward,
        hint="Go through the kernel in order: Q copy and initial state (acc_o = 0, ℓ = 0, m = −∞), the causal "
             "stop, the K/V copies, S = Q Kᵀ, the mask by selection, the online softmax with its guard, α on ℓ "
             "and acc_o, P V, then the guarded division and the natural-log LSE.",
        summary="the causal stop at every residue of the tile, block_M ≶ block_N, rows that see no key, ragged S, "
                "S below a block, one row and one key, scores all very negative or very large",
        gpu=forward_gpu_config(), learner=("my_softmax_step",))


HINTS = {
    "a": ["Non-causal: every key block. Causal: the last row of query block q_block is (q_block+1)·block_M − 1; "
          "it sees keys up to that index, so stop after the key block holding it, never past the last block.",
          "Python's // rounds down; a ceiling division is -(-a // b). Count the key blocks with one, find the key "
          "block that holds the last row's diagonal with another, and keep the stop within the key blocks with min."],
    "b": ["Every visited tile costs two matrix products of block_M × block_N × dim, each 2·M·N·K FLOPs, "
          "masked parts included. Count the visited tiles over all query blocks.",
          "Call your kv_blocks_visited for every query block (their number is a ceiling division, walked with range) "
          "and add up the visited tiles; then multiply by the FLOPs of one tile for every batch entry and head."],
    "c": ["tile_step: scores, mask by selection, running max without reset, guarded shift, α, probabilities, "
          "ℓ and acc_o rescaled by α, then P·V. epilogue: shift again, LSE in natural log, one guarded "
          "division.",
          "The TileLang calls, in the order the step needs them: T.clear and T.gemm (transpose_B for Kᵀ) for the "
          "scores; T.if_then_else inside tb.parallel for the mask; T.reduce_max, whose clear= decides whether the max"
          " carries over; T.exp2 with scale_log2 and the guarded shift; T.reduce_sum for the row sums; T.copy into "
          "the shared P before the second T.gemm. The epilogue's T.log2 is base 2: LOG2E converts it back."],
    "d": ["It is exercise (c)'s two macros inside (c)'s skeleton: allocate the tiles, copy Q once, start acc_o and ℓ "
          "at 0 and m at −∞; loop over the key blocks up to the causal stop ⌈((qb+1)·block_M + past) / block_N⌉; "
          "in the loop copy K and V, then (c)'s tile step; after it, (c)'s epilogue and the two stores.",
          "tb.shared for the T.gemm operands (Q, K, V and P: on the GPU a float32 register tile cannot be one), "
          "tb.fragment for S, acc_o and the per-row statistics; T.copy between a slice of a global tensor and a tile;"
          " T.fill for the starting values; T.Pipelined(stop, num_stages=1) for the key loop, with T.min and "
          "T.ceildiv for the stop."],
}
