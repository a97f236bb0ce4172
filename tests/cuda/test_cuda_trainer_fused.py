"""A short real training run on CUDA takes the fused paths only: no ``FallbackWarning``, none recorded.

``SmartBatchingTrainer`` with the ``packed`` strategy, ``bf16=True``, a tiny random Llama: packed attention
must run a varlen kernel (``attention.varlen``), the LM head fused with the loss
(``trainer.fused_lm_head``), and nothing else may fall back. ``FallbackWarning`` is an error for the run;
torch's profiler must see the varlen op run and no SDPA call; the peak ``torch.cuda.max_memory_allocated`` is printed (``-rA`` shows it). The dry run on CPU trains in
float32 (bf16 on a CPU is its own documented fallback where the CPU lacks bf16 instructions, and a test must
not depend on the CPU's features).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402

pytestmark = pytest.mark.cuda

VOCAB = 1024


def test_packed_bf16_training_run_takes_no_fallback(device, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the Trainer's dataset is a datasets.Dataset")
    from smart_batching.hf import SmartBatchingTrainer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in rng.integers(20, 300, size=96)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], max_steps=4, save_strategy="no", disable_tqdm=True,
        bf16=device.type == "cuda", use_cpu=device.type == "cpu", learning_rate=1e-3, seed=0, logging_steps=1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        trainer = SmartBatchingTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
            strategy="packed",
            strategy_options={"capacity": 1024},
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = trainer.train()
    names = {e.name for e in prof.events()}
    where = next(model.parameters()).device.type
    assert where == device.type, f"the Trainer ran on {where}, not {device.type}"
    print(f"[cuda tier] packed run: {recorded_fallbacks()=}, precision {trainer.smart_batching.precision}")
    if device.type == "cuda":
        precision = trainer.smart_batching.precision
        assert precision.get("autocast") == precision.get("lm_head_matmul") == "bfloat16", (
            f"the bf16 run's attention/LM head did not run in bfloat16: {precision}"
        )
        # A packed batch that reached attention without max_length_q would take the segment path unwarned:
        # what ran is the observable.
        assert [n for n in names if "varlen" in n], "no varlen attention op ran in the packed bf16 run"
        assert not [n for n in names if "scaled_dot_product" in n], "the packed bf16 run called SDPA"
        peak = torch.cuda.max_memory_allocated() / 2**20
        print(f"[cuda tier] packed bf16 run: 4 steps, peak torch.cuda.max_memory_allocated {peak:.1f} MiB")
    assert recorded_fallbacks() == {}, f"the packed bf16 run fell back: {recorded_fallbacks()}"
    assert trainer.state.global_step == 4, f"the run stopped at step {trainer.state.global_step} of 4"
    assert math.isfinite(result.training_loss), f"training loss {result.training_loss}"
    assert trainer.smart_batching.target_logits is True, (
        "the run did not take the target-logits (fused head) path"
    )
