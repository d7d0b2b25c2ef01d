"""Snapshot of the code TileLang generates for every kernel the course ships (a dev tool, no GPU needed).

For each shipped configuration (the defaults of ``flash_attention``, ``flash_attention_varlen``,
``flash_decode`` and ring attention, the configs of ``attention`` and the benchmark modules) and each
ablation version (chapters 07 and 08), this writes the generated sm_80 and/or sm_90a CUDA, and for the
kernels that run on the CPU the C source, one file each, plus ``MANIFEST.sha256``. A refactor that must
not change behaviour is checked by comparing two snapshots::

    python -m course_utils.tooling.codegen_snapshot OUT_DIR            # write a snapshot
    python -m course_utils.tooling.codegen_snapshot --compare A B      # byte-compare two snapshots

Kernels are captured where they are compiled: ``tilelang.compile`` is replaced by a recorder for the
duration of the snapshot, so the CPU kernels go through the public API (``forward_kernel``,
``backward_kernels``, ``varlen_kernels``, ``decode_kernels``) and the ablation versions through their
``build``; the CUDA kernels are built by their factories with the shipped configs. The recorder keeps
the prim_func and the pass options the course compiles it with, and the snapshot lowers it for each
architecture under those options. Each file also gets a ``.meta`` line: out_idx and pass options.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import sys
from pathlib import Path

import tilelang
import torch
from tilelang import tvm

_PACKAGES = ("kernels", "kernels.versions", "api", "checking", "measure", "measure.benchmarks", "pictures", "tooling")


def _module(name):
    """``course_utils.<layer>.<name>`` wherever the layer puts it (the snapshot runs before and after moves)."""
    for package in _PACKAGES:
        try:
            return importlib.import_module(f"course_utils.{package}.{name}")
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("course_utils"):
                raise
    return importlib.import_module(f"course_utils.{name}")


def _first_module(*names):
    """The first of modules ``names`` that exists: a kernel or front door split off its module keeps its jobs."""
    for name in names[:-1]:
        with contextlib.suppress(ModuleNotFoundError):
            return _module(name)
    return _module(names[-1])


def _benchmarks():
    for name in ("course_utils.measure.benchmarks", "course_utils" + ".benchmarks"):  # after, before the layers
        with contextlib.suppress(ModuleNotFoundError):
            return importlib.import_module(name)
    raise ModuleNotFoundError("course_utils' benchmarks package")


class _Captured:
    """What ``tilelang.compile`` was asked to build (returned instead of a compiled kernel)."""

    def __init__(self, func, out_idx, target, pass_configs):
        self.func, self.out_idx, self.target = func, out_idx, target
        self.pass_configs = dict(pass_configs or {})

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a captured kernel is not compiled")


@contextlib.contextmanager
def _capturing():
    captured = []
    real = tilelang.compile

    def record(func, out_idx=None, target=None, pass_configs=None, **kwargs):
        captured.append(_Captured(func, out_idx, target, pass_configs))
        return captured[-1]

    tilelang.compile = record
    try:
        yield captured
    finally:
        tilelang.compile = real


def _key(key):
    return getattr(key, "value", key)


def _lower(cap, arch):
    configs = {_key(k): v for k, v in cap.pass_configs.items()}
    target = "c" if arch == "c" else tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(config=configs), (tvm.target.Target(target) if arch == "c" else target):
        return tilelang.lower(cap.func, target=target).kernel_source


def _fast_math(pass_configs):
    """What ``compile_kernel`` adds for the GPU (so a factory-built kernel is lowered as it is compiled)."""
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True, **(pass_configs or {})}


def _cuda_jobs():
    """(name, archs, prim_func thunk, pass_configs): the shipped GPU kernels, one shape per config."""
    att = _module("attention")
    fwd, fwd_h = _module("flash_fwd"), _module("flash_fwd_hopper")
    bwd, bwd_h = _module("flash_bwd"), _module("flash_bwd_hopper")
    var, dec = _module("flash_varlen"), _module("flash_decode")
    var_h = _first_module("flash_varlen_hopper", "flash_varlen")
    vapi, reg = _module("varlen_api"), _module("registry")
    bench = _benchmarks()
    ch07 = importlib.import_module(f"{bench.__name__}.ch07_hopper")
    both, hopper = ("sm_80", "sm_90a"), ("sm_90a",)
    B, H, S = 1, 4, 512
    jobs = []
    # Dense forward: chapter 03/04's kernel (tuned, and chapter 03's 2-stage config), variants.
    variants = {"d128": dict(dim=128), "d128_causal": dict(dim=128, causal=True),
                "d64_gqa_window_sinks": dict(dim=64, heads_kv=2, causal=True, window_size=128, has_sinks=True)}
    for cname, config in (("tuned", att.TUNED_FORWARD_CONFIG), ("ch03", bench.CH03_FORWARD_CONFIG)):
        for vname, v in variants.items():
            v = dict(v)
            dim = v.pop("dim")
            archs = both if (config.num_stages < 2 or not v.get("causal")) else hopper  # upstream sm_80 bug
            jobs.append((f"fwd_{cname}_{vname}", archs,
                         lambda config=config, v=v, dim=dim: fwd.flash_fwd_kernel(
                             B, H, S, S, dim, target="cuda", **v, **reg.FORWARD["flash_fwd"].arguments(config)), None))
    # Hopper forwards: the configs flash_attention picks (each through its kernel's factory), the window fallback,
    # the rotated loop.
    def hopper_forward(config, dim, **options):
        row = reg.FORWARD[config.kernel]
        return row.factory(B, H, 4096, 4096, dim, **options, **row.arguments(config))

    for (dim, masked), config in att.HOPPER_FORWARD_CONFIGS.items():
        jobs.append((f"fwd_{config.kernel.removeprefix('flash_fwd_')}_d{dim}_{'masked' if masked else 'full'}", hopper,
                     lambda config=config, dim=dim, masked=masked: hopper_forward(config, dim, causal=masked), None))
    config = att.ONE_WARPGROUP_FORWARD_CONFIG
    jobs.append(("fwd_hopper_one_warpgroup_d64_full", hopper,
                 lambda config=config: hopper_forward(config, 64), None))
    config = att.hopper_forward_config(64, True, seq_len=4096, window=True)
    jobs.append((f"fwd_{config.kernel.removeprefix('flash_fwd_')}_d64_gqa_window_sinks", hopper,
                 lambda config=config: hopper_forward(config, 64, heads_kv=2, causal=True, window_size=128,
                                                      has_sinks=True), None))
    for (dim, masked), config in ch07.ROTATED_LOOP_CONFIGS.items():
        jobs.append((f"fwd_hopper_rotated_d{dim}_{'masked' if masked else 'full'}", hopper,
                     lambda config=config, dim=dim, masked=masked: fwd_h.flash_fwd_hopper_kernel(
                         B, H, S, S, dim, causal=masked, **reg.FORWARD["flash_fwd_hopper"].arguments(config)), None))
    # Dense backward: chapter 05's kernel and its helpers, chapter 08's Hopper kernel.
    for vname, v in (("d128", dict(dim=128)), ("d128_causal", dict(dim=128, causal=True)),
                     ("d64_gqa_window", dict(dim=64, heads_kv=2, causal=True, window_size=128))):
        v = dict(v)
        dim = v.pop("dim")
        jobs.append((f"bwd_tuned_{vname}", both,
                     lambda v=v, dim=dim: bwd.flash_bwd_kernel(
                         B, H, S, S, dim, target="cuda", **v,
                         **reg.BACKWARD["flash_bwd"].arguments(att.TUNED_BACKWARD_CONFIG)), None))
    jobs.append(("bwd_preprocess_d128", both,
                 lambda: bwd.flash_bwd_preprocess_kernel(B, H, S, 128, block=64, threads=128, target="cuda"), None))
    jobs.append(("bwd_postprocess_d128", both,
                 lambda: bwd.flash_bwd_postprocess_kernel(B, H, S, 128, scale=128 ** -0.5, block=64, threads=128,
                                                          target="cuda"), None))
    for (dim, masked), config in att.HOPPER_BACKWARD_CONFIGS.items():
        jobs.append((f"bwd_hopper_d{dim}_{'masked' if masked else 'full'}", hopper,
                     lambda config=config, dim=dim, masked=masked: bwd_h.flash_bwd_hopper_kernel(
                         B, H, S, S, dim, causal=masked, **reg.BACKWARD[config.kernel].arguments(config)),
                     bwd_h.PASS_CONFIGS))
    config = att.HOPPER_BACKWARD_CONFIGS[128, True]
    jobs.append(("bwd_hopper_deterministic_d128_gqa_window", hopper,
                 lambda config=config: bwd_h.flash_bwd_hopper_kernel(
                     B, H, S, S, 128, heads_kv=2, causal=True, window_size=128,
                     tiling=bwd_h.FA3_TILING._replace(**config.tiling()), deterministic=True), bwd_h.PASS_CONFIGS))
    for dim, (block_M, block_N) in att.HOPPER_DQ_TILES.items():
        jobs.append((f"bwd_hopper_dq_d{dim}", hopper,
                     lambda dim=dim, block_M=block_M, block_N=block_N: bwd_h.flash_bwd_hopper_dq_kernel(
                         B, H, S, S, dim, heads_kv=2, causal=True, window_size=128,
                         **reg.HELPERS["bwd_hopper_dq"].arguments(None, block_M=block_M, block_N=block_N)), None))
    # Packed (varlen) batches.
    vc = vapi.VARLEN_CUDA_CONFIG
    common = dict(heads_kv=2, target="cuda", **reg.PACKED_FORWARD["flash_fwd"].arguments(vc))
    for vname, v, archs, pc in (
            ("grid", dict(schedule="grid"), ("sm_80",), None),
            ("grid_causal_own", dict(schedule="grid", causal=True, own_barriers=True), hopper,
             var.OWN_BARRIERS_PASS_CONFIGS),
            ("grid_own", dict(schedule="grid", own_barriers=True), hopper, var.OWN_BARRIERS_PASS_CONFIGS),
            ("list_window_own", dict(schedule="list", causal=True, window_size=128, own_barriers=True), hopper,
             var.OWN_BARRIERS_PASS_CONFIGS),
            ("grid_hopper", dict(schedule="grid", hopper=True), hopper, None)):
        jobs.append((f"varlen_fwd_{vname}", archs,
                     lambda v=v: var.flash_varlen_fwd_kernel(4, 128, **common, **v), pc))
    bc = att.TUNED_BACKWARD_CONFIG
    for vname, v in (("grid", dict(schedule="grid")), ("list_causal", dict(schedule="list", causal=True))):
        jobs.append((f"varlen_bwd_{vname}", both,
                     lambda v=v: var.flash_varlen_bwd_kernel(4, 128, heads_kv=2, target="cuda", **v,
                                                             **reg.PACKED_BACKWARD["flash_bwd"].arguments(bc)), None))
    # Packed batches on Hopper: the persistent forward and the Hopper backward, as varlen_api picks them.
    pc = vapi.VARLEN_PERSISTENT_CONFIG

    def packed_tiling(row_name, config, table="PACKED_FORWARD", **more):
        """A packed Hopper kernel's tiling: one ``tiling`` argument, or, before, keywords."""
        tiling = getattr(getattr(reg, table)[row_name], "tiling", None)
        if tiling is None:
            return dict(**config.tiling(), **more)
        return dict(tiling=tiling(**config.tiling(), **more))

    for dim in vapi.VARLEN_HOPPER_DIMS:
        for masked in (False, True):
            jobs.append((f"varlen_fwd_persistent_d{dim}_{'masked' if masked else 'full'}", hopper,
                         lambda dim=dim, masked=masked: var_h.flash_varlen_fwd_persistent_kernel(
                             4, dim, heads_kv=2, causal=masked,
                             **packed_tiling(pc.kernel, pc, pingpong=pc.pingpong, num_ctas=132)), None))
    jobs.append(("varlen_fwd_persistent_d128_window_nopingpong", hopper,
                 lambda: var_h.flash_varlen_fwd_persistent_kernel(
                     4, 128, causal=True, window_size=128, **packed_tiling(pc.kernel, pc, pingpong=False,
                                                                           num_ctas=132)), None))
    for (dim, masked), config in vapi.VARLEN_HOPPER_BACKWARD_CONFIGS.items():
        for schedule in ("grid", "list"):
            jobs.append((f"varlen_bwd_hopper_d{dim}_{'masked' if masked else 'full'}_{schedule}", hopper,
                         lambda config=config, dim=dim, masked=masked, schedule=schedule:
                         var_h.flash_varlen_bwd_hopper_kernel(4, dim, heads_kv=2, causal=masked, schedule=schedule,
                                                            **packed_tiling(config.kernel, config, "PACKED_BACKWARD")),
                         bwd_h.PASS_CONFIGS))
    config = vapi.VARLEN_HOPPER_BACKWARD_CONFIGS[128, True]
    jobs.append(("varlen_bwd_hopper_d128_mha_window", hopper,
                 lambda config=config: var_h.flash_varlen_bwd_hopper_kernel(
                     4, 128, causal=True, window_size=128, **packed_tiling(config.kernel, config, "PACKED_BACKWARD")),
                 bwd_h.PASS_CONFIGS))
    jobs.append(("varlen_delta", both, lambda: var.varlen_delta_kernel(128, block=64, threads=128, target="cuda"),
                 None))
    jobs.append(("varlen_scale_cast", both, lambda: var.scale_cast_kernel(128, block=64, threads=128, target="cuda"),
                 None))
    # Decoding.
    for vname, page_size, causal in (("contiguous", None, False), ("paged_causal", 64, True)):
        config = dec.decode_config("cuda", 8, 2, 128, 1, page_size)
        jobs.append((f"decode_split_{vname}", both,
                     lambda config=config, page_size=page_size, causal=causal: dec.flash_decode_kernel(
                         8, 2, 128, 1, page_size=page_size, causal=causal, target="cuda", tiling=config),
                     config.pass_configs()))
    jobs.append(("decode_merge", both, lambda: dec.flash_decode_merge_kernel(8, 128, 1, target="cuda"), None))
    return jobs


def _cpu_jobs():
    """(name, thunk returning the list of kernels compiled): the CPU kernels, through the public API."""
    att, vapi = _module("attention"), _module("varlen_api")
    dapi = _first_module("decode_api", "varlen_api")

    def dense(dtype, heads_kv, dim, **kw):
        q = torch.zeros(1, 4, 64, dim, dtype=dtype)
        k = torch.zeros(1, heads_kv, 64, dim, dtype=dtype)
        att.forward_kernel(q, k, has_sinks=kw.pop("has_sinks", False), **kw)
        att.backward_kernels(q, k, **kw)

    def varlen(dtype, **kw):
        q, k = torch.zeros(96, 4, 64, dtype=dtype), torch.zeros(96, 2, 64, dtype=dtype)
        vapi.varlen_kernels(q, k, **kw)
        vapi._varlen_small_kernels(64, {torch.float32: "float32", torch.float16: "float16"}[dtype], "c")

    def decode(dtype, paged, **kw):
        q = torch.zeros(2, 1, 4, 64, dtype=dtype)
        k = torch.zeros(8, 16, 2, 64, dtype=dtype) if paged else torch.zeros(2, 64, 2, 64, dtype=dtype)
        table = torch.zeros(2, 4, dtype=torch.int32) if paged else None
        dapi.decode_kernels(q, k, block_table=table, **kw)

    return [
        ("cpu_dense_f32_d64", lambda: dense(torch.float32, 4, 64)),
        ("cpu_dense_f16_d32_gqa_window_sinks", lambda: dense(torch.float16, 2, 32, causal=True, window_size=16,
                                                             has_sinks=True)),
        ("cpu_varlen_f32", lambda: varlen(torch.float32)),
        ("cpu_varlen_f16_causal_list", lambda: varlen(torch.float16, causal=True, schedule="list")),
        ("cpu_decode_f32", lambda: decode(torch.float32, False)),
        ("cpu_decode_f16_paged_causal", lambda: decode(torch.float16, True, causal=True)),
    ]


def _version_jobs():
    """(name, thunk): every ablation version, at each causal setting it is measured at, one head dim."""
    jobs = []
    for direction in ("fwd", "bwd"):
        module = _module(f"flash_{direction}_hopper_versions")
        for v in module.VERSIONS:
            dim = 128 if 128 in v.dims else v.dims[0]
            for causal in ((True,) if v.causal_only else (False, True)):
                name = f"version_{direction}_{v.number:02d}_d{dim}_{'causal' if causal else 'full'}"
                jobs.append((name, lambda v=v, dim=dim, causal=causal: v.build(1, 4, 512, dim, causal=causal)))
    return jobs


def _write(out, name, source, cap):
    (out / name).write_text(source)
    meta = {"out_idx": cap.out_idx, "pass_configs": {_key(k): v for k, v in sorted(cap.pass_configs.items(),
                                                                                    key=lambda kv: _key(kv[0]))}}
    (out / f"{name}.meta").write_text(json.dumps(meta, sort_keys=True) + "\n")


def snapshot(out, only=None, resume=False, skip=None):
    """Write the snapshot into directory ``out``; ``only``: a substring the job names must contain, ``skip``
    one they must not; ``resume``: skip the files ``out`` already has (a snapshot that was interrupted)."""

    def wanted(name):
        return (not only or only in name) and not (skip and skip in name)

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    failures = []
    with _capturing() as captured:
        for name, archs, thunk, pass_configs in _cuda_jobs():
            if not wanted(name):
                continue
            cap = _Captured(thunk(), None, "cuda", _fast_math(pass_configs))
            for arch in archs:
                _run(failures, out, f"{name}.{arch}.cu", cap, arch, resume)
        for name, thunk in _cpu_jobs() + _version_jobs():
            if not wanted(name):
                continue
            del captured[:]
            thunk()
            if name.startswith("version_bwd"):
                del captured[1:]  # the main kernel; the shared helpers are snapshotted above
            for i, cap in enumerate(captured):
                on_cpu = cap.target == "c"
                _run(failures, out, f"{name}.{i}.{'c' if on_cpu else 'sm_90a.cu'}", cap, "c" if on_cpu else "sm_90a",
                     resume)
    files = sorted(p for p in out.iterdir() if p.name != "MANIFEST.sha256")
    (out / "MANIFEST.sha256").write_text("".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
                                                 for p in files))
    print(f"{len(files)} files in {out}; {len(failures)} failures")
    for f in failures:
        print("  FAILED", f)
    return not failures


def _run(failures, out, name, cap, arch, resume=False):
    if resume and ((out / name).exists() or (out / f"{name}.error").exists()):
        return
    print(name, flush=True)
    try:
        _write(out, name, _lower(cap, arch), cap)
    except Exception as e:  # noqa: BLE001  (recorded and reported: a lowering that fails is part of the snapshot)
        failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        (out / f"{name}.error").write_text(failures[-1] + "\n")


def compare(a, b):
    """Byte-compare two snapshots; prints every difference and returns whether there are none."""
    a, b = Path(a), Path(b)
    names_a = {p.name for p in a.iterdir() if p.name != "MANIFEST.sha256"}
    names_b = {p.name for p in b.iterdir() if p.name != "MANIFEST.sha256"}
    same = True
    for name in sorted(names_a ^ names_b):
        print(f"only in {a if name in names_a else b}: {name}")
        same = False
    common = sorted(names_a & names_b)
    differ = [n for n in common if (a / n).read_bytes() != (b / n).read_bytes()]
    for name in differ:
        print(f"differs: {name}")
    print(f"{len(common)} files compared, {len(common) - len(differ)} byte-identical, {len(differ)} differ")
    return same and not differ


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--only", help="only the jobs whose name contains this")
    parser.add_argument("--skip", help="leave out the jobs whose name contains this")
    parser.add_argument("--resume", action="store_true", help="skip the files the output directory already has")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = parser.parse_args(argv)
    if args.compare:
        return 0 if compare(*args.compare) else 1
    if not args.out:
        parser.error("give an output directory or --compare A B")
    return 0 if snapshot(args.out, args.only, args.resume, args.skip) else 1


if __name__ == "__main__":
    sys.exit(main())
