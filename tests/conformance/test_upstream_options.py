"""One line on a TRL or HF trainer changes the batches, never the training: each row of
:data:`smart_batching.hf.upstream.UPSTREAM_OPTIONS` is held by a test here (:data:`ROW_TESTS`).

The equivalence tests run TRL's ``SFTTrainer`` alone and with ``apply_smart_batching`` on the same data
and compare one epoch of train batches as documents: the same documents (token ids), the same target
tokens in the loss, the same attention boundaries (each document alone in its rows, or its own segment
of a packed row).
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from smart_batching.errors import ConfigError, DataError  # noqa: E402
from smart_batching.hf import apply_smart_batching  # noqa: E402
from smart_batching.hf.upstream import UPSTREAM_OPTIONS, markdown_table  # noqa: E402
from smart_batching.units import EmptyExamplesWarning  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _example_module():
    spec = importlib.util.spec_from_file_location("trl_sft_example", ROOT / "examples" / "trl_sft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = _example_module()
TOKENIZER = EX.word_tokenizer()


def sft(tmp_path, data, strategy=None, *, smart_options=None, **config):
    """An SFTTrainer on a tiny Llama, alone (``strategy=None``) or with ``apply_smart_batching``."""
    from trl import SFTConfig, SFTTrainer

    base = dict(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1, disable_tqdm=True,
        max_length=256, seed=0, per_device_train_batch_size=4,
    )  # fmt: skip
    base.update(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=EX.tiny_llama(len(TOKENIZER)), args=SFTConfig(**base), train_dataset=data,
            processing_class=TOKENIZER,
        )  # fmt: skip
    if strategy is not None:
        apply_smart_batching(trainer, strategy, **(smart_options or {}))
    return trainer


def documents(trainer) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """One epoch of train batches as sorted (token ids, target labels) per document.

    The first label of a document is left out: a causal LM never predicts a document's first token
    (labels shift by one), so packed collators write -100 there and padded ones may not.
    """
    docs = []
    for batch in trainer.get_train_dataloader():
        ids, labels = batch["input_ids"], batch["labels"]
        if "cu_seq_lens_q" in batch:  # one padding-free row: documents by their boundaries
            cu = batch["cu_seq_lens_q"].tolist()
            for lo, hi in zip(cu[:-1], cu[1:], strict=True):
                docs.append((tuple(ids[0, lo:hi].tolist()), tuple(labels[0, lo + 1 : hi].tolist())))
        else:
            mask = batch["attention_mask"].bool()
            for r in range(ids.shape[0]):
                row_ids, row_labels = ids[r][mask[r]], labels[r][mask[r]]
                docs.append((tuple(row_ids.tolist()), tuple(row_labels[1:].tolist())))
    return sorted(docs)


def num_targets(docs) -> int:
    return sum(sum(1 for t in labels if t != -100) for _, labels in docs)


@pytest.fixture(scope="module")
def prompt_completion():
    return EX.copy_task(24, seed=1)


def assert_same_training(tmp_path, data, strategy, smart_options=None, **config):
    alone = documents(sft(tmp_path, data, **config))
    ours = documents(sft(tmp_path, data, strategy, smart_options=smart_options, **config))
    assert len(ours) == len(alone), "another number of documents (attention segments) than TRL alone"
    assert num_targets(ours) == num_targets(alone), "another number of target tokens than TRL alone"
    assert ours == alone, "other documents or other target tokens than TRL alone"
    return alone


# -- equivalence with TRL alone ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["packed", "token_budget"])
@pytest.mark.parametrize("completion_only_loss", [None, True, False])
def test_completion_only_loss_is_honoured(tmp_path, prompt_completion, strategy, completion_only_loss):
    docs = assert_same_training(
        tmp_path, prompt_completion, strategy, completion_only_loss=completion_only_loss
    )
    full = sum(len(ids) - 1 for ids, _ in docs)
    assert (num_targets(docs) == full) == (completion_only_loss is False)  # prompt in the loss or not


@pytest.mark.parametrize("packing_strategy", ["bfd", "bfd_split"])
def test_trl_packing_documents_are_planned_as_units(tmp_path, prompt_completion, packing_strategy):
    """TRL's packed rows are split back into their documents: 24 documents, 24 attention segments."""
    docs = assert_same_training(
        tmp_path, prompt_completion, "packed", packing=True, packing_strategy=packing_strategy,
        max_length=64 if packing_strategy == "bfd_split" else 128,
    )  # fmt: skip
    if packing_strategy == "bfd":
        assert len(docs) == 24
    trainer = sft(tmp_path, prompt_completion, "packed", packing=True, max_length=128)
    assert trainer.smart_batching.spec.capacity == 128  # SFTConfig.max_length


def test_padding_free_is_honoured_by_packed(tmp_path, prompt_completion):
    assert_same_training(tmp_path, prompt_completion, "packed", padding_free=True, max_length=None)


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_max_length_and_truncation_mode_are_honoured(tmp_path, prompt_completion, truncation_mode):
    docs = assert_same_training(
        tmp_path, prompt_completion, "token_budget", smart_options={"max_tokens": 256},
        max_length=12, truncation_mode=truncation_mode,
    )  # fmt: skip
    assert max(len(ids) for ids, _ in docs) == 12


def test_dataset_preparation_options_are_honoured(tmp_path):
    """dataset_text_field, shuffle_dataset (and the rest of TRL's preparation) run before we see the data."""
    texts = [" ".join(EX.WORDS[i : i + 3 + i % 7]) for i in range(20)]
    data = datasets.Dataset.from_dict({"content": texts})
    assert_same_training(
        tmp_path, data, "packed", dataset_text_field="content", shuffle_dataset=True, max_length=None
    )


def test_assistant_masks_are_honoured_through_trl_labels(tmp_path):
    """A pre-tokenized set with assistant_masks: TRL builds labels from them; ours are the same."""
    rng = np.random.default_rng(0)
    ids = [rng.integers(4, 60, size=n).tolist() for n in rng.integers(3, 20, size=16)]
    masks = [[0] * (len(x) // 2) + [1] * (len(x) - len(x) // 2) for x in ids]
    data = datasets.Dataset.from_dict({"input_ids": ids, "assistant_masks": masks})
    docs = assert_same_training(tmp_path, data, "packed", max_length=None)
    assert num_targets(docs) < sum(len(x) - 1 for x in ids)


def test_leftover_completion_mask_does_not_override_labels(tmp_path):
    """completion_only_loss=False on a pre-tokenized set with completion_mask: TRL trains every token."""
    rng = np.random.default_rng(1)
    ids = [rng.integers(4, 60, size=n).tolist() for n in rng.integers(3, 20, size=16)]
    data = datasets.Dataset.from_dict(
        {"input_ids": ids, "completion_mask": [[0] * 2 + [1] * (len(x) - 2) for x in ids]}
    )
    docs = assert_same_training(tmp_path, data, "packed", completion_only_loss=False, max_length=None)
    assert num_targets(docs) == sum(len(x) - 1 for x in ids)


def test_empty_and_fully_masked_examples_are_skipped_before_step_1(tmp_path):
    """TRL with max_length=None keeps them (its loss ignores them); ours leaves them out of the plan,
    names them in one warning, and trains the same tokens."""
    rng = np.random.default_rng(2)
    ids = [rng.integers(4, 60, size=n).tolist() for n in rng.integers(3, 20, size=16)]
    ids[0], ids[5] = [], []
    labels = [list(x) for x in ids]
    labels[7] = [-100] * len(labels[7])
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    alone = documents(sft(tmp_path, data, max_length=None))
    with pytest.warns(EmptyExamplesWarning, match=r"2 empty.*1 fully masked.*dataset rows 0, 5, 7"):
        ours = documents(sft(tmp_path, data, "packed", max_length=None))
    assert num_targets(ours) == num_targets(alone)
    assert ours == [d for d in alone if d[0] and any(t != -100 for t in d[1])]
    trainer = sft(tmp_path, data, "packed", smart_options={"empty_examples": "error"}, max_length=None)
    with pytest.raises(DataError, match="empty_examples='skip'"):
        trainer.get_train_dataloader()


def test_no_fallback_warning_under_trl_fused_lm_head(tmp_path, prompt_completion, recwarn, cpu_half_path):
    """Under SFTTrainer (plain NLL) target-only logits stand in for TRL's loss: no fallback warning of
    their own, and TRL's metrics are still logged (one training step runs). ``SFTConfig``'s defaults
    train in bf16: on a CPU without bf16 instructions (the emulated and reference paths) that, and only
    that, is warned about (``precision.cpu_half``, docs/guides/fallbacks.md)."""
    from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks

    trainer = sft(tmp_path, prompt_completion, "packed")
    assert trainer.args.bf16  # SFTConfig's default
    trainer.train()
    assert trainer.smart_batching.target_logits is True and trainer.smart_batching.trl_metrics is True
    warned = [str(w.message) for w in recwarn if w.category is FallbackWarning]
    if cpu_half_path == "native":
        assert not warned and recorded_fallbacks() == {}
    else:
        assert len(warned) == 1 and "(precision.cpu_half)" in warned[0] and "set bf16=False" in warned[0]
        assert recorded_fallbacks() == {"precision.cpu_half": 1}
    logged = trainer.state.log_history[0]
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(logged)


@pytest.mark.parametrize("strategy", ["packed", "token_budget"])
def test_target_logits_under_sft_trainer_equal_trl_loss_gradients_and_metrics(
    tmp_path, prompt_completion, strategy
):
    """Our loss at target positions equals SFTTrainer.compute_loss (its fused LM head) on the same batch:
    loss, gradients, and the entropy / token accuracy / token count it logs."""
    import torch
    from trl import SFTTrainer

    trainer = sft(tmp_path, prompt_completion, strategy, completion_only_loss=True)
    trainer._target_logits_apply(trainer.model)
    assert trainer.smart_batching.target_logits and trainer.smart_batching.trl_metrics
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model.train()
    n = (batch["labels"][..., 1:] != -100).sum()

    def run(compute):
        model.zero_grad()
        trainer._metrics["train"].clear()
        trainer._total_train_tokens = 0
        loss = compute(trainer, model, dict(batch), num_items_in_batch=n)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}

    ours = run(type(trainer).compute_loss)
    theirs = run(SFTTrainer.compute_loss)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert ours[2].keys() == theirs[2].keys() == {"entropy", "mean_token_accuracy", "num_tokens"}
    for key in ours[2]:
        np.testing.assert_allclose(ours[2][key], theirs[2][key], rtol=1e-5, err_msg=f"TRL's {key} moved")


# -- TrainingArguments --------------------------------------------------------------------------------


def test_per_device_train_batch_size_is_the_fixed_batch_size(tiny_llama_and_args):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.per_device_train_batch_size = 3
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 10})
    trainer = apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "random")
    assert trainer.smart_batching.spec.batch_size == 3
    assert trainer.smart_batching.upstream["per_device_train_batch_size"] == "batch_size=3"
    trainer = apply_smart_batching(
        Trainer(model=model, args=args, train_dataset=data), "random", batch_size=5
    )
    assert trainer.smart_batching.spec.batch_size == 5  # strategy_options win
    trainer = apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "token_budget")
    assert not hasattr(trainer.smart_batching.spec, "batch_size")


@pytest.mark.parametrize(
    ("sampling", "strategy", "error"),
    [
        ("group_by_length", "packed", "use strategy='group_by_length'"),
        ("group_by_length", "token_budget", "set train_sampling_strategy='random'"),
        ("sequential", "random", "keeps the dataset order"),
        ("group_by_length", "group_by_length", None),
        ("random", "packed", None),
    ],
)
def test_train_sampling_strategy_is_honoured_or_refused(tiny_llama_and_args, sampling, strategy, error):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.train_sampling_strategy = sampling
    trainer = Trainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    )
    if error is None:
        apply_smart_batching(trainer, strategy)
    else:
        with pytest.raises(ConfigError, match=error):
            apply_smart_batching(trainer, strategy)


def test_hf_group_by_length_gets_hf_megabatches_and_ours_defaults_to_sorted(tiny_llama_and_args):
    """A trainer set to HF's group_by_length keeps HF's semantics (megabatch mode); without it the
    strategy's own default (mode='sorted', issue 13's accuracy study); an explicit mode wins."""
    from transformers import Trainer

    data = datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    model, args = tiny_llama_and_args()
    args.train_sampling_strategy = "group_by_length"
    trainer = apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "group_by_length")
    assert trainer.smart_batching.spec.mode == "megabatch"
    assert "mode='megabatch'" in trainer.smart_batching.upstream["train_sampling_strategy"]
    trainer = apply_smart_batching(
        Trainer(model=model, args=args, train_dataset=data), "group_by_length", mode="sorted"
    )
    assert trainer.smart_batching.spec.mode == "sorted"
    model, args = tiny_llama_and_args()
    trainer = apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "group_by_length")
    assert trainer.smart_batching.spec.mode == "sorted"


def test_length_column_name_is_read(tiny_llama_and_args):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.length_column_name = "n_tokens"
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "n_tokens": [3, 5]})
    trainer = apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "random")
    with pytest.raises(ConfigError, match="the 'n_tokens' column disagrees with input_ids"):
        trainer.get_train_dataloader()  # read, and checked against the data


@pytest.mark.parametrize(
    ("strategy", "honoured"), [("random", True), ("group_by_length", True), ("packed", False)]
)
def test_dataloader_drop_last_is_honoured_or_refused(tiny_llama_and_args, strategy, honoured):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.dataloader_drop_last = True
    trainer = Trainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]] * 11})
    )
    if honoured:
        apply_smart_batching(trainer, strategy, batch_size=4)
        assert trainer.smart_batching.spec.drop_last
        batches = list(trainer.get_train_dataloader())
        assert [b["input_ids"].shape[0] for b in batches] == [4, 4]
    else:
        with pytest.raises(ConfigError, match="set dataloader_drop_last=False"):
            apply_smart_batching(trainer, strategy)


@pytest.mark.parametrize("remove", [True, False])
def test_remove_unused_columns_with_your_own_collator(tiny_llama_and_args, remove):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.remove_unused_columns = remove
    seen = []

    def collate(features):
        seen.append(sorted(features[0]))
        from smart_batching.collate import PaddingCollator

        return PaddingCollator(0)([{"input_ids": f["input_ids"]} for f in features])

    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "source": ["a", "b"]})
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    apply_smart_batching(trainer, "random", replace_collator=False)
    next(iter(trainer.get_train_dataloader()))
    assert ("source" in seen[0]) is (not remove)


@pytest.mark.parametrize("remove", [True, False])
def test_dropping_the_prompt_mask_before_your_collator_is_warned(tiny_llama_and_args, remove, recwarn):
    """HF's rule drops ``prompt_length`` (no forward argument) before the caller's own collator, which
    would then train on the prompt too: said once, naming the setting; kept (and quiet) with False."""
    from transformers import Trainer

    from smart_batching.collate import PaddingCollator
    from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks

    model, args = tiny_llama_and_args()
    args.remove_unused_columns = remove
    seen = []
    padding = PaddingCollator(0)

    def collate(features):  # the user's collator around smart batching's, masking by prompt_length
        seen.append(sorted(features[0]))
        return padding(features)

    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6, 7]], "prompt_length": [2, 3]})
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    apply_smart_batching(trainer, "random", replace_collator=False)
    batch = next(iter(trainer.get_train_dataloader()))
    warned = [str(w.message) for w in recwarn if w.category is FallbackWarning]
    targets = int((batch["labels"] != -100).sum())
    if remove:
        assert "prompt_length" not in seen[0] and targets == 7  # every token
        assert len(warned) == 1 and "(trainer.mask_columns)" in warned[0]
        assert "remove_unused_columns=False" in warned[0]
        assert recorded_fallbacks() == {"trainer.mask_columns": 1}
    else:
        assert "prompt_length" in seen[0] and targets == 2  # the tokens after each prompt
        assert not warned and recorded_fallbacks() == {}


def test_smart_batching_collators_get_the_columns_they_read(tiny_llama_and_args):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "source": ["a"], "seq_lengths": [[3]]})
    trainer = apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "packed", capacity=8)
    assert trainer.get_train_dataloader().dataset.dataset.column_names == ["input_ids", "seq_lengths"]


def test_label_names_other_than_labels_are_refused(tiny_llama_and_args):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.label_names = ["start_positions"]
    data = datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    with pytest.raises(ConfigError, match="collators write 'labels'"):
        apply_smart_batching(Trainer(model=model, args=args, train_dataset=data), "random")
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=lambda f: f)
    apply_smart_batching(trainer, "random", replace_collator=False)  # your collator: your labels


def test_auto_find_batch_size_is_refused(tiny_llama_and_args):
    from transformers import Trainer

    model, args = tiny_llama_and_args()
    args.auto_find_batch_size = True
    trainer = Trainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": [[1, 2]]})
    )
    with pytest.raises(ConfigError, match="max_tokens': 'auto'"):
        apply_smart_batching(trainer, "token_budget")


# -- SFTConfig refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "strategy", "error"),
    [
        (
            {"packing": True, "max_length": 64},
            "token_budget",
            r"packing=True.*strategy='packed'.*packing=False",
        ),
        ({"padding_free": True, "max_length": None}, "random", r"padding_free=True.*padding_free=False"),
        ({"pad_to_multiple_of": 8}, "packed", "set pad_to_multiple_of=None"),
    ],
)
def test_sft_settings_that_cannot_be_honoured_are_refused(
    tmp_path, prompt_completion, config, strategy, error
):
    with pytest.raises(ConfigError, match=error):
        sft(tmp_path, prompt_completion, strategy, **config)


def test_pad_to_multiple_of_reaches_the_padding_collator(tmp_path, prompt_completion):
    def widths(**config):
        trainer = sft(tmp_path, prompt_completion, "token_budget", smart_options={"max_tokens": 96}, **config)
        return [b["input_ids"].shape[1] for b in trainer.get_train_dataloader()]

    assert any(w % 8 for w in widths())  # without it, widths are the batches' longest
    assert all(w % 8 == 0 for w in widths(pad_to_multiple_of=8))


def test_wrapped_packing_rows_are_units(tmp_path, prompt_completion):
    """TRL's wrapped rows have no document boundaries (TRL attends across them by design): one unit each."""
    alone = sft(tmp_path, prompt_completion, packing=True, packing_strategy="wrapped", max_length=32)
    ours = sft(tmp_path, prompt_completion, "packed", packing=True, packing_strategy="wrapped", max_length=32)
    assert sorted(d[0] for d in documents(ours)) == sorted(tuple(x) for x in alone.train_dataset["input_ids"])


# -- the table --------------------------------------------------------------------------------------


ROW_TESTS = {
    "per_device_train_batch_size": [test_per_device_train_batch_size_is_the_fixed_batch_size],
    "train_sampling_strategy": [test_train_sampling_strategy_is_honoured_or_refused],
    "length_column_name": [test_length_column_name_is_read],
    "dataloader_drop_last": [test_dataloader_drop_last_is_honoured_or_refused],
    "remove_unused_columns": [
        test_remove_unused_columns_with_your_own_collator,
        test_dropping_the_prompt_mask_before_your_collator_is_warned,
        test_smart_batching_collators_get_the_columns_they_read,
    ],
    "label_names": [test_label_names_other_than_labels_are_refused],
    "label_smoothing_factor": [
        "tests/test_target_logits.py::test_a_subclass_compute_loss_or_a_label_smoother_keeps_full_logits"
    ],
    "auto_find_batch_size": [test_auto_find_batch_size_is_refused],
    "gradient_accumulation_steps": ["tests/test_trainer.py", "tests/test_distributed_trainer.py"],
    "average_tokens_across_devices": ["tests/test_distributed_trainer.py"],
    "seed / data_seed": ["tests/test_trainer.py"],
    "dataloader_num_workers / pin_memory / persistent_workers / prefetch_factor": ["tests/test_trainer.py"],
    "packing / packing_strategy": [
        test_trl_packing_documents_are_planned_as_units,
        test_wrapped_packing_rows_are_units,
        test_sft_settings_that_cannot_be_honoured_are_refused,
    ],
    "padding_free": [
        test_padding_free_is_honoured_by_packed,
        test_sft_settings_that_cannot_be_honoured_are_refused,
    ],
    "max_length / truncation_mode": [test_max_length_and_truncation_mode_are_honoured],
    "completion_only_loss": [
        test_completion_only_loss_is_honoured,
        test_leftover_completion_mask_does_not_override_labels,
    ],
    "assistant_only_loss": [test_assistant_masks_are_honoured_through_trl_labels],
    "pad_to_multiple_of": [test_pad_to_multiple_of_reaches_the_padding_collator],
    "dataset_text_field / dataset_kwargs / formatting_func / eos_token / shuffle_dataset": [
        test_dataset_preparation_options_are_honoured
    ],
    "pad_token": ["tests/test_trainer.py"],
    "loss_type": [
        "tests/test_examples.py::test_trl_sft_example_trains_with_packed_batches",
        test_no_fallback_warning_under_trl_fused_lm_head,
        test_target_logits_under_sft_trainer_equal_trl_loss_gradients_and_metrics,
    ],
    "empty and fully masked examples": [test_empty_and_fully_masked_examples_are_skipped_before_step_1],
}


def test_every_row_of_the_table_is_held_by_a_test():
    assert sorted(ROW_TESTS) == sorted(o.name for o in UPSTREAM_OPTIONS)
    for name, tests in ROW_TESTS.items():
        for t in tests:
            if isinstance(t, str):  # held elsewhere: the file (and test) must exist
                path, _, func = t.partition("::")
                text = (ROOT / path).read_text()
                assert not func or f"def {func}(" in text, f"{name}: {t} is gone"
            else:
                assert t.__name__.startswith("test_"), name


def test_docs_show_the_table():
    page = (ROOT / "docs" / "options.md").read_text()
    assert markdown_table() in page, (
        "docs/options.md: the upstream-options table is stale: paste markdown_table()"
    )
