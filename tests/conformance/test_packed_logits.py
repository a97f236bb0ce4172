"""Packed logits: our packed attention against transformers' own padding-free path.

For each causal family we claim (llama, qwen2, mistral with a sliding window), the same features go
through transformers' ``DataCollatorWithFlattening`` into the model with its stock ``sdpa`` attention
(transformers detects packed ``position_ids`` and builds a block-causal mask), and through our
``PackingCollator`` into the model switched to :func:`~smart_batching.attention.enable_packed_attention`.
The logits must agree (fp32), and both must equal each example run alone, so a transformers release
that stops honouring packed ``position_ids`` fails here by name.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from smart_batching.attention import enable_packed_attention  # noqa: E402
from smart_batching.collate import PackingCollator  # noqa: E402

VOCAB = 500
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
LENGTHS = [9, 14, 5, 14, 3, 11]


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**TINY, num_key_value_heads=2, vocab_size=VOCAB)
    )


def _qwen2():
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**TINY, num_key_value_heads=2, vocab_size=VOCAB)
    )


def _mistral():
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(**TINY, num_key_value_heads=2, vocab_size=VOCAB, sliding_window=6)
    )


@pytest.mark.parametrize("factory", [_llama, _qwen2, _mistral], ids=["llama", "qwen2", "mistral-sliding"])
def test_packed_logits_equal_transformers_padding_free_path(factory):
    gen = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=gen).tolist()} for n in LENGTHS]
    torch.manual_seed(0)
    model = factory().eval()
    model.set_attn_implementation("sdpa")
    theirs_batch = transformers.DataCollatorWithFlattening(return_tensors="pt")([dict(f) for f in features])
    theirs_batch.pop("labels", None)
    with torch.no_grad():
        theirs = model(**theirs_batch, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([f["input_ids"]])).logits[0] for f in features])
    torch.testing.assert_close(
        theirs,
        alone,
        rtol=1e-4,
        atol=1e-5,
        msg=lambda m: f"transformers' packed position_ids path moved: {m}",
    )
    enable_packed_attention(model)
    batch = PackingCollator()([dict(f) for f in features])
    batch.pop("labels")
    with torch.no_grad():
        mine = model(**batch).logits[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
