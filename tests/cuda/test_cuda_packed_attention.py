"""Packed rows on CUDA: each varlen kernel gives the per-token loss and gradients of the same examples padded.

The CPU suite proves the packed path exact against padded and per-example forwards in fp32
(``tests/test_attention.py``, ``tests/conformance/test_vs_padded_forward.py``); on CUDA in half precision
the packed path runs a fused varlen kernel instead (``attention/_kernels.py``: flash-attn's
``flash_attn_varlen_func`` where installed, else ``torch.nn.attention.varlen.varlen_attn``), and in fp32
it takes the documented fallback, segment-wise SDPA, with a ``FallbackWarning``. Here the same model (same
weights) runs the same examples padded (transformers' SDPA with an ``attention_mask``) and packed in one
row; per-token losses, logits and every parameter's gradient must agree:

* fp32 (CUDA: the SDPA segment fallback, which must be recorded): tight, ``FP32``.
* bf16 autocast (CUDA: the varlen kernel, with no fallback): loose, ``BF16`` (both sides round to bf16,
  in kernels that sum in another order).

Three families: Llama, Qwen3 (q/k norms) and Mistral with a sliding window shorter than most examples.
A separate test watches the kernel run (torch's profiler sees the varlen op, and no SDPA call, in a packed
bf16 forward and backward).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from cuda_tier import needs_cuda, to_device  # noqa: E402

from smart_batching import compat  # noqa: E402
from smart_batching.attention import _kernels, enable_packed_attention  # noqa: E402
from smart_batching.collate import PackingCollator  # noqa: E402
from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402

pytestmark = pytest.mark.cuda

VOCAB = 256
WINDOW = 16
LENGTHS = [37, 64, 9, 64, 23, 50, 5, 41]  # most longer than WINDOW; 64 twice: an equal-length group
TINY = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, attention_dropout=0.0, max_position_embeddings=256, initializer_range=0.1,
)  # fmt: skip

FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=32)),
    "mistral-sliding": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    ),
}


class Tol:
    """A tolerance: per-token losses within ``atol``; logits, and each parameter's gradient, within
    ``rtol`` of their largest entry (a relative bound: logits reach ~10 here, gradients span decades)."""

    def __init__(self, atol: float, rtol: float) -> None:
        self.atol, self.rtol = atol, rtol


FP32 = Tol(atol=1e-4, rtol=1e-4)  # dry run on CPU measured: loss 1.4e-6, logits 7e-7, grads 7e-7
BF16 = Tol(atol=1e-1, rtol=8e-2)  # dry run on CPU measured: loss 4.4e-2, logits 1.5e-2, grads 2.5e-2

# (dtype, kernel): the kernel is the one the packed side must take on CUDA ("segment_sdpa": fp32's fallback).
PATHS = {
    "bf16-torch_varlen": (torch.bfloat16, "torch_varlen"),
    "bf16-flash_attn": (torch.bfloat16, "flash_attn"),
    "fp32-segment_sdpa": (torch.float32, "segment_sdpa"),
}


def _examples() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]


def _build(family: str, device: torch.device):
    torch.manual_seed(0)
    model = FAMILIES[family]().to(device)
    model.set_attn_implementation("sdpa")
    return model.train()


def _force_kernel(kernel: str, monkeypatch) -> None:
    """Make ``kernel`` the one the packed path picks (skip where it is not installed)."""
    if kernel == "flash_attn" and _kernels._flash_attn_varlen() is None:
        pytest.skip("flash-attn is not installed: its varlen kernel cannot be checked here")
    if kernel == "torch_varlen":
        if _kernels._torch_varlen() is None:
            pytest.skip("torch.nn.attention.varlen does not import in this torch")
        monkeypatch.setattr(_kernels, "_flash_attn_varlen", lambda: None)  # flash-attn would be preferred


def _per_token(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of one example, float32: (len - 1,)."""
    return F.cross_entropy(logits[:-1].float(), ids[1:].to(logits.device), reduction="none")


def _padded(model, examples, device, dtype):
    """transformers' SDPA forward of a right-padded batch: per-token losses, logits on real tokens, grads."""
    width = max(len(x) for x in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(examples):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
    losses = torch.cat([_per_token(logits[i, : len(x)], x) for i, x in enumerate(examples)])
    losses.sum().backward()
    real = logits[mask.to(device).bool()].detach().float()
    return losses.detach(), real, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _packed(model, examples, device, dtype):
    """One packed row (our PackingCollator, cu_seq_lens): per-token losses, logits, grads."""
    batch = PackingCollator(return_seq_idx=False)([{"input_ids": x} for x in examples])
    batch.pop("labels")
    batch = to_device(batch, device)
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(**batch).logits[0]
    starts = [0]
    for x in examples:
        starts.append(starts[-1] + len(x))
    losses = torch.cat(
        [_per_token(logits[s : s + len(x)], x) for s, x in zip(starts[:-1], examples, strict=True)]
    )
    losses.sum().backward()
    return (
        losses.detach(),
        logits.detach().float(),
        {n: p.grad.detach().clone() for n, p in model.named_parameters()},
    )


def _compare(what: str, ours, theirs, tol: Tol) -> None:
    losses, logits, grads = ours
    ref_losses, ref_logits, ref_grads = theirs
    assert losses.shape == ref_losses.shape and logits.shape == ref_logits.shape, what
    loss_diff = (losses - ref_losses).abs().max().item()
    assert loss_diff <= tol.atol, (
        f"{what}: per-token loss differs from padded SDPA by {loss_diff:.3e} (> {tol.atol})"
    )
    logit_diff = (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item()
    assert logit_diff <= tol.rtol, (
        f"{what}: logits differ from padded SDPA by {logit_diff:.3e} of the largest logit (> {tol.rtol})"
    )
    worst = max(
        ((grads[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-12), n)
        for n, g in ref_grads.items()
    )
    print(
        f"[cuda tier] {what}: loss {loss_diff:.2e} logits {logit_diff:.2e} grads {worst[0]:.2e} ({worst[1]})"
    )
    assert worst[0] <= tol.rtol, (
        f"{what}: gradient of {worst[1]} differs from padded SDPA's by {worst[0]:.3e} of its largest entry "
        f"(> {tol.rtol})"
    )


def test_torch_varlen_takes_the_calls_the_library_makes(device):
    """``compat.torch_varlen_call`` maps the library's causal and sliding-window calls onto this torch's
    ``varlen_attn`` signature (``scale``/``window_size`` from 2.11, ``enable_gqa`` from 2.12): none refused."""
    varlen = _kernels._torch_varlen()
    if varlen is None:
        pytest.skip("torch.nn.attention.varlen does not import in this torch")
    signature = inspect.signature(varlen)
    for window_size in ((-1, 0), (15, 0)):
        kwargs, repeat_kv, refused = compat.torch_varlen_call(
            window_size=window_size, scale=None, head_dim=32, gqa=True
        )
        print(
            f"[cuda tier] torch {torch.__version__} varlen_attn{signature}: {window_size=} -> {kwargs} {repeat_kv=}"
        )
        assert refused is None, (
            f"torch {torch.__version__}: varlen_attn{signature} refuses {window_size=}: {refused}"
        )


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_loss_and_gradients_equal_padded(device, family, path, monkeypatch):
    dtype, kernel = PATHS[path]
    _force_kernel(kernel, monkeypatch)
    tol = BF16 if dtype == torch.bfloat16 else FP32
    what = f"{family} {path} on {device.type}"
    examples = _examples()
    model = _build(family, device)
    reference = _padded(model, examples, device, dtype)
    # Guard against a vacuous pass: the examples run as one plain sequence (attending to each other) must
    # differ from the padded reference by more than the tolerance.
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        leaky = model(input_ids=torch.cat(examples)[None].to(device), use_cache=False).logits[0].float()
    leak = (leaky - reference[1]).abs().max().item()
    leak = leak / reference[1].abs().max().item()
    print(f"[cuda tier] {what}: leak {leak:.2e} of the largest logit")
    assert leak > 5 * tol.rtol, (
        f"{what}: the leak guard is too weak ({leak:.3e}); the comparison proves nothing"
    )

    enable_packed_attention(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        ours = _packed(model, examples, device, dtype)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    _compare(what, ours, reference, tol)
    if device.type == "cuda" and dtype == torch.float32:
        # fp32 on CUDA: the varlen kernels take half precision only; the segment path is the documented,
        # warned and counted fallback.
        assert recorded_fallbacks().get("attention.varlen", 0) > 0, f"{what}: fallback not recorded"
        assert fallbacks and "float32" in fallbacks[0], (
            f"{what}: no FallbackWarning naming float32: {fallbacks}"
        )
    else:
        # bf16 on CUDA must take the fused kernel; off CUDA the segment path is the documented one.
        assert recorded_fallbacks() == {}, f"{what}: fell back: {recorded_fallbacks()} {fallbacks}"
        assert fallbacks == [], f"{what}: FallbackWarning fired: {fallbacks}"


@pytest.mark.parametrize("kernel", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_packed_attention_runs_the_varlen_kernel(device, family, kernel, monkeypatch):
    """What runs, seen by torch's profiler: the varlen op in the packed forward and backward, no SDPA."""
    needs_cuda(device, "watching the fused varlen kernel run")
    _force_kernel(kernel, monkeypatch)
    model = enable_packed_attention(_build(family, device))
    batch = PackingCollator(return_seq_idx=False)([{"input_ids": x} for x in _examples()])
    batch.pop("labels")
    batch = to_device(batch, device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(**batch).logits
            logits.float().logsumexp(-1).sum().backward()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events()})
    attention = [n for n in names if "attention" in n or "attn" in n]
    assert recorded_fallbacks() == {}, f"{family} {kernel}: fell back: {recorded_fallbacks()}"
    assert not [n for n in names if "scaled_dot_product" in n], (
        f"{family} {kernel}: the packed bf16 forward called SDPA (the segment path), ops: {attention}"
    )
    if kernel == "torch_varlen":
        assert [n for n in names if "varlen" in n], (
            f"{family}: torch's varlen op (torch_attn::_varlen_attn) never ran; attention ops: {attention}"
        )
