"""Chapter 07's Hopper forward without a GPU: it lowers to the intended sm_90a schedule, ptxas
keeps its wgmmas asynchronous, and asking for it where it cannot run is a clear error."""

import re

import pytest
import torch

from course_utils import flash_attention
from course_utils.attention import HOPPER_FORWARD_CONFIGS, ForwardConfig, default_forward_config, is_hopper
from course_utils.flash_fwd_hopper import flash_fwd_hopper_kernel
from course_utils.flash_fwd_hopper_versions import flash_fwd_hopper_variant
from course_utils.source import cuda_source, ptxas_report

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
    with pytest.raises(ValueError, match="needs kernel='flash_fwd_hopper'"):
        flash_attention(q, q, q, config=ForwardConfig(16, 16, 1, 1, pingpong=True))
