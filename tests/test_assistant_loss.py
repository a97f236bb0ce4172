"""``loss_on="assistant"``: a conversation learns from every assistant turn, and from nothing else.

The spans come from rendering each turn's prefixes (:func:`smart_batching.data.formats.assistant_spans`);
the upstream way, ``apply_chat_template(return_assistant_tokens_mask=True)``, needs a template with
``{% generation %}`` markers, which SmolLM2's lacks: the conformance test gives its ChatML such markers
and compares the two masks token by token.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from smart_batching.bench.measure import CountingCollator, example_targets  # noqa: E402
from smart_batching.collate import PaddingCollator  # noqa: E402
from smart_batching.data.formats import assistant_spans, render_batch  # noqa: E402
from smart_batching.data.tasks import prepare_training_data  # noqa: E402
from smart_batching.data.tokenizers import load_tokenizer  # noqa: E402
from smart_batching.errors import ConfigError, DataError  # noqa: E402

SGD = Path(__file__).resolve().parents[2] / "shared" / "data" / "sgd_dialogues" / "train.jsonl.gz"
DIALOGUES = [
    [
        {"role": "user", "content": "Find me a table for two in San Jose."},
        {"role": "assistant", "content": "Which cuisine would you like?"},
        {"role": "user", "content": "Thai, please."},
        {"role": "assistant", "content": "Bangkok Garden has a table at 7 pm."},
    ],
    [
        {"role": "system", "content": "You book trains."},
        {"role": "user", "content": "A train to Sacramento tomorrow."},
        {"role": "assistant", "content": "The 9:15 leaves from Union Station."},
        {"role": "user", "content": "Book it."},
        {"role": "assistant", "content": "Booked."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "Have a good trip!"},
    ],
    [
        {"role": "user", "content": "Is it going to rain?"},
        {"role": "assistant", "content": "No rain is expected today."},
        {"role": "user", "content": "And tomorrow?"},
    ],
]
GENERATION_CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""SmolLM2's ChatML with ``{% generation %}`` around each reply and its end-of-turn marker."""
RECORDS = [{"messages": d} for d in DIALOGUES + DIALOGUES[:1]]
"""The three dialogues to train on, and the first again to hold out."""


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def _write(folder: Path, dialogues: list) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": d}) + "\n" for d in dialogues))
    return path


def test_plain_spans_are_the_replies_and_their_newline():
    batch = {"messages": [DIALOGUES[0], DIALOGUES[2]]}
    text = render_batch(batch).texts
    spans = assistant_spans(batch)
    assert [text[0][a:b] for a, b in spans[0]] == [
        "Which cuisine would you like?\n",
        "Bangkok Garden has a table at 7 pm.",
    ]
    assert [text[1][a:b] for a, b in spans[1]] == ["No rain is expected today.\n"]
    assert assistant_spans({"text": ["all of it", ""]}) == [[(0, 9)], []]
    single = {"prompt": ["2 + 2 ="], "completion": [" 4"]}
    (rendered,) = render_batch(single).texts
    assert [rendered[a:b] for a, b in assistant_spans(single)[0]] == [" 4"]


def test_template_spans_hold_each_reply_with_its_end_marker(tokenizer):
    batch = {"messages": DIALOGUES}
    rendered = render_batch(batch, tokenizer)
    spans = assistant_spans(batch, tokenizer)
    replies = [[m["content"] + "<|im_end|>\n" for m in d if m["role"] == "assistant"] for d in DIALOGUES]
    assert [[t[a:b] for a, b in s] for t, s in zip(rendered.texts, spans, strict=True)] == replies
    for k in (0, 1):  # the last span is the completion that loss_on="completion" trains on
        assert spans[k][-1] == (len(rendered.prompts[k]), len(rendered.texts[k]))


def test_masks_match_transformers_generation_markers(tokenizer):
    """Conformance: transformers' assistant_masks of a template with generation markers, on the same text."""
    tokenizer = load_tokenizer("smollm2")
    tokenizer.chat_template = GENERATION_CHATML
    data = prepare_training_data(
        RECORDS, tokenizer=tokenizer, eval_examples=1, loss_on="assistant", num_prompts=0
    )
    for k, dialogue in enumerate(DIALOGUES):
        upstream = tokenizer.apply_chat_template(
            dialogue, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = data.train["input_ids"][k], data.train["assistant_masks"][k]
        n = len(upstream["input_ids"])
        assert ids[:n] == list(upstream["input_ids"])
        assert mask[:n] == list(upstream["assistant_masks"])
        assert sum(mask[:n]) > 0
        # The EOS appended after the text learns where the dialogue ends on a reply
        assert mask[n:] == ([1] if dialogue[-1]["role"] == "assistant" else [0]) * (len(ids) - n)


def test_last_reply_learns_the_same_under_both_settings(tokenizer):
    ending_on_a_reply = RECORDS[:2] + RECORDS[-1:]
    last = prepare_training_data(ending_on_a_reply, tokenizer=tokenizer, eval_examples=1, num_prompts=0)
    every = prepare_training_data(
        ending_on_a_reply, tokenizer=tokenizer, eval_examples=1, loss_on="assistant", num_prompts=0
    )
    assert every.train["input_ids"] == last.train["input_ids"]
    assert "assistant_masks" not in last.train.column_names
    for ids, p_last, p_every, mask in zip(
        last.train["input_ids"], last.train["prompt_length"], every.train["prompt_length"],
        every.train["assistant_masks"], strict=True,
    ):  # fmt: skip
        mask = np.asarray(mask)
        assert mask[p_last:].all() and len(mask) == len(ids)
        assert p_every == int(np.flatnonzero(mask)[0]) < p_last  # the first reply comes before the last
        assert not mask[:p_every].any()
    # A single-turn record trains on the same tokens either way
    single = [{"question": f"What is {i} + {i}?", "answer": f"{2 * i}"} for i in range(4)]
    a = prepare_training_data(single, tokenizer=tokenizer, eval_examples=1, num_prompts=0)
    b = prepare_training_data(
        single, tokenizer=tokenizer, eval_examples=1, loss_on="assistant", num_prompts=0
    )
    for ids, p, mask in zip(
        a.train["input_ids"], a.train["prompt_length"], b.train["assistant_masks"], strict=True
    ):
        assert mask == [0] * p + [1] * (len(ids) - p)


def test_targets_counted_by_the_bench_are_what_the_collator_trains(tokenizer):
    data = prepare_training_data(
        RECORDS, tokenizer=tokenizer, eval_examples=1, loss_on="assistant", num_prompts=0
    )
    counting = CountingCollator(PaddingCollator(tokenizer.pad_token_id or 0))
    batch = counting([data.train[k] for k in range(data.num_train)])
    targets = example_targets(data)
    assert targets is not None and targets.sum() == counting.target_tokens[0] > 0
    labels = batch["labels"]
    for k in range(data.num_train):
        mask = np.asarray(data.train["assistant_masks"][k])
        kept = labels[k, : len(mask)].numpy() != -100
        assert (kept == mask.astype(bool)).all()
        assert targets[k] == int(mask[1:].sum())


def test_bench_trains_on_every_reply(tmp_path):
    from smart_batching.bench.runner import run_bench

    train = _write(tmp_path / "data", DIALOGUES * 4)
    common = dict(
        model="tiny-llama", model_options={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                           "num_attention_heads": 2, "num_key_value_heads": 1},
        strategies=("random",), num_examples=8, batch_size=4, eval_examples=2, num_generations=0, progress=False,
        render=False,
    )  # fmt: skip
    (last,) = run_bench(str(train), out_dir=tmp_path / "last", **common)
    (every,) = run_bench(str(train), out_dir=tmp_path / "every", loss_on="assistant", **common)
    assert every["settings"]["loss_on"] == "assistant" and last["settings"]["loss_on"] == "completion"
    assert every["real_tokens"] == last["real_tokens"]
    assert every["target_tokens"] > 2 * last["target_tokens"]


@pytest.mark.skipif(not SGD.is_file(), reason="needs ../shared/data (Schema-Guided Dialogue)")
def test_sgd_dialogues_learn_from_every_reply(tokenizer):
    with gzip.open(SGD, "rt") as f:
        records = [json.loads(next(f)) for _ in range(12)]
    data = prepare_training_data(
        [{"messages": r["messages"]} for r in records], tokenizer=tokenizer, eval_examples=2,
        loss_on="assistant", num_prompts=0,
    )  # fmt: skip
    last = prepare_training_data(
        [{"messages": r["messages"]} for r in records], tokenizer=tokenizer, eval_examples=2, num_prompts=0
    )
    every, only_last = example_targets(data), example_targets(last)
    assert (every > only_last).all() and every.sum() > 5 * only_last.sum()
    for k, r in enumerate(records[:10]):
        replies = sum(m["role"] == "assistant" for m in r["messages"])
        text = tokenizer.decode(
            [
                t
                for t, m in zip(data.train["input_ids"][k], data.train["assistant_masks"][k], strict=True)
                if m
            ]
        )
        assert text.count("<|im_end|>") == replies + 1  # and the EOS after the last


def test_refusals(tokenizer):
    from transformers import ByT5Tokenizer

    from smart_batching.bench.config import BenchConfig

    with pytest.raises(ConfigError, match="loss_on='everything' must be one of"):
        prepare_training_data(RECORDS, tokenizer=tokenizer, eval_examples=1, loss_on="everything")
    with pytest.raises(ConfigError, match="loss_on="):
        BenchConfig(loss_on="all")
    with pytest.raises(ConfigError, match="slow tokenizer.*use_fast=True"):
        prepare_training_data(RECORDS, tokenizer=ByT5Tokenizer(), eval_examples=1, loss_on="assistant")
    rewriting = load_tokenizer("smollm2")  # drops earlier replies, as templates that strip reasoning do
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% endif %}"
    )
    with pytest.raises(DataError, match=r"assistant message \d+ differently.*loss_on='completion'"):
        assistant_spans({"messages": DIALOGUES}, rewriting)
