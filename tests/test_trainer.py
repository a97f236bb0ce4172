"""SmartBatchingTrainer on a tiny real Llama: strategies, exact batches, packed == padded, loss
normalisation across gradient accumulation, resume, and refusing models that leak across packs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from smart_batching import ConfigError, plan_batches  # noqa: E402
from smart_batching.collate import PaddingCollator  # noqa: E402
from smart_batching.hf import (  # noqa: E402
    SAMPLER_STATE_NAME,
    SmartBatchingTrainer,
    apply_smart_batching,
    dataset_lengths,
)
from smart_batching.loss import TokenLoss  # noqa: E402

VOCAB = 512
STRATEGIES = {
    "random": {"batch_size": 4},
    "group_by_length": {"batch_size": 4},
    "token_budget": {"max_tokens": 192},
    "packed": {"capacity": 160},
}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama(attn_implementation: str = "sdpa", cls: type = LlamaForCausalLM) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation=attn_implementation,
    )
    return cls(config).float()


def counting_dataset(num_examples: int = 40, seed: int = 0, max_len: int = 60) -> datasets.Dataset:
    """Sequences that count up by one from a random start: learnable in a few steps."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, max_len, size=num_examples)
    starts = rng.integers(1, VOCAB, size=num_examples)
    rows = [((s + np.arange(n)) % (VOCAB - 1) + 1).tolist() for s, n in zip(starts, lengths, strict=True)]
    return datasets.Dataset.from_dict(
        {"input_ids": rows, "text": [f"example {i}" for i in range(num_examples)]}
    )


def training_args(tmp_path, **overrides) -> TrainingArguments:
    values = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": [],
        "max_steps": 4,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    values.update(overrides)
    return TrainingArguments(**values)


def sgd_args(tmp_path, **overrides) -> TrainingArguments:
    """One optimizer step of plain SGD with lr 1: the weight change is minus the gradient."""
    return training_args(
        tmp_path,
        optim="sgd",
        learning_rate=1.0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        max_steps=1,
        **overrides,
    )


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def reference_step(dataset, example_ids) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one padded batch of ``example_ids``, outside any Trainer."""
    model = tiny_llama()
    batch = PaddingCollator(0)([dataset[int(i)] for i in example_ids])
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach()), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def sgd_gradient(trainer) -> dict[str, torch.Tensor]:
    before = weights(tiny_llama())
    after = dict(trainer.model.named_parameters())
    return {k: before[k] - after[k].detach() for k in after}


def train_loss(trainer) -> float:
    return float(trainer.train().training_loss)


# -- training with every strategy --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_trains_with_each_strategy(tmp_path, strategy):
    ds = counting_dataset()
    trainer = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=8),
        train_dataset=ds,
        strategy=strategy,
        strategy_options=STRATEGIES[strategy],
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0]
    if strategy == "packed":
        assert trainer.model.config._attn_implementation == "smart_batching_packed"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_dataloader_yields_exactly_the_planned_batches(tmp_path, strategy):
    ds = counting_dataset(num_examples=37)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path),
        train_dataset=ds,
        strategy=strategy,
        strategy_options=STRATEGIES[strategy],
    )
    loader = trainer.get_train_dataloader()
    plan = trainer.smart_batching.sampler.plan_for_epoch(0)
    batches = list(loader)
    assert len(batches) == len(loader) == len(plan)
    seen = []
    for batch, ids in zip(batches, plan, strict=True):
        rows = [ds[int(i)]["input_ids"] for i in ids]
        if strategy == "packed":
            assert batch["input_ids"][0].tolist() == [t for r in rows for t in r]
            assert (
                batch["cu_seq_lens_q"].tolist()
                == np.concatenate([[0], np.cumsum([len(r) for r in rows])]).tolist()
            )
        else:
            got = [
                row[mask.bool()].tolist()
                for row, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
            ]
            assert got == rows
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(len(ds)))  # no round dropped, no example twice


def test_dataloader_with_workers_yields_every_example_once(tmp_path):
    ds = counting_dataset(num_examples=37)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path, dataloader_num_workers=2),
        train_dataset=ds,
        strategy="token_budget",
        strategy_options=STRATEGIES["token_budget"],
    )
    batches = list(trainer.get_train_dataloader())
    assert sum(int(b["attention_mask"].shape[0]) for b in batches) == len(ds)
    assert sum(int(b["attention_mask"].sum()) for b in batches) == int(dataset_lengths(ds).sum())


def test_lengths_come_from_arrow_offsets_and_honour_index_mappings():
    ds = counting_dataset(num_examples=30)
    expected = np.array([len(r) for r in ds["input_ids"]])
    assert dataset_lengths(ds).tolist() == expected.tolist()
    picked = ds.select([5, 2, 29, 2])
    assert dataset_lengths(picked).tolist() == expected[[5, 2, 29, 2]].tolist()
    shuffled = ds.shuffle(seed=1)
    assert dataset_lengths(shuffled).tolist() == [len(r) for r in shuffled["input_ids"]]
    with_column = ds.add_column("length", [7] * len(ds))
    assert set(dataset_lengths(with_column).tolist()) == {7}
    assert dataset_lengths(with_column, length_column=None).tolist() == expected.tolist()


# -- numerics: packed == padded, gradient accumulation == one big batch ------------------------------------


def test_packed_and_padded_give_equal_loss_and_gradients(tmp_path):
    ds = counting_dataset(num_examples=6)
    total = int(dataset_lengths(ds).sum())
    results = {}
    for strategy, options in (("random", {"batch_size": 6}), ("packed", {"capacity": total})):
        trainer = SmartBatchingTrainer(
            model=tiny_llama(),
            args=sgd_args(tmp_path / strategy),
            train_dataset=ds,
            strategy=strategy,
            strategy_options=options,
        )
        assert len(trainer.get_train_dataloader()) == 1  # one step = the whole dataset, either way
        results[strategy] = (train_loss(trainer), sgd_gradient(trainer))
    ref_loss, ref_grad = reference_step(ds, range(len(ds)))
    for loss, grad in results.values():
        assert abs(loss - ref_loss) <= 1e-5
        assert max_diff(grad, ref_grad) <= 1e-5
    assert max(float(g.abs().max()) for g in ref_grad.values()) > 1e-3  # not a vacuous comparison


class NoKwargsLlama(LlamaForCausalLM):
    """A causal LM whose forward takes no loss kwargs: Trainer cannot pass it num_items_in_batch."""

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


@pytest.mark.parametrize(
    ("model_cls", "strategy", "options"),
    [
        (LlamaForCausalLM, "token_budget", {"max_tokens": 160}),
        (LlamaForCausalLM, "packed", {"capacity": 160}),
        (NoKwargsLlama, "token_budget", {"max_tokens": 160}),  # TokenLoss as compute_loss_func
    ],
)
def test_gradient_accumulation_of_variable_batches_equals_one_big_batch(
    tmp_path, model_cls, strategy, options
):
    ds = counting_dataset(num_examples=24, seed=3)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(cls=model_cls),
        args=sgd_args(tmp_path, gradient_accumulation_steps=3),
        train_dataset=ds,
        strategy=strategy,
        strategy_options=options,
    )
    if model_cls is NoKwargsLlama:
        assert not trainer.model_accepts_loss_kwargs
        assert isinstance(trainer.compute_loss_func, TokenLoss)
    plan = plan_batches(dataset_lengths(ds), strategy, seed=0, **options)
    micro = [plan[b] for b in range(3)]
    tokens = [int(dataset_lengths(ds)[ids].sum()) for ids in micro]
    assert len(set(tokens)) > 1 and len({len(ids) for ids in micro}) > 1  # variable sizes for real
    loss = train_loss(trainer)
    ref_loss, ref_grad = reference_step(ds, np.concatenate(micro))
    assert abs(loss - ref_loss) <= 1e-5
    assert max_diff(sgd_gradient(trainer), ref_grad) <= 1e-5


def test_mean_of_micro_batch_means_would_differ(tmp_path):
    # Guard against a vacuous pass of the test above: the naive average is measurably different here.
    ds = counting_dataset(num_examples=24, seed=3)
    plan = plan_batches(dataset_lengths(ds), "token_budget", seed=0, max_tokens=160)
    naive = np.mean([reference_step(ds, plan[b])[0] for b in range(3)])
    right = reference_step(ds, np.concatenate([plan[b] for b in range(3)]))[0]
    assert abs(naive - right) > 1e-4


# -- resume --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "save_steps", "cursor"),
    [
        ("token_budget", 3, (0, 6)),  # mid-epoch: 3 steps x 2 micro-batches of epoch 0 consumed
        ("packed", 3, (0, 6)),
        ("token_budget", 4, (1, 0)),  # at the epoch boundary: the cursor points at epoch 1
    ],
)
def test_resume_gives_identical_weights(tmp_path, strategy, save_steps, cursor):
    ds = counting_dataset(num_examples=40, seed=5)
    options = STRATEGIES[strategy]
    args = dict(max_steps=7, gradient_accumulation_steps=2, save_strategy="steps", save_steps=save_steps)

    def make_trainer():
        return SmartBatchingTrainer(
            model=tiny_llama(),
            args=training_args(tmp_path, **args),
            train_dataset=ds,
            strategy=strategy,
            strategy_options=options,
        )

    full = make_trainer()
    assert len(full.get_train_dataloader()) == 8  # 4 steps per epoch: the run crosses an epoch boundary
    full.train()
    final = weights(full.model)

    checkpoint = tmp_path / "out" / f"checkpoint-{save_steps}"
    saved = json.loads((checkpoint / SAMPLER_STATE_NAME).read_text())
    assert (saved["epoch"], saved["batches_yielded"], saved["strategy"]) == (*cursor, strategy)

    resumed = make_trainer()
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 7
    assert max_diff(weights(resumed.model), final) <= 1e-6
    assert max_diff(weights(tiny_llama()), final) > 1e-3  # training moved the weights


def test_resume_refuses_a_changed_seed_dataset_or_accumulation(tmp_path):
    ds = counting_dataset(num_examples=30, seed=5)
    options = STRATEGIES["token_budget"]
    SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=ds,
        strategy="token_budget",
        strategy_options=options,
    ).train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    assert os.path.isfile(os.path.join(checkpoint, SAMPLER_STATE_NAME))
    changes = [
        ({"seed": 1}, {}, "seed changed"),
        ({"train_dataset": ds.select(range(29))}, {}, "dataset changed"),
        ({"strategy_options": {"max_tokens": 256}}, {}, "options changed"),
        ({}, {"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
    ]
    for change, arg_change, message in changes:
        kwargs = {"train_dataset": ds, "strategy": "token_budget", "strategy_options": options, **change}
        trainer = SmartBatchingTrainer(
            model=tiny_llama(), args=training_args(tmp_path, max_steps=4, **arg_change), **kwargs
        )
        with pytest.raises(ConfigError, match=message):
            trainer.train(resume_from_checkpoint=checkpoint)

    # A checkpoint of a 2-process run cannot resume on 1 process: each would see other batches.
    cursor_file = os.path.join(checkpoint, SAMPLER_STATE_NAME)
    with open(cursor_file) as f:
        cursor = json.load(f)
    assert cursor["num_processes"] == 1
    with open(cursor_file, "w") as f:
        json.dump({**cursor, "num_processes": 2}, f)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=4),
        train_dataset=ds,
        strategy="token_budget",
        strategy_options=options,
    )
    with pytest.raises(ConfigError, match="world size changed"):
        trainer.train(resume_from_checkpoint=checkpoint)


# -- packed attention safety ----------------------------------------------------------------------------


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize(
    ("make_model", "args", "message"),
    [
        # Llama on eager with a KV cache: transformers turns its packed-sequence detection off.
        (lambda: tiny_llama(attn_implementation="eager"), {"use_cache": True}, "use_cache=True"),
        # An encoder: transformers never keeps packed examples apart for it on sdpa/eager.
        (tiny_bert, {}, "encoder"),
    ],
)
def test_packed_refuses_a_model_that_would_attend_across_examples(tmp_path, make_model, args, message):
    with pytest.raises(ConfigError, match=f"attend to each other.*{message}"):
        SmartBatchingTrainer(
            model=make_model(),
            args=training_args(tmp_path, **args),
            train_dataset=counting_dataset(),
            strategy="packed",
            strategy_options={"capacity": 128},
            packed_attention=False,
        )


def test_packed_accepts_transformers_own_packed_path_when_it_is_safe(tmp_path):
    # eager + position_ids + no attention_mask + no KV cache: transformers builds the block-causal mask itself.
    trainer = SmartBatchingTrainer(
        model=tiny_llama(attn_implementation="eager"),
        args=training_args(tmp_path, max_steps=1),
        train_dataset=counting_dataset(num_examples=8),
        strategy="packed",
        strategy_options={"capacity": 128},
        packed_attention=False,
    )
    assert trainer.model.config._attn_implementation == "eager"
    assert np.isfinite(train_loss(trainer))


def test_packed_refuses_a_model_that_cannot_switch_attention(tmp_path, monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(model, "_can_set_attn_implementation", lambda: False)
    with pytest.raises(ConfigError, match="packed attention cannot be enabled"):
        SmartBatchingTrainer(
            model=model,
            args=training_args(tmp_path),
            train_dataset=counting_dataset(),
            strategy="packed",
            strategy_options={"capacity": 128},
        )


# -- apply_smart_batching ----------------------------------------------------------------------------


def test_apply_smart_batching_switches_an_existing_trainer(tmp_path):
    ds = counting_dataset(num_examples=20)
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path, max_steps=2), train_dataset=ds)
    apply_smart_batching(trainer, "packed", capacity=128)
    assert type(trainer).__name__ == "SmartBatchingTrainer" or "SmartBatching" in type(trainer).__name__
    assert isinstance(trainer, Trainer)
    assert trainer.smart_batching.spec.capacity == 128
    assert np.isfinite(train_loss(trainer))
    assert len(trainer.smart_batching.sampler) == len(trainer.get_train_dataloader())
