"""On the CPU: the packed batches' Hopper kernels (chapter 07's persistent forward and chapter 08's
backward under the packed prelude) — their work list, when they are the default, and what their sm_90a code
must and must not contain (lowered without a GPU). Their numbers: docs/varlen_and_decoding.md."""

import dataclasses
import functools
import re

import pytest
import torch
from shared_lowering import cuda_source

from course_utils import flash_attention_varlen
from course_utils.api import registry, varlen_api
from course_utils.api.attention import BackwardConfig, ForwardConfig
from course_utils.kernels.flash_varlen_hopper import varlen_pair_list


def _walk(pairs, count, lengths, block_M, num_ctas):
    """The tiles each persistent block takes, as the kernel computes them (its index arithmetic in Python)."""
    n = int(count[0])
    rounds = -(-n // num_ctas)
    taken = [[] for _ in range(num_ctas)]
    for cta in range(num_ctas):
        for w in range(2 * rounds):
            r = w // 2
            slot = r * num_ctas + (cta if r % 2 == 0 else num_ctas - 1 - cta)
            b, h, j = pairs[min(slot, pairs.shape[0] - 1)].tolist()
            n_qb = -(-lengths[b] // block_M)
            qb = n_qb - 1 - j if w % 2 == 0 else j
            if slot < n and (w % 2 == 0 or j != n_qb - 1 - j):
                taken[cta].append((b, h, qb))
    return taken


@pytest.mark.parametrize("lengths, block_M, heads, num_ctas", [
    ([1, 127, 128, 129, 0, 300, 1000], 128, 3, 5),
    ([0, 0, 5], 64, 1, 132),
    ([2817, 6892, 6576, 5368, 221, 6462, 2245, 6761, 6715, 936, 374, 1494, 3674, 2277, 2986, 1374, 6704, 1660],
     128, 16, 132),
])
def test_persistent_work_list_takes_every_tile_once(lengths, block_M, heads, num_ctas):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pairs, count = varlen_pair_list(cu, cu, heads, block_M, max(lengths))
    assert pairs.dtype == count.dtype == torch.int32 and count.shape == (1,)
    taken = [t for per_block in _walk(pairs, count, lengths, block_M, num_ctas) for t in per_block]
    expected = [(b, h, qb) for b, n in enumerate(lengths) for h in range(heads) for qb in range(-(-n // block_M))]
    assert sorted(taken) == sorted(expected)  # every tile, none twice, nothing of an empty sequence
    # Longest sequences first: the pairs taken last are the cheapest.
    order = [int(b) for b in pairs[:int(count[0]), 0]]
    assert [lengths[b] for b in order] == sorted((lengths[b] for b in order), reverse=True)


def test_persistent_work_list_balances_the_record_batch():
    """Causal tiles per block on 132 SMs (the record's batch): the folded pairs, longest first and snaking
    over the blocks, leave the busiest block within 3% of the mean."""
    lengths = [2817, 6892, 6576, 5368, 221, 6462, 2245, 6761, 6715, 936, 374, 1494, 3674, 2277, 2986, 1374, 6704,
               1660]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pairs, count = varlen_pair_list(cu, cu, 16, 128, max(lengths))
    work = [sum(qb + 1 for _, _, qb in per_block) for per_block in _walk(pairs, count, lengths, 128, 132)]
    assert max(work) / (sum(work) / len(work)) < 1.03


@pytest.mark.parametrize("dim, masked", [(64, True), (64, False), (128, True), (128, False), (256, True)])
def test_hopper_defaults_for_packed_batches(monkeypatch, dim, masked):
    monkeypatch.setattr(varlen_api, "is_hopper", lambda: True)
    fwd, bwd = varlen_api._varlen_configs("cuda", dim, masked, None, None)
    if dim in varlen_api.VARLEN_HOPPER_DIMS:
        assert fwd == varlen_api.VARLEN_PERSISTENT_CONFIG
        assert bwd == varlen_api.VARLEN_HOPPER_BACKWARD_CONFIGS[dim, masked]
    else:
        assert (fwd, bwd) == (varlen_api.VARLEN_CUDA_CONFIG, varlen_api.VARLEN_CUDA_BACKWARD_CONFIG)
    monkeypatch.setattr(varlen_api, "is_hopper", lambda: False)  # other GPUs keep chapter 03's and 05's loops
    assert varlen_api._varlen_configs("cuda", dim, masked, None, None) == (
        varlen_api.VARLEN_CUDA_CONFIG, varlen_api.VARLEN_CUDA_BACKWARD_CONFIG)


def test_packed_and_dense_backward_share_the_step_at_d128():
    """At D = 128 the packed backward runs the dense default's step and tile height, causal or not (versions 20, 22
    and 23; measured on chapter 09's batch, docs/varlen_and_decoding.md): a change to one config must reach the other.
    Only ``longest_first`` differs (measured a loss or no gain for packed batches)."""
    from course_utils.api.attention import HOPPER_BACKWARD_CONFIGS

    for masked in (False, True):
        packed, dense = varlen_api.VARLEN_HOPPER_BACKWARD_CONFIGS[128, masked], HOPPER_BACKWARD_CONFIGS[128, masked]
        assert packed == dense._replace(longest_first=False)
        assert packed.block_M == 80


def _args():
    lengths = [5, 0, 11]
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32)
    q, k, v = (torch.randn(16, 2, 16) for _ in range(3))
    return q, k, v, cu, cu, max(lengths), max(lengths)


@pytest.mark.parametrize("kwargs, message", [
    (dict(config=varlen_api.VARLEN_PERSISTENT_CONFIG), "needs an sm_90 GPU"),
    (dict(backward_config=varlen_api.VARLEN_HOPPER_BACKWARD_CONFIGS[128, True]), "needs an sm_90 GPU"),
    (dict(config=ForwardConfig(16, 16, 1, 1, kernel="flash_fwd_hopper", pingpong=True)), "pingpong"),
    (dict(config=ForwardConfig(16, 16, 1, 1, kernel="nope")), "config.kernel must be one of"),
    (dict(backward_config=BackwardConfig(16, 16, 1, 1, kernel="nope")), "backward_config.kernel must be one of"),
])
def test_packed_hopper_kernels_refused_where_they_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        flash_attention_varlen(*_args(), **kwargs)


def test_persistent_threads_must_match_its_warpgroups(monkeypatch):
    monkeypatch.setattr(varlen_api, "is_hopper", lambda: True)
    with pytest.raises(ValueError, match="config.threads must be 2 \\* block_M"):
        varlen_api._varlen_configs("cuda", 128, True, ForwardConfig(128, 128, 2, 128, "flash_fwd_hopper_persistent"),
                                   None)


def test_persistent_packed_forward_code():
    """sm_90a lowering, no GPU: the consumers never meet in a barrier of their own (the producer zeroes the value
    rows past a sequence's end: it waits for that load itself, zeroes, fences, and only then lets them read)."""
    from course_utils.kernels.flash_varlen_hopper import PackedForwardPieces, flash_varlen_fwd_persistent_kernel

    source = cuda_source(flash_varlen_fwd_persistent_kernel(4, 128, causal=True,
                                                            pieces=PackedForwardPieces(o_by_tma=False)))
    assert not re.search(r"__sync_thread_partial\([^;]*, 256\)", source)  # no consumer barrier
    assert source.count("__syncthreads()") == 1  # the barriers' initialisation, before the roles split
    edge = source.index("v_edge[0].wait(")
    zero, fence = source.index("half_t(0x0p+0f", edge), source.index("tl::fence_proxy_async();", edge)
    assert edge < zero < fence < source.index(".arrive();", fence)
    assert "tma_store" not in source  # o_by_tma=False: O leaves row by row, every tile


def test_persistent_packed_forward_stores_full_tiles_by_tma():
    """``o_by_tma``: a tile whose 128 rows are all its sequence's goes through shared memory by TMA (after the
    previous store has read it), a ragged one row by row; the block waits for its last store before it exits."""
    from course_utils.kernels.flash_varlen_hopper import flash_varlen_fwd_persistent_kernel

    source = cuda_source(flash_varlen_fwd_persistent_kernel(4, 128, causal=True))  # the default
    full = source.index("if (128 <= rows_left) {")
    wait, store = source.index("tma_store_wait<0, true>();", full), source.index("tma_store(Output_desc", full)
    ragged = source.index("} else {", store)
    assert full < wait < store < ragged < source.index("< (rows_left + 64)", ragged)
    assert source.rindex("tma_store_wait<0, true>();") > source.rindex("LSE[")


def test_packed_hopper_backward_code():
    """sm_90a lowering: the barrier after zeroing rows of another sequence sits only in the two branches that
    zero them (K/V on a block's first step, Q/dO on a query block past the end), each after its fence."""
    from course_utils.kernels.flash_bwd_hopper import PASS_CONFIGS
    from course_utils.kernels.flash_varlen_hopper import flash_varlen_bwd_hopper_kernel

    source = cuda_source(flash_varlen_bwd_hopper_kernel(4, 128, causal=True), pass_configs=PASS_CONFIGS)
    assert len(re.findall(r"fence_proxy_async\(\);\s*tl::__sync_thread_partial\(7, 256\)", source)) == 2
    assert source.count("__sync_thread_partial(7, 256)") == 2


def test_packed_hopper_backward_takes_the_dense_kernels_fields(monkeypatch):
    """sm_90a lowering: the dense kernel's ``BackwardConfig`` fields mean the same in the packed backward.
    ``dv_under_ds``: dV is issued before dSᵀ's barrier (three products before it, not two); ``dkdv_by_tma``: a block
    whose keys are all its sequence's stores by TMA, a ragged one row by row (GQA's accumulators: row by row
    always); ``longest_first``: the key block on the grid's second axis, the head on its first (as dense);
    ``defer_dq_wait``: the dQ reduce's wait before the next dSᵀ barrier, none right after it; and
    ``_varlen_backward`` passes the fields on."""
    from course_utils.kernels.flash_bwd_hopper import PASS_CONFIGS
    from course_utils.kernels.flash_varlen_hopper import PackedBackwardPieces, flash_varlen_bwd_hopper_kernel
    from course_utils.kernels.generated_code import _EARLY_WAIT, MOVED_WAIT

    def source(heads_kv=None, **fields):
        return cuda_source(flash_varlen_bwd_hopper_kernel(4, 128, heads_kv=heads_kv, causal=True,
                                                          pieces=PackedBackwardPieces(**fields)),
                           pass_configs=PASS_CONFIGS)

    def products_before_ds_barrier(src):
        return len(re.findall(r"wgmma_(?:ss|rs)<", src[:src.index("__sync_thread_partial(6, 256)")]))

    plain, under, tma, first = (source(), source(dv_under_ds=True), source(dkdv_by_tma=True),
                                source(longest_first=True))
    assert (products_before_ds_barrier(plain), products_before_ds_barrier(under)) == (2, 3)
    assert "tma_store(dK_desc" not in plain and "tma_store(dK_desc" in tma and "tma_store(dV_desc" in tma
    guard = tma.index("if (128 <= keys_left)")
    assert guard < tma.index("tma_store(dV_desc") < tma.index("keys_left + 64")  # the ragged branch after it
    gqa = source(heads_kv=2, dkdv_by_tma=True)
    assert "tma_store(dK_desc" not in gqa
    deferred = source(defer_dq_wait=True)
    early, moved = _EARLY_WAIT.pattern, MOVED_WAIT.pattern + r"6, 256\)"  # moved: before the dSᵀ barrier
    assert [len(re.findall(pattern, src)) for src in (plain, deferred) for pattern in (early, moved)] == [1, 0, 0, 1]
    assert "(i * 64), ((((int)blockIdx.x) * 128) + k0), ((int)blockIdx.y));" in plain  # K: key block x, head y
    assert "(i * 64), ((((int)blockIdx.y) * 128) + k0), ((int)blockIdx.x));" in first  # key block y, head x
    seen = {}
    row = registry.PACKED_BACKWARD["flash_bwd_hopper"]
    # The stand-in keeps the factory's signature (the row reads its default tiling from it).
    monkeypatch.setitem(registry.PACKED_BACKWARD, "flash_bwd_hopper",
                        dataclasses.replace(row, factory=functools.wraps(row.factory)(
                            lambda *a, **kw: seen.update(kw))))
    monkeypatch.setattr(registry, "compile_kernel", lambda *a, **kw: None)
    x = torch.empty(8, 4, 128, dtype=torch.float16)
    problem = dataclasses.replace(varlen_api.AttentionProblem.packed(x, x, causal=True), target="cuda")
    fields = dict(dv_under_ds=True, dkdv_by_tma=True, longest_first=True, defer_dq_wait=True)
    varlen_api.compiled.cache_clear()
    varlen_api._varlen_backward(problem, BackwardConfig(64, 128, 2, 256, "flash_bwd_hopper", **fields), "grid")
    varlen_api.compiled.cache_clear()
    assert seen["pieces"]._asdict() == fields and tuple(seen["tiling"]) == (64, 128, 2, 256)
