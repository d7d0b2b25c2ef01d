"""Chapter 09 on the CPU: packed variable-length attention and decoding with a KV cache, each sequence
checked against the float64 reference on its own. Few kernel variants, reused across cases: the
kernels take the lengths, the batch size, the cache size and the split count at run time."""

import re

import pytest
import torch

from course_utils import CheckFailed, check_close, flash_attention_varlen, flash_decode
from course_utils.api.attention import ForwardConfig
from course_utils.checking.validation import check_backward, check_forward, decode_references, varlen_references
from course_utils.kernels.flash_varlen import lse_row_layout, varlen_work_list

H, H_KV, D = 4, 2, 16  # GQA 4/2; the CPU tile is 16 × 16
BLOCK = 16


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _packed(lengths_q, lengths_k, requires_grad=False):
    q = torch.randn(sum(lengths_q), H, D, requires_grad=requires_grad)
    k, v = (torch.randn(sum(lengths_k), H_KV, D, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


# Lengths 1, a block, a block + 1, empty (on one side or both), and q ≠ k (causal aligned bottom-right,
# some rows seeing nothing when q is the longer).
LENGTHS_Q = [1, BLOCK, BLOCK + 1, 0, 9, 5, 0, 33]
LENGTHS_K = [1, BLOCK, BLOCK + 1, 0, 30, 2, 7, 33]
MASKS = {"causal": dict(causal=True), "window 5": dict(window_size=5), "full": dict()}


@pytest.mark.parametrize("mask", list(MASKS))
def test_varlen_matches_the_reference_per_sequence(mask):
    """O, LSE and the gradients of q, k, v and sinks; GQA; every sequence against its own reference."""
    q, k, v = _packed(LENGTHS_Q, LENGTHS_K, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)
    cu_q, cu_k = _cu(LENGTHS_Q), _cu(LENGTHS_K)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), sinks=sinks,
                                      return_lse=True, **MASKS[mask])
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    refs = varlen_references(q, k, v, cu_q, cu_k, d_out=d_out, sinks=sinks, **MASKS[mask])
    check_forward(q, k, v, out, lse, refs=refs, name=mask, quiet=True)
    check_backward(q, k, v, d_out, grads, refs=refs, name=mask, quiet=True)


@pytest.mark.parametrize("uses", ["O and LSE", "O", "LSE"])
def test_varlen_gradients_of_a_loss_on_o_and_the_lse(uses):
    """Gradients of Σ O·dO + Σ LSE·dLSE against autograd through the float64 reference, sequence by sequence;
    also of a loss of one output only, whose other gradient then reaches the backward as None, not as zeros."""
    from course_utils import attention_reference

    lq = lk = [BLOCK + 1, 1, 0, 20]
    q, k, v = _packed(lq, lk, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)
    cu = _cu(lq)
    out, lse = flash_attention_varlen(q, k, v, cu, cu, max(lq), max(lk), causal=True, sinks=sinks, return_lse=True)
    d_out, d_lse = torch.randn_like(out), torch.randn_like(lse)
    if uses == "O":
        d_lse = torch.zeros_like(lse)
    elif uses == "LSE":
        d_out = torch.zeros_like(out)
    loss = (out * d_out).sum() if "O" in uses.split() else 0
    loss = loss + ((lse * d_lse).sum() if "LSE" in uses else 0)
    grads = torch.autograd.grad(loss, (q, k, v, sinks))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    loss = 0
    for b in range(len(lq)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        if rows.start == rows.stop:
            continue
        o, s = attention_reference(*(t[rows].transpose(0, 1)[None] for t in leaves[:3]), causal=True,
                                   sinks=leaves[3], return_lse=True)
        loss = loss + (o[0].transpose(0, 1) * d_out[rows].double()).sum() + (s[0].double() * d_lse[:, rows]).sum()
    ref_grads = torch.autograd.grad(loss, leaves)
    for name, g, r in zip(("dQ", "dK", "dV", "dsinks"), grads, ref_grads):
        check_close(g, r, name, dtype=torch.float32)


def test_varlen_schedules_agree():
    """The padded grid (with idle blocks) and the work list give the same O."""
    lq = lk = [BLOCK + 1, 3, 0, 40]
    q, k, v = _packed(lq, lk)
    cu = _cu(lq)
    out_list = flash_attention_varlen(q, k, v, cu, cu, max(lq), max(lk), causal=True, schedule="list")
    out_grid = flash_attention_varlen(q, k, v, cu, cu, max(lq) + 20, max(lk), causal=True, schedule="grid")
    check_close(out_grid, out_list, "grid vs list schedule", atol=0, rtol=0)


def test_nothing_of_one_sequence_reaches_another():
    """NaN in every input of sequence 1 (its q, k, v and dO): the other sequences' O and gradients are
    unchanged, although their tiles overlap sequence 1's rows (0 · NaN would be NaN)."""
    lq = lk = [BLOCK + 1, BLOCK + 3, 5, 20]
    q, k, v = _packed(lq, lk)
    cu = _cu(lq)
    d_out = torch.randn(q.shape)
    mine = slice(int(cu[1]), int(cu[2]))

    def run(q, k, v, d_out):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention_varlen(*leaves, cu, cu, max(lq), max(lk), causal=True)
        return (out,) + torch.autograd.grad(out, leaves, d_out)

    clean = run(q, k, v, d_out)
    poisoned = [t.clone() for t in (q, k, v, d_out)]
    for t in poisoned:
        t[mine] = float("nan")
    dirty = run(*poisoned)
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[mine] = False
    for name, a, b in zip(("O", "dQ", "dK", "dV"), dirty, clean):
        check_close(a[others], b[others], f"{name} of the other sequences")
        assert a[mine].isnan().all(), name


def test_a_shifted_sequence_boundary_fails_the_check():
    """Planted bug: the kernel given cu_seqlens off by one row must not pass the per-sequence check."""
    lq = lk = [BLOCK + 1, 20]
    q, k, v = _packed(lq, lk)
    cu = _cu(lq)
    wrong = cu.clone()
    wrong[1] += 1
    out, lse = flash_attention_varlen(q, k, v, wrong, wrong, 21, 21, causal=True, return_lse=True)
    with pytest.raises(CheckFailed):
        check_forward(q, k, v, out, lse, refs=varlen_references(q, k, v, cu, cu, causal=True), quiet=True)


def test_work_list_is_complete_and_heaviest_first():
    lengths_q, lengths_k = torch.tensor([40, 0, 17]), torch.tensor([40, 3, 20])
    items = varlen_work_list(lengths_q, lengths_k, BLOCK, causal=True)
    assert sorted(map(tuple, items.tolist())) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    assert items[0].tolist() == [0, 2]  # the last block of the longest sequence sees the most keys
    by_keys = varlen_work_list(lengths_q, lengths_k, BLOCK, causal=True, by_keys=True)
    assert len(by_keys) == 3 + 1 + 2 and by_keys[0].tolist() == [0, 0]


@pytest.mark.parametrize("block", [16, 64, 80])
def test_lse_rows_start_on_block_boundaries_and_never_overlap(block):
    """The backward's LSE/Δ layout: the H100's copy engine faulted on rows loaded from unaligned starts."""
    lengths = [1, 127, 0, 128, 129, 3, 0, 1000]
    bounds = tuple(_cu(lengths).tolist())
    rows, index = lse_row_layout(bounds, block)
    assert rows % block == 0 and len(index) == sum(lengths) and len(set(index.tolist())) == sum(lengths)
    for b, n in enumerate(lengths):
        cols = index[bounds[b]:bounds[b + 1]]
        if n:
            assert cols[0] % block == 0 and (cols.diff() == 1).all()
            assert int(cols[-1]) < rows
    starts = [int(index[bounds[b]]) for b, n in enumerate(lengths) if n]
    ends = [int(index[bounds[b + 1] - 1]) + 1 for b, n in enumerate(lengths) if n]
    assert all(e <= s for e, s in zip(ends, starts[1:]))  # in order, disjoint


# ---------------------------------------------------------------------------------------------- decoding

def _cache(lengths, seq_new, seq_max=40):
    batch = len(lengths)
    q = torch.randn(batch, seq_new, H, D)
    k, v = (torch.randn(batch, seq_max, H_KV, D) for _ in range(2))
    for t in (k, v):  # slots past each sequence's length are never read into a result
        for b, n in enumerate(lengths):
            t[b, n:] = float("nan")
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def _paged(k, v, lengths, page_size=16):
    """The same cache as shuffled pages: a block table with -1 in the entries a sequence does not use."""
    batch, seq_max = k.shape[:2]
    per_seq = -(-seq_max // page_size)
    pages = torch.randperm(batch * per_seq + 3)  # a few spare pages that nobody uses
    table = torch.full((batch, per_seq), -1, dtype=torch.int32)
    k_pages = torch.randn(len(pages), page_size, H_KV, D)
    v_pages = torch.randn(len(pages), page_size, H_KV, D)
    for b, n in enumerate(lengths):
        for j in range(-(-n // page_size)):
            page = int(pages[b * per_seq + j])
            table[b, j] = page
            rows = slice(j * page_size, min((j + 1) * page_size, seq_max))
            k_pages[page, :rows.stop - rows.start] = k[b, rows]
            v_pages[page, :rows.stop - rows.start] = v[b, rows]
    return k_pages, v_pages, table


DECODE_LENGTHS = [0, 1, BLOCK, BLOCK + 1, 40]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_contiguous_causal_sinks(num_splits):
    q, k, v, lengths = _cache(DECODE_LENGTHS, seq_new=2)
    sinks = torch.randn(H)
    out, lse = flash_decode(q, k, v, lengths, causal=True, sinks=sinks, num_splits=num_splits, return_lse=True)
    refs = decode_references(q, k, v, lengths, causal=True, sinks=sinks)
    check_forward(q, k, v, out, lse, refs=refs, name=f"{num_splits} splits", quiet=True)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_decode_paged_one_new_token(num_splits):
    q, k, v, lengths = _cache(DECODE_LENGTHS, seq_new=1)
    k_pages, v_pages, table = _paged(k, v, DECODE_LENGTHS)
    out, lse = flash_decode(q, k_pages, v_pages, lengths, block_table=table, num_splits=num_splits, return_lse=True)
    refs = decode_references(q, k, v, lengths)
    check_forward(q, k, v, out, lse, refs=refs, name="paged", quiet=True)
    check_close(out, flash_decode(q, k, v, lengths, num_splits=num_splits), "paged = contiguous")


def test_decode_paged_window_sinks():
    q, k, v, lengths = _cache(DECODE_LENGTHS, seq_new=2)
    k_pages, v_pages, table = _paged(k, v, DECODE_LENGTHS)
    sinks = torch.randn(H)
    out, lse = flash_decode(q, k_pages, v_pages, lengths, block_table=table, window_size=5, sinks=sinks,
                            num_splits=4, return_lse=True)
    refs = decode_references(q, k, v, lengths, window_size=5, sinks=sinks)
    check_forward(q, k, v, out, lse, refs=refs, name="window 5", quiet=True)


def test_a_wrong_page_fails_the_check():
    """Planted bug: sequence 4's first page read from sequence 3's must not pass."""
    q, k, v, lengths = _cache(DECODE_LENGTHS, seq_new=1)
    k_pages, v_pages, table = _paged(k, v, DECODE_LENGTHS)
    table[4, 0] = table[3, 0]
    out = flash_decode(q, k_pages, v_pages, lengths, block_table=table, num_splits=2)
    with pytest.raises(CheckFailed):
        check_forward(q, k, v, out, refs=decode_references(q, k, v, lengths), quiet=True)


@pytest.fixture
def kv_heads_per_block(request, monkeypatch):
    """The CPU default with ``kv_heads_per_block`` set (plans and configs made under it are dropped after)."""
    import course_utils.api.decode_api as decode_api
    import course_utils.kernels.flash_decode as fd

    monkeypatch.setitem(fd.DECODE_CONFIGS, "c", fd.DECODE_CONFIGS["c"]._replace(kv_heads_per_block=request.param))
    fd.decode_config.cache_clear()
    decode_api._PLANS.clear()
    yield request.param
    fd.decode_config.cache_clear()
    decode_api._PLANS.clear()


@pytest.mark.parametrize("kv_heads_per_block", [2, 4], indirect=True)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_several_kv_heads_per_block(kv_heads_per_block, num_splits):
    """A block owning 2 or 4 K/V heads (block-diagonal query tile over the cache read as [.., H_kv / c, c·D]):
    every head of every sequence, causal with two new tokens and sinks, contiguous and paged with a window."""
    from course_utils.api.decode_api import _decode_problem

    heads, heads_kv, dim, lengths = 8, 4, 16, [0, 1, 17, 40]
    q = torch.randn(len(lengths), 2, heads, dim)
    k, v = (torch.randn(len(lengths), 40, heads_kv, dim) for _ in range(2))
    for t in (k, v):
        for b, n in enumerate(lengths):
            t[b, n:] = float("nan")  # past the end: masked, never reaching another head of the block
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    sinks = torch.randn(heads)
    assert _decode_problem(q, k, None, True, None, None)[1].kv_heads_per_block == kv_heads_per_block
    out, lse = flash_decode(q, k, v, seqlens, causal=True, sinks=sinks, num_splits=num_splits, return_lse=True)
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, seqlens, causal=True, sinks=sinks),
                  name=f"{kv_heads_per_block} heads per block", quiet=True)
    table = torch.randperm(len(lengths) * 3).view(len(lengths), 3).to(torch.int32)  # pages of 16 keys, shuffled
    k_pages, v_pages = (torch.empty(len(lengths) * 3, 16, heads_kv, dim) for _ in range(2))
    for b in range(len(lengths)):
        for j in range(3):
            rows = slice(j * 16, min(j * 16 + 16, 40))
            k_pages[table[b, j], :rows.stop - rows.start] = k[b, rows]
            v_pages[table[b, j], :rows.stop - rows.start] = v[b, rows]
    out, lse = flash_decode(q, k_pages, v_pages, seqlens, block_table=table, window_size=5, sinks=sinks,
                            num_splits=num_splits, return_lse=True)
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, seqlens, window_size=5, sinks=sinks),
                  name="paged, window 5", quiet=True)


def test_kv_heads_per_block_is_fitted_and_checked():
    """decode_config lowers it to a divisor of H_kv whose rows fit a 64-row tile; the kernel refuses one that
    does not divide H_kv or whose rows do not fit ``block_M``; the split rule counts blocks of c heads."""
    from course_utils.kernels.flash_decode import SPLIT_TILING, choose_num_splits, decode_config, flash_decode_kernel

    assert decode_config("cuda", 64, 8, 64, 1, kv_heads_per_block=16).kv_heads_per_block == 8  # 8 × 8 rows
    assert decode_config("cuda", 64, 8, 64, 2, kv_heads_per_block=8).kv_heads_per_block == 4  # 16 rows a head
    assert decode_config("cuda", 12, 6, 64, 1, kv_heads_per_block=4).kv_heads_per_block == 2
    two = decode_config("cuda", 64, 8, 64, 1, kv_heads_per_block=2)
    assert (two.block_M, two.block_N) == (16, 64)  # the same bytes per K/V tile as one head's 128 × 64
    assert decode_config("cuda", 64, 8, 64, 1, 32, kv_heads_per_block=2).block_N == 32  # divides the page
    assert choose_num_splits(1, 8, 131072, num_sms=132, config=two) == 33  # 4 blocks before splitting
    for kwargs, message in ((dict(kv_heads_per_block=3), "kv_heads_per_block must be a positive int dividing"),
                            (dict(kv_heads_per_block=0), "kv_heads_per_block"),
                            (dict(kv_heads_per_block=2, block_M=8), r"block_M \(8\) must be at least 2 × 8")):
        with pytest.raises(ValueError, match=message):
            flash_decode_kernel(64, 8, 64, 1, target="c", tiling=SPLIT_TILING._replace(**kwargs))


# ---------------------------------------------------------------------------------------------- bad input

def _varlen_args():
    q, k, v = _packed([3, 5], [3, 5])
    return [q, k, v, _cu([3, 5]), _cu([3, 5]), 5, 5]


def _with(args, index, value):
    args = list(args)
    args[index] = value
    return args


@pytest.mark.parametrize("change, message", [
    (lambda a: _with(a, 3, torch.tensor([0, 9, 8], dtype=torch.int32)), "non-decreasing"),
    (lambda a: _with(a, 3, torch.tensor([0, 3, 7], dtype=torch.int32)), "must equal the packed length 8"),
    (lambda a: _with(a, 3, torch.tensor([1, 3, 8], dtype=torch.int32)), r"\[0\] must be 0"),
    (lambda a: _with(a, 5, 4), "max_seqlen_q = 4 is smaller than the length 5"),
    (lambda a: _with(a, 6, 2), "max_seqlen_k = 2 is smaller"),
    (lambda a: _with(a, 3, torch.tensor([0, 3, 8])), "int32"),
    (lambda a: _with(a, 4, torch.tensor([0, 3, 8], dtype=torch.int32)[None]), "1-D"),
    (lambda a: _with(a, 4, torch.tensor([0, 8], dtype=torch.int32)), "batch \\+ 1"),
    (lambda a: _with(a, 0, a[0][:, :3]), "multiple of key/value heads"),
    (lambda a: _with(a, 0, a[0][None]), r"\[total_q, heads, head_dim\]"),
    (lambda a: _with(a, 5, 5.0), "must be an int"),
])
def test_varlen_rejects_bad_input(change, message):
    with pytest.raises((ValueError, TypeError), match=message):
        flash_attention_varlen(*change(_varlen_args()))


def test_varlen_rejects_bad_sinks_and_windows():
    args = _varlen_args()
    with pytest.raises(ValueError, match="sinks"):
        flash_attention_varlen(*args, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="window_size"):
        flash_attention_varlen(*args, window_size=0)
    with pytest.raises(ValueError, match="pingpong"):  # it never finished on the H100: refused, not run
        flash_attention_varlen(*args, config=ForwardConfig(16, 16, 1, 1, pingpong=True))
    with pytest.raises(ValueError, match="blocks_per_sm"):  # the packed persistent forward runs one block per SM
        flash_attention_varlen(*args, config=ForwardConfig(64, 128, 2, 128, kernel="flash_fwd_hopper_persistent",
                                                           blocks_per_sm=2))


def _decode_args(paged=False):
    q, k, v, lengths = _cache([5, 20], seq_new=1, seq_max=32)
    if not paged:
        return (q, k, v, lengths), {}
    k_pages, v_pages, table = _paged(k, v, [5, 20])
    return (q, k_pages, v_pages, lengths), dict(block_table=table)


@pytest.mark.parametrize("paged, change, message", [
    (False, lambda a, kw: ((a[0], a[1], a[2], torch.tensor([5, 33], dtype=torch.int32)), kw),
     r"cache_seqlens must lie in \[0, 32\].*k_cache.shape\[1\]"),
    (False, lambda a, kw: ((a[0], a[1], a[2], torch.tensor([5, -1], dtype=torch.int32)), kw), "must lie in"),
    (False, lambda a, kw: ((a[0], a[1], a[2], a[3].long()), kw), "cache_seqlens must have dtype torch.int32"),
    (False, lambda a, kw: ((a[0], a[1], a[2], a[3][:1]), kw), r"cache_seqlens must have shape \[2\]"),
    (False, lambda a, kw: ((a[0], a[1][:, ::2], a[2][:, ::2], a[3]), kw), "must be contiguous"),
    (False, lambda a, kw: ((a[0], a[1][:1], a[2][:1], a[3]), kw), "one row per sequence"),
    (True, lambda a, kw: ((a[0], a[1], a[2], torch.tensor([5, 33], dtype=torch.int32)), kw),
     r"must lie in \[0, 32\].*pages given"),
    (True, lambda a, kw: (a, dict(block_table=torch.where(kw["block_table"] == kw["block_table"][1, 1], 99,
                                                         kw["block_table"]))), r"block_table\[1, 1\] = 99"),
    (True, lambda a, kw: (a, dict(block_table=torch.where(kw["block_table"] == kw["block_table"][0, 0], -2,
                                                         kw["block_table"]))), r"block_table\[0, 0\] = -2"),
    (True, lambda a, kw: (a, dict(block_table=kw["block_table"].long())), "block_table must have dtype torch.int32"),
    (True, lambda a, kw: (a, dict(block_table=kw["block_table"][:1])), "block_table must have shape"),
    (True, lambda a, kw: ((a[0], a[1][:, :8], a[2][:, :8], a[3]), dict(block_table=kw["block_table"])),
     "page_size .* multiple of 16"),
])
def test_decode_rejects_bad_input(paged, change, message):
    good_args, good_kwargs = _decode_args(paged)
    flash_decode(*good_args, **good_kwargs)  # kept as a plan: the bad call must not ride on it
    args, kwargs = change(good_args, good_kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        flash_decode(*args, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_splits=0), "num_splits"), (dict(num_splits=True), "num_splits"), (dict(sm_scale=-1.0), "sm_scale"),
    (dict(window_size=0), "window_size"), (dict(sinks=torch.zeros(H, dtype=torch.int64)), "floating-point"),
])
def test_decode_rejects_bad_options(kwargs, message):
    args, _ = _decode_args()
    flash_decode(*args, num_splits=1, sinks=torch.zeros(H))  # a good call of the nearest signature first
    with pytest.raises(ValueError, match=message):
        flash_decode(*args, **kwargs)


def test_decode_plan_is_kept_per_signature():
    """The second call with the same host-known signature reuses the first's plan (no checks, no kernel
    choice) and gives the reference's answer for new contents; a new signature (another batch size, the
    cache paged) gets its own plan."""
    from course_utils.api.decode_api import _PLANS, _plan_key

    args, _ = _decode_args()
    flash_decode(*args)
    key = _plan_key(*args, None, False, None, None, None, None, None)
    plan = _PLANS[key]
    q, k, v, lengths = _cache([3, 32], seq_new=1, seq_max=32)  # new contents and lengths, same signature
    out, lse = flash_decode(q, k, v, lengths, return_lse=True)
    assert _PLANS[key] is plan
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths), quiet=True, name="plan reused")
    paged_args, paged_kwargs = _decode_args(paged=True)
    flash_decode(*paged_args, **paged_kwargs)
    assert _plan_key(*paged_args, paged_kwargs["block_table"], False, None, None, None, None, None) in _PLANS
    assert _plan_key(q, k, v, lengths, None, False, None, None, None, True, None) != \
        _plan_key(q, k, v, lengths, None, False, None, None, None, 1, None)  # True == 1, but not as a signature


def test_decode_plan_keeps_checking_index_values_on_the_host():
    """CPU index tensors are checked at every call (they are on the host already), plan or no plan."""
    args, _ = _decode_args()
    flash_decode(*args)
    bad = torch.tensor([5, 33], dtype=torch.int32)
    with pytest.raises(ValueError, match="must lie in"):
        flash_decode(*args[:3], bad)
    flash_decode(*args[:3], bad, check_indices=False)  # unchecked on request: clamped, no error


def test_packed_forward_syncs_only_on_the_edge_tile():
    """sm_90a lowering, no GPU: with its own barriers the packed forward's loop has no barrier of its 256
    consumer threads in every iteration (one cost the H100 4–18%), only on a sequence's last tile."""
    from course_utils.core.source import cuda_source
    from course_utils.kernels.flash_varlen import OWN_BARRIERS_PASS_CONFIGS, flash_varlen_fwd_kernel
    from course_utils.kernels.tiles import Tiling

    kernel = flash_varlen_fwd_kernel(4, 64, causal=True, target="cuda", tiling=Tiling(128, 128, 2, 256),
                                     schedule="grid", own_barriers=True)
    source = cuda_source(kernel, pass_configs=OWN_BARRIERS_PASS_CONFIGS)
    assert "__sync_thread_partial(3, 256)" not in source  # TileLang's own, before P·V
    assert source.count("__sync_thread_partial(5, 256)") == 3  # the edge tile's, and two in the epilogue
    # the branch taken when the tile runs past the end (the length is named after the macro that binds it)
    branch = re.search(r"if \((?:seq_k|length)\w* < \(\(kb\w* \* 128\) \+ 128\)\) \{", source)
    depth, end = 0, branch.end() - 1
    for end in range(branch.end() - 1, len(source)):
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        if depth == 0:
            break
    assert branch.end() < source.index("__sync_thread_partial(5, 256)") < end  # the loop's only barrier is in it
    with pytest.raises(ValueError, match="own_barriers"):
        flash_varlen_fwd_kernel(4, 64, own_barriers=True, target="c")
