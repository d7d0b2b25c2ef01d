"""Every kernel the front doors run is a registry row, compiled through the one cache (``api.compiled``)."""

import ast
from pathlib import Path

import pytest
import torch

import course_utils
from course_utils.api import compiled as compiled_module
from course_utils.api import decode_api, registry
from course_utils.api.attention import _compiled_backward, flash_attention
from course_utils.api.compiled import compiled
from course_utils.api.decode_api import flash_decode
from course_utils.api.flex import causal_mask, flex_attention, soft_cap
from course_utils.api.fp8 import flash_attention_fp8
from course_utils.api.varlen_api import flash_attention_varlen
from course_utils.kernels import (
    flash_bwd,
    flash_flex,
    flash_flex_hopper,
    flash_flex_hopper_bwd,
    flash_fwd_fp8,
    flash_varlen,
)
from course_utils.kernels import flash_decode as decode_kernels
from course_utils.kernels.flash_bwd_hopper import flash_bwd_hopper_dq_kernel, flash_bwd_hopper_kernel
from course_utils.kernels.flash_fwd import flash_fwd_kernel
from course_utils.kernels.flash_fwd_hopper import flash_fwd_hopper_kernel
from course_utils.kernels.flash_fwd_hopper_one_warpgroup import flash_fwd_hopper_one_warpgroup_kernel
from course_utils.kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel
from course_utils.kernels.flash_varlen_hopper import flash_varlen_bwd_hopper_kernel, flash_varlen_fwd_persistent_kernel

API = Path(course_utils.__file__).parent / "api"


def test_every_factory_the_front_doors_use_is_a_row():
    factories = {row.factory for table in registry.ROWS.values() for row in table.values()}
    expected = {
        flash_fwd_kernel, flash_fwd_hopper_kernel, flash_fwd_hopper_persistent_kernel,
        flash_fwd_hopper_one_warpgroup_kernel, flash_bwd.flash_bwd_kernel, flash_bwd_hopper_kernel,
        flash_bwd.flash_bwd_preprocess_kernel, flash_bwd.flash_bwd_postprocess_kernel, flash_bwd_hopper_dq_kernel,
        flash_varlen.flash_varlen_fwd_kernel, flash_varlen.flash_varlen_bwd_kernel, flash_varlen_fwd_persistent_kernel,
        flash_varlen_bwd_hopper_kernel, flash_varlen.varlen_delta_kernel, flash_varlen.scale_cast_kernel,
        decode_kernels.flash_decode_kernel, decode_kernels.flash_decode_merge_kernel,
        flash_fwd_fp8.flash_fwd_fp8_kernel, flash_fwd_fp8.flash_fwd_fp8_hopper_kernel,
        flash_flex.flex_fwd_kernel, flash_flex_hopper.flex_fwd_hopper_kernel, flash_flex.flex_bwd_kernel,
        flash_flex_hopper_bwd.flex_bwd_hopper_kernel,
    }
    assert expected <= factories, expected - factories
    names = [(table, name) for table, rows in registry.ROWS.items() for name in rows]
    assert all(registry.ROWS[table][name].name == name for table, name in names)


@pytest.mark.parametrize("path", sorted(p.name for p in API.glob("*.py")))
def test_only_the_registry_compiles(path):
    """No front door compiles a kernel itself: ``compile_kernel`` is called in ``registry`` only."""
    if path == "registry.py":
        return
    tree = ast.parse((API / path).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert "compile_kernel" not in imported, f"{path} compiles kernels itself; make them registry rows"


@pytest.fixture
def compiles(monkeypatch):
    """The number of kernels compiled so far (from a clear cache)."""
    count = [0]
    real = registry.compile_kernel

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "compile_kernel", counting)
    compiled.cache_clear()
    _compiled_backward.cache_clear()
    decode_api._PLANS.clear()
    yield count
    compiled.cache_clear()
    _compiled_backward.cache_clear()


def _twice(call):
    call()
    call()


def test_a_second_identical_call_compiles_nothing(compiles):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, requires_grad=True) for _ in range(3))
    qp, kp, vp = (torch.randn(40, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 16, 40], dtype=torch.int32)
    qd, cache = torch.randn(2, 1, 2, 16), torch.randn(2, 32, 1, 16)
    lengths = torch.tensor([5, 32], dtype=torch.int32)
    calls = {
        "dense forward and backward": lambda: flash_attention(q, k, v, causal=True).sum().backward(),
        "packed": lambda: flash_attention_varlen(qp, kp, vp, cu, cu, 24, 24, causal=True),
        "decode, one split": lambda: flash_decode(qd, cache, cache, lengths),
        "decode, two splits": lambda: flash_decode(qd, cache, cache, lengths, num_splits=2),
        "fp8": lambda: flash_attention_fp8(q.detach(), k.detach(), v.detach()),
        # soft_cap(20.0) is a new function object at every call, with the same formula: the same kernels
        "flex forward and backward": lambda: flex_attention(q, k, v, score_mod=soft_cap(20.0),
                                                            mask_mod=causal_mask).sum().backward(),
    }
    expected = {"dense forward and backward": 4, "packed": 1, "decode, one split": 1, "decode, two splits": 2,
                "fp8": 1, "flex forward and backward": 4}
    for what, call in calls.items():
        before = compiles[0]
        _twice(call)
        assert compiles[0] - before == expected[what], what
        decode_api._PLANS.clear()
        call()  # the plan is made again; its kernels come from the cache
        assert compiles[0] - before == expected[what], what
    assert compiled_module.compiled.cache_info().currsize == sum(expected.values())


CAP = 5.0


def capped(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def test_a_flex_kernel_follows_what_its_modifier_reads(compiles):
    """The flex kernels are keyed by the traced formula: a modifier reading a changed global compiles anew, another
    function with the same formula compiles nothing."""
    global CAP
    q = torch.randn(1, 2, 32, 16)
    flex_attention(q, q, q, score_mod=capped)
    flex_attention(q, q, q, score_mod=capped)
    assert compiles[0] == 1
    CAP = 7.0
    try:
        flex_attention(q, q, q, score_mod=capped)
        assert compiles[0] == 2
    finally:
        CAP = 5.0

    def twin(score, b, h, q_idx, kv_idx):
        return CAP * torch.tanh(score / CAP)

    flex_attention(q, q, q, score_mod=twin)
    assert compiles[0] == 2
