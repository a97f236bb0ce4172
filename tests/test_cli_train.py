"""`smart-batching train` keeps the word of its help: checkpoints and resume, a model folder, refused
settings before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from smart_batching.cli import main  # noqa: E402

BASE = [
    "train",
    "--data",
    "default",
    "--num-examples",
    "48",
    "--strategy",
    "packed",
    "--max-length",
    "256",
    "--json",
]


def _summary(capsys) -> dict:
    out = capsys.readouterr().out
    return json.loads([line for line in out.splitlines() if line.startswith('{"strategy"')][-1])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epochs", "0"], "argument --epochs: must be a positive number"),
        (["--lr", "-1"], "argument --lr: must be a positive number"),
        (["--capacity", "128"], "--capacity 128 is below --max-length 256"),
        (["--max-tokens", "100", "--strategy", "token_budget"], "--max-tokens 100 is below --max-length 256"),
        (["--model", "/no/such/folder"], "is neither a model name"),
        (["--batch-schedule", "fast"], "batch_schedule='fast'"),
        (["--batch-schedule", "0:512", "--grad-accum", "2"], "set gradient_accumulation_steps=1"),
    ],
)
def test_refused_settings_name_what_to_change(capsys, tmp_path, extra, message):
    assert main([*BASE, "--out", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_checkpoints_and_resume_mid_run(capsys, tmp_path):
    out = str(tmp_path / "run")
    assert main([*BASE, "--out", out, "--resume"]) == 2
    assert "no checkpoint in --out" in capsys.readouterr().err
    assert main([*BASE, "--out", out, "--max-steps", "2", "--save-steps", "2"]) == 0
    assert _summary(capsys)["steps"] == 2
    assert (Path(out) / "checkpoint-2" / "smart_batching_sampler.json").is_file()
    assert main([*BASE, "--out", out, "--max-steps", "4", "--save-steps", "2", "--resume"]) == 0
    resumed = _summary(capsys)
    assert resumed["steps"] == 4 and (Path(out) / "checkpoint-4").is_dir()
    assert main([*BASE, "--out", str(tmp_path / "straight"), "--max-steps", "4"]) == 0
    straight = _summary(capsys)
    # The resumed run trained only the last two steps (from the checkpoint's sampler cursor).
    assert resumed["real_tokens"] < 0.75 * straight["real_tokens"]


def test_a_model_folder_trains(capsys, tmp_path):
    from smart_batching.models.zoo import load_training_model

    tiny = load_training_model("tiny-llama")
    folder = tmp_path / "model"
    tiny.fresh().save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    assert main([*BASE, "--out", str(tmp_path / "run"), "--model", str(folder), "--max-steps", "1"]) == 0
    summary = _summary(capsys)
    assert summary["steps"] == 1 and summary["model"] == "llama"


def test_batch_schedule_ramps_the_tokens_per_step(capsys, tmp_path):
    """--batch-schedule: the summary's tokens per step rise along the ramp, within one example of it."""
    args = [*BASE, "--out", str(tmp_path), "--batch-schedule", "linear:300->1200@60%", "--lr-scaling", "sqrt",
            "--oom-backoff"]  # fmt: skip
    assert main(args) == 0
    summary = _summary(capsys)
    per_step = summary["tokens_per_step"]
    assert summary["steps"] == len(per_step) > 4
    assert abs(per_step[0] - 300) <= 128 and abs(per_step[-2] - 1200) <= 128  # half an example at most
    assert summary["oom_backoffs"] == 0 and sum(per_step) == summary["real_tokens"]


def test_an_epoch_learns_from_every_completion_and_no_prompt(capsys, tmp_path, recwarn):
    """The loss covers each example's completion, never its prompt: the data's prompt_length reaches the
    collator (HF's remove_unused_columns would drop it), and nothing falls back."""
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.fallbacks import FallbackWarning

    assert main([*BASE, "--out", str(tmp_path / "run"), "--epochs", "1"]) == 0
    summary = _summary(capsys)
    data = prepare_training_data(
        "default", tokenizer=load_tokenizer("smollm2"), num_examples=48, eval_examples=8, max_length=256
    )
    prompts = data.train["prompt_length"]
    assert max(prompts) > 1
    expected = sum(len(ids) - max(p, 1) for ids, p in zip(data.train["input_ids"], prompts, strict=True))
    assert summary["target_tokens"] == expected < summary["real_tokens"] - 48
    assert not [w for w in recwarn if w.category is FallbackWarning]


def test_loss_on_assistant_learns_from_every_reply(capsys, tmp_path):
    """--loss-on assistant: an epoch of dialogues counts every reply's tokens as targets, and only them."""
    from test_assistant_loss import DIALOGUES

    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.data.tokenizers import load_tokenizer

    data_file = tmp_path / "dialogues.jsonl"
    data_file.write_text("".join(json.dumps({"messages": d}) + "\n" for d in DIALOGUES * 6))
    args = ["train", "--data", str(data_file), "--strategy", "packed", "--max-length", "256", "--json",
            "--epochs", "1"]  # fmt: skip
    summaries = {}
    for loss_on in ("completion", "assistant"):
        assert main([*args, "--out", str(tmp_path / loss_on), "--loss-on", loss_on]) == 0
        summaries[loss_on] = _summary(capsys)
    data = prepare_training_data(
        str(data_file),
        tokenizer=load_tokenizer("smollm2"),
        eval_examples=8,
        max_length=256,
        loss_on="assistant",
    )
    expected = sum(sum(mask[1:]) for mask in data.train["assistant_masks"])
    assert summaries["assistant"]["target_tokens"] == expected > 2 * summaries["completion"]["target_tokens"]
    assert summaries["assistant"]["real_tokens"] == summaries["completion"]["real_tokens"]
