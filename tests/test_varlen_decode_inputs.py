"""Chapter 09's bad and unusual inputs on the CPU: each gets the right answer or a clear
ValueError naming the argument, never a TileLang adapter message naming a kernel parameter."""

import pytest
import torch

from course_utils import attention_reference, check_close, flash_attention, flash_attention_varlen, flash_decode
from course_utils.checking.validation import check_backward, check_forward, decode_references, varlen_references

H, H_KV, D = 4, 2, 16
INF = float("inf")


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _packed(lengths_q, lengths_k, requires_grad=False):
    q = torch.randn(sum(lengths_q), H, D, requires_grad=requires_grad)
    k, v = (torch.randn(sum(lengths_k), H_KV, D, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


# ---------------------------------------------------------------------------------------------- max_seqlen

@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value, message", [
    (2 ** 31, "int32"),           # wrapped to -2³¹ in the grid kernel: every row uninitialised
    (2 ** 32 + 5, "int32"),       # wrapped to 5: rows past the first block uninitialised
    (9, "packed length 8"),       # longer than every sequence together: no sequence can be that long
])
def test_max_seqlen_past_what_can_be_is_refused(which, value, message):
    q, k, v = _packed([3, 5], [3, 5])
    cu = _cu([3, 5])
    args = dict(max_seqlen_q=5, max_seqlen_k=5) | {which: value}
    with pytest.raises(ValueError, match=f"{which}.*{message}"):
        flash_attention_varlen(q, k, v, cu, cu, **args)


# ---------------------------------------------------------------------------------------------- strided indices

def _strided(t):
    """The same values as a strided view (every other element of a twice-as-long tensor)."""
    wide = torch.full((2 * t.shape[0],) + tuple(t.shape[1:]), -7, dtype=t.dtype)
    wide[::2] = t
    view = wide[::2]
    assert not view.is_contiguous()
    return view


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k", "both"])
def test_varlen_accepts_strided_cu_seqlens(which):
    lq, lk = [3, 17, 1], [5, 17, 2]
    q, k, v = _packed(lq, lk)
    cu_q, cu_k = _cu(lq), _cu(lk)
    expected = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    if which in ("cu_seqlens_q", "both"):
        cu_q = _strided(cu_q)
    if which in ("cu_seqlens_k", "both"):
        cu_k = _strided(cu_k)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
    check_close(out, expected, f"strided {which}")


def _decode_case(lengths=(5, 20, 33), seq_max=48, page_size=16):
    batch = len(lengths)
    q = torch.randn(batch, 1, H, D)
    k, v = (torch.randn(batch, seq_max, H_KV, D) for _ in range(2))
    lengths = torch.tensor(lengths, dtype=torch.int32)
    per_seq = seq_max // page_size
    order = torch.randperm(batch * per_seq)
    table = order.view(batch, per_seq).to(torch.int32)
    k_pages, v_pages = (t.reshape(batch * per_seq, page_size, H_KV, D)[torch.argsort(order)].contiguous()
                        for t in (k, v))
    return q, k, v, lengths, k_pages, v_pages, table


def _wide(table):
    wide = torch.full((table.shape[0], table.shape[1] + 3), -1, dtype=torch.int32)
    wide[:, :table.shape[1]] = table
    return wide[:, :table.shape[1]]  # last dimension contiguous, rows strided (FlashAttention accepts it)


def _transposed(table):
    return table.t().contiguous().t()  # the same values, column-major


@pytest.mark.parametrize("layout", [_wide, _transposed])
def test_decode_accepts_a_strided_block_table(layout):
    q, k, v, lengths, k_pages, v_pages, table = _decode_case()
    view = layout(table)
    assert not view.is_contiguous() and torch.equal(view, table)
    out, lse = flash_decode(q, k_pages, v_pages, lengths, block_table=view, num_splits=2, return_lse=True)
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths), quiet=True, name=layout.__name__)


@pytest.mark.parametrize("paged", [False, True])
def test_decode_accepts_a_strided_cache_seqlens(paged):
    q, k, v, lengths, k_pages, v_pages, table = _decode_case()
    caches, extra = ((k_pages, v_pages), dict(block_table=table)) if paged else ((k, v), {})
    out, lse = flash_decode(q, *caches, _strided(lengths), return_lse=True, **extra)
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths), quiet=True, name="strided lengths")


# ---------------------------------------------------------------------------------------------- page size

def test_page_size_zero_is_refused():
    q, _, _, lengths, k_pages, v_pages, table = _decode_case()
    empty = k_pages[:, :0]
    with pytest.raises(ValueError, match="page_size"):
        flash_decode(q, empty, empty, torch.zeros_like(lengths), block_table=table)


# ---------------------------------------------------------------------------------------------- dsinks

SINKS = [-INF, 0.5, -INF, -1.0]  # two heads without a sink (logit −∞), two with one


def _sinks():
    return torch.tensor(SINKS, requires_grad=True)


def test_dense_dsinks_of_rows_that_see_no_key():
    """S_q > S_k causal: the first S_q − S_k rows see no key; with a −∞ sink their LSE is −∞ too."""
    q = torch.randn(1, H, 24, D, requires_grad=True)
    k, v = (torch.randn(1, H_KV, 16, D, requires_grad=True) for _ in range(2))
    sinks = _sinks()
    out = flash_attention(q, k, v, causal=True, sinks=sinks)
    d_out = torch.randn_like(out)
    (d_sinks,) = torch.autograd.grad(out, sinks, d_out)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = attention_reference(*leaves[:3], causal=True, sinks=leaves[3])
    (ref_sinks,) = torch.autograd.grad(ref, leaves[3], d_out.double())
    assert torch.isfinite(ref_sinks).all()  # the float64 reference: 0 for the heads without a sink
    check_close(d_sinks, ref_sinks, "dense dsinks", dtype=torch.float32)


@pytest.mark.parametrize("lengths_q, lengths_k", [
    ([9, 4, 6], [3, 4, 0]),   # causal with S_q > S_k, and a sequence with no key at all
    ([5, 7], [0, 7]),
])
def test_varlen_dsinks_of_rows_that_see_no_key(lengths_q, lengths_k):
    q, k, v = _packed(lengths_q, lengths_k, requires_grad=True)
    sinks = _sinks()
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, sinks=sinks)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    refs = varlen_references(q, k, v, cu_q, cu_k, d_out=d_out, causal=True, sinks=sinks)
    assert torch.isfinite(refs["grads"][3]).all()
    check_backward(q, k, v, d_out, grads, refs=refs, name="varlen dsinks", quiet=True)


# ---------------------------------------------------------------------------------------------- no host sync

@pytest.mark.parametrize("lengths", [[3, 17, 0, 1], [0, 0, 40], [16, 16, 16], [1]])
@pytest.mark.parametrize("block", [16, 64])
def test_lse_layout_made_on_the_device_matches_the_host_one(lengths, block):
    """The backward's LSE layout, now made from cu_seqlens on the device (no read), is the host's."""
    from course_utils.api.varlen_api import _lse_index_on_device, _lse_rows
    from course_utils.kernels.flash_varlen import lse_row_layout

    cu = _cu(lengths)
    rows, index = lse_row_layout(tuple(cu.tolist()), block)
    assert _lse_rows(sum(lengths), len(lengths), block) == rows
    assert torch.equal(_lse_index_on_device(cu, sum(lengths), block, rows), index)


def test_unchecked_bad_indices_are_clamped_into_the_cache():
    """check_indices=False (the GPU's default): a length past the capacity reads as the capacity, a page
    number past the pool as its last page; nothing outside the cache is read."""
    q, k, v, lengths, k_pages, v_pages, table = _decode_case()
    too_long = torch.tensor([5, 99, 33], dtype=torch.int32)
    capacity = torch.tensor([5, 48, 33], dtype=torch.int32)
    check_close(flash_decode(q, k, v, too_long, check_indices=False), flash_decode(q, k, v, capacity), "length")
    bad_table, last_page = table.clone(), table.clone()
    bad_table[1, 0], last_page[1, 0] = 1000, k_pages.shape[0] - 1
    out = flash_decode(q, k_pages, v_pages, lengths, block_table=bad_table, num_splits=2, check_indices=False)
    check_close(out, flash_decode(q, k_pages, v_pages, lengths, block_table=last_page, num_splits=2), "page")
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 1000"):  # the debug mode still says what is wrong
        flash_decode(q, k_pages, v_pages, lengths, block_table=bad_table, check_indices=True)
    with pytest.raises(ValueError, match="check_indices"):
        flash_decode(q, k, v, lengths, check_indices="yes")


def test_varlen_checks_cu_seqlens_on_request():
    q, k, v = _packed([3, 5], [3, 5])
    bad = torch.tensor([0, 9, 8], dtype=torch.int32)
    for check in (None, True):  # CPU tensors: checked by default
        with pytest.raises(ValueError, match="non-decreasing"):
            flash_attention_varlen(q, k, v, bad, _cu([3, 5]), 5, 5, check_indices=check)


# ---------------------------------------------------------------------------------------------- one kernel

@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=5)])
@pytest.mark.parametrize("sinks", [[100.0, -INF, 0.3, -50.0], None])
def test_one_split_kernel_matches_split_and_merge_and_the_reference(mask, sinks):
    """One split runs one kernel that adds each row's sink itself (no merge): the reference's O and LSE, and
    the split + merge path's, with sinks that dominate (100), vanish (−∞, −50) and rows that see no key."""
    lengths = [0, 1, 16, 17, 40]
    q = torch.randn(len(lengths), 2, H, D)
    k, v = (torch.randn(len(lengths), 40, H_KV, D) for _ in range(2))
    for t in (k, v):
        for b, n in enumerate(lengths):
            t[b, n:] = float("nan")
    lengths = torch.tensor(lengths, dtype=torch.int32)
    sinks = None if sinks is None else torch.tensor(sinks)
    out, lse = flash_decode(q, k, v, lengths, sinks=sinks, num_splits=1, return_lse=True, **mask)
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths, sinks=sinks, **mask), quiet=True,
                  name="one kernel")
    out3, lse3 = flash_decode(q, k, v, lengths, sinks=sinks, num_splits=3, return_lse=True, **mask)
    check_close(out, out3, "one kernel vs split + merge: O")
    check_close(lse, lse3, "one kernel vs split + merge: LSE")


def test_split_count_rule():
    """One split (one kernel) once the blocks cover the SMs, or when the cache has at most ONE_SPLIT_TILES key
    tiles; otherwise one block per SM (the H100 sweep of 2026-11-26, one K/V head per block: B=8 2 splits, B=1
    16, i.e. 128 blocks), with at least num_stages + 1 key tiles per split. The default at D=64 puts two K/V heads
    in a block: half the blocks, twice the splits."""
    from course_utils.kernels.flash_decode import ONE_SPLIT_TILES, choose_num_splits, decode_config

    for heads_per_block in (1, None):
        config = decode_config("cuda", 64, 8, 64, 1, kv_heads_per_block=heads_per_block)
        blocks = 8 // config.kv_heads_per_block  # per sequence, before splitting
        picked = {}
        for batch in (1, 8, 16, 64):
            for capacity in (128, 1024, 8192, 131072):
                splits = choose_num_splits(batch, 8, capacity, num_sms=132, config=config)
                tiles = -(-capacity // config.block_N)
                assert splits == 1 or tiles // splits >= config.num_stages + 1, (batch, capacity, splits)
                assert splits == 1 or tiles > ONE_SPLIT_TILES, (batch, capacity, splits)
                assert splits * batch * blocks <= 132 or splits == 1, (batch, capacity, splits)
                picked[batch, capacity] = splits
        if heads_per_block == 1:
            assert picked[1, 131072] == 16 and picked[8, 131072] == 2 and picked[16, 131072] == 1
            assert picked[1, 1024] == 1 and picked[1, 8192] == 16  # 16 key tiles of 64: one kernel
        else:
            assert config.kv_heads_per_block == 2
            assert picked[1, 131072] == 33 and picked[8, 131072] == 4 and picked[16, 131072] == 2
            assert picked[1, 1024] == 1 and picked[8, 1024] == 1  # 16 key tiles of 64: one kernel
            assert choose_num_splits(1, 8, 2048, num_sms=132, config=config) == 1  # 32 tiles: one kernel
            assert choose_num_splits(1, 8, 4096, num_sms=132, config=config) == 16  # 64 tiles: 16 splits of 4
            assert picked[1, 8192] == 32  # 128 tiles: 32 splits of four tiles (4 blocks × 32 ≤ 132 SMs)
        assert all(picked[64, c] == 1 for c in (128, 1024, 8192, 131072))


@pytest.mark.parametrize("page_size", [None, 256])
def test_one_split_kernel_lowers_for_the_h100(page_size):
    """sm_90a lowering, no GPU: the one-kernel path keeps the split kernel's TMA loads and warp specialisation,
    reads the sinks itself, and clamps the length and (paged) the page number it loads from."""
    from course_utils.core.source import cuda_source
    from course_utils.kernels.flash_decode import decode_config, flash_decode_kernel

    config = decode_config("cuda", 64, 8, 64, 1, page_size)
    kernel = flash_decode_kernel(64, 8, 64, 1, page_size=page_size, dtype="bfloat16", single=True, target="cuda",
                                 tiling=config)
    source = cuda_source(kernel, pass_configs=config.pass_configs())
    assert "flash_decode_single_kernel" in source and "tl::tma_load" in source and "Sinks[" in source
    assert "O_part" not in source
    capacity = "(max_pages * 256)" if page_size else "seq_max"
    assert f"max(min(CacheSeqlens[((int64_t)((int)blockIdx.y))], {capacity}), 0)" in source
    if page_size:
        assert "(num_pages - 1)), 0)" in source  # the looked-up page, clamped into the pool


@pytest.mark.parametrize("page_size", [None, 256])
def test_kv_eviction_hint_reaches_every_kv_load(page_size):
    """sm_90a lowering, no GPU: ``kv_eviction`` (an option kept for its measured A/B, not the default) puts
    its cache hint on every K/V TMA load, and the default puts none."""
    from course_utils.core.source import cuda_source
    from course_utils.kernels.flash_decode import decode_config, flash_decode_kernel

    loads = {}
    for hint in (None, "evict_first"):
        config = decode_config("cuda", 64, 8, 128, 1, page_size)._replace(kv_eviction=hint)
        kernel = flash_decode_kernel(64, 8, 128, 1, page_size=page_size, dtype="bfloat16", target="cuda",
                                     tiling=config)
        loads[hint] = [line for line in cuda_source(kernel).splitlines() if "tl::tma_load" in line]
    assert len(loads[None]) == len(loads["evict_first"]) >= 2
    assert not any("CacheHint" in line for line in loads[None])
    assert all("tl::tma_load<tl::CacheHintSm90::EVICT_FIRST>" in line for line in loads["evict_first"])


@pytest.mark.parametrize("schedule", ["list", "grid"])
def test_both_schedules_backward_with_the_lse_layout_from_host_or_device(schedule):
    """The list schedule's LSE layout comes from cu_seqlens read on the host, the grid's from the device (no
    read): both give the reference's gradients, with empty sequences and lengths off the block size."""
    lq, lk = [17, 0, 1, 33, 5], [20, 3, 0, 33, 5]
    q, k, v = _packed(lq, lk, requires_grad=True)
    sinks = torch.randn(H, requires_grad=True)
    cu_q, cu_k = _cu(lq), _cu(lk)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, sinks=sinks, schedule=schedule,
                                 check_indices=False)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), d_out)
    refs = varlen_references(q, k, v, cu_q, cu_k, d_out=d_out, causal=True, sinks=sinks)
    check_backward(q, k, v, d_out, grads, refs=refs, name=schedule, quiet=True)
