"""Adaptive token budget: the largest budget whose costliest batch trains within a memory cap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from smart_batching.adaptive.autotune import (
    _peak_rss_bytes,
    accumulation_steps_for,
    costliest_batch_shape,
    find_max_tokens,
)
from smart_batching.errors import ConfigError
from smart_batching.planners import plan_batches


def tiny_llama(hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


LENGTHS = np.random.default_rng(0).integers(8, 400, 300)


def test_costliest_batch_is_the_widest() -> None:
    plan = plan_batches(LENGTHS, "token_budget", max_tokens=1024)
    rows, width, segs = costliest_batch_shape(plan)
    assert rows * width == plan.slots_per_batch.max()
    assert max(segs) == width


@pytest.mark.parametrize("strategy", ["token_budget", "packed"])
def test_generous_cap_reaches_the_largest_budget_and_a_tight_one_none(strategy) -> None:
    torch.set_num_threads(1)
    model = tiny_llama()
    candidates = (256, 512, 1024, 2048, 4096)
    base = _peak_rss_bytes()
    generous = find_max_tokens(
        model, LENGTHS, strategy, memory_cap_bytes=base + 8 * 2**30, candidates=candidates
    )
    assert generous == 4096
    # A cap below what the process already uses fits nothing: a clear error naming the setting.
    with pytest.raises(ConfigError, match="memory_cap_bytes="):
        find_max_tokens(model, LENGTHS, strategy, memory_cap_bytes=base // 2, candidates=candidates)
    # Gradients are left clean and the mode restored.
    assert all(p.grad is None for p in model.parameters())


def test_cpu_needs_a_cap_and_accumulation_keeps_tokens_per_step() -> None:
    with pytest.raises(ConfigError, match="memory_cap_bytes="):
        find_max_tokens(tiny_llama(), LENGTHS, "token_budget")
    assert accumulation_steps_for(16384, 4096) == 4
    assert accumulation_steps_for(16384, 3000) == 6
    assert accumulation_steps_for(100, 4096) == 1


def test_trainer_resolves_auto(tmp_path) -> None:
    import datasets
    from transformers import TrainingArguments

    from smart_batching.hf import SmartBatchingTrainer

    rows = [np.random.default_rng(i).integers(1, 256, int(n)).tolist() for i, n in enumerate(LENGTHS[:64])]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, report_to=[], save_strategy="no"
    )
    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        strategy="token_budget",
        strategy_options={"max_tokens": "auto", "memory_cap_bytes": _peak_rss_bytes() + 8 * 2**30,
                          "tokens_per_step": 4096, "auto_candidates": (512, 1024, 2048)},
    )  # fmt: skip
    assert trainer.smart_batching.spec.max_tokens == 2048
    assert trainer.args.gradient_accumulation_steps == 2
    assert trainer.train().global_step == 2
