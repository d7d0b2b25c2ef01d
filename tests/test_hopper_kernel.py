"""Chapter 07's Hopper forwards without a GPU: they lower to the intended sm_90a schedule, ptxas
keeps their wgmmas asynchronous without spilling, the persistent kernel's tile schedule covers every
tile once, and asking for them where they cannot run is a clear error."""

import functools
import re

import pytest
import torch

from course_utils import flash_attention
from course_utils.api.attention import HOPPER_FORWARD_CONFIGS, ForwardConfig, default_forward_config, is_hopper
from course_utils.core.source import cuda_source, ptxas_report
from course_utils.kernels.flash_fwd_hopper import flash_fwd_hopper_kernel
from course_utils.kernels.versions.flash_fwd_hopper_versions import flash_fwd_hopper_variant

VARIANTS = {
    "plain": dict(),
    "gpt-oss": dict(heads_kv=2, causal=True, window_size=128, has_sinks=True, dtype="bfloat16", dim=64),
    "ragged causal": dict(causal=True, seq_q=1000, seq_k=1000),
}


def _source(factory=flash_fwd_hopper_kernel, **options):
    shape = dict(batch=2, heads=4, seq_q=2048, seq_k=2048, dim=128)
    shape.update({k: options.pop(k) for k in list(options) if k in shape})
    return cuda_source(factory(**shape, **options))


def _consumer_loop(source):
    start = source.index("for (int kb_1 = ")
    return source[start:source.index("stage_in_use[0] =", start)]


@pytest.mark.parametrize("name", VARIANTS)
def test_rotated_loop_order(name):
    loop = _consumer_loop(_source(**VARIANTS[name]))
    positions = [loop.find(mark) for mark in ("wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>", "exp2f", "wait_wgmma<0>")]
    assert -1 not in positions and positions == sorted(positions), positions


def test_both_matmuls_issued_unconditionally():
    loop = _consumer_loop(_source())
    before_first_wait = loop[:loop.index("wait_wgmma<1>")]
    assert not re.search(r"if \(kb_1 < |if \(0 < kb_1\)", before_first_wait)


def test_ptxas_keeps_wgmma_async_only_without_conditional_issue():
    good = ptxas_report(_source())
    if good is None:
        pytest.skip("nvcc is not installed")
    bad = ptxas_report(_source(flash_fwd_hopper_variant, conditional_issue=True))
    assert not any("serialized" in line for line in good)
    assert any("serialized" in line for line in bad)
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in good), good


def test_cpu_defaults_unchanged_and_overlap_rejected_off_hopper():
    assert not is_hopper()
    assert default_forward_config("cpu", 64).kernel == "flash_fwd"
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="sm_90"):
        flash_attention(q, q, q, config=HOPPER_FORWARD_CONFIGS[128, False])
    with pytest.raises(ValueError, match=r"pingpong=True\) needs a kernel that takes it, one of \['flash_fwd_hopper'"):
        flash_attention(q, q, q, config=ForwardConfig(16, 16, 1, 1, pingpong=True))


# The persistent kernel (flash_fwd_hopper_persistent_kernel).

def _evaluate(expr):
    from tilelang import tvm

    return expr if isinstance(expr, int) else int(tvm.arith.Analyzer().simplify(expr))


@pytest.mark.parametrize("total, num_ctas", [(96, 10), (95, 10), (7, 132), (2048, 132), (2731, 132)])
def test_persistent_schedule_covers_every_tile_once(total, num_ctas):
    from course_utils.kernels.flash_fwd_hopper_persistent import tile_index, tiles_per_block

    num_ctas = min(num_ctas, (total + 1) // 2)  # as the kernel launches
    taken = [_evaluate(tile_index(num_ctas, cta, w))
             for cta in range(num_ctas) for w in range(_evaluate(tiles_per_block(total, num_ctas, cta)))]
    assert sorted(taken) == list(range(total))


@pytest.mark.parametrize("seq, block_M", [(1024, 128), (4096, 128), (1024, 192)])
def test_folded_causal_pairs_cost_about_the_same(seq, block_M):
    from course_utils.kernels.flash_fwd_hopper_persistent import tile_order
    from course_utils.kernels.flash_pieces import prelude

    p = prelude(2, seq, seq, 64, causal=True)
    n_qb = p.blocks(seq, block_M)
    blocks = [-(-(_evaluate(tile_order(p, t, block_M)[2]) + 1) * block_M // 128) for t in range(n_qb)]
    pairs = [blocks[i] + blocks[i + 1] for i in range(0, n_qb - 1, 2)]
    assert max(pairs) - min(pairs) <= 1, pairs
    assert sorted(_evaluate(tile_order(p, t, block_M)[2]) for t in range(n_qb)) == list(range(n_qb))


PERSISTENT = {
    "D=128": dict(dim=128),
    "D=64, 3 warpgroups, causal, ping-pong": dict(dim=64, heads=8, block_M=192, threads=384, causal=True,
                                                   pingpong=True),
}


@functools.cache
def _persistent_source(name):
    from course_utils.kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel

    return _source(flash_fwd_hopper_persistent_kernel, **PERSISTENT[name])


@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_loop_is_peeled(name):
    """Per tile: one QKᵀ before the loop, QKᵀ + P·V in it, one P·V after it — no idle matmul, no branch."""
    source = _persistent_source(name)
    consumer = source[source.index("warpgroup_reg_alloc<"):]
    loop_start = re.search(r"for \(int \w+ = 1; ", consumer).start()  # the loop over key blocks 1, 2, ...
    loop = consumer[loop_start:]
    assert consumer.count("wgmma_ss<") == 2 and consumer.count("wgmma_rs<") == 2
    assert consumer.index("wgmma_ss<") < loop_start < consumer.rindex("wgmma_rs<")
    marks = [loop.find(mark) for mark in ("wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>", "exp2f", "wait_wgmma<0>")]
    assert -1 not in marks and marks == sorted(marks), marks
    assert "__syncthreads" not in consumer  # producer and consumers never wait for each other except on mbarriers


@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_ptxas_keeps_wgmma_async_without_spills(name):
    report = ptxas_report(_persistent_source(name))
    if report is None:
        pytest.skip("nvcc is not installed")
    assert not any("C75" in line for line in report), report
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report


def test_persistent_kernel_rejects_a_thread_count_that_is_not_one_warpgroup_per_64_rows():
    from course_utils.kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel

    with pytest.raises(ValueError, match="one consumer warpgroup per 64 query rows"):
        flash_fwd_hopper_persistent_kernel(1, 2, 256, 256, 64, block_M=128, threads=384)
