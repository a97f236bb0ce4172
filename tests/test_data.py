"""Loading datasets from files, folders and the hub, and rendering records to text (formats)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")

from smart_batching.data import load_dataset_any  # noqa: E402
from smart_batching.data.formats import (  # noqa: E402
    FORMATS,
    detect_format,
    render_batch,
    render_texts,
    resolve_format,
)
from smart_batching.errors import ConfigError, DataError  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"real datasets not found at {SHARED}")

ROWS = [
    {"question": "What is 2 + 2?", "answer": "4"},
    {"question": 'Say "hi", then stop.', "answer": "hi"},
    {"question": "Tabs\tand, commas", "answer": "ok"},
]


def _write_jsonl(path: Path, rows, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def _check(ds, rows=ROWS):
    assert isinstance(ds, datasets.Dataset)
    assert ds.num_rows == len(rows)
    assert ds.to_list() == rows


# --- files -------------------------------------------------------------------------------------


def test_jsonl_and_gzipped_jsonl(tmp_path):
    _check(load_dataset_any(_write_jsonl(tmp_path / "a.jsonl", ROWS)))
    _check(load_dataset_any(_write_jsonl(tmp_path / "a.jsonl.gz", ROWS, gzip.open)))
    # str paths, blank lines between records
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) + "\n" for r in ROWS))
    _check(load_dataset_any(str(tmp_path / "b.jsonl")))


def test_json_shapes(tmp_path):
    (tmp_path / "array.json").write_text(json.dumps(ROWS, indent=2))
    _check(load_dataset_any(tmp_path / "array.json"))
    cols = {k: [r[k] for r in ROWS] for k in ROWS[0]}
    (tmp_path / "columns.json").write_text(json.dumps(cols, indent=2))
    _check(load_dataset_any(tmp_path / "columns.json"))
    (tmp_path / "field.json").write_text(json.dumps({"version": "1", "data": ROWS}))
    _check(load_dataset_any(tmp_path / "field.json"))
    (tmp_path / "one.json").write_text(json.dumps(ROWS[0]))  # a single record
    _check(load_dataset_any(tmp_path / "one.json"), ROWS[:1])
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    (tmp_path / "conv.json").write_text(json.dumps(conv, indent=1))
    _check(load_dataset_any(tmp_path / "conv.json"), [conv])
    _check(load_dataset_any(_write_jsonl(tmp_path / "lines.json", ROWS)))  # JSON lines named .json
    with gzip.open(tmp_path / "array.json.gz", "wt") as f:
        json.dump(ROWS, f)
    _check(load_dataset_any(tmp_path / "array.json.gz"))


def test_csv_quoted_and_tsv_unquoted(tmp_path):
    import csv

    with open(tmp_path / "a.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["question", "answer"])
        w.writeheader()
        w.writerows(ROWS)
    _check(load_dataset_any(tmp_path / "a.csv"))
    # SST-2 style: no quoting at all, a lone double quote is text
    (tmp_path / "s.tsv").write_text("label\tsentence\n0\ta \"quoted\n1\tit 's fine , really\n")
    ds = load_dataset_any(tmp_path / "s.tsv")
    assert ds.to_list() == [
        {"label": 0, "sentence": 'a "quoted'},
        {"label": 1, "sentence": "it 's fine , really"},
    ]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    _check(load_dataset_any(tmp_path / "a.parquet"))


def test_save_to_disk_folders(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    _check(load_dataset_any(tmp_path / "single"))
    dd = datasets.DatasetDict({"train": ds, "test": ds.select([0])})
    dd.save_to_disk(str(tmp_path / "dict"))
    _check(load_dataset_any(tmp_path / "dict"))
    _check(load_dataset_any(tmp_path / "dict", split="test"), ROWS[:1])
    with pytest.raises(DataError, match="split='dev' not found; splits: train, test"):
        load_dataset_any(tmp_path / "dict", split="dev")


def test_folder_of_split_files(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    _write_jsonl(tmp_path / "test.jsonl.gz", ROWS[:1], gzip.open)
    (tmp_path / "README.md").write_text("not data")
    _check(load_dataset_any(tmp_path))
    _check(load_dataset_any(tmp_path, split="test"), ROWS[:1])


def test_folder_of_shards_under_data(tmp_path):
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "train-00000-of-00002.jsonl", ROWS[:2])
    _write_jsonl(tmp_path / "data" / "train-00001-of-00002.jsonl", ROWS[2:])
    _check(load_dataset_any(tmp_path))


def test_folder_without_train_needs_split(tmp_path):
    _write_jsonl(tmp_path / "dev.jsonl", ROWS)
    _write_jsonl(tmp_path / "test.jsonl", ROWS)
    with pytest.raises(DataError, match="pass split="):
        load_dataset_any(tmp_path)


# --- errors ------------------------------------------------------------------------------------


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3\n{"a": 4}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 4 is not valid JSON"):
        load_dataset_any(path)
    gz = tmp_path / "bad.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write('{"a": 1}\n[1, 2]\n')
    with pytest.raises(DataError, match="line 2 is a JSON list"):
        load_dataset_any(gz)


def test_malformed_json_array_names_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"a": 1},\n  {"a": 2,}\n]\n')
    with pytest.raises(DataError, match=r"bad\.json: not valid JSON .* line 3"):
        load_dataset_any(path)


def test_mixed_types_are_a_data_error(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"a": 1}\n{"a": "one"}\n')
    with pytest.raises(DataError, match="mixed.jsonl"):
        load_dataset_any(path)


@pytest.mark.parametrize(
    ("name", "content"),
    [("e.jsonl", ""), ("e2.jsonl", "\n\n"), ("e.json", "[]"), ("e.csv", "a,b\n"), ("e.tsv", "")],
)
def test_empty_files_are_reported(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match="is empty"):
        load_dataset_any(path)


def test_empty_saved_dataset_is_reported(tmp_path):
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="is empty"):
        load_dataset_any(tmp_path / "empty")


def test_missing_and_unsupported_paths(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_dataset_any(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="no such file"):
        load_dataset_any("data/train.jsonl")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type"):
        load_dataset_any(tmp_path / "notes.txt")
    with pytest.raises(DataError, match="neither a save_to_disk folder"):
        load_dataset_any(tmp_path)


def test_hub_name_offline_is_a_clear_error():
    with pytest.raises(DataError) as err:
        load_dataset_any("smart-batching-tests/no-such-dataset-3b7e")
    assert "need the network" in str(err.value) and "local path" in str(err.value)


# --- the real shared datasets --------------------------------------------------------------------


@needs_shared
def test_real_gsm8k():
    ds = load_dataset_any(SHARED / "gsm8k")  # folder: picks train.jsonl
    assert ds.num_rows == 7473 and ds.column_names == ["question", "answer"]
    assert load_dataset_any(SHARED / "gsm8k", split="test").num_rows == 1319
    assert detect_format(ds.column_names) == "prompt_completion"


@needs_shared
def test_real_lima():
    ds = load_dataset_any(SHARED / "lima" / "lima.json")
    assert ds.num_rows == 1029
    assert set(ds.column_names) == {"instruction", "input", "output", "history"}
    assert sum(1 for h in ds["history"] if h) == 29
    assert detect_format(ds.column_names) == "alpaca"


@needs_shared
def test_real_sgd_dialogues():
    ds = load_dataset_any(SHARED / "sgd_dialogues" / "train.jsonl.gz")
    assert ds.num_rows == 12174
    first = ds[0]["messages"]
    assert first[0]["role"] == "user" and first[-1]["role"] == "assistant"
    assert detect_format(ds.column_names) == "messages"
    assert load_dataset_any(SHARED / "sgd_dialogues", split="dev").num_rows == 2098


@needs_shared
def test_real_sst2_unquoted():
    ds = load_dataset_any(SHARED / "sst2" / "train.tsv")
    assert ds.num_rows == 67349 and ds.column_names == ["label", "sentence"]
    labels = ds["label"]
    assert sum(labels) == 37569
    assert ds[0] == {"label": 0, "sentence": "hide new secretions from the parental units"}  # CRLF stripped
    assert detect_format(ds.column_names) == "text"


# --- formats -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "expected"),
    [
        (["id", "messages"], "messages"),
        (["instruction", "input", "output", "history"], "alpaca"),
        (["instruction", "output"], "alpaca"),
        (["prompt", "completion"], "prompt_completion"),
        (["question", "answer"], "prompt_completion"),
        (["label", "sentence"], "text"),
        (["text", "meta"], "text"),
        (["content"], "text"),
        (["messages", "text"], "messages"),  # first match wins
    ],
)
def test_detect_format(columns, expected):
    assert detect_format(columns) == expected
    assert expected in FORMATS


def test_unknown_shape_lists_columns_and_shapes():
    with pytest.raises(DataError) as err:
        detect_format(["foo", "bar"])
    msg = str(err.value)
    assert "'bar'" in msg and "'foo'" in msg
    assert all(f in msg for f in FORMATS)


def test_resolve_format_checks_columns():
    assert resolve_format("auto", ["text"]) == "text"
    assert resolve_format("text", ["sentence", "label"]) == "text"
    with pytest.raises(DataError, match="format='messages'"):
        resolve_format("messages", ["text"])
    with pytest.raises(ConfigError, match="format='chat'"):
        resolve_format("chat", ["messages"])


def test_plain_rendering_concatenates_prompt_and_completion():
    rb = render_batch({"question": ["Q1?", "Q2 "], "answer": ["A1", "A2"]})
    assert rb.prompts == ["Q1?\n", "Q2 "]  # a separator only where none is there
    assert rb.completions == ["A1", "A2"]
    assert rb.texts == ["Q1?\nA1", "Q2 A2"] and not rb.chat_template
    # TRL-style data owns its separator
    rb = render_batch({"prompt": ["The sky is"], "completion": [" blue."]})
    assert rb.texts == ["The sky is blue."]
    rb = render_batch({"instruction": ["Add."], "input": ["1 2"], "output": ["3"]})
    assert rb.prompts == ["Add.\n\n1 2\n"] and rb.completions == ["3"]
    rb = render_batch({"sentence": ["just text", None]})
    assert rb.prompts == ["", ""] and rb.completions == ["just text", ""]


def test_plain_rendering_of_history_and_messages():
    batch = {"instruction": ["u2"], "input": [""], "output": ["a2"], "history": [[["u1", "a1"]]]}
    rb = render_batch(batch)  # no tokenizer: plain text
    assert rb.prompts == ["u1\na1\nu2\n"] and rb.completions == ["a2"]
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rb = render_batch({"messages": [msgs, msgs[:1]]})
    assert rb.texts == ["hi\nhello", "hi"]
    assert rb.completions == ["hello", ""]


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    from smart_batching.data.tokenizers import load_tokenizer

    return load_tokenizer("smollm2")


def test_chat_rendering_splits_at_the_last_assistant_turn(smollm2):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    rb = render_batch({"messages": [msgs, msgs[:3]]}, smollm2)
    assert rb.chat_template
    full = smollm2.apply_chat_template(msgs, tokenize=False)
    assert rb.texts[0] == full
    assert rb.prompts[0].endswith("<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n")
    assert rb.completions[0] == "ciao<|im_end|>\n"
    assert rb.completions[1] == "" and rb.prompts[1] == smollm2.apply_chat_template(msgs[:3], tokenize=False)
    assert render_texts({"messages": [msgs]}, smollm2) == [full]


def test_alpaca_uses_the_template_only_with_history(smollm2):
    single = {"instruction": ["Add."], "input": [""], "output": ["3"]}
    assert not render_batch(single, smollm2).chat_template
    multi = dict(single, history=[[["u1", "a1"]]])
    rb = render_batch(multi, smollm2)
    assert rb.chat_template
    expected = smollm2.apply_chat_template(
        [
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "Add."},
            {"role": "assistant", "content": "3"},
        ],
        tokenize=False,
    )
    assert rb.texts == [expected] and rb.completions == ["3<|im_end|>\n"]
    # forced on and off
    assert render_batch(single, smollm2, use_chat_template=True).chat_template
    assert not render_batch(multi, smollm2, use_chat_template=False).chat_template


def test_conversational_prompt_completion(smollm2):
    batch = {
        "prompt": [[{"role": "user", "content": "2+2?"}]],
        "completion": [[{"role": "assistant", "content": "4"}]],
    }
    rb = render_batch(batch, smollm2)
    assert rb.chat_template and rb.completions == ["4<|im_end|>\n"]
    assert rb.prompts[0].endswith("<|im_start|>assistant\n")


def test_forcing_a_template_the_tokenizer_lacks_is_a_config_error():
    pytest.importorskip("transformers")
    from smart_batching.data.tokenizers import load_tokenizer

    with pytest.raises(ConfigError, match="use_chat_template=True"):
        render_batch({"question": ["q"], "answer": ["a"]}, load_tokenizer("gpt2"), use_chat_template=True)
