"""Packed logits equal transformers' own padded logits, for every model family we claim.

Upstream: transformers ``tests/test_modeling_common.py`` (``ModelTesterMixin.
attention_mask_padding_matches_padding_free_with_position_ids``, run per model as
``test_sdpa_padding_matches_padding_free_with_position_ids``): a padded batch with an ``attention_mask``
and the same sequences flattened padding-free give the same logits on the real tokens. Here the padded
side is the stock model (its default attention, a right-padded batch as a padding collator builds it);
the packed side is our path (``enable_packed_attention`` + ``PackingCollator``). ``tests/test_attention.py``
compares packed rows with each example run alone; this suite compares with upstream's padded batch,
so a change in how transformers masks padding or numbers positions fails here first.

Families: those ``smart_batching.attention.guard`` names (Llama, Qwen2, Mistral with a sliding window,
GPT-2, BERT), tiny random-init models in fp32, tolerance 1e-5.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smart_batching.attention import enable_packed_attention  # noqa: E402
from smart_batching.collate import PackingCollator  # noqa: E402

ATOL = 1e-5
VOCAB = 500
LENGTHS = [9, 14, 5, 14, 3, 11]
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}

FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, num_key_value_heads=2, vocab_size=VOCAB)
    ),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TINY, num_key_value_heads=2, vocab_size=VOCAB)
    ),
    "mistral-sliding": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**TINY, num_key_value_heads=2, vocab_size=VOCAB, sliding_window=6)
    ),
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
    ),
    "bert": lambda: transformers.BertModel(
        transformers.BertConfig(**TINY, vocab_size=VOCAB), add_pooling_layer=False
    ),
}


def _out(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _build(family: str):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


@pytest.fixture(scope="module")
def examples() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]


def _padded(model, examples) -> torch.Tensor:
    """Upstream's padded forward: right padding with 0, an attention_mask; real tokens only: (total, dim)."""
    width = max(len(x) for x in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, x in enumerate(examples):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    extra = {} if isinstance(model, transformers.BertModel) else {"use_cache": False}
    with torch.no_grad():
        out = _out(model(input_ids=ids, attention_mask=mask, **extra))
    return out[mask.bool()]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_upstream_padded_logits(one_thread, examples, family):
    reference = _padded(_build(family), examples)
    model = _build(family)
    # Guard against a vacuous pass: the same tokens run as one plain sequence (examples attending to each
    # other) must differ from the padded reference.
    with torch.no_grad():
        leaky = _out(model(input_ids=torch.cat(examples)[None]))[0]
    assert (leaky - reference).abs().max().item() > 1e-3
    enable_packed_attention(model)
    batch = PackingCollator(return_seq_idx=False)([{"input_ids": x} for x in examples])
    batch.pop("labels")
    with torch.no_grad():
        packed = _out(model(**batch))[0]
    assert packed.shape == reference.shape
    diff = (packed - reference).abs().max().item()
    assert diff <= ATOL, (
        f"{family}: packed logits differ from transformers' padded logits by {diff:.2e} (> {ATOL}); if our "
        f"packed path did not change, transformers' padded forward moved (attention_mask handling, position "
        f"numbering or the sdpa mask for {type(model).__name__})"
    )
