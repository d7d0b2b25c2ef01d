"""Full-size checks that run only on a CUDA machine (the lent H100); skipped elsewhere."""

import pytest
import torch

from course_utils import attention_reference, check_close, flash_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _slice_ref(q, k, v, heads, **kw):
    """float64 reference for the first batch and the first ``heads`` query heads."""
    group = q.shape[1] // k.shape[1]
    kv_heads = max(1, heads // group)
    sinks = kw.pop("sinks", None)
    return attention_reference(q[:1, :heads], k[:1, :kv_heads], v[:1, :kv_heads],
                               sinks=None if sinks is None else sinks[:heads], **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [4096, 1000])
def test_forward_full_size(dtype, dim, causal, seq):
    q, k, v = (torch.randn(2, 16, seq, dim, device="cuda", dtype=dtype) for _ in range(3))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ref, ref_lse = _slice_ref(q, k, v, 2, causal=causal, return_lse=True)
    check_close(out[:1, :2], ref, f"O {dtype} D={dim} S={seq} causal={causal}")
    check_close(lse[:1, :2], ref_lse, "LSE", atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [None, 128, 100])
def test_forward_gpt_oss_shape(window):
    q = torch.randn(1, 64, 2048, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 2048, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(64, device="cuda")
    out = flash_attention(q, k, v, causal=True, window_size=window, sinks=sinks)
    ref = _slice_ref(q, k, v, 16, causal=True, window_size=window, sinks=sinks)
    check_close(out[:1, :16], ref, f"O gpt-oss window={window}")
