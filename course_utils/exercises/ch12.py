"""Checkers for chapter 12: a tensor quantised to e4m3 block by block with its descales, and the FP8 forward's
key-tile step written in TileLang (run on the C backend against a float64 emulation of the same FP8 roundings,
bugs named by models of the kernel with one mistake each)."""

import torch

from ..api.fp8 import E4M3_MAX, emulate_fp8_forward, quantise_blocks, quantise_tensor
from .common import ExerciseWrong, check_exercise, with_diagnosis
from .kernels import KernelCase, Suspect, check_kernel, same_outputs

__all__ = ["check_quantise_tile", "check_fp8_forward", "fp8_case_inputs"]


def _blocks_of_different_scales(shape, block, seed):
    """Normal values whose blocks of ``block`` rows differ in scale by up to 64×, with one block of zeros when
    there are three or more: a descale from the wrong block, or one for the whole tensor, shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    blocks = -(-shape[-2] // block)
    scales = torch.tensor([2.0 ** (3 * (b % 3) - 3) for b in range(blocks)]).repeat_interleave(block)[:shape[-2]]
    x = x * scales[:, None]
    if blocks >= 3:
        x[..., block:2 * block, :] = 0
    return x


_QUANTISE_CASES = [  # (x, block): ragged last block, one block, a block of zeros, several heads
    (_blocks_of_different_scales((1, 1, 16, 8), 16, seed=1), 16),
    (_blocks_of_different_scales((1, 2, 40, 16), 16, seed=2), 16),
    (_blocks_of_different_scales((2, 3, 37, 8), 8, seed=3), 8),
    (_blocks_of_different_scales((1, 1, 5, 4), 8, seed=4), 8),
]


def _pair(result):
    if not isinstance(result, tuple) or len(result) != 2:
        raise ExerciseWrong("quantise_tile: return a pair (values in torch.float8_e4m3fn, descale per block)")
    values, descale = result
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn:
        kind = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
        raise ExerciseWrong(f"quantise_tile: the values must be a torch.float8_e4m3fn tensor (cast with .to); "
                            f"got {kind}")
    return values, descale


def _restored(values, descale, block, seq):
    return values.float() * descale.float().repeat_interleave(block, -1)[..., :seq, None]


def check_quantise_tile(fn):
    """``fn(x, block)`` must return (x's blocks of ``block`` rows scaled to e4m3's full range and cast, the descale
    of each block): what ``api.fp8.quantise_blocks`` returns."""
    def learner(x, block):
        values, descale = _pair(fn(x.clone(), block))
        return torch.cat([values.float().flatten(), torch.as_tensor(descale).float().flatten()])

    def reference(x, block):
        values, descale = quantise_blocks(x, block)
        return torch.cat([values.float().flatten(), descale.flatten()])

    def descales(case):
        x, block = _QUANTISE_CASES[case]
        return torch.as_tensor(_pair(fn(x.clone(), block))[1]).double(), quantise_blocks(x, block)[1].double()

    def returned_the_scale():
        got, want = descales(1)
        return torch.allclose(got * want, torch.ones_like(want))

    def one_scale():
        got, want = descales(2)
        return torch.allclose(got, got.amax(-1, keepdim=True).expand_as(got)) and not torch.allclose(got, want)

    def zero_block_nan():
        got, _ = descales(1)
        return bool((torch.isnan(got) | (got == 0)).any())

    with_diagnosis(lambda: check_exercise(
        "quantise_tile", learner, reference, _QUANTISE_CASES, atol=0, rtol=1e-6,
        hint="Each block of rows gets its own scale: its largest magnitude maps to E4M3_MAX (448), a block of zeros "
             "keeps descale 1, the last block may be shorter, and the descale is the scale's inverse, so that "
             "values × descale ≈ x (hint(\"12\", \"a\", 1) says more)."), [
        ("the second value returned is the scale (448 / amax), not the descale (amax / 448): the kernel multiplies by "
         "the descale to get the real values back.", returned_the_scale),
        ("one scale for the whole tensor: take the largest magnitude of each block of rows on its own (a block's "
         "values then use e4m3's precision whatever the other blocks hold).", one_scale),
        ("a block of zeros has amax 0, and 0 / 0 gives NaN: keep descale 1 for such a block.", zero_block_nan),
    ])
    values, descale = _pair(fn(_QUANTISE_CASES[1][0].clone(), 16))
    restored = _restored(values, torch.as_tensor(descale), 16, 40)
    error = float(((restored - _QUANTISE_CASES[1][0]).abs() / _QUANTISE_CASES[1][0].abs().clamp(min=1e-3)).max())
    print(f"  largest relative error of values × descale: {error:.3g} (e4m3 rounds to within 2⁻⁴ = 0.0625, "
          f"subnormals aside), E4M3_MAX = {E4M3_MAX:g}")


# --- Exercise (b): the FP8 key-tile step, in TileLang ---------------------------------------------------

def fp8_case_inputs(batch, heads, seq_q, seq_k, dim, *, block_M, block_N, seed):
    """Float32 Q, K, V whose query blocks and key blocks differ in scale, quantised as the kernel reads them:
    (q8, k8, v8 as float32 e4m3 values, descales {"Q", "K", "V"}), and the unquantised (q, k, v)."""
    q = _blocks_of_different_scales((batch, heads, seq_q, dim), block_M, seed) * 0.5
    k = _blocks_of_different_scales((batch, heads, seq_k, dim), block_N, seed + 1) * 0.5
    v = torch.randn(batch, heads, seq_k, dim, generator=torch.Generator().manual_seed(seed + 2))
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = quantise_blocks(q, block_M), quantise_blocks(k, block_N), \
        quantise_tensor(v)
    return (q8.float(), k8.float(), v8.float()), dict(Q=q_descale, K=k_descale, V=v_descale), (q, k, v)


def _fp8_case(label, batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N, seed):
    (q8, k8, v8), descales, _ = fp8_case_inputs(batch, heads, seq_q, seq_k, dim, block_M=block_M, block_N=block_N,
                                                seed=seed)
    out, lse = emulate_fp8_forward(q8, k8, v8, descales, causal=causal, block_M=block_M, block_N=block_N)
    kwargs = dict(causal=causal, block_M=block_M, block_N=block_N)

    def run(kernel):
        o, l = kernel(q8, k8, v8, descales["Q"], descales["K"], descales["V"])
        return {"O": o, "LSE": l}

    data = dict(q8=q8, k8=k8, v8=v8, descales=descales, **kwargs)
    return KernelCase(label, (batch, heads, seq_q, seq_k, dim), kwargs, [6, 7], run, {"O": out, "LSE": lse},
                      data=data, rows="query row")


def _fp8_cases():
    """Blocks of different scales in every case, most revealing first (the checker stops at the first wrong one)."""
    return [
        _fp8_case("non-causal, block_M=8 < block_N=16, S_q=24 ≠ S_k=40: query and key blocks of different scales",
                  1, 2, 24, 40, 16, causal=False, block_M=8, block_N=16, seed=11),
        _fp8_case("causal, block_M=16 > block_N=8, S_q=S_k=37 (ragged): rows that see few keys", 1, 2, 37, 37, 16,
                  causal=True, block_M=16, block_N=8, seed=12),
        _fp8_case("causal, S_q=20 > S_k=12: rows that see no key", 1, 2, 20, 12, 16, causal=True, block_M=8,
                  block_N=8, seed=13),
        _fp8_case("non-causal, S below one block (S_q=5, S_k=3)", 1, 1, 5, 3, 16, causal=False, block_M=8,
                  block_N=8, seed=14),
    ]


def _like(*bugs):
    def test(case, got, kernel):
        d = case.data
        model, lse = emulate_fp8_forward(d["q8"], d["k8"], d["v8"], d["descales"], causal=d["causal"],
                                         block_M=d["block_M"], block_N=d["block_N"], bugs=bugs)
        return same_outputs(got, {"O": model, "LSE": lse}, atol=1e-4)
    return test


_FP8_SUSPECTS = [
    Suspect("the descales are missing from the exponent: the scores of e4m3 values are the real scores divided by "
            "q_descale · k_descale, so the constant the scores are multiplied by is q_descale · k_descale · "
            "sm_scale · log2(e).", _like("no descale")),
    Suspect("a descale is applied twice: Q's descale appears twice in the exponent's constant, which must be "
            "q_descale · k_descale · sm_scale · log2(e), each once.", _like("q descale twice")),
    Suspect("the key tile's descale comes from the wrong block: K_descale is indexed by the key block kb (the tile "
            "just loaded), not by the query block.", _like("K descale of the query block")),
    Suspect("P is not quantised: round P · P_SCALE to e4m3 with round_to_e4m3 before the P V product (that is the "
            "operand FP8 tensor cores take; the epilogue divides P_SCALE back out).", _like("P not quantised")),
]


def check_fp8_forward(factory):
    """Check the learner's FP8 forward, ``factory(batch, heads, seq_q, seq_k, dim, *, causal, block_M, block_N,
    target)`` returning a prim_func (Q, K, V, Q_descale, K_descale, V_descale) -> (O, LSE), on the C backend
    against the float64 emulation of the same FP8 roundings, then lowered for sm_90a and sm_80."""
    check_kernel(
        "FP8 forward", factory, _fp8_cases, suspects=_FP8_SUSPECTS, atol=1e-4, rtol=1e-3,
        hint="Compare your tile step with section 3: S = Q Kᵀ, the descales of this Q block and this K tile "
             "multiplied into sm_scale · log2(e), the mask, the running max in exp2 units with its guard, α on ℓ "
             "and acc_o, ℓ from P before rounding, P · P_SCALE rounded to e4m3, then P V.",
        summary="query and key blocks of different scales, block_M ≶ block_N, ragged S, rows that see no key, "
                "S below one block", learner=("fp8_tile_macros",),
        # its float32 tiles lowered for the GPUs: the TileLang must compile there too (section 7 makes them FP8)
        gpu=((1, 4, 256, 256, 64), dict(causal=True, block_M=64, block_N=64)))


HINTS = {
    "a": ["Cut the rows into blocks (pad the last one with zeros so every block has the same shape), take each "
          "block's largest magnitude, and choose the descale that maps it to E4M3_MAX; a block of zeros keeps "
          "descale 1. Divide every row by its block's descale, cast, and return the values with the descales.",
          "torch.nn.functional.pad for the padding, Tensor.unflatten to make the blocks a dimension, abs and amax "
          "over the last two dimensions, torch.where for the zero block, repeat_interleave to give every row its "
          "block's descale (then slice off the padding), and .to(torch.float8_e4m3fn) for the cast."],
    "b": ["A score of e4m3 values is the real score divided by both descales, so fold them into the constant that "
          "already multiplies the scores on their way into exp2; keep the running max in those exp2 units (the next "
          "tile has other descales), sum ℓ from P before rounding, and round P times the fixed P_SCALE to e4m3 "
          "before the second product.",
          "T.clear and T.gemm with transpose_B for the scores; read this tile's descales from Q_descale and K_descale "
          "at the block indices; T.if_then_else in tb.parallel for the mask; T.reduce_max with clear=False; T.exp2; "
          "T.reduce_sum; round_to_e4m3 on each element of P; then the second T.gemm."],
}
