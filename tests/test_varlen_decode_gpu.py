"""Chapter 09 at full size on a CUDA machine (an H100 here); skipped elsewhere. Every head of every
sequence is checked against the float64 reference with FlashAttention's criterion."""

import pytest
import torch

from course_utils import flash_attention_varlen, flash_decode
from course_utils.api.varlen_api import VARLEN_CUDA_CONFIG
from course_utils.checking.validation import check_backward, check_forward, decode_references, varlen_references

pytestmark = pytest.mark.gpu  # skipped without a CUDA GPU (tests/conftest.py)

LENGTHS = [1, 127, 128, 129, 0, 3000, 8192, 4097]  # 1, a block ± 1, empty, long


def _cache(batch, seq_max, heads_kv, dim, seq_new, heads, dtype=torch.bfloat16, min_length=0):
    q = torch.randn(batch, seq_new, heads, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seq_max, heads_kv, dim, device="cuda", dtype=dtype) for _ in range(2))
    lengths = torch.tensor(LENGTHS[:batch], dtype=torch.int32, device="cuda").clamp(min_length, seq_max)
    for t in (k, v):  # never-written slots: whatever they hold must not reach a result
        for b, n in enumerate(lengths.tolist()):
            t[b, n:] = float("nan")
    return q, k, v, lengths


def _pages(k, v, lengths, page_size):
    batch, seq_max, heads_kv, dim = k.shape
    per_seq = seq_max // page_size
    order = torch.randperm(batch * per_seq, device="cuda")
    table = order.view(batch, per_seq).to(torch.int32)
    k_pages, v_pages = (t.view(batch * per_seq, page_size, heads_kv, dim)[torch.argsort(order)] for t in (k, v))
    return k_pages.contiguous(), v_pages.contiguous(), table


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_gpt_oss_shape(dim, paged):
    q, k, v, lengths = _cache(8, 8192, 8, dim, 1, 64)
    sinks = torch.randn(64, device="cuda")
    extra = {}
    caches = (k, v)
    if paged:
        *caches, table = _pages(k, v, lengths, 256)
        extra = dict(block_table=table)
    for splits in (None, 1, 7):
        out, lse = flash_decode(q, *caches, lengths, sinks=sinks, num_splits=splits, return_lse=True, **extra)
        refs = decode_references(q, k, v, lengths, sinks=sinks)
        check_forward(q, k, v, out, lse, refs=refs, name=f"D={dim} paged={paged} splits={splits}")


def test_decode_several_new_tokens_causal_window():
    q, k, v, lengths = _cache(8, 8192, 8, 64, 4, 64, min_length=4)  # the 4 new tokens are in the cache
    k_pages, v_pages, table = _pages(k, v, lengths, 256)
    sinks = torch.randn(64, device="cuda")
    for mask in (dict(causal=True), dict(window_size=1000)):
        out, lse = flash_decode(q, k_pages, v_pages, lengths, block_table=table, sinks=sinks, return_lse=True, **mask)
        refs = decode_references(q, k, v, lengths, sinks=sinks, **mask)
        check_forward(q, k, v, out, lse, refs=refs, name=f"4 new tokens, {mask}")


def test_decode_multi_head_attention():
    """Group 1: each packed tile holds one real row."""
    q, k, v, lengths = _cache(8, 8192, 16, 128, 1, 16, dtype=torch.float16)
    out, lse = flash_decode(q, k, v, lengths, causal=True, return_lse=True)
    check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths, causal=True), name="MHA")


def _refill(q, k, v, lengths, seq_new=1):
    """New contents in place (the addresses a captured graph holds): q, K, V, and lengths from 1 to the capacity
    (sequence 0 at the capacity), every slot past a length NaN."""
    batch, seq_max = k.shape[:2]
    q.copy_(torch.randn_like(q))
    new = torch.randint(seq_new, seq_max + 1, (batch,), device="cuda", dtype=torch.int32)
    new[0] = seq_max
    lengths.copy_(new)
    for t in (k, v):
        t.copy_(torch.randn_like(t))
        t.masked_fill_(torch.arange(seq_max, device="cuda")[None, :, None, None] >= new[:, None, None, None],
                       float("nan"))


@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_step_replays_in_a_cuda_graph(paged, num_splits):
    """The default path reads nothing back to the host: a decoding step is captured once in a CUDA graph and
    replayed with new q, new cache contents and new lengths, each replay checked against the reference."""
    batch, seq_max, heads, heads_kv, dim, page_size = 8, 4096, 64, 8, 64, 256
    q = torch.empty(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.empty(batch, seq_max, heads_kv, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.empty(batch, dtype=torch.int32, device="cuda")
    sinks = torch.randn(heads, device="cuda")
    per_seq = seq_max // page_size
    table = torch.randperm(batch * per_seq, device="cuda").view(batch, per_seq).to(torch.int32)
    k_pages, v_pages = (torch.empty(batch * per_seq, page_size, heads_kv, dim, device="cuda", dtype=torch.bfloat16)
                        for _ in range(2))

    def write_pages():
        for pages, cache in ((k_pages, k), (v_pages, v)):
            pages[table.long()] = cache.view(batch, per_seq, page_size, heads_kv, dim)

    caches, extra = ((k_pages, v_pages), dict(block_table=table)) if paged else ((k, v), {})

    def step():
        return flash_decode(q, *caches, lengths, sinks=sinks, num_splits=num_splits, return_lse=True, **extra)

    _refill(q, k, v, lengths)
    write_pages()
    side = torch.cuda.Stream()  # warm up (compile, allocate) off the capturing stream, as PyTorch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for replay in range(3):
        _refill(q, k, v, lengths)
        write_pages()
        graph.replay()
        torch.cuda.synchronize()
        check_forward(q, k, v, out, lse, refs=decode_references(q, k, v, lengths, sinks=sinks),
                      name=f"replay {replay}, paged={paged}, splits={num_splits}")


def test_decode_launches_through_the_compiled_host_function():
    """flash_decode calls TVM-FFI's compiled host function (``tiles.launcher``, found once), not TileLang's
    Python adapter: the same kernel, so the same result bit for bit (the host function still checks every
    argument; the adapter only found it)."""
    from course_utils.api.decode_api import decode_single_kernel
    from course_utils.kernels.tiles import launcher

    q, k, v, lengths = _cache(8, 4096, 8, 64, 1, 64)
    sinks = torch.randn(64, device="cuda")
    kernel = decode_single_kernel(q, k)
    assert launcher(kernel) is not kernel, "expected TileLang's TVM-FFI backend on CUDA"
    out, lse = flash_decode(q, k, v, lengths, sinks=sinks, num_splits=1, return_lse=True)
    out_adapter, lse_adapter = torch.empty_like(out), torch.empty_like(lse)
    kernel(q, k, v, torch.zeros(8, 1, dtype=torch.int32, device="cuda"), lengths, sinks, out_adapter, lse_adapter)
    assert torch.equal(out, out_adapter) and torch.equal(lse, lse_adapter)


def test_default_calls_never_wait_for_the_gpu():
    """torch's sync debug mode turns any synchronising call into an error: flash_decode (both caches) and the
    packed forward and backward (default "grid" schedule) make none."""
    q, k, v, lengths = _cache(8, 4096, 8, 64, 1, 64)
    k_pages, v_pages, table = _pages(k, v, lengths, 256)
    sinks = torch.randn(64, device="cuda")
    pq, pk, pv, cu = _packed(LENGTHS, 16, 16, 128, torch.float16)
    leaves = [t.clone().requires_grad_() for t in (pq, pk, pv)]
    calls = {"decode": lambda: flash_decode(q, k, v, lengths, sinks=sinks),
             "decode paged": lambda: flash_decode(q, k_pages, v_pages, lengths, block_table=table, sinks=sinks),
             "decode 1 split": lambda: flash_decode(q, k, v, lengths, sinks=sinks, num_splits=1),
             "varlen forward + backward": lambda: flash_attention_varlen(
                 *leaves, cu, cu, max(LENGTHS), max(LENGTHS), causal=True).backward(torch.ones_like(pq))}
    for name, call in calls.items():
        call()  # compile first (compiling may synchronise)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
        except RuntimeError as exc:
            raise AssertionError(f"{name} waited for the GPU: {exc}") from exc
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _packed(lengths, heads, heads_kv, dim, dtype):
    total = sum(lengths)
    q = torch.randn(total, heads, dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, heads_kv, dim, device="cuda", dtype=dtype) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("schedule", ["list", "grid"])
def test_varlen_forward_backward(causal, schedule):
    q, k, v, cu = _packed(LENGTHS, 16, 16, 128, torch.float16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention_varlen(*leaves, cu, cu, max(LENGTHS), max(LENGTHS), causal=causal, schedule=schedule,
                                      return_lse=True)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = varlen_references(q, k, v, cu, cu, d_out=d_out, causal=causal)
    check_forward(q, k, v, out, lse, refs=refs, name=f"varlen causal={causal} {schedule}")
    check_backward(q, k, v, d_out, grads, refs=refs, name=f"varlen causal={causal} {schedule}")


@pytest.mark.parametrize("config", [None, "chapter 03"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lengths_q, lengths_k", [((200, 5, 384, 77), (260, 5, 1, 500)), ((300, 0, 129), (300, 7, 0))])
def test_varlen_query_blocks_without_keys(causal, lengths_q, lengths_k, config):
    """Query blocks that see no key (causal with fewer keys than queries; a sequence with no key at all) get
    O = 0, with the default and with chapter 03's packed loop (``config=VARLEN_CUDA_CONFIG``, the default on
    sm_90 before 2026-11-26), which got them wrong on the H200 (max error 1.2–2.9) until it was compiled with
    shared-memory reuse off (O's staging tile had been placed over Q's, whose load lands late)."""
    q, _, _, cu_q = _packed(list(lengths_q), 16, 16, 128, torch.float16)
    _, k, v, cu_k = _packed(list(lengths_k), 16, 16, 128, torch.float16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal,
                                      return_lse=True, config=VARLEN_CUDA_CONFIG if config else None)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = varlen_references(q, k, v, cu_q, cu_k, d_out=d_out, causal=causal)
    check_forward(q, k, v, out, lse, refs=refs, name=f"no keys causal={causal} config={config}")
    check_backward(q, k, v, d_out, grads, refs=refs, name=f"no keys causal={causal}")


@pytest.mark.parametrize("heads, heads_kv, dim, dtype, window", [
    (64, 8, 64, torch.bfloat16, 128),  # gpt-oss
    # D = 128 without GQA: the packed backward's default writes a key tile that is all its sequence's by TMA and a
    # ragged one row by row (``dkdv_by_tma``); the forward likewise stores O of a full tile by TMA (``o_by_tma``).
    (16, 16, 128, torch.float16, 200),
], ids=["gpt-oss", "d128-tma"])
def test_varlen_window_sinks(heads, heads_kv, dim, dtype, window):
    lengths_k = [n + 50 for n in LENGTHS]  # more keys than queries: the diagonal aligned bottom-right
    q, _, _, cu_q = _packed(LENGTHS, heads, heads_kv, dim, dtype)
    _, k, v, cu_k = _packed(lengths_k, heads, heads_kv, dim, dtype)
    sinks = torch.randn(heads, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = flash_attention_varlen(*leaves[:3], cu_q, cu_k, max(LENGTHS), max(lengths_k), window_size=window,
                                      sinks=leaves[3], return_lse=True)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = varlen_references(q, k, v, cu_q, cu_k, d_out=d_out, window_size=window, sinks=sinks)
    name = f"D={dim} window {window} + sinks"
    check_forward(q, k, v, out, lse, refs=refs, name=name)
    check_backward(q, k, v, d_out, grads, refs=refs, name=name)


def precompile():
    """Compile the kernels these tests use that the chapter 09 records do not, in parallel threads."""
    from course_utils.api.decode_api import decode_kernels, decode_single_kernel
    from course_utils.api.varlen_api import _varlen_small_kernels, varlen_kernels
    from course_utils.measure.benchmarks.common import in_parallel

    def q_cache(heads, heads_kv, dim, seq_new, dtype=torch.bfloat16):
        return (torch.empty(1, seq_new, heads, dim, device="cuda", dtype=dtype),
                torch.empty(1, 256, heads_kv, dim, device="cuda", dtype=dtype))

    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    x64 = torch.empty(8, 64, 64, device="cuda", dtype=torch.bfloat16)
    kv64 = torch.empty(8, 8, 64, device="cuda", dtype=torch.bfloat16)
    jobs = [
        lambda: decode_kernels(*q_cache(64, 8, 64, 4), block_table=table, causal=True, merge_allocates=False),
        lambda: decode_single_kernel(*q_cache(64, 8, 64, 4), block_table=table, causal=True),
        lambda: decode_kernels(*q_cache(64, 8, 64, 4), block_table=table, window_size=1000, merge_allocates=False),
        lambda: decode_single_kernel(*q_cache(64, 8, 64, 4), block_table=table, window_size=1000),
        lambda: decode_kernels(*q_cache(16, 16, 128, 1, torch.float16), causal=True, merge_allocates=False),
        lambda: decode_single_kernel(*q_cache(16, 16, 128, 1, torch.float16), causal=True),
        lambda: varlen_kernels(x64, kv64, window_size=128),
        lambda: _varlen_small_kernels(64, "bfloat16", "cuda"),
    ]
    in_parallel(lambda job: job(), jobs)
