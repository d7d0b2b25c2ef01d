"""FlexAttention in TileLang (chapter 11) on the CPU: every modifier against float64, the causal mask against
flash_attention, bad modifiers, block-mask edge cases, and planted bugs the checks must catch."""

import math

import pytest
import torch

import course_utils as cu
from course_utils.api import flex
from course_utils.api.flex import (
    EMPTY,
    FULL,
    PARTIAL,
    Dual,
    alibi,
    alibi_slopes,
    captured,
    causal_mask,
    create_block_mask,
    document_ids,
    document_mask,
    flex_attention,
    flex_backward,
    flex_forward,
    plan_modifiers,
    prefix_lm,
    soft_cap,
    window_with_globals,
)
from course_utils.checking.checks import CheckFailed
from course_utils.checking.flex_reference import flex_references
from course_utils.checking.validation import backward_bugs, forward_bugs
from course_utils.kernels.flash_flex import flex_bwd_kernel, flex_fwd_kernel


def _inputs(batch=1, heads=2, heads_kv=None, seq=40, dim=16, scale=1.0, seq_k=None):
    heads_kv = heads_kv or heads
    q = torch.randn(batch, heads, seq, dim) * scale
    k, v = (torch.randn(batch, heads_kv, seq_k or seq, dim) for _ in range(2))
    return q, k, v, torch.randn(batch, heads, seq, dim)


def _run(q, k, v, d_out, **mods):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, return_lse=True, **mods)
    grads = torch.autograd.grad(out, leaves, d_out)
    return out.detach(), lse, grads


def _check_all(q, k, v, d_out, name, **mods):
    out, lse, grads = _run(q, k, v, d_out, **mods)
    mask_mod = mods.get("mask_mod") or (mods["block_mask"].mask_mod if mods.get("block_mask") else None)
    refs = flex_references(q, k, v, d_out=d_out, score_mod=mods.get("score_mod"), mask_mod=mask_mod)
    cu.check_forward(q, k, v, out, lse, refs=refs, name=name)
    cu.check_backward(q, k, v, d_out, grads, refs=refs, name=name)
    return out, lse, grads, refs


# --- Every modifier of the chapter, forward and gradients, against float64 ------------------------------------

def test_soft_cap_50_forward_and_gradients():
    q, k, v, d_out = _inputs(scale=5.0)  # scores up to about ±25: the cap of 50 bends them
    _check_all(q, k, v, d_out, "soft-cap 50", score_mod=soft_cap(50.0), mask_mod=causal_mask)


def test_soft_cap_differs_from_plain_attention():
    q, k, v, _ = _inputs(scale=40.0)
    capped = flex_attention(q, k, v, score_mod=soft_cap(50.0))
    plain = flex_attention(q, k, v)
    assert (capped - plain).abs().max() > 1e-2  # the modifier really reached the kernel


def test_alibi_with_gqa():
    q, k, v, d_out = _inputs(heads=4, heads_kv=2)
    _check_all(q, k, v, d_out, "ALiBi, GQA", score_mod=alibi(alibi_slopes(4)), mask_mod=causal_mask)


def test_document_mask_of_a_packed_batch():
    q, k, v, d_out = _inputs(seq=45)
    mask = document_mask(document_ids([7, 20, 1, 17]))
    out, *_ = _check_all(q, k, v, d_out, "documents", mask_mod=mask)
    # Each document is its own causal attention.
    first = cu.attention_reference(q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=True)
    cu.check_close(out[:, :, :7], first.double(), "first document alone")


def test_prefix_lm_with_soft_cap():
    q, k, v, d_out = _inputs(scale=20.0)
    _check_all(q, k, v, d_out, "prefix-LM", score_mod=soft_cap(30.0), mask_mod=prefix_lm(13))


def test_sliding_window_with_global_tokens():
    q, k, v, d_out = _inputs(seq=56)
    bm = create_block_mask(window_with_globals(9, 3), None, None, 56, 56)
    assert bm.counts()["empty"] > 0  # the window leaves blocks out
    _check_all(q, k, v, d_out, "window + globals", block_mask=bm)


def test_causal_mask_mod_matches_flash_attention_exactly():
    q, k, v, d_out = _inputs(batch=2, heads=4, heads_kv=2, seq=40)
    out, lse, grads = _run(q, k, v, d_out, mask_mod=causal_mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = cu.flash_attention(*leaves, causal=True, return_lse=True)
    ref_grads = torch.autograd.grad(ref_out, leaves, d_out)
    assert torch.equal(out, ref_out.detach()) and torch.equal(lse, ref_lse)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def test_float16_on_the_cpu_is_held_to_the_16_bit_criterion():
    q, k, v, d_out = (t.half() for t in _inputs(seq=40))
    _check_all(q, k, v, d_out, "fp16", score_mod=soft_cap(50.0), mask_mod=prefix_lm(9))


def test_no_modifier_is_plain_attention():
    q, k, v, d_out = _inputs(seq=33, seq_k=21)
    out, lse, grads = _run(q, k, v, d_out)
    refs = cu.validation.references(q, k, v, d_out=d_out)
    cu.check_forward(q, k, v, out, lse, refs=refs)
    cu.check_backward(q, k, v, d_out, grads, refs=refs)


def test_score_mod_reading_b_h_and_a_2d_captured_tensor():
    bias = captured(torch.randn(2, 3), "bias")

    def per_head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h] * flex.where(q_idx == kv_idx, 1.0, 0.0)

    q, k, v, d_out = _inputs(batch=2, heads=3, seq=20)
    _check_all(q, k, v, d_out, "bias[b, h]", score_mod=per_head_bias)


def test_every_helper_in_a_score_mod():
    def everything(score, b, h, q_idx, kv_idx):
        s = flex.maximum(flex.minimum(score, 3.0), -3.0) + flex.abs(score) * 0.1
        return s + flex.log(flex.exp(score * 0.5) + 1.0) - flex.sqrt(score * score + 1.0) + flex.tanh(score) / 2

    q, k, v, d_out = _inputs(seq=24, scale=3.0)
    _check_all(q, k, v, d_out, "helpers", score_mod=everything)


def test_dual_numbers_match_autograd():
    s = torch.linspace(-70, 70, 101, dtype=torch.float64, requires_grad=True)
    h, q_idx, kv_idx = torch.tensor(1), torch.arange(101), torch.tensor(50)
    for mod in (soft_cap(50.0), alibi(alibi_slopes(2)), lambda s_, b, h_, q, kv: flex.where(s_ > 0, s_ * s_, -s_) / 3):
        dual = mod(Dual(s.detach(), torch.ones_like(s)), 0, h, q_idx, kv_idx)
        (grad,) = torch.autograd.grad(mod(s, 0, h, q_idx, kv_idx).sum(), s)
        cu.check_close(dual.deriv, grad, "Dual derivative")


# --- Bad modifiers --------------------------------------------------------------------------------------------

def _bad(match, **mods):
    q, k, v, _ = _inputs(seq=16)
    with pytest.raises(TypeError, match=match):
        flex_attention(q, k, v, **mods)


def test_wrong_arity_names_the_modifier():
    def four(score, b, h, q_idx):
        return score

    def five(b, h, q_idx, kv_idx, extra):
        return q_idx >= kv_idx

    _bad("score_mod `four` must take 5 arguments", score_mod=four)
    _bad("mask_mod `five` must take 4 arguments", mask_mod=five)


def test_non_boolean_mask_is_rejected():
    def distance(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    _bad("mask_mod `distance` must return a boolean", mask_mod=distance)
    with pytest.raises(TypeError, match="mask_mod `distance`"):
        create_block_mask(distance, None, None, 16, 16)


def test_operations_a_kernel_cannot_express():
    def uses_math(score, b, h, q_idx, kv_idx):
        return math.sin(score)

    def uses_torch(score, b, h, q_idx, kv_idx):
        return torch.sin(score)

    def uses_if(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx if q_idx > 3 else q_idx == kv_idx

    def uses_and(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx and kv_idx > 2

    def returns_bool(score, b, h, q_idx, kv_idx):
        return score > 0

    _bad("score_mod `uses_math` uses an operation the kernel cannot express", score_mod=uses_math)
    _bad("score_mod `uses_torch` uses an operation", score_mod=uses_torch)
    _bad("mask_mod `uses_if` uses an operation.*where", mask_mod=uses_if)
    _bad("mask_mod `uses_and`", mask_mod=uses_and)
    _bad("score_mod `returns_bool` returned a boolean", score_mod=returns_bool)
    _bad("score_mod must be a function", score_mod=3)
    with pytest.raises(TypeError, match="captured"):
        captured([1, 2, 3])


def test_block_mask_must_fit_the_inputs():
    q, k, v, _ = _inputs(seq=16)
    with pytest.raises(ValueError, match="Q_LEN=32"):
        flex_attention(q, k, v, block_mask=create_block_mask(causal_mask, None, None, 32, 32))
    with pytest.raises(ValueError, match="not `prefix_lm_mask`"):
        flex_attention(q, k, v, mask_mod=prefix_lm(3), block_mask=create_block_mask(causal_mask, None, None, 16, 16))
    with pytest.raises(ValueError, match="block"):
        create_block_mask(causal_mask, None, None, 16, 16, block=(16, 0))
    with pytest.raises(ValueError, match="Q_LEN"):
        create_block_mask(causal_mask, None, None, 0, 16)


def test_logical_not_is_logical_in_the_kernel():
    # TVM's ~ on a boolean is a bitwise not, which C reads as true for both values: Sym makes it logical.
    def not_future(b, h, q_idx, kv_idx):
        return ~(kv_idx > q_idx)

    q, k, v, _ = _inputs(seq=20)
    out = flex_attention(q, k, v, mask_mod=not_future)
    cu.check_close(out, cu.attention_reference(q, k, v, causal=True).double(), "~(kv > q) = causal")


# --- Block masks ------------------------------------------------------------------------------------------------

def test_block_states_of_causal_ragged():
    bm = create_block_mask(causal_mask, None, None, 37, 37, block=(16, 16))
    assert bm.state.shape == (1, 1, 3, 3)
    expected = torch.tensor([[PARTIAL, EMPTY, EMPTY], [FULL, PARTIAL, EMPTY], [PARTIAL, PARTIAL, PARTIAL]])
    assert torch.equal(bm.state[0, 0], expected.int())  # the ragged last row and column are never FULL
    assert bm.kv_count[0, 0].tolist() == [1, 2, 3] and bm.q_count[0, 0].tolist() == [3, 2, 1]
    assert bm.kv_list[0, 0, 1, :2].tolist() == [0, 1] and bm.q_list[0, 0, 1, :2].tolist() == [1, 2]
    assert bm.fraction_skipped() == 3 / 9


def test_all_full_mask_has_no_partial_block():
    bm = create_block_mask(flex.noop_mask, None, None, 32, 48, block=(16, 16))
    assert bm.counts() == {"empty": 0, "partial": 0, "full": 6}
    q, k, v, d_out = _inputs(seq=32, seq_k=48)
    _check_all(q, k, v, d_out, "all full", block_mask=bm)


def test_ragged_lengths_and_unequal_blocks():
    # A 32 × 16 mask block: the backward walks each mask query block in two 16-row steps.
    q, k, v, d_out = _inputs(seq=45, seq_k=29)
    bm = create_block_mask(prefix_lm(5), None, None, 45, 29, block=(32, 16))
    _check_all(q, k, v, d_out, "ragged, 32×16 blocks", block_mask=bm, score_mod=soft_cap(20.0))


def test_rows_that_see_no_key():
    def late_queries_only(b, h, q_idx, kv_idx):
        return (q_idx >= 20) & (kv_idx <= q_idx)

    q, k, v, d_out = _inputs(seq=40)
    bm = create_block_mask(late_queries_only, None, None, 40, 40)
    assert bm.kv_count[0, 0, 0] == 0  # the first query block visits no key block at all
    out, lse, grads, _ = _check_all(q, k, v, d_out, "empty rows", block_mask=bm)
    assert torch.equal(out[:, :, :20], torch.zeros_like(out[:, :, :20]))
    assert torch.isneginf(lse[:, :, :20]).all()
    assert torch.equal(grads[0][:, :, :20], torch.zeros_like(grads[0][:, :, :20]))


def test_mask_that_hides_everything():
    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    q, k, v, d_out = _inputs(seq=20)
    out, lse, grads = _run(q, k, v, d_out, mask_mod=nothing)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_mask_depending_on_batch_and_head():
    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + h * 8) & (kv_idx >= b * 4)

    q, k, v, d_out = _inputs(batch=2, heads=3, seq=30)
    bm = create_block_mask(per_head, 2, 3, 30, 30)
    assert bm.state.shape[:2] == (2, 3) and not torch.equal(bm.state[0, 0], bm.state[0, 2])
    _check_all(q, k, v, d_out, "per (b, h) mask", block_mask=bm)


def test_hidden_keys_have_no_influence():
    q, k, v, _ = _inputs(seq=40)
    doc = document_ids([16, 24])
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 16:], v2[:, :, 16:] = float("nan"), float("nan")  # the second document's keys
    out = flex_attention(q, k2, v2, mask_mod=document_mask(doc))
    assert not out[:, :, :16].isnan().any()


# --- Planted bugs that the checks catch ---------------------------------------------------------------------------

def _softcap_problem():
    q, k, v, d_out = _inputs(heads=2, seq=40, scale=5.0)
    mods = dict(score_mod=soft_cap(50.0), mask_mod=causal_mask)
    out, lse, grads = _run(q, k, v, d_out, **mods)
    refs = flex_references(q, k, v, d_out=d_out, **mods)
    return q, k, v, d_out, out, lse, grads, refs


def test_planted_forward_and_backward_bugs_are_caught():
    q, k, v, d_out, out, lse, grads, refs = _softcap_problem()
    cu.show_bugs_caught(lambda o, l_: cu.check_forward(q, k, v, o, l_, refs=refs), forward_bugs(out, lse))
    cu.show_bugs_caught(lambda *g: cu.check_backward(q, k, v, d_out, g, refs=refs), backward_bugs(grads))


def test_chain_rule_dropped_is_caught():
    """A score_mod whose derivative is forced to 1: the backward forgets soft-capping's tanh′."""
    cap = soft_cap(50.0)

    def no_chain_rule(score, b, h, q_idx, kv_idx):
        out = cap(score, b, h, q_idx, kv_idx)
        return Dual(out.value, 1.0) if isinstance(out, Dual) else out

    q, k, v, d_out, out, lse, grads, refs = _softcap_problem()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    wrong = torch.autograd.grad(flex_attention(*leaves, score_mod=no_chain_rule, mask_mod=causal_mask), leaves, d_out)
    with pytest.raises(CheckFailed):
        cu.check_backward(q, k, v, d_out, wrong, refs=refs, quiet=True)


def test_mask_skipped_on_partial_blocks_is_caught():
    """A block mask claiming every visited block FULL: the kernel never evaluates the mask."""
    q, k, v, d_out, out, lse, grads, refs = _softcap_problem()
    bm = create_block_mask(causal_mask, None, None, 40, 40)
    lying = bm._replace(state=torch.where(bm.state == PARTIAL, FULL, bm.state).int())
    plan = plan_modifiers(soft_cap(50.0), causal_mask)
    bad_out, bad_lse = flex_forward(q, k, v, plan, lying, 1 / math.sqrt(16))
    with pytest.raises(CheckFailed):
        cu.check_forward(q, k, v, bad_out, bad_lse, refs=refs, quiet=True)


def test_delta_dropped_is_caught():
    q, k, v, d_out, out, lse, grads, refs = _softcap_problem()
    plan = plan_modifiers(soft_cap(50.0), causal_mask)
    bm = create_block_mask(causal_mask, None, None, 40, 40)
    wrong = flex_backward(q, k, v, out, lse, d_out, plan, bm, 1 / math.sqrt(16), delta=torch.zeros(lse.shape))
    with pytest.raises(CheckFailed):
        cu.check_backward(q, k, v, d_out, wrong, refs=refs, quiet=True)


# --- CUDA code without a GPU -----------------------------------------------------------------------------------------

def test_kernels_lower_for_sm90a():
    from course_utils.core.source import cuda_source

    plan = plan_modifiers(soft_cap(50.0), document_mask(document_ids([100, 300, 112])))
    fwd = cuda_source(flex_fwd_kernel(1, 8, 512, 512, 128, plan, (1, 1, 4, 4), heads_kv=2, sm_scale=0.09,
                                      dtype="bfloat16", target="cuda"))
    bwd = cuda_source(flex_bwd_kernel(1, 8, 512, 512, 128, plan, (1, 1, 4, 4), (128, 128), heads_kv=2, sm_scale=0.09,
                                      dtype="bfloat16", target="cuda"))
    for src in (fwd, bwd):
        assert "wgmma" in src and "tanh" in src


# --- The chapter's exercise checkers ------------------------------------------------------------------------

def _alibi_factory(body):
    def make(slopes):
        slope = flex.captured(slopes, "slopes")

        def score_mod(score, b, h, q_idx, kv_idx):
            return body(score, slope, h, q_idx, kv_idx)

        return score_mod

    return make


def _doc_factory(body):
    def make(doc_ids):
        doc = flex.captured(doc_ids, "doc")

        def mask_mod(b, h, q_idx, kv_idx):
            return body(doc, q_idx, kv_idx)

        return mask_mod

    return make


def test_exercise_checkers_pass_the_solutions():
    from course_utils.exercises import ch11

    ch11.check_alibi(_alibi_factory(lambda s, slope, h, q, kv: s + slope[h] * (kv - q)))
    ch11.check_document_mask(_doc_factory(lambda doc, q, kv: (doc[q] == doc[kv]) & (q >= kv)))


@pytest.mark.parametrize("body, diagnosis", [
    (lambda s, slope, h, q, kv: s + slope[h] * (q - kv), "wrong sign"),
    (lambda s, slope, h, q, kv: slope[h] * (kv - q) + 0 * s, "score itself is missing"),
    (lambda s, slope, h, q, kv: s + (kv - q), "its own slope"),
    (lambda s, slope, h, q, kv: flex.where(s > 1e9, s, s) + slope[0] * (kv - q), "index the captured slopes with h"),
])
def test_alibi_checker_names_the_bug(body, diagnosis):
    from course_utils.exercises import ch11
    from course_utils.exercises.common import ExerciseWrong

    with pytest.raises(ExerciseWrong, match=diagnosis):
        ch11.check_alibi(_alibi_factory(body))


@pytest.mark.parametrize("body, diagnosis", [
    (lambda doc, q, kv: doc[q] == doc[kv], "must not see later keys"),
    (lambda doc, q, kv: q >= kv, "only keys of its own document"),
    (lambda doc, q, kv: (doc[q] == doc[kv]) & (q > kv), "its own position too"),
    (lambda doc, q, kv: (doc[q] == doc[kv]) and (q >= kv), "join conditions with &"),
])
def test_document_checker_names_the_bug(body, diagnosis):
    from course_utils.exercises import ch11
    from course_utils.exercises.common import ExerciseWrong

    with pytest.raises(ExerciseWrong, match=diagnosis):
        ch11.check_document_mask(_doc_factory(body))


def test_skipped_fraction_checker():
    from course_utils.exercises import ch11
    from course_utils.exercises.common import ExerciseIncomplete, ExerciseWrong

    def by_pairs(lengths, block):  # a correct answer, computed from the pairs
        s = sum(lengths)
        bm = create_block_mask(document_mask(document_ids(lengths)), None, None, s, s, block=(block, block))
        return bm.fraction_skipped()

    def causal_only(lengths, block):
        n = -(-sum(lengths) // block)
        return (n * (n - 1) / 2) / (n * n)

    def blank(lengths, block):
        raise NotImplementedError  # your code here

    ch11.check_skipped_fraction(by_pairs)
    with pytest.raises(ExerciseWrong, match="causal masking alone"):
        ch11.check_skipped_fraction(causal_only)
    with pytest.raises(ExerciseIncomplete):
        ch11.check_skipped_fraction(blank)


def test_blank_modifier_exercise_says_not_written():
    from course_utils.exercises import ch11
    from course_utils.exercises.common import ExerciseIncomplete

    def make_alibi(slopes):
        raise NotImplementedError  # your code here

    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        ch11.check_alibi(make_alibi)
