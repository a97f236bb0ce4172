"""The Trainer on a streamed dataset: batches planned online over a bounded buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from launched import run_launcher

datasets = pytest.importorskip("datasets")


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize(
    "strategy, options", [("packed", {"capacity": 256}), ("token_budget", {"max_tokens": 256})]
)
def test_trainer_trains_on_a_streamed_dataset(tmp_path, strategy, options) -> None:
    from transformers import TrainingArguments

    from smart_batching.hf import SmartBatchingTrainer

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 128, rng.integers(5, 90)).tolist() for _ in range(120)]
    stream = datasets.Dataset.from_dict({"input_ids": rows}).to_iterable_dataset(num_shards=2)
    seen: list[int] = []

    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=6, learning_rate=1e-3, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=args, train_dataset=stream, strategy=strategy, strategy_options=options,
        streaming_buffer_size=40,
    )  # fmt: skip
    inner = trainer.data_collator

    def recording(features):
        seen.append(sum(len(f["input_ids"]) for f in features))
        return inner(features)

    trainer.data_collator = recording
    result = trainer.train()
    assert result.global_step == 6
    assert np.isfinite(result.training_loss)
    # Batches respect the strategy's limit and are planned online: packed rows come out (nearly) full.
    assert seen and max(seen) <= 256
    if strategy == "packed":
        assert sum(seen) / (256 * len(seen)) >= 0.9


def test_streamed_dataset_needs_max_steps(tmp_path) -> None:
    from transformers import TrainingArguments

    from smart_batching.errors import ConfigError
    from smart_batching.hf import SmartBatchingTrainer

    stream = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 8}).to_iterable_dataset()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=-1)
    with pytest.raises((ConfigError, ValueError), match="max_steps"):
        trainer = SmartBatchingTrainer(model=tiny_llama(), args=args, train_dataset=stream, strategy="packed",
                                       strategy_options={"capacity": 64})  # fmt: skip
        trainer.train()


def test_max_length_strategy_pads_every_row_to_the_planned_width(tmp_path) -> None:
    """'Longest Sequence' padding through the Trainer: rows padded to the dataset's longest, not the batch's."""
    from transformers import TrainingArguments

    from smart_batching.hf import SmartBatchingTrainer

    rows = [list(range(1, n + 1)) for n in (5, 9, 30, 7, 12, 3, 8, 11)]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], save_strategy="no"
    )
    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
        strategy="max_length", strategy_options={"batch_size": 4},
    )  # fmt: skip
    widths = {batch["input_ids"].shape[1] for batch in trainer.get_train_dataloader()}
    assert widths == {30}


@pytest.mark.parametrize("num_shards", [3, 4])
def test_trainer_on_two_processes_with_a_streamed_dataset(tmp_path, num_shards) -> None:
    """2 real ranks (torchrun, gloo): every example once per epoch, equal steps, no gradient spill."""
    import json
    import math
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    num_examples, accum = 203, 2
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(root / "examples" / "ddp_streaming.py"), "--out", str(tmp_path),
        "--num-examples", str(num_examples), "--num-shards", str(num_shards), "--accum", str(accum),
        "--epochs", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = run_launcher(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["global_steps"] == ranks[1]["global_steps"]
    for epoch in range(2):
        # Every example exactly once per epoch across the two ranks, and both ranks had work.
        seen = sorted(i for r in ranks for b in r["epochs"][epoch] for i in b)
        assert seen == list(range(num_examples))
        assert all(r["epochs"][epoch] for r in ranks)
    # The second epoch is planned anew (set_epoch reached the stream).
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    # Real + null micro-batches are equal on both ranks and fill whole optimizer steps.
    totals = {sum(len(e) for e in r["epochs"]) + r["null_batches"] for r in ranks}
    assert len(totals) == 1
    (total,) = totals
    assert total % accum == 0 and ranks[0]["global_steps"] == total // accum
    # No micro-batch's loss spilled into the next step: every logged loss stays near ln(vocab).
    assert max(ranks[0]["losses"]) < 1.2 * math.log(256)


def test_resume_on_a_stream_after_a_pass_ended_gives_identical_weights(tmp_path) -> None:
    """Checkpoint in the second pass over the stream, resume: the same batches, the same final weights."""
    import json

    from transformers import TrainingArguments

    from smart_batching.errors import ConfigError
    from smart_batching.hf import SAMPLER_STATE_NAME, SmartBatchingTrainer

    torch.set_num_threads(1)
    rng = np.random.default_rng(3)
    rows = [rng.integers(1, 128, rng.integers(5, 60)).tolist() for _ in range(40)]
    stream = datasets.Dataset.from_dict({"input_ids": rows}).to_iterable_dataset(num_shards=2)

    def make(max_steps=11, buffer=20):
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=max_steps, learning_rate=1e-3,
            report_to=[], save_strategy="steps", save_steps=8, disable_tqdm=True, seed=0,
            gradient_accumulation_steps=2, lr_scheduler_type="constant",
        )  # fmt: skip
        return SmartBatchingTrainer(
            model=tiny_llama(), args=args, train_dataset=stream, strategy="token_budget",
            strategy_options={"max_tokens": 128}, streaming_buffer_size=buffer,
        )  # fmt: skip

    def weights(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    full = make()
    full.train()
    checkpoint = tmp_path / "out" / "checkpoint-8"
    cursor = json.loads((checkpoint / SAMPLER_STATE_NAME).read_text())
    assert cursor["kind"] == "stream" and cursor["epoch"] >= 1  # the checkpoint lies past the first pass

    resumed = make()
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 11
    assert (weights(resumed.model) - weights(full.model)).abs().max().item() <= 1e-6
    assert (weights(tiny_llama()) - weights(full.model)).abs().max().item() > 1e-3

    with pytest.raises(ConfigError, match="buffer_size"):
        make(buffer=10).train(resume_from_checkpoint=str(checkpoint))
