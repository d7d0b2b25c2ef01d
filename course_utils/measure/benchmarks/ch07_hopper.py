"""Chapter 07: the Hopper forward's ablation (``flash_fwd_hopper_versions``), its tiling sweep, and what
the persistent kernel does for short sequences."""

import itertools

import torch

from ...api.attention import (
    D64_SHORT_FORWARD_CONFIGS,
    HOPPER_FORWARD_CONFIGS,
    ONE_WARPGROUP_FORWARD_CONFIG,
    SHORT_MASKED_MAX_SEQ,
    ForwardConfig,
    flash_attention,
    forward_kernel,
    hopper_forward_config,
)
from ...checking.validation import check_forward, references
from ...core.labels import OURS
from ...kernels.versions.flash_fwd_hopper_versions import versions_for
from ..bench import attention_flops, tflops, time_side_by_side
from .ch03_forward import forward_config_sweep
from .common import (
    SDPA_PEERS,
    AblationCase,
    ablation,
    comparison_shapes,
    in_parallel,
    peer_attentions,
    random_inputs,
    sdpa,
)

__all__ = ["forward_ablation", "hopper_tiling_sweep", "ROTATED_LOOP_CONFIGS", "ROTATED", "persistent_vs_rotated",
           "PERSISTENT_ALTERNATIVES"]

# Chapter 07's rotated loop (flash_fwd_hopper_kernel), tiled per (head dim, mask) as its own sweep
# picked before the persistent kernel existed: the kernel the persistent one is compared with.
ROTATED_LOOP_CONFIGS = {
    (128, False): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"),
    (128, True): ForwardConfig(128, 192, 2, 256, kernel="flash_fwd_hopper"),
    (64, False): ForwardConfig(128, 128, 2, 256, kernel="flash_fwd_hopper"),
    (64, True): ForwardConfig(128, 192, 2, 256, kernel="flash_fwd_hopper", pingpong=True),
}
ROTATED = "rotated loop (one block per tile)"
# The tilings at D = 64 the record times beside the default, as it names them: the persistent kernel by consumer
# warpgroups per block (1: with its producer warpgroup, two or three blocks per SM), and ("own") one warpgroup per
# block issuing its own loads, three blocks per SM.
PERSISTENT_ALTERNATIVES = {3: "persistent, 3 consumer warpgroups", 2: "persistent, 2 consumer warpgroups",
                           1: "persistent, 1 consumer warpgroup, 2-3 blocks per SM",
                           "own": "1 warpgroup loading for itself, 3 blocks per SM"}


def forward_ablation(dims=(128, 64), dtype_name="float16", causal_options=(False, True), seq=4096, versions=None):
    """TFLOP/s of every version of the ablation (or of ``versions``), each checked on every head, timed
    side by side with FlashAttention-2 and cuDNN (``common.ablation``)."""
    dtype = getattr(torch, dtype_name)

    def prepare(shape, causal):
        q, k, v = random_inputs(shape, dtype)
        no_sinks = torch.full((shape["heads"],), float("-inf"), device="cuda")
        refs = references(q, k, v, causal=causal)

        def check(kernel, name):
            out, lse = kernel(q, k, v, no_sinks)
            return check_forward(q, k, v, out, lse, causal=causal, refs=refs, quiet=True, name=name)

        peers = {name: (lambda peer=peer: peer(q, k, v)) for name, peer in peer_attentions(causal).items()}
        return AblationCase(check, lambda kernel: (lambda: kernel(q, k, v, no_sinks)), peers)

    return ablation(itertools.product(dims, causal_options),
                    versions_for if versions is None else (lambda causal, dim: versions), prepare,
                    mode="fwd", dtype_name=dtype_name, seq=seq)


def hopper_tiling_sweep():
    """Chapter 07's two Hopper kernels at D = 128 and 64: wider key blocks, ping-pong, and (persistent)
    three consumer warpgroups of 64 query rows each (block_M = 192, 384 consumer threads)."""
    rows = []
    rotated = {128: [(128, 128, False), (128, 176, False), (128, 192, False)],
               64: [(128, 128, False), (128, 192, False), (128, 128, True), (128, 192, True)]}
    # (128 × 192 at D = 128 needs 256 KB of shared memory with O's staging tile: more than an SM has.)
    persistent = {128: [(128, 128, False), (128, 128, True)],
                  64: [(128, 128, False), (128, 128, True), (128, 192, True), (192, 128, False), (192, 128, True)]}
    for dim in (128, 64):
        configs = [ForwardConfig(m, n, 2, 256, kernel="flash_fwd_hopper", pingpong=pp) for m, n, pp in rotated[dim]]
        configs += [ForwardConfig(m, n, 2, 2 * m, kernel="flash_fwd_hopper_persistent", pingpong=pp)
                    for m, n, pp in persistent[dim]]
        rows += forward_config_sweep(shape=comparison_shapes(seq_lens=(4096,), dim=dim)[0], configs=configs)
    return rows


def persistent_vs_rotated(seq_lens=(1024, 2048, 4096, 16384), dims=(64, 128), dtype_name="float16",
                          causal_options=(False, True)):
    """The default kernel (persistent) against chapter 07's rotated loop with one block per tile, from
    short sequences, where the difference is largest, to long ones. At D = 64 also the persistent
    kernel with the other numbers of consumer warpgroups (``PERSISTENT_ALTERNATIVES``: three, two with
    ping-pong, one with several blocks per SM, and one warpgroup per block issuing its own loads): the measurement
    behind ``THREE_WARPGROUPS_MIN_SEQ`` and ``ONE_WARPGROUP_FORWARD_CONFIG``. All checked on every head; FA2 and
    cuDNN alongside."""
    rows = []
    jobs = list(itertools.product(dims, seq_lens, causal_options))
    dtype = getattr(torch, dtype_name)

    def configs(dim, seq, causal):
        ours = hopper_forward_config(dim, causal, seq_len=seq)
        named = {ROTATED: ROTATED_LOOP_CONFIGS[dim, causal], OURS: ours}
        if dim == 64:
            three = HOPPER_FORWARD_CONFIGS[64, False]  # three warpgroups with ping-pong, with or without the mask
            one = D64_SHORT_FORWARD_CONFIGS[causal, seq <= SHORT_MASKED_MAX_SEQ]
            two = three._replace(block_M=128, threads=256)
            others = dict(zip(PERSISTENT_ALTERNATIVES.values(), (three, two, one, ONE_WARPGROUP_FORWARD_CONFIG)))
            named.update({name: config for name, config in others.items() if config != ours})
        return named

    def build(job):
        dim, seq, causal = job
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        q = torch.empty(1, 1, 1, 1, device="cuda", dtype=dtype).expand(
            shape["batch"], shape["heads"], shape["seq"], shape["dim"])
        for config in configs(dim, seq, causal).values():
            forward_kernel(q, q, causal=causal, config=config)

    in_parallel(build, jobs)
    for dim, seq, causal in jobs:
        shape = comparison_shapes(seq_lens=(seq,), dim=dim)[0]
        q, k, v = random_inputs(shape, dtype)
        refs = references(q, k, v, causal=causal)
        impls, errors, used = {}, {}, {}
        for name, config in configs(dim, seq, causal).items():
            out, lse = flash_attention(q, k, v, causal=causal, config=config, return_lse=True)
            errors[name] = check_forward(q, k, v, out, lse, causal=causal, refs=refs, quiet=True, name=name)
            impls[name] = lambda config=config: flash_attention(q, k, v, causal=causal, config=config)
            used[name] = config._asdict()
        del refs
        for name, backend in SDPA_PEERS.items():
            impls[name] = lambda backend=backend: sdpa(q, k, v, causal, backend)
        flops = attention_flops(shape["batch"], shape["heads"], seq, seq, dim, causal=causal)
        for impl, ms in time_side_by_side(impls).items():
            rows.append(dict(impl=impl, dtype=dtype_name, causal=causal, ms=ms, tflops=tflops(flops, ms),
                             errors=errors.get(impl), config=used.get(impl), **shape))
        print(f"D={dim} S={seq:>5} causal={causal!s:5}: " + ", ".join(
            f"{r['impl'].split()[0]} {r['tflops']:.0f}" for r in rows[-len(impls):]))
    return rows
