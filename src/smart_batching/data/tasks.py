"""Training data: load, split, tokenise once for every strategy, and the task it is scored on.

Used by ``smart-batching train`` and the bench. Every strategy of a bench trains on the *same* tokenised examples: the data is tokenised here, once,
and truncated here, once (``max_length``), so no planner has anything left to cut. What was cut is
counted in :attr:`TrainingData.truncation` and reported next to every strategy.

Tasks, told apart by the model kind and the columns:

==================  ====================================  ===============================================
task                when                                  metric after training
==================  ====================================  ===============================================
``gsm8k``           causal LM; ``question``/``answer``    exact match of the ``#### <number>`` answer of
                    with ``#### <number>`` answers        greedy generations on held-out questions
``lm``              causal LM, any other record shape     none (eval loss and perplexity only)
``classification``  encoder; a text column and ``label``  accuracy on the held-out split
==================  ====================================  ===============================================

Causal-LM examples are rendered by :mod:`smart_batching.data.formats` into a prompt and a completion;
``input_ids`` is the full text plus EOS (so generations learn to stop) and ``prompt_length`` masks the
prompt out of the loss (plain text has no prompt and trains on every token).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError, DataError, require

EVAL_SPLITS = ("validation", "dev", "test")
TEXT_LABEL_COLUMNS = ("sentence", "text", "content")
LOSS_ON = ("completion", "assistant")
"""What a causal LM learns from: the last reply (TRL's ``completion_only_loss``) or every assistant turn
(TRL's ``assistant_only_loss``)."""
DEFAULT_NUM_PROMPTS = {"gsm8k": 16, "lm": 4, "classification": 8}
"""Held-out prompts generated for (GSM8K: the exact-match sample) or predicted, per task."""
_ANSWER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


@dataclass
class TrainingData:
    """Tokenised train and eval examples, and what a report needs to know about them.

    Attributes:
        source: where the training data came from (a path, ``"default"`` or ``"<Dataset>"``).
        eval_source: where the eval data came from (a path, or ``"held out from the training data"``).
        task: ``"gsm8k"``, ``"lm"`` or ``"classification"``.
        format: the record shape (:mod:`smart_batching.data.formats`); None for classification.
        train: ``datasets.Dataset`` with ``input_ids`` and ``prompt_length`` (causal LM) or ``labels``
            (classification).
        eval: the held-out examples, tokenised the same way.
        lengths: (num_train,) token lengths of ``train`` after truncation.
        prompts: held-out prompts for generations: ``{"prompt", "prompt_ids", "reference"}`` (causal LM)
            or ``{"text", "input_ids", "label"}`` (classification).
        truncation: ``max_length``, ``num_truncated``, ``truncated_tokens`` (train), ``eval_num_truncated``.
        label_names: class names (classification), else None.
    """

    source: str
    eval_source: str
    task: str
    format: str | None
    train: Any
    eval: Any
    lengths: np.ndarray
    prompts: list[dict[str, Any]]
    truncation: dict[str, Any]
    label_names: list[str] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_train(self) -> int:
        return int(self.lengths.shape[0])


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _load(source: Any, split: str | None = None) -> tuple[Any, str]:
    datasets = require("datasets", "hf")
    if isinstance(source, datasets.Dataset):
        return source, "<Dataset>"
    if isinstance(source, (list, tuple)):
        cols = {k: [r.get(k) for r in source] for k in (source[0] if source else {})}
        return datasets.Dataset.from_dict(cols), "<records>"
    name = os.fspath(source)
    if name == "default":
        from smart_batching.data.default_data import default_dataset_as_hf

        return default_dataset_as_hf(), "default (embedded dataset)"
    from smart_batching.data import load_dataset_any

    return load_dataset_any(name, split=split), name


def _sibling_eval_file(path: Path) -> Path | None:
    """``dev.tsv`` / ``test.jsonl`` ... next to a ``train.*`` file, if there is one."""
    stem, _, suffix = path.name.partition(".")
    if stem != "train" or not path.is_file():
        return None
    for split in EVAL_SPLITS:
        candidate = path.with_name(f"{split}.{suffix}")
        if candidate.is_file():
            return candidate
    return None


def _load_eval(data: Any, eval_data: Any) -> tuple[Any | None, str | None]:
    if eval_data is not None:
        return _load(eval_data)
    if isinstance(data, (str, os.PathLike)) and os.fspath(data) != "default":
        path = Path(os.fspath(data)).expanduser()
        if path.is_dir():
            for split in EVAL_SPLITS:
                try:
                    return _load(path, split=split)
                except DataError:
                    continue
        else:
            sibling = _sibling_eval_file(path)
            if sibling is not None:
                return _load(sibling)
    return None, None


# --------------------------------------------------------------------------------------------------
# Tokenising
# --------------------------------------------------------------------------------------------------


def _encode(tokenizer: Any, texts: list[str], **kwargs: Any) -> list[list[int]]:
    """``input_ids`` of each text; no texts (e.g. ``num_prompts=0``) gives none (tokenizers fail on [])."""
    return tokenizer(texts, **kwargs)["input_ids"] if texts else []


def _assistant_masks(
    tokenizer: Any, texts: list[str], spans: list[list[tuple[int, int]]], **kwargs: Any
) -> tuple[list[list[int]], list[np.ndarray]]:
    """``input_ids`` of each text and (num_tokens,) int8 masks: 1 on tokens that start inside a span."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"loss_on='assistant' maps each assistant turn to its tokens through the tokenizer's offsets, which "
            f"{type(tokenizer).__name__} (a slow tokenizer) does not give; use a fast tokenizer "
            "(AutoTokenizer.from_pretrained(..., use_fast=True)) or loss_on='completion'"
        )
    if not texts:
        return [], []
    encoded = tokenizer(texts, return_offsets_mapping=True, **kwargs)
    masks = []
    for offsets, text_spans in zip(encoded["offset_mapping"], spans, strict=True):
        starts = np.fromiter((a for a, _ in offsets), dtype=np.int64, count=len(offsets))  # (num_tokens,)
        bounds = np.asarray(text_spans, dtype=np.int64).reshape(-1)  # (2 * num_spans,) start, end, ...
        # Inside a span: an odd number of span bounds at or before the token's first character.
        masks.append((np.searchsorted(bounds, starts, side="right") % 2).astype(np.int8))
    return encoded["input_ids"], masks


def _tokenize_causal(
    ds: Any, tokenizer: Any, fmt: str, max_length: int | None, loss_on: str = "completion"
) -> tuple[dict, dict]:
    from smart_batching.data.formats import render_batch

    every = loss_on == "assistant"
    rendered = render_batch(ds.to_dict(), tokenizer, format=fmt, assistant_spans=every)
    special = not rendered.chat_template
    prompts = _encode(tokenizer, rendered.prompts, add_special_tokens=special)
    masks: list[Any] = [None] * len(prompts)
    ends: list[bool] = [False] * len(prompts)
    if every:
        spans = rendered.assistant_spans
        assert spans is not None
        full, masks = _assistant_masks(tokenizer, rendered.texts, spans, add_special_tokens=special)
        # The EOS appended below is a target where the last span runs to the end of the text.
        ends = [bool(sp) and sp[-1][1] == len(t) for sp, t in zip(spans, rendered.texts, strict=True)]
    else:
        full = _encode(tokenizer, rendered.texts, add_special_tokens=special)
    eos = tokenizer.eos_token_id
    ids: list[list[int]] = []
    prompt_lengths: list[int] = []
    assistant: list[list[int]] = []
    num_cut = cut_tokens = 0
    for text_ids, prompt_ids, prompt, mask, end in zip(
        full, prompts, rendered.prompts, masks, ends, strict=True
    ):
        row = list(text_ids)
        if eos is not None and (not row or row[-1] != eos):
            row.append(eos)
            if mask is not None:
                mask = np.append(mask, np.int8(end))
        if max_length is not None and len(row) > max_length:
            num_cut += 1
            cut_tokens += len(row) - max_length
            row = row[:max_length]
        ids.append(row)
        if mask is None:
            prompt_lengths.append(min(len(prompt_ids), len(row)) if prompt else 0)
        else:
            mask = mask[: len(row)]
            first = np.flatnonzero(mask)
            prompt_lengths.append(int(first[0]) if first.size else len(row))  # the first target token
            assistant.append(mask.tolist())
    columns = {"input_ids": ids, "prompt_length": prompt_lengths}
    if every:
        columns["assistant_masks"] = assistant
    info = {
        "num_truncated": num_cut,
        "truncated_tokens": cut_tokens,
        "texts": rendered.prompts,
        "prompt_ids": prompts,
    }
    return columns, info


def _label_column(column_names: list[str]) -> str:
    for name in ("label", "labels"):
        if name in column_names:
            return name
    raise DataError(f"classification needs a 'label' column; the data has {column_names}")


def _text_column(column_names: list[str]) -> str:
    for name in TEXT_LABEL_COLUMNS:
        if name in column_names:
            return name
    raise DataError(
        f"classification needs a text column ({', '.join(TEXT_LABEL_COLUMNS)}); the data has {column_names}"
    )


def _tokenize_classification(ds: Any, tokenizer: Any, max_length: int | None) -> tuple[dict, dict]:
    text_col, label_col = _text_column(ds.column_names), _label_column(ds.column_names)
    texts = ["" if t is None else str(t) for t in ds[text_col]]
    full = _encode(tokenizer, texts)
    ids: list[list[int]] = []
    num_cut = cut_tokens = 0
    for row in full:
        row = list(row)
        if max_length is not None and len(row) > max_length:
            num_cut += 1
            cut_tokens += len(row) - max_length
            row = row[: max_length - 1] + row[-1:]  # keep the closing [SEP]
        ids.append(row)
    labels = [int(x) for x in ds[label_col]]
    return {"input_ids": ids, "labels": labels}, {
        "num_truncated": num_cut,
        "truncated_tokens": cut_tokens,
        "texts": texts,
    }


def detect_task(column_names: list[str], sample_answers: list[Any], model_kind: str) -> str:
    """``"classification"`` for encoders, ``"gsm8k"`` for ``####`` answers, else ``"lm"``."""
    if model_kind == "classifier":
        return "classification"
    if {"question", "answer"} <= set(column_names) and any("####" in str(a) for a in sample_answers):
        return "gsm8k"
    return "lm"


def gsm8k_answer(text: str | None) -> str | None:
    """The number after the first ``####`` in ``text`` (commas removed), or None."""
    if not text:
        return None
    m = _ANSWER.search(text)
    if m is None:
        return None
    value = m.group(1).replace(",", "")
    try:
        number = float(value)
    except ValueError:
        return None
    return str(int(number)) if number.is_integer() else str(number)


def gsm8k_exact_match(generation: str, reference: str) -> bool:
    """Whether a generation's ``#### <number>`` equals the reference's."""
    predicted = gsm8k_answer(generation)
    return predicted is not None and predicted == gsm8k_answer(reference)


def prepare_training_data(
    data: Any = "default",
    *,
    tokenizer: Any,
    model_kind: str = "causal",
    eval_data: Any = None,
    num_examples: int | None = None,
    eval_examples: int = 64,
    max_length: int | None = None,
    num_prompts: int | None = None,
    loss_on: str = "completion",
) -> TrainingData:
    """Load, split and tokenise a bench's data.

    Args:
        data: ``"default"``, a data file or folder (:func:`~smart_batching.data.load_dataset_any`), a
            ``datasets.Dataset`` or a list of records.
        tokenizer: a HF fast tokenizer.
        model_kind: ``"causal"`` or ``"classifier"``.
        eval_data: held-out data; None means a ``validation``/``dev``/``test`` split or sibling file
            (``train.jsonl`` -> ``test.jsonl``), else the last ``eval_examples`` records of ``data``.
        num_examples: training examples (the first ones of ``data``); None means all.
        eval_examples: held-out examples for eval loss / accuracy (the first ones of the eval data).
        max_length: most tokens per example; longer ones are truncated here, for every strategy alike.
            None keeps every example whole.
        num_prompts: held-out prompts kept for generations (causal LM) or sample predictions (the
            first ones of the eval data); None means :data:`DEFAULT_NUM_PROMPTS` of the task.
        loss_on: what a causal LM learns from (:data:`LOSS_ON`): ``"completion"``, the last reply (the
            prompt masked by ``prompt_length``), or ``"assistant"``, every assistant turn of a conversation
            (an ``assistant_masks`` column besides ``prompt_length``, which then covers the tokens before
            the first turn; :func:`~smart_batching.data.formats.assistant_spans`). The same for held-out
            examples. Single-turn records learn the same from both.

    Raises:
        DataError: empty data, missing columns, or too few examples for the split.
    """
    if loss_on not in LOSS_ON:
        raise ConfigError(f"loss_on={loss_on!r} must be one of {', '.join(map(repr, LOSS_ON))}")
    if max_length is not None and max_length < 2:
        raise ConfigError(f"max_length={max_length} must be at least 2 tokens or None")
    train_ds, source = _load(data)
    eval_ds, eval_source = _load_eval(data, eval_data)
    if eval_ds is None:
        if train_ds.num_rows < eval_examples + 1:
            raise DataError(
                f"{source} has {train_ds.num_rows} examples: too few to hold out eval_examples={eval_examples}; "
                "pass eval_data= or lower eval_examples="
            )
        cut = train_ds.num_rows - eval_examples
        eval_ds = train_ds.select(range(cut, train_ds.num_rows))
        train_ds = train_ds.select(range(cut))
        eval_source = f"last {eval_examples} records of the data, held out"
    if num_examples is not None:
        if num_examples < 1:
            raise ConfigError(f"num_examples={num_examples} must be a positive integer or None")
        train_ds = train_ds.select(range(min(num_examples, train_ds.num_rows)))
    datasets = require("datasets", "hf")
    columns = list(train_ds.column_names)
    answers = train_ds["answer"][:20] if "answer" in columns else []
    task = detect_task(columns, answers, model_kind)
    if num_prompts is None:
        num_prompts = DEFAULT_NUM_PROMPTS[task]
    prompt_ds = eval_ds.select(range(min(num_prompts, eval_ds.num_rows)))
    eval_ds = eval_ds.select(range(min(eval_examples, eval_ds.num_rows)))
    if task == "classification":
        train_cols, train_info = _tokenize_classification(train_ds, tokenizer, max_length)
        eval_cols, eval_info = _tokenize_classification(eval_ds, tokenizer, max_length)
        p_cols, p_info = _tokenize_classification(prompt_ds, tokenizer, max_length)
        fmt = None
        label_names = [str(x) for x in sorted(set(train_cols["labels"]) | set(eval_cols["labels"]))]
        prompts = [
            {"text": t, "input_ids": i, "label": y}
            for t, i, y in zip(p_info["texts"], p_cols["input_ids"], p_cols["labels"], strict=True)
        ]
    else:
        from smart_batching.data.formats import detect_format

        fmt = detect_format(columns)
        train_cols, train_info = _tokenize_causal(train_ds, tokenizer, fmt, max_length, loss_on)
        eval_cols, eval_info = _tokenize_causal(eval_ds, tokenizer, fmt, max_length, loss_on)
        p_cols, p_info = _tokenize_causal(prompt_ds, tokenizer, fmt, max_length)
        label_names = None
        ref_col = {"prompt_completion": "answer" if "answer" in columns else "completion", "alpaca": "output"}
        refs = (
            prompt_ds[ref_col[fmt]]
            if ref_col.get(fmt) in prompt_ds.column_names
            else [None] * prompt_ds.num_rows
        )
        prompts = []
        for k in range(prompt_ds.num_rows):
            prompt_ids = p_info["prompt_ids"][k]
            if max_length is not None:
                prompt_ids = prompt_ids[:max_length]
            if not prompt_ids:  # plain text has no prompt: continue its first tokens
                full = p_cols["input_ids"][k]
                prompt_ids = full[: max(1, min(16, len(full) // 2))]
            prompts.append(
                {
                    "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
                    "prompt_ids": list(prompt_ids),
                    "reference": None if refs[k] is None else str(refs[k]),
                }
            )
    train = datasets.Dataset.from_dict(train_cols)
    evald = datasets.Dataset.from_dict(eval_cols)
    lengths = np.fromiter((len(r) for r in train_cols["input_ids"]), dtype=np.int64, count=train.num_rows)
    if lengths.size == 0 or not lengths.any():
        raise DataError(f"{source}: no training tokens after tokenising")
    truncation = {
        "max_length": max_length,
        "num_truncated": train_info["num_truncated"],
        "truncated_tokens": train_info["truncated_tokens"],
        "eval_num_truncated": eval_info["num_truncated"],
    }
    return TrainingData(
        source=source,
        eval_source=str(eval_source),
        task=task,
        format=fmt,
        train=train,
        eval=evald,
        lengths=lengths,
        prompts=prompts,
        truncation=truncation,
        label_names=label_names,
    )


__all__ = [
    "LOSS_ON",
    "TrainingData",
    "detect_task",
    "gsm8k_answer",
    "gsm8k_exact_match",
    "prepare_training_data",
]
