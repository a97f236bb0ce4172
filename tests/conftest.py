"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module of tiny models: faster, and far faster on a busy CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_fallbacks():
    """Each test sees its own fallback warnings and counts (they warn once per process otherwise)."""
    from smart_batching.fallbacks import reset_fallbacks

    reset_fallbacks()
    yield


@pytest.fixture
def tiny_llama_and_args(tmp_path):
    """``make(max_steps) -> (model, args)``: a one-layer random Llama (vocabulary 64, seed 0) and CPU
    ``TrainingArguments`` for a few steps, for tests that only need a real Trainer to run."""

    def make(max_steps: int = 1):
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=600,
        )  # fmt: skip
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "trainer"), use_cpu=True, report_to=[], max_steps=max_steps,
            save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config), args

    return make
