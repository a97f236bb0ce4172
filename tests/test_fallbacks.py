"""No silent fallback: one warning per kind and process, every occurrence counted, reasons that name
the setting to change."""

from __future__ import annotations

import warnings

import pytest

from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks, reset_fallbacks, warn_fallback


def test_a_fallback_warns_once_per_kind_and_counts_every_time():
    with pytest.warns(FallbackWarning) as seen:
        for _ in range(3):
            warn_fallback("demo.a", "slower; set x=1")
        warn_fallback("demo.b", "other")
    assert [str(w.message) for w in seen] == [
        "smart batching fell back (demo.a): slower; set x=1",
        "smart batching fell back (demo.b): other",
    ]
    assert recorded_fallbacks() == {"demo.a": 3, "demo.b": 1}
    reset_fallbacks()
    assert recorded_fallbacks() == {}
    with pytest.warns(FallbackWarning):
        warn_fallback("demo.a", "again after a reset")


def test_fallback_warnings_can_be_silenced_and_are_still_counted():
    with warnings.catch_warnings():
        warnings.filterwarnings("error")
        warnings.filterwarnings("ignore", category=FallbackWarning)
        warn_fallback("demo.quiet", "not shown")
    assert recorded_fallbacks() == {"demo.quiet": 1}


def test_varlen_fallback_reasons_name_what_to_change():
    torch = pytest.importorskip("torch")
    from smart_batching.attention._kernels import varlen_unavailable_reason as reason

    both = {"same_head_dim": True, "dropout": 0.0, "has_flash_attn": True, "has_torch_varlen": True}
    assert reason(torch.bfloat16, **both) is None
    assert reason(torch.float16, **{**both, "has_flash_attn": False}) is None
    assert "bf16=True" in reason(torch.float32, **both)
    assert "pip install flash-attn" in reason(
        torch.bfloat16, **{**both, "has_flash_attn": False, "has_torch_varlen": False}
    )
    assert "attention_dropout=0.0" in reason(
        torch.bfloat16, **{**both, "has_flash_attn": False, "dropout": 0.1}
    )
    assert reason(torch.bfloat16, **{**both, "dropout": 0.1}) is None  # flash-attn has dropout
    assert "differ in size" in reason(torch.bfloat16, **{**both, "same_head_dim": False})


def test_packed_attention_on_the_cpu_is_no_fallback(recwarn):
    torch = pytest.importorskip("torch")
    from smart_batching.attention._kernels import _varlen_attention

    q = torch.randn(6, 2, 4)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    out = _varlen_attention(q, q, q, cu, 4, causal=True, window=None, scale=None, dropout=0.0)
    assert out is None  # segment-wise SDPA is the documented CPU path: no warning, nothing counted
    assert not [w for w in recwarn if w.category is FallbackWarning] and recorded_fallbacks() == {}
