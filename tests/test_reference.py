"""The float64 reference against PyTorch's own attention, and its input validation."""

import math

import pytest
import torch
import torch.nn.functional as F

from course_utils import attention_reference, check_close
from course_utils.core.reference import visibility_mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 5, 8), (2, 3, 33, 16)])
def test_matches_sdpa_float64(shape, causal):
    q, k, v = (torch.randn(shape, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    check_close(attention_reference(q, k, v, causal=causal), expected, "reference vs SDPA")


def test_gqa_equals_repeated_heads():
    q = torch.randn(2, 6, 10, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 10, 8, dtype=torch.float64) for _ in range(2))
    expected = attention_reference(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1))
    check_close(attention_reference(q, k, v), expected, "GQA")


def test_window_matches_explicit_mask():
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    mask = (j <= i) & (j > i - 4)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    check_close(attention_reference(q, k, v, window_size=4), expected, "window 4")


def test_sinks_equal_an_extra_zero_value_column():
    """gpt-oss's formulation: append the sink logit as a column, softmax, drop it."""
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], dtype=torch.float64)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    sink_col = sinks[None, :, None, None].expand(1, 2, 7, 1)
    probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    check_close(attention_reference(q, k, v, sinks=sinks), probs @ v, "sinks")


def test_lse_is_logsumexp_of_scaled_scores():
    q, k, v = (torch.randn(1, 1, 9, 4, dtype=torch.float64) for _ in range(3))
    _, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    scores = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~visibility_mask(9, 9, causal=True), -math.inf)
    check_close(lse.double(), torch.logsumexp(scores, -1), "LSE", atol=1e-6, rtol=1e-6)


def test_row_with_no_visible_key_is_zero_not_nan():
    q = torch.randn(1, 1, 6, 4, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 3, 4, dtype=torch.float64) for _ in range(2))
    out, lse = attention_reference(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[0, 0, :3], torch.zeros(3, 4, dtype=torch.float64))
    assert torch.isinf(lse[0, 0, :3]).all() and torch.isfinite(lse[0, 0, 3:]).all()


@pytest.mark.parametrize("bad, message", [
    (dict(q=torch.randn(2, 4, 8)), "shape \\[batch, heads, seq, head_dim\\]"),
    (dict(k=torch.randn(1, 2, 8, 8, dtype=torch.float64)), "share a dtype"),
    (dict(k=torch.randn(1, 3, 8, 8), v=torch.randn(1, 3, 8, 8)), "multiple of key/value heads"),
    (dict(v=torch.randn(1, 2, 9, 8)), "same shape"),
    (dict(k=torch.randn(1, 2, 8, 4), v=torch.randn(1, 2, 8, 4)), "head dims differ"),
    (dict(window_size=0), "window_size"),
    (dict(sinks=torch.zeros(3)), "sinks must be a tensor of shape \\[4\\]"),
])
def test_bad_inputs_raise_clear_errors(bad, message):
    args = dict(q=torch.randn(1, 4, 8, 8), k=torch.randn(1, 2, 8, 8), v=torch.randn(1, 2, 8, 8))
    args.update(bad)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=message):
        attention_reference(q, k, v, **args)
