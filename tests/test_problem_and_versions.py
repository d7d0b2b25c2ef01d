"""One problem description, one kernel registry, versions as pieces (docs/layout_codegen.md), checked without a GPU."""

import re

import pytest
import torch

from course_utils.api import attention, registry
from course_utils.api.attention import ForwardConfig, forward_kernel
from course_utils.api.compiled import compiled
from course_utils.core.problem import AttentionProblem
from course_utils.core.source import cuda_source
from course_utils.kernels.flash_fwd import flash_fwd_kernel
from course_utils.kernels.flash_fwd_hopper import flash_fwd_hopper_kernel
from course_utils.kernels.flash_fwd_hopper_one_warpgroup import flash_fwd_hopper_one_warpgroup_kernel
from course_utils.kernels.flash_fwd_hopper_persistent import flash_fwd_hopper_persistent_kernel
from course_utils.kernels.versions import flash_bwd_hopper_versions as bwd_versions
from course_utils.kernels.versions import flash_fwd_hopper_versions as fwd_versions
from course_utils.kernels.versions.version import Version


def test_the_problem_is_built_once_and_is_the_cache_key():
    q, k = torch.zeros(1, 4, 32, 16), torch.zeros(1, 2, 48, 16)
    a = AttentionProblem.dense(q, k, window_size=8)
    assert a == AttentionProblem.dense(q.clone(), k.clone(), window_size=8) and hash(a) == hash(
        AttentionProblem.dense(q, k, window_size=8))
    assert a.causal and a.shape == (1, 4, 32, 48, 16) and a.target == "c" and a.sm_scale == 0.25
    assert AttentionProblem.dense(q, k) != a
    compiled.cache_clear()
    forward_kernel(q, k, window_size=8)
    forward_kernel(q.clone(), k.clone(), window_size=8)
    info = compiled.cache_info()
    assert (info.misses, info.hits) == (1, 1), info


def test_a_kernel_is_one_row():
    assert attention.FORWARD_KERNELS == {name: row.factory for name, row in registry.FORWARD.items()}
    assert attention.BACKWARD_KERNELS == {name: row.factory for name, row in registry.BACKWARD.items()}
    q = torch.zeros(1, 2, 16, 16)
    with pytest.raises(ValueError, match="ForwardConfig.kernel must be one of"):
        forward_kernel(q, q, config=ForwardConfig(16, 16, 1, 1, kernel="flash_fwd_nope"))
    with pytest.raises(ValueError, match="needs an sm_90 GPU"):
        forward_kernel(q, q, config=ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper_persistent"))
    with pytest.raises(ValueError, match="pingpong=True"):
        forward_kernel(q, q, config=ForwardConfig(16, 16, 1, 1, pingpong=True))


def test_forward_versions_are_shipped_kernels_plus_pieces():
    shipped = {flash_fwd_kernel, flash_fwd_hopper_kernel, flash_fwd_hopper_persistent_kernel,
               flash_fwd_hopper_one_warpgroup_kernel}
    assert all(v.factory in shipped for v in fwd_versions.VERSIONS)
    assert [v.number for v in fwd_versions.VERSIONS] == list(range(1, len(fwd_versions.VERSIONS) + 1))
    # one Version type for both ablations
    assert all(type(v) is Version for v in fwd_versions.VERSIONS + bwd_versions.VERSIONS)
    v12 = next(v for v in fwd_versions.VERSIONS if v.number == 12)
    assert v12.knobs_for(128, True)["order"] is fwd_versions.unfolded_order


def test_a_variant_without_its_switches_is_the_shipped_kernel():
    shape = dict(batch=1, heads=2, seq_q=512, seq_k=512, dim=64, causal=True)
    a = cuda_source(flash_fwd_hopper_kernel(**shape))
    b = cuda_source(fwd_versions.flash_fwd_hopper_variant(**shape))
    assert a != b  # the variant keeps its own kernel name
    assert a == re.sub(r"flash_fwd_hopper_variant_kernel", "flash_fwd_hopper_kernel", b)


def test_one_ablation_runner_for_both_directions(monkeypatch):
    """Chapter 07's and chapter 08's records go through ``common.ablation``; it keeps a version that fails
    to build or to check as a row with its error, and times the others next to the peers."""
    from course_utils.measure.benchmarks import ch07_hopper, ch08_hopper_backward, common

    modes = []
    for module in (ch07_hopper, ch08_hopper_backward):
        monkeypatch.setattr(module, "ablation", lambda *args, **kw: modes.append(kw["mode"]) or [])
    ch07_hopper.forward_ablation()
    ch08_hopper_backward.backward_ablation()
    assert modes == ["fwd", "bwd"]

    def builder(version, *args, **kw):
        if version.number == 2:
            raise RuntimeError("out of registers")
        return f"kernel {version.number}"

    def check(kernel, name):
        if kernel == "kernel 3":
            raise AssertionError("dK wrong")
        return {"dq": {"err": 0.0}}

    versions = [Version(n, f"v{n}", "why", builder=builder, kept=n != 3) for n in (1, 2, 3)]
    monkeypatch.setattr(common, "time_side_by_side", lambda impls: {name: 2.0 for name in impls})
    rows = common.ablation([(64, True)], lambda causal, dim: versions,
                           lambda shape, causal: common.AblationCase(check, lambda k: (lambda: k), {"peer": None}),
                           mode="bwd", seq=256)
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"v1", "v2", "v3", "peer"}
    assert "out of registers" in by_impl["v2"]["error"] and "dK wrong" in by_impl["v3"]["error"]
    assert by_impl["v3"]["kept"] is False and "ms" not in by_impl["v3"]
    assert by_impl["v1"]["error"] is None and by_impl["v1"]["ms"] == 2.0 and by_impl["v1"]["version"] == 1
    assert by_impl["peer"]["version"] is None and by_impl["peer"]["tflops"] == by_impl["v1"]["tflops"] > 0
