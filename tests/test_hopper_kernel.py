"""Chapter 07's Hopper forwards without a GPU: they lower to the intended sm_90a schedule, ptxas
keeps their wgmmas asynchronous without spilling, the persistent kernel's tile schedule covers every
tile once, and asking for them where they cannot run is a clear error."""

import functools
import re

import pytest
import torch
from shared_lowering import cuda_source, ptxas_reports

from course_utils import flash_attention
from course_utils.api.attention import (
    HOPPER_FORWARD_CONFIGS,
    ONE_WARPGROUP_FORWARD_CONFIG,
    ForwardConfig,
    default_forward_config,
    hopper_forward_config,
    is_hopper,
)
from course_utils.kernels.flash_fwd_hopper import flash_fwd_hopper_kernel
from course_utils.kernels.flash_fwd_hopper_persistent import PersistentTiling
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


@pytest.fixture(scope="module")
def reports():
    """ptxas's report on each kernel the tests below compile, all from one nvcc run (``shared_lowering.ptxas_reports``:
    each kernel under its own name in one translation unit); None where nvcc is not installed."""
    sources = {"rotated": _source(), "rotated, conditional issue": _source(flash_fwd_hopper_variant,
                                                                          conditional_issue=True),
               **{("persistent", name): _persistent_source(name) for name in PERSISTENT},
               **{("one warpgroup", name): _one_warpgroup_source(name) for name in ONE_WARPGROUP}}
    return ptxas_reports(sources)


def report_of(reports, kernel):
    """``kernel``'s report; the test is skipped where nvcc is not installed."""
    if reports is None:
        pytest.skip("nvcc is not installed")
    return reports[kernel]


def assert_async_without_spills(report):
    assert not any("C75" in line for line in report), report  # C75xx: ptxas serialised the wgmmas
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in report), report


def registers_used(report):
    return int(re.search(r"Used (\d+) registers", " ".join(report)).group(1))


def test_ptxas_keeps_wgmma_async_only_without_conditional_issue(reports):
    good, bad = report_of(reports, "rotated"), report_of(reports, "rotated, conditional issue")
    assert not any("serialized" in line for line in good)
    assert any("serialized" in line for line in bad)
    assert any("0 bytes spill stores, 0 bytes spill loads" in line for line in good), good


@pytest.mark.skipif(is_hopper(), reason="the defaults and errors of a machine without a Hopper GPU")
def test_cpu_defaults_unchanged_and_overlap_rejected_off_hopper():
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
    "D=64, 3 warpgroups, causal, ping-pong": dict(dim=64, heads=8, causal=True, tiling=PersistentTiling(
        block_M=192, threads=384, pingpong=True)),
    "D=64, 1 warpgroup, 2 blocks per SM": dict(dim=64, heads=8, tiling=PersistentTiling(block_M=64, threads=128,
                                                                                          blocks_per_sm=2)),
    "D=64, 1 warpgroup, 64-key tiles, 3 blocks per SM, causal": dict(
        dim=64, heads=8, causal=True, tiling=PersistentTiling(block_M=64, block_N=64, threads=128, blocks_per_sm=3)),
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
def test_persistent_ptxas_keeps_wgmma_async_without_spills(name, reports):
    assert_async_without_spills(report_of(reports, ("persistent", name)))


def test_persistent_kernel_rejects_a_thread_count_that_is_not_one_warpgroup_per_64_rows():
    from course_utils.kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel

    with pytest.raises(ValueError, match="one consumer warpgroup per 64 query rows"):
        flash_fwd_hopper_persistent_kernel(1, 2, 256, 256, 64, tiling=PersistentTiling(block_M=128, threads=384))


@pytest.mark.parametrize("name", [n for n in PERSISTENT if "blocks per SM" in n])
def test_several_blocks_per_sm_fit_the_register_file(name, reports):
    """Two or three blocks of 256 threads share an SM's 65536 registers: the launch asks for that many,
    ptxas stays within 65536 / (blocks * 256) a thread, and the consumers get the producer's spare ones."""
    blocks = PERSISTENT[name]["tiling"].blocks_per_sm
    source = _persistent_source(name)
    assert f"__launch_bounds__(256, {blocks})" in source
    launch = 65536 // (blocks * 256) // 8 * 8
    assert f"warpgroup_reg_alloc<{2 * launch - 24}>" in source and "warpgroup_reg_dealloc<24>" in source
    report = report_of(reports, ("persistent", name))
    assert registers_used(report) <= launch, report


def test_several_blocks_per_sm_need_one_consumer_warpgroup():
    from course_utils.kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel

    with pytest.raises(ValueError, match="one consumer warpgroup"):
        flash_fwd_hopper_persistent_kernel(1, 2, 256, 256, 64, tiling=PersistentTiling(blocks_per_sm=2))
    with pytest.raises(ValueError, match="two or three"):
        flash_fwd_hopper_persistent_kernel(1, 2, 256, 256, 64, tiling=PersistentTiling(block_M=64, threads=128,
                                                                                       blocks_per_sm=4))
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match=r"blocks_per_sm=2\) needs a kernel that takes it"):
        flash_attention(q, q, q, config=ForwardConfig(16, 16, 1, 1, blocks_per_sm=2))


@pytest.mark.parametrize("masked, seq, expected", [
    (False, 512, "one"), (False, 1024, "one"), (False, 4096, "one"), (False, 8192, "three"), (False, None, "three"),
    (True, 1024, "one"), (True, 2048, "one"), (True, 16384, "one"), (True, None, "one")])
def test_d64_tiling_by_length(masked, seq, expected):
    """At D = 64: one warpgroup per block with the causal mask, and without it below THREE_WARPGROUPS_MIN_SEQ."""
    config = hopper_forward_config(64, masked, seq_len=seq)
    if expected == "one":
        assert config == ONE_WARPGROUP_FORWARD_CONFIG
        assert (config.kernel, config.block_M, config.threads, config.blocks_per_sm) == (
            "flash_fwd_hopper_one_warpgroup", 64, 128, 3)
    else:
        assert (config.kernel, config.block_M, config.threads, config.pingpong) == (
            "flash_fwd_hopper_persistent", 192, 384, True)


def test_window_takes_one_warpgroup_at_d64_and_d128_keeps_its_tiling():
    assert hopper_forward_config(64, True, seq_len=1024, window=True) == ONE_WARPGROUP_FORWARD_CONFIG
    assert hopper_forward_config(64, True, seq_len=16384, window=True) == ONE_WARPGROUP_FORWARD_CONFIG
    for seq in (1024, 4096):
        assert hopper_forward_config(128, True, seq_len=seq) == HOPPER_FORWARD_CONFIGS[128, True]


# One warpgroup per block issuing its own TMA loads (flash_fwd_hopper_one_warpgroup_kernel), D = 64's default.

ONE_WARPGROUP = {
    "S=1k": dict(seq_q=1024, seq_k=1024),
    "S=1k causal": dict(seq_q=1024, seq_k=1024, causal=True),
    "gpt-oss window sinks, ragged": dict(seq_q=1000, seq_k=1000, heads=16, heads_kv=2, causal=True, window_size=128,
                                         has_sinks=True, dtype="bfloat16"),
}


@functools.cache
def _one_warpgroup_source(name):
    from course_utils.kernels.flash_fwd_hopper_one_warpgroup import flash_fwd_hopper_one_warpgroup_kernel

    return _source(flash_fwd_hopper_one_warpgroup_kernel, dim=64, **ONE_WARPGROUP[name])


@pytest.mark.parametrize("name", ONE_WARPGROUP)
def test_one_warpgroup_block_loads_for_itself_and_is_peeled(name):
    """No producer warpgroup: 128 threads, three blocks per SM, every TMA load issued by one elected thread;
    one QKᵀ before the loop, QKᵀ + P·V in it, one P·V after it; a stage is refilled only after the block met."""
    source = _one_warpgroup_source(name)
    assert "__launch_bounds__(128, 3)" in source and "warpgroup_reg_alloc" not in source
    loads = [m.start() for m in re.finditer(r"tl::tma_load\(", source)]
    # Q, the first stages' K and V, block 0's key slot, and K and V in the loop; with a window too (its refills'
    # guards read a register, so TileLang cannot drop them, nor fail on them: see the test below).
    assert len(loads) == 6
    assert all("tl_shuffle_elect<128>()" in source[start - 200:start] for start in loads)
    loop_start = re.search(r"for \(int \w+ = 1; ", source).start()
    assert source.count("wgmma_ss<") == 2 and source.count("wgmma_rs<") == 2
    assert source.index("wgmma_ss<") < loop_start < source.rindex("wgmma_rs<")
    loop = source[loop_start:source.rindex("wgmma_rs<")]
    marks = [loop.find(mark) for mark in ("wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>", "exp2f", "wait_wgmma<0>")]
    assert -1 not in marks and marks == sorted(marks), marks
    refill = loop.index("tl::tma_load(")
    assert "__syncthreads()" in loop[loop.rindex("wait_wgmma<0>", 0, refill):refill]


@pytest.mark.parametrize("seq_q, seq_k, window", [(1000, 1000, 2), (1024, 1024, 65), (1000, 1077, 128),
                                                  (1024, 1024, 193), (512, 640, 150)])
def test_one_warpgroup_kernel_lowers_for_short_windows(seq_q, seq_k, window):
    """A window that bounds the key blocks a query block sees lets TileLang prove a refill's guard false; it then
    failed to lower that refill's TMA load ("TMA is not available for src=K") for windows of 2-65 keys, 130-193, and
    96-130 with more keys than queries (GPU tests, 2026-11-27). The guards now read a register."""
    from course_utils.core.source import lowering_error
    from course_utils.kernels.flash_fwd_hopper_one_warpgroup import flash_fwd_hopper_one_warpgroup_kernel

    func = flash_fwd_hopper_one_warpgroup_kernel(1, 2, seq_q, seq_k, 64, heads_kv=1, causal=True, window_size=window)
    assert lowering_error(func) is None


@pytest.mark.parametrize("name", ONE_WARPGROUP)
def test_one_warpgroup_fits_three_blocks_per_sm(name, reports):
    """ptxas: no serialised wgmma, no spill, and at most 65536 / (3 · 128) registers a thread."""
    report = report_of(reports, ("one warpgroup", name))
    assert_async_without_spills(report)
    assert registers_used(report) <= 65536 // (3 * 128), report


def test_one_warpgroup_kernel_rejects_other_tilings():
    from course_utils.kernels.flash_fwd_hopper_one_warpgroup import (
        OneWarpgroupTiling,
        flash_fwd_hopper_one_warpgroup_kernel,
    )

    with pytest.raises(ValueError, match="one warpgroup on 64 query rows"):
        flash_fwd_hopper_one_warpgroup_kernel(1, 2, 256, 256, 64, tiling=OneWarpgroupTiling(block_M=128, threads=256))
    with pytest.raises(ValueError, match="blocks_per_sm must be 1 to 4"):
        flash_fwd_hopper_one_warpgroup_kernel(1, 2, 256, 256, 64, tiling=OneWarpgroupTiling(blocks_per_sm=5))
    q = torch.randn(1, 2, 32, 16)
    with pytest.raises(ValueError, match="sm_90"):
        flash_attention(q, q, q, config=ONE_WARPGROUP_FORWARD_CONFIG)


def test_the_wait_check_finds_the_wait_on_the_softmax_path_only():
    """``wait_before_exponentials`` (chapter 07, section 3) on planted SASS: the wait for P·V before the first
    exponential is found; one after it, or only on the other path of a branch (the last iteration's), is not."""
    from course_utils.core.source import wait_before_exponentials

    scores, all_done, exp = "WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R1, R1"
    assert wait_before_exponentials([scores, "FMNMX R2, R3", all_done, exp])[1]
    assert not wait_before_exponentials([scores, "FMNMX R2, R3", exp, all_done])[1]
    assert not wait_before_exponentials([scores, "@!P0 BRA `(.L_x_1)", all_done, "BRA `(.L_x_2)", "FFMA R1", exp,
                                         all_done])[1]
    assert wait_before_exponentials([scores, "@!P0 BRA `(.L_x_1)", all_done, "BRA `(.L_x_2)", all_done, exp])[1]
