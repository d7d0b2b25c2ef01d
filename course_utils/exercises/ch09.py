"""Checkers for chapter 09 (packed variable-length batches and decoding with a KV cache).

Each checker runs the learner's function through ``check_exercise``; when the answer is wrong it
compares it with the usual mistakes (a missing leading 0, lengths instead of prefix sums, the sink
left out, the sink given a value row, weights that do not share one maximum) and says which one it
looks like. The two kernel checkers run the learner's TileLang merge kernel and paged-cache lookup
on the C backend against float64 references, and name the bug by comparing with PyTorch models of
the usual mistakes (weights not divided by the total, no max subtracted, the max not carried, the max
started at 0, the max over only some splits, no guard for a row no split saw; the wrong page, the block
table skipped, the last partial tile dropped, every tile read from its page's start). Both draw their
inputs from ``shapes``: the merge one row per class of ``merge_row_classes`` (the largest LSE in the first,
a middle and the last split, the first and the last split empty, LSEs all past 88 and all below −104), the
lookup its lengths at the residues of the tile and the page (``draw_residue_lengths``).
"""

import math

import torch

from ..kernels.softmax import merge_attention_states
from .common import ExerciseWrong, check_exercise, with_diagnosis
from .kernels import KernelCase, Suspect, check_kernel, same_outputs
from .late_tools import c_lowering, surfacing_warnings
from .shapes import describe_merge_rows, draw_merge_rows, draw_residue_lengths

__all__ = ["check_pack", "check_merge_with_sink", "check_merge_kernel", "check_paged_scores", "HINTS"]

HINTS = {
    "a": ["Sequence b's real tokens are the first lengths[b] rows of padded[b]; cu_seqlens[b] is where "
          "sequence b starts in the packed tensor, so it starts at 0 and ends at the total.",
          "Slicing padded[b, :n] keeps a sequence's real tokens and torch.cat joins them; torch.cumsum gives the "
          "running ends, so put a 0 in front (torch.cat again, or F.pad); the checker expects torch.int32 (.to)."],
    "b": ["The sink is one more partial state: its LSE is the sink logit, its O is 0 (no value row). "
          "Merge all states with weights e^{LSE_s − LSE}, where LSE is over every state, sink included.",
          "Treat the sink as one more state: torch.cat it onto the LSEs, torch.logsumexp gives the total over every "
          "state, torch.exp of each LSE minus the total its weight; weigh the O's (a [..., None] broadcast) and sum "
          "over the states."],
    "c": ["LSE = m + log Σ_s e^{LSE_s − m}, with m the largest LSE_s (so nothing overflows), and "
          "O = Σ_s e^{LSE_s − LSE} · O_s. A row no split saw has every LSE_s = −∞: take m = 0 there, "
          "and give it O = 0 and LSE = −∞.",
          "Scalars live in shift[0] and l[0]; loop over splits with T.serial(splits), over D with tb.parallel(dim); "
          "T.max, T.exp, T.log and T.if_then_else(cond, a, b) build the expressions; T.clear(acc) before summing into"
          " acc."],
    "d": ["Key position p of sequence b sits in logical page p // page_size, at row p % page_size of it; "
          "the block table turns the logical page into the physical one. A tile of block_N keys lies "
          "inside one page. The last page is usually partial: it still needs its tile.",
          "num_key_tiles is a ceiling division (T.ceildiv). load_key_tile reads the physical page from BlockTable[b, "
          "logical page] (integer division of the tile's first key by page_size), the tile's first row in that page "
          "with %, and T.copy's the block_N rows from Pages."],
}


# --- Exercise (a): pack a padded batch ---------------------------------------------------------------

def _pack_cases():
    g = torch.Generator().manual_seed(9)
    cases = []
    for lengths in ([3, 1, 4], [5, 0, 2, 5], [1]):
        padded = torch.randn(len(lengths), max(lengths), 2, 4, generator=g, dtype=torch.float64)
        cases.append((padded, torch.tensor(lengths)))
    return cases


def _reference_pack(padded, lengths):
    packed = torch.cat([padded[b, :n] for b, n in enumerate(lengths.tolist())])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return packed, cu


def check_pack(pack):
    """``pack(padded [B, S_max, H, D], lengths [B]) -> (packed [total, H, D], cu_seqlens int32 [B + 1])``."""
    cases = _pack_cases()

    def part(index):
        return lambda *args: pack(*args)[index]

    def run():
        check_exercise("pack (packed tokens)", part(0), lambda *a: _reference_pack(*a)[0], cases)
        check_exercise("pack (cu_seqlens)", part(1), lambda *a: _reference_pack(*a)[1], cases, atol=0, rtol=0)
        for args in cases:
            if pack(*args)[1].dtype != torch.int32:
                raise ExerciseWrong("pack: cu_seqlens must be int32, as flash_attention_varlen requires "
                                    "(.to(torch.int32)).")

    padded, lengths = cases[1]
    with_diagnosis(run, [
        ("cu_seqlens starts with 0: sequence b occupies rows cu_seqlens[b] … cu_seqlens[b+1] − 1, so it has B + 1 "
         "entries.", lambda: pack(padded, lengths)[1].tolist() == torch.cumsum(lengths, 0).tolist()),
        ("cu_seqlens holds prefix sums of the lengths, not the lengths themselves.",
         lambda: pack(padded, lengths)[1].tolist()[1:] == lengths.tolist()),
        ("keep only the first lengths[b] tokens of each row: the rest is padding.",
         lambda: pack(padded, lengths)[0].shape[0] == padded.shape[0] * padded.shape[1]),
    ])


# --- Exercise (b): merge split-KV partial states, with a sink -------------------------------------

def _merge_cases():
    g = torch.Generator().manual_seed(10)
    cases = []
    for splits, rows, dim, empty in ((2, 3, 4, False), (5, 4, 8, True), (1, 2, 4, False)):
        o = torch.randn(splits, rows, dim, generator=g, dtype=torch.float64)
        lse = torch.randn(splits, rows, generator=g, dtype=torch.float64) * 5
        if empty:  # a split that saw no key for these rows
            lse[1, :2] = float("-inf")
            o[1, :2] = 0
        sink = torch.randn(rows, generator=g, dtype=torch.float64)
        cases.append((o, lse, sink))
    return cases


def _reference_merge(o, lse, sink):
    o_all = torch.cat([o, torch.zeros_like(o[:1])])
    lse_all = torch.cat([lse, sink[None]])
    return merge_attention_states(o_all, lse_all, dim=0)


def check_merge_with_sink(merge):
    """``merge(o [splits, rows, D], lse [splits, rows], sink [rows]) -> (O [rows, D], LSE [rows])``."""
    cases = _merge_cases()
    o, lse, sink = cases[0]

    def run():
        check_exercise("merge_with_sink (O)", lambda *a: merge(*a)[0], lambda *a: _reference_merge(*a)[0], cases)
        check_exercise("merge_with_sink (LSE)", lambda *a: merge(*a)[1], lambda *a: _reference_merge(*a)[1], cases)

    without_sink = merge_attention_states(o, lse, dim=0)
    with_diagnosis(run, [
        ("the sink is missing: it is one more state, with LSE = its logit and O = 0 (it has no value row).",
         lambda: torch.allclose(merge(o, lse, sink)[0], without_sink[0])),
        ("the sink's state has O = 0, not O = 1: it joins the denominator but adds nothing to the output.",
         lambda: torch.allclose(merge(o, lse, sink)[0],
                                merge_attention_states(torch.cat([o, torch.ones_like(o[:1])]),
                                                       torch.cat([lse, sink[None]]), dim=0)[0])),
        ("each state's weight is e^{LSE_s − LSE} with the LSE over all states (sink included), not a plain "
         "average of the O_s.", lambda: torch.allclose(merge(o, lse, sink)[0], o.mean(dim=0))),
    ])


# --- Exercise (c): the split-KV merge kernel, in TileLang --------------------------------------------

def _merge_kernel_reference(o_part, lse_part):
    """Float64 O [rows, D] and LSE [rows] of merged states o_part [rows, splits, D], lse_part [rows, splits]."""
    lse = torch.logsumexp(lse_part.double(), dim=1)
    weight = torch.where(torch.isfinite(lse)[:, None], torch.exp(lse_part.double() - lse[:, None]), 0.0)
    return (weight[..., None] * o_part.double()).sum(dim=1), lse


def _merge_model(o_part, lse_part, *, shift="max", normalise=True, guard=True):
    """The merge in float32 as the kernel computes it, with one bug: ``shift`` "max", "none" (e^{LSE_s}
    taken as is), "last" (the max not carried: the last split's LSE), "floored" (the running max started at
    0, not −∞), or a tuple of the splits the max is taken over (a loop that misses some); weights not divided
    by the total (``normalise=False``); no guard for a row no split saw (``guard=False``: the weights are
    e^{−∞ − (−∞)} there)."""
    lse_part, o_part = lse_part.float(), o_part.float()
    if shift == "max":
        m = lse_part.max(dim=1).values
    elif shift == "last":
        m = lse_part[:, -1]
    elif shift == "floored":
        m = lse_part.max(dim=1).values.clamp(min=0)
    elif isinstance(shift, tuple):
        m = lse_part[:, list(shift)].max(dim=1).values
    else:
        m = torch.zeros_like(lse_part[:, 0])
    if guard:
        m = torch.where(m == -math.inf, 0.0, m)
    e = torch.exp(lse_part - m[:, None])
    l = e.sum(dim=1)  # noqa: E741
    lse = torch.where(l > 0, m + torch.log(l), -math.inf)  # NaN > 0 is false too
    weight = torch.exp(lse_part - lse[:, None]) if normalise else e
    if guard:  # without it, a row no split saw gets e^{−∞ − (−∞)} = NaN
        weight = torch.where((l > 0)[:, None], weight, 0.0)
    return {"O": (weight[..., None] * o_part).sum(dim=1), "LSE": lse}


def _merge_kernel_case(splits, dim, seed):
    """One row per class of ``shapes.merge_row_classes`` (which split holds the largest LSE, which saw no key,
    LSEs all past 88 or all below −104, a tie), then two ordinary rows."""
    lse_part, labels = draw_merge_rows(splits, seed=seed)
    rows = len(labels)
    g = torch.Generator().manual_seed(seed)
    o_part = torch.randn(rows, splits, dim, generator=g)
    o_part[lse_part == -math.inf] = 0  # a split that saw no key of the row
    out, lse = _merge_kernel_reference(o_part, lse_part)

    def run(kernel):
        got_o, got_lse = kernel(o_part, lse_part)
        return {"O": got_o, "LSE": got_lse}

    return KernelCase(f"{splits} splits (rows: {describe_merge_rows(labels)})", (rows, splits, dim), {}, [2, 3], run,
                      {"O": out, "LSE": lse}, data=dict(o_part=o_part, lse_part=lse_part))


def _merge_kernel_cases():
    """Three and five splits (a middle split exists in both; three ≠ D = 8 and five ≠ D = 16, so a loop bound
    taken from the other size shows), each with the rows of ``shapes.draw_merge_rows``."""
    return [_merge_kernel_case(3, 8, 91), _merge_kernel_case(5, 16, 92)]


def _looks_like(**bug):
    return lambda case, got, kernel: same_outputs(got, _merge_model(case.data["o_part"], case.data["lse_part"], **bug))


def _max_over_some_splits(case, got, kernel):
    """Whether the outputs are those of a max taken over only some splits: the first k, or one split alone."""
    splits = case.data["lse_part"].shape[1]
    subsets = [tuple(range(k)) for k in range(1, splits)] + [(s,) for s in range(1, splits)]
    return any(same_outputs(got, _merge_model(case.data["o_part"], case.data["lse_part"], shift=subset))
               for subset in subsets)


_MERGE_SUSPECTS = [
    Suspect("split s's weight is e^{LSE_s − m}: not divided by the total. The weights must sum to 1: "
            "use e^{LSE_s − LSE}, with LSE = m + log ℓ the merged log-sum-exp.", _looks_like(normalise=False)),
    Suspect("no maximum is subtracted: e^{LSE_s} overflows float32 once LSE_s > 88. Compute "
            "m = max_s LSE_s, sum e^{LSE_s − m}, and add m back: LSE = m + log ℓ.", _looks_like(shift="none")),
    Suspect("the maximum is not carried across the splits: m ends as the last split's LSE, not the largest "
            "(write m = T.max(m, LSE_s) in the loop), so a larger LSE_s overflows.", _looks_like(shift="last")),
    Suspect("the maximum starts at 0, not at −∞ (shift[0] = NEG_INF before the loop): in a row whose LSEs are all "
            "below −104, e^{LSE_s − 0} is 0 in float32, so ℓ = 0 and the row comes out as one that no split saw.",
            _looks_like(shift="floored")),
    Suspect("the maximum is not taken over every split: the loop reads only some of them (split 0 alone, or not "
            "the last), so a row whose largest LSE is in a split it misses overflows e^{LSE_s − m}. Take "
            "m = T.max(m, LSE_part[r, s]) for every s of T.serial(splits).", _max_over_some_splits),
    Suspect("no guard for a row that no split saw: every LSE_s = −∞, so e^{LSE_s − LSE} = e^{−∞ − (−∞)} = NaN. "
            "Such a row has ℓ = 0: give it weight 0 (O = 0) and LSE = −∞.", _looks_like(guard=False)),
]


def check_merge_kernel(merge_kernel):
    """Run the learner's ``merge_kernel(rows, splits, dim, target=...)`` on the C backend: O [rows, D]
    and LSE [rows] of the merged split states, against the float64 merge."""
    surfacing_warnings(lambda: check_kernel(
        "split-KV merge kernel", merge_kernel, _merge_kernel_cases, suspects=_MERGE_SUSPECTS,
        hint="Hint: LSE = m + log Σ_s e^{LSE_s − m} with m the largest LSE_s (0 if it is −∞), and O = Σ_s "
             "e^{LSE_s − LSE} · O_s.",
        summary="3 and 5 splits; a row no split saw, the first and the last split empty, the largest LSE first, in "
                "the middle and last by more than 88, a tie, LSEs all past 88 and all below −104"),
        c_lowering(merge_kernel, 6, 3, 8))


# --- Exercise (d): the paged-cache lookup, in TileLang ----------------------------------------------

def _paged_case(label, lengths, max_pages, page_size, block_N, dim, seed):
    """A shuffled page pool for sequences of ``lengths``; unused block-table entries point at a page of
    NaN (a never-written page), so a kernel that reads one shows it."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    used = [-(-n // page_size) for n in lengths]
    num_pages = sum(used) + 1
    order = torch.randperm(num_pages, generator=g)
    poison = int(order[-1])
    pages = torch.randn(num_pages, page_size, dim, generator=g)
    pages[poison] = math.nan
    table = torch.full((batch, max_pages), poison, dtype=torch.int32)
    position = 0
    for b, n in enumerate(used):
        table[b, :n] = order[position:position + n].to(torch.int32)
        position += n
    q = torch.randn(batch, dim, generator=g)
    lens = torch.tensor(lengths, dtype=torch.int32)
    expected = torch.full((batch, max_pages * page_size), -math.inf, dtype=torch.float64)
    for b, n in enumerate(lengths):
        for p in range(n):
            expected[b, p] = q[b].double() @ pages[table[b, p // page_size], p % page_size].double()

    def run(kernel):
        return {"S": kernel(q, pages, table, lens)}

    return KernelCase(label, (batch, max_pages, num_pages, page_size, dim, block_N), {}, [4], run, {"S": expected},
                      data=dict(q=q, pages=pages, table=table, lengths=lengths, block_N=block_N), rows="sequence")


# (page_size, block_N): two and three tiles per page, so a page or row counted for one of them alone shows.
_PAGED_CONFIGS = ((8, 4), (6, 2))


def _paged_cases():
    """Per configuration of ``_PAGED_CONFIGS``, lengths from ``shapes.draw_residue_lengths``: residues 0, 1 and
    m − 1 modulo the tile and the page (a partial last tile, a partial last page, exactly full pages), an empty
    sequence, one shorter than a tile, one past a page."""
    cases = []
    for index, (page_size, block_N) in enumerate(_PAGED_CONFIGS):
        max_pages = 4
        lengths = draw_residue_lengths((block_N, page_size), max_length=3 * page_size, seed=93 + index)
        cases.append(_paged_case(f"pages of {page_size}, tiles of {block_N}, lengths {', '.join(map(str, lengths))}",
                                 lengths, max_pages, page_size, block_N, 8, 93 + index))
    return cases


def _paged_model(case, *, page_of, row_of, tiles):
    """Scores as a kernel with one bug computes them: tile kb of sequence b read from page
    ``page_of(b, kb)`` at row ``row_of(kb)``, for ``tiles(length)`` tiles."""
    d = case.data
    q, pages, table, block_N = d["q"].double(), d["pages"].double(), d["table"], d["block_N"]
    flat = table.flatten()  # an index past a row of the table reads the next row, as the kernel does
    out = torch.full((len(d["lengths"]), table.shape[1] * pages.shape[1]), -math.inf, dtype=torch.float64)
    for b, n in enumerate(d["lengths"]):
        for kb in range(tiles(n)):
            page = page_of(flat, b, kb, table.shape[1])
            for j in range(block_N):
                p = kb * block_N + j
                if p < n:
                    out[b, p] = q[b] @ pages[page, row_of(kb) + j]
    return {"S": out}


def _paged_suspect(message, **bug):
    def test(case, got, kernel):
        page_size, block_N = case.data["pages"].shape[1], case.data["block_N"]
        model = dict(page_of=lambda flat, b, kb, width: int(flat[b * width + kb * block_N // page_size]),
                     row_of=lambda kb: kb * block_N % page_size, tiles=lambda n: -(-n // block_N))
        model.update({k: v(page_size, block_N) for k, v in bug.items()})
        return same_outputs(got, _paged_model(case, **model))
    return Suspect(message, test)


_PAGED_SUSPECTS = [
    _paged_suspect("the last, partial tile is skipped: a sequence of n keys needs ⌈n / block_N⌉ tiles "
                   "(T.ceildiv), not n // block_N. The mask inside the tile hides the keys past the end.",
                   tiles=lambda page_size, block_N: lambda n: n // block_N),
    _paged_suspect("tile kb is looked up as block-table entry kb, but the table lists pages, and a page holds "
                   "page_size // block_N tiles: the entry is kb · block_N // page_size.",
                   page_of=lambda page_size, block_N: lambda flat, b, kb, width: int(flat[b * width + kb])),
    _paged_suspect("the logical page number is used as the physical one: look it up in the block table, "
                   "BlockTable[b, kb · block_N // page_size].",
                   page_of=lambda page_size, block_N: lambda flat, b, kb, width: kb * block_N // page_size),
    _paged_suspect("every tile is read from the first row of its page: tile kb starts at row "
                   "kb · block_N % page_size of the page.", row_of=lambda page_size, block_N: lambda kb: 0),
]


def _fixed_tiles_per_page(case, got, kernel):
    """Whether the outputs are those of a kernel that counts a fixed number of tiles per page (right for one
    tiling alone): some count other than page_size // block_N explains them."""
    page_size, block_N = case.data["pages"].shape[1], case.data["block_N"]
    tiles = lambda n: -(-n // block_N)  # noqa: E731
    return any(same_outputs(got, _paged_model(case, page_of=lambda flat, b, kb, width, c=count: int(
                   flat[b * width + kb // c]), row_of=lambda kb, c=count: kb % c * block_N, tiles=tiles))
               for count in range(1, page_size + 1) if count != page_size // block_N)


_PAGED_SUSPECTS.append(Suspect(
    "the number of tiles in a page is written in as a constant: a page holds page_size // block_N tiles, so tile kb "
    "is in block-table entry kb · block_N // page_size, at row kb · block_N % page_size (the checker draws pages of "
    "two and of three tiles).", _fixed_tiles_per_page))


def check_paged_scores(paged_scores):
    """Run the learner's ``paged_scores(batch, max_pages, num_pages, page_size, dim, block_N, target=...)``
    on the C backend: the scores q · k of each sequence's keys read through the block table, −∞ past
    its length, against the float64 reference."""
    surfacing_warnings(lambda: check_kernel(
        "paged-cache lookup", paged_scores, _paged_cases, suspects=_PAGED_SUSPECTS,
        hint="Hint: key p of sequence b is row p % page_size of page BlockTable[b, p // page_size]; a sequence of "
             "n keys has ⌈n / block_N⌉ tiles.",
        summary="lengths at residues 0, 1 and m − 1 of the tile and the page, an empty sequence, two and three tiles "
                "per page"),
        c_lowering(paged_scores, 5, 4, 10, 8, 8, 4))
