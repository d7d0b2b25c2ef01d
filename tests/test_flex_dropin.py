"""Chapter 11's flex_attention on the CPU: modifiers written as PyTorch's FlexAttention documentation writes them,
run unchanged against float64, and each answer that used to be silently wrong, now right or a clear error."""

import pytest
import torch
from torch.nn.attention.flex_attention import or_masks

import course_utils as cu
from course_utils.api import flex
from course_utils.api.flex import create_block_mask, document_mask, flex_attention
from course_utils.checking.flex_reference import flex_reference, flex_references

B, H, S, D = 2, 2, 24, 16


def _inputs(batch=B, heads=H, seq=S, scale=1.0):
    g = torch.Generator().manual_seed(seq * 7 + heads)
    q = torch.randn(batch, heads, seq, D, generator=g) * scale
    k, v, d_out = (torch.randn(batch, heads, seq, D, generator=g) for _ in range(3))
    return q, k, v, d_out


def _check(name, q, k, v, d_out, score_mod=None, mask_mod=None, block_mask=None, ref_score=None, ref_mask=None):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flex_attention(*leaves, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                              return_lse=True)
    grads = torch.autograd.grad(out, leaves, d_out)
    refs = flex_references(q, k, v, d_out=d_out, score_mod=ref_score or score_mod,
                           mask_mod=ref_mask or mask_mod or (block_mask.mask_mod if block_mask else None))
    cu.check_forward(q, k, v, out.detach(), lse, refs=refs, name=name, quiet=True)
    cu.check_backward(q, k, v, d_out, grads, refs=refs, name=name, quiet=True)
    return out.detach(), grads


# --- Ten modifiers as the FlexAttention documentation writes them ---------------------------------------------

softcap = 20.0


def soft_cap(score, b, h, q_idx, kv_idx):
    score = score / softcap
    score = torch.tanh(score)
    score = score * softcap
    return score


alibi_bias = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)])


def alibi(score, b, h, q_idx, kv_idx):
    bias = alibi_bias[h] * (kv_idx - q_idx)
    return score + bias


def relative_positional(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


SLIDING_WINDOW = 5


def sliding_window_causal(b, h, q_idx, kv_idx):
    causal_mask = q_idx >= kv_idx
    window_mask = q_idx - kv_idx <= SLIDING_WINDOW
    return causal_mask & window_mask


document_id = torch.tensor([0] * 7 + [1] * 10 + [2] * 7, dtype=torch.int32)


def document_causal_mask(b, h, q_idx, kv_idx):
    causal_mask = q_idx >= kv_idx
    document_mask = document_id[q_idx] == document_id[kv_idx]
    return causal_mask & document_mask


prefix_length = torch.tensor([5, 13])  # one per batch entry


def prefix_mask(b, h, q_idx, kv_idx):
    return kv_idx <= prefix_length[b]


prefix_lm_causal = or_masks(prefix_mask, causal)  # torch.nn.attention.flex_attention's own combinator


head_bias_table = torch.tensor([0.75, -1.5])


def head_bias(score, b, h, q_idx, kv_idx):
    return score + head_bias_table[h]


def causal_where(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def soft_capped_alibi(score, b, h, q_idx, kv_idx):
    score = score + alibi_bias[h] * (kv_idx - q_idx)
    return softcap * torch.tanh(score / softcap)


DOCUMENTED = {
    "soft-capping (torch.tanh)": dict(score_mod=soft_cap),
    "ALiBi (closed-over slopes[h])": dict(score_mod=alibi),
    "relative position": dict(score_mod=relative_positional),
    "causal mask": dict(mask_mod=causal),
    "sliding window": dict(block="sliding"),
    "document mask (closed-over ids)": dict(mask_mod=document_causal_mask),
    "prefix-LM (prefix_length[b])": dict(mask_mod=prefix_lm_causal),
    "per-head bias table [h]": dict(score_mod=head_bias),
    "score_mod with torch.where": dict(score_mod=causal_where),
    "soft-capped ALiBi, document mask": dict(score_mod=soft_capped_alibi, mask_mod=document_causal_mask),
}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_documented_modifier_runs_unchanged(name):
    mods = dict(DOCUMENTED[name])
    q, k, v, d_out = _inputs(scale=3.0)
    if mods.pop("block", None):  # as the documentation does: block_mask = create_block_mask(mask, None, None, ...)
        mods["block_mask"] = create_block_mask(sliding_window_causal, None, None, S, S, device="cpu", block=(8, 8))
        assert mods["block_mask"].counts()["empty"] > 0
    _check(name, q, k, v, d_out, **mods)


# --- Each silent wrong answer, now right or a clear error -----------------------------------------------------

def test_mask_reading_b_and_h_without_a_block_mask():
    ids = torch.tensor([[0] * 12 + [1] * 12, [0] * 3 + [1] * 21])  # one packing per batch row

    def second_head_sees_all(b, h, q_idx, kv_idx):
        return (h == 1) | (kv_idx < 2)

    q, k, v, d_out = _inputs()
    _check("document_mask, [B, S] ids", q, k, v, d_out, mask_mod=document_mask(ids))
    _check("h == 1", q, k, v, d_out, mask_mod=second_head_sees_all)
    with pytest.raises(ValueError, match="reads b.*B=2"):  # a block mask made at b = 0 alone
        flex_attention(q, k, v, block_mask=create_block_mask(document_mask(ids), None, None, S, S))


def test_score_mod_hiding_whole_rows_has_finite_gradients():
    def late_rows(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx < 6, -float("inf"), score)

    q, k, v, d_out = _inputs()
    out, grads = _check("rows of −∞ scores", q, k, v, d_out, score_mod=late_rows)
    assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
    assert all(torch.isfinite(g).all() for g in grads)


CAP = 5.0
SETTINGS = {"cap": 5.0}


def capped_by_global(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def capped_by_dict(score, b, h, q_idx, kv_idx):
    return SETTINGS["cap"] * torch.tanh(score / SETTINGS["cap"])


def test_kernels_follow_what_the_modifier_reads():
    global CAP
    q, k, v, _ = _inputs(batch=1, heads=1, seq=16, scale=8.0)
    for mod in (capped_by_global, capped_by_dict):
        for cap in (5.0, 40.0):
            CAP = SETTINGS["cap"] = cap
            out = flex_attention(q, k, v, score_mod=mod)
            ref = flex_reference(q, k, v, score_mod=mod)[0]
            cu.check_close(out, ref, f"{mod.__name__}, cap {cap}", quiet=True)
    CAP = SETTINGS["cap"] = 5.0

    table = torch.zeros(16)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]

    flex_attention(q, k, v, score_mod=bias)
    table.data[3] = 30.0  # changed under autograd's nose: no version bump
    out = flex_attention(q, k, v, score_mod=bias)
    cu.check_close(out, flex_reference(q, k, v, score_mod=bias)[0], ".data update", quiet=True)


def test_captured_tensor_requiring_grad_is_refused():
    bias = torch.zeros(H, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    q, k, v, _ = _inputs(seq=16)
    with pytest.raises(ValueError, match=r"`bias` \(2,\).*requires grad.*bias.detach\(\)"):
        flex_attention(q, k, v, score_mod=learned)
    with torch.no_grad():
        flex_attention(q, k, v, score_mod=learned)  # no gradient asked for: fine


def test_negative_indices_wrap_and_short_tables_are_an_error():
    rel = torch.linspace(-2, 2, 2 * S - 1)

    def relative_table(score, b, h, q_idx, kv_idx):
        return score + rel[q_idx - kv_idx]  # q_idx < kv_idx reads from the end, as in torch

    q, k, v, d_out = _inputs()
    _check("rel[q_idx - kv_idx]", q, k, v, d_out, score_mod=relative_table)

    short = torch.zeros(S - 4, dtype=torch.int32)

    def short_table(b, h, q_idx, kv_idx):
        return short[q_idx] == short[kv_idx]

    with pytest.raises(ValueError, match=r"reads `short` \(shape \(20,\)\) at index 0..23.*size 20"):
        flex_attention(q, k, v, mask_mod=short_table)
    with pytest.raises(IndexError):
        flex_attention(q, k, v, mask_mod=short_table)


def test_integer_division_by_zero_is_zero_not_a_crash():
    period = torch.tensor([0, 3])

    def banded(score, b, h, q_idx, kv_idx):
        return score + (q_idx // period[h]) * 0.25 + (kv_idx % period[h]) * 0.5

    def banded_safe(score, b, h, q_idx, kv_idx):  # the same, with x // 0 = x % 0 = 0
        p = period[h].clamp(min=1)
        zero = period[h] == 0
        return score + torch.where(zero, 0, q_idx // p) * 0.25 + torch.where(zero, 0, kv_idx % p) * 0.5

    q, k, v, d_out = _inputs()
    _check("// and % by a runtime 0", q, k, v, d_out, score_mod=banded, ref_score=banded_safe)


# --- Errors that say what happened ----------------------------------------------------------------------------

def test_clear_errors():
    q, k, v, _ = _inputs(seq=16)

    def huge(b, h, q_idx, kv_idx):
        return q_idx * 3_000_000_000 >= kv_idx

    with pytest.raises(TypeError, match="mask_mod `huge`.*3000000000 does not fit the kernel's int32"):
        flex_attention(q, k, v, mask_mod=huge)

    def overflows(b, h, q_idx, kv_idx):
        return q_idx * 2 ** 20 * 2 ** 20 >= kv_idx  # fine in torch's int64, wraps in int32

    with pytest.raises(ValueError, match="mask_mod `overflows` computes .* past int32"):
        flex_attention(q, k, v, mask_mod=overflows)

    def own_error(score, b, h, q_idx, kv_idx):
        raise KeyError("my own problem")

    def own_value_error(score, b, h, q_idx, kv_idx):
        raise ValueError("my own problem")

    with pytest.raises(KeyError, match="my own problem"):
        flex_attention(q, k, v, score_mod=own_error)
    with pytest.raises(ValueError, match="^my own problem$"):
        flex_attention(q, k, v, score_mod=own_value_error)

    def uses_sin(score, b, h, q_idx, kv_idx):
        return torch.sin(score)

    with pytest.raises(TypeError, match="score_mod `uses_sin`.*torch.sin cannot be compiled.*torch.tanh"):
        flex_attention(q, k, v, score_mod=uses_sin)

    rows = torch.zeros(4, 16)

    def sliced(score, b, h, q_idx, kv_idx):
        return score + rows[h][q_idx]

    with pytest.raises(TypeError, match="indexes `rows` .* with 1 indices.*one index per dimension"):
        flex_attention(q, k, v, score_mod=sliced)

    far = torch.zeros(2, device="meta")

    def on_meta(score, b, h, q_idx, kv_idx):
        return score + far[h]

    with pytest.raises(ValueError, match="`far`, read by a modifier, is on meta.*move it there"):
        flex_attention(q, k, v, score_mod=on_meta)


def test_a_block_the_backward_walks_in_smaller_steps():
    # 24 query rows a block: the CPU backward walks them in steps of 12 (it took 16, and failed after the forward).
    q, k, v, d_out = _inputs(batch=1, heads=1, seq=40)
    bm = create_block_mask(causal, None, None, 40, 40, block=(24, 16))
    _check("24 × 16 blocks", q, k, v, d_out, block_mask=bm)


def test_plans_are_reused_until_what_the_modifier_reads_changes():
    global CAP
    first = flex.cached_plan(capped_by_global)
    assert flex.cached_plan(capped_by_global) is first  # nothing changed: no new trace
    CAP = 7.0
    try:
        changed = flex.cached_plan(capped_by_global)
        assert changed is not first and changed.key != first.key
    finally:
        CAP = 5.0
    assert flex.cached_plan(capped_by_global).key == first.key
    assert flex.cached_plan(capped_by_dict) is not flex.cached_plan(capped_by_dict)  # a dict: traced every call

    def twin(score, b, h, q_idx, kv_idx):  # another function, the same formula: the same kernel
        return CAP * torch.tanh(score / CAP)

    assert flex.cached_plan(twin).key == first.key


def test_closed_over_boolean_table_and_torch_functions_on_duals():
    allowed = torch.rand(S, S, generator=torch.Generator().manual_seed(3)) > 0.4
    allowed.fill_diagonal_(True)

    def from_table(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx]

    def smooth(score, b, h, q_idx, kv_idx):
        return torch.clamp(score, min=-4.0) + torch.sigmoid(score) * torch.exp(-score.abs() / 4) + score.tanh()

    q, k, v, d_out = _inputs(batch=1, scale=2.0)
    _check("bool table, sigmoid/clamp/exp/abs", q, k, v, d_out, score_mod=smooth, mask_mod=from_table)
