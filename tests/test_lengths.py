"""Token lengths from every source: length columns, Arrow offsets, .npy files, token ids, text, records."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from smart_batching.data.lengths import (
    compute_lengths,
    lengths_from_dataset,
    lengths_from_records,
    lengths_from_texts,
    lengths_from_token_ids,
)
from smart_batching.errors import ConfigError, DataError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"real datasets not found at {SHARED}")


def _ids_rows(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=int(k)).tolist() for k in rng.integers(0, 40, size=n)]


# --- stored lengths: no tokenizer ------------------------------------------------------------------


def test_token_id_lists():
    rows = _ids_rows(50)
    assert lengths_from_token_ids(rows).tolist() == [len(r) for r in rows]
    assert lengths_from_token_ids((np.arange(3), np.arange(0), (1, 2))).tolist() == [3, 0, 2]
    assert lengths_from_token_ids(np.zeros((4, 7), dtype=np.int64)).tolist() == [7] * 4
    out = lengths_from_token_ids([])
    assert out.dtype == np.int64 and out.shape == (0,)
    assert lengths_from_token_ids(iter([[1], [1, 2]])).tolist() == [1, 2]


def test_compute_lengths_from_in_memory_values():
    assert compute_lengths([3, 1, 2]).tolist() == [3, 1, 2]
    assert compute_lengths(np.array([3.0, 4.0])).dtype == np.int64
    assert compute_lengths([[1, 2], [3]]).tolist() == [2, 1]
    assert compute_lengths([]).shape == (0,)
    with pytest.raises(DataError, match="non-negative"):
        compute_lengths([3, -1])


def test_npy_file(tmp_path):
    lengths = np.array([5, 0, 17, 3], dtype=np.int32)
    np.save(tmp_path / "lengths.npy", lengths)
    out = compute_lengths(tmp_path / "lengths.npy")
    assert out.dtype == np.int64 and out.tolist() == lengths.tolist()
    assert compute_lengths(str(tmp_path / "lengths.npy")).tolist() == lengths.tolist()
    np.save(tmp_path / "bad.npy", np.array([1, -2]))
    with pytest.raises(DataError, match="non-negative"):
        compute_lengths(tmp_path / "bad.npy")
    np.save(tmp_path / "2d.npy", np.ones((2, 2), dtype=np.int64))
    with pytest.raises(DataError, match="1-D"):
        compute_lengths(tmp_path / "2d.npy")
    with pytest.raises(DataError, match="no such file"):
        compute_lengths(tmp_path / "missing.npy")


datasets = pytest.importorskip("datasets")


@pytest.mark.filterwarnings("ignore::FutureWarning")  # datasets' sort passes a deprecated pyarrow option
def test_arrow_offsets_equal_python_len():
    rows = _ids_rows(500)
    ds = datasets.Dataset.from_dict({"input_ids": rows, "i": list(range(len(rows)))})
    expected = np.array([len(r) for r in rows])
    assert np.array_equal(lengths_from_dataset(ds), expected)
    # Row order after an indices mapping (select / shuffle / sort / filter)
    for view in (
        ds.select([5, 3, 3, 499, 0]),
        ds.shuffle(seed=1),
        ds.sort("i", reverse=True),
        ds.filter(lambda r: r["i"] % 3 == 0),
        ds.shuffle(seed=2).select(range(100)),
    ):
        assert np.array_equal(lengths_from_dataset(view), [len(r) for r in view["input_ids"]])
        assert np.array_equal(lengths_from_dataset(view), expected[view["i"]])


def test_arrow_offsets_over_chunks_slices_and_large_lists():
    import pyarrow as pa

    rows = _ids_rows(300, seed=3)
    parts = [
        datasets.Dataset.from_dict({"input_ids": rows[a:b]}) for a, b in ((0, 100), (100, 120), (120, 300))
    ]
    ds = datasets.concatenate_datasets(parts)
    assert ds.data.column("input_ids").num_chunks == 3
    assert lengths_from_dataset(ds).tolist() == [len(r) for r in rows]
    # a table whose chunks are slices of a bigger array (offsets do not start at 0)
    arr = pa.array(rows)
    sliced = pa.chunked_array([arr.slice(10, 50), arr.slice(200, 30)])
    ds = datasets.Dataset(pa.table({"input_ids": sliced}))
    assert lengths_from_dataset(ds).tolist() == [len(r) for r in rows[10:60] + rows[200:230]]
    large = pa.table({"input_ids": pa.array(rows, type=pa.large_list(pa.int64()))})
    assert lengths_from_dataset(datasets.Dataset(large)).tolist() == [len(r) for r in rows]
    fixed = pa.table({"input_ids": pa.array([[1, 2, 3]] * 4, type=pa.list_(pa.int64(), 3))})
    assert lengths_from_dataset(datasets.Dataset(fixed)).tolist() == [3] * 4


def test_length_columns_are_reused():
    ds = datasets.Dataset.from_dict({"input_ids": [[1], [1, 2]], "length": [10, 20], "num_tokens": [7, 8]})
    assert lengths_from_dataset(ds).tolist() == [10, 20]  # "length" first
    assert lengths_from_dataset(ds, column="num_tokens").tolist() == [7, 8]
    assert lengths_from_dataset(ds, column="input_ids").tolist() == [1, 2]
    assert lengths_from_dataset(ds.select([1, 0])).tolist() == [20, 10]
    assert compute_lengths(ds, column="input_ids").tolist() == [1, 2]


def test_missing_column_names_the_setting():
    ds = datasets.Dataset.from_dict({"input_ids": [[1]]})
    with pytest.raises(DataError, match="column='nope' not found"):
        compute_lengths(ds, column="nope")
    with pytest.raises(DataError, match="column='nope'"):
        lengths_from_dataset(ds, column="nope")


def test_null_and_text_columns_are_rejected():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], None, [3]]})
    with pytest.raises(DataError, match="example 1 is null"):
        lengths_from_dataset(ds)
    ds = datasets.Dataset.from_dict({"text": ["a b", "c"]})
    with pytest.raises(DataError, match="holds text"):
        lengths_from_dataset(ds, column="text")
    with pytest.raises(ConfigError, match="tokenizer="):
        compute_lengths(ds)
    with pytest.raises(ConfigError, match="tokenizer="):
        compute_lengths(ds, column="text")
    with pytest.raises(ConfigError, match="tokenizer="):
        compute_lengths(["some text"])


def test_dataset_without_known_shape_lists_columns():
    ds = datasets.Dataset.from_dict({"foo": ["x"], "bar": [1]})
    with pytest.raises(DataError, match="'bar', 'foo'"):
        compute_lengths(ds, "gpt2")


def test_datasetdict_picks_the_split():
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"length": [1, 2]}),
            "test": datasets.Dataset.from_dict({"length": [3]}),
        }
    )
    assert compute_lengths(dd).tolist() == [1, 2]
    assert compute_lengths(dd, split="test").tolist() == [3]


def test_files_without_tokenizer(tmp_path):
    import json

    (tmp_path / "ids.jsonl").write_text(
        "".join(json.dumps({"input_ids": r}) + "\n" for r in [[1, 2, 3], [4]])
    )
    assert compute_lengths(tmp_path / "ids.jsonl").tolist() == [3, 1]


# --- tokenising ------------------------------------------------------------------------------------

pytest.importorskip("transformers")

from smart_batching.data.tokenizers import load_tokenizer  # noqa: E402

TEXTS = ["Hello world", "", "a much longer sentence, with punctuation; and numbers 12345.", "日本語 🙂", None]


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2")


def test_lengths_from_texts_match_single_calls(gpt2):
    expected = [len(gpt2(t or "").input_ids) for t in TEXTS]
    for batch_size in (1, 2, 1000):
        out = lengths_from_texts(TEXTS, gpt2, batch_size=batch_size, progress=False)
        assert out.dtype == np.int64 and out.tolist() == expected
    assert compute_lengths(TEXTS, "gpt2", progress=False).tolist() == expected
    with pytest.raises(ConfigError, match="batch_size"):
        lengths_from_texts(TEXTS, gpt2, batch_size=0)


def test_special_tokens_are_counted_on_request():
    llama = load_tokenizer("llama-sp")
    minilm = load_tokenizer("minilm")
    texts = ["Hello world", "one two three"]
    plain = lengths_from_texts(texts, llama, add_special_tokens=False, progress=False)
    assert (lengths_from_texts(texts, llama, progress=False) == plain + 1).all()  # <s>
    plain = lengths_from_texts(texts, minilm, add_special_tokens=False, progress=False)
    assert (lengths_from_texts(texts, minilm, progress=False) == plain + 2).all()  # [CLS] [SEP]


def test_text_column_and_mapped_input_ids_agree(gpt2):
    ds = datasets.Dataset.from_dict({"text": [t or "" for t in TEXTS] * 20})
    by_text = compute_lengths(ds, gpt2, column="text", progress=False)
    tokenized = ds.map(lambda b: gpt2(b["text"]), batched=True, remove_columns=["text"])
    assert np.array_equal(lengths_from_dataset(tokenized), by_text)
    shuffled = ds.shuffle(seed=0)
    assert np.array_equal(
        compute_lengths(shuffled, gpt2, column="text", progress=False),
        [len(gpt2(t).input_ids) for t in shuffled["text"]],
    )


def test_records_in_each_shape(gpt2):
    records = [
        {"instruction": "Add.", "input": "1 2", "output": "3"},
        {"instruction": "Hi", "output": "Hello"},
    ]
    expected = [len(gpt2(t).input_ids) for t in ("Add.\n\n1 2\n3", "Hi\nHello")]
    assert lengths_from_records(records, gpt2, progress=False).tolist() == expected
    assert compute_lengths(records, gpt2, progress=False).tolist() == expected
    columns = {"question": ["Q?"], "answer": ["A"]}
    assert compute_lengths(columns, gpt2, progress=False).tolist() == [len(gpt2("Q?\nA").input_ids)]
    with pytest.raises(DataError, match="format='messages'"):
        lengths_from_records(records, gpt2, format="messages", progress=False)


def test_chat_lengths_equal_the_tokenized_template(smollm2):
    conv = [
        [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}] * 3,
    ]
    ds = datasets.Dataset.from_dict({"messages": conv})
    out = compute_lengths(ds, smollm2, progress=False)
    for n, msgs in zip(out, conv, strict=True):
        ids = smollm2.apply_chat_template(msgs, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert n == len(ids)
    plain = compute_lengths(ds, smollm2, progress=False, use_chat_template=False)
    assert (plain < out).all()


@needs_shared
def test_gsm8k_lengths_with_smollm2(smollm2):
    lengths = compute_lengths(SHARED / "gsm8k" / "train.jsonl", smollm2, progress=False)
    assert lengths.shape == (7473,) and lengths.dtype == np.int64
    # SOURCES.md: question + answer, no template: mean 186, p50 173, max 539
    assert 150 <= lengths.mean() <= 230
    assert 100 <= np.median(lengths) <= 250 and lengths.max() < 1000


@needs_shared
def test_lima_history_uses_the_chat_template(smollm2):
    from smart_batching.data import load_dataset_any

    ds = load_dataset_any(SHARED / "lima").select(range(200))
    chat = compute_lengths(ds, smollm2, progress=False)
    plain = compute_lengths(ds, smollm2, progress=False, use_chat_template=False)
    assert (chat > plain).all()  # the ChatML markers and default system prompt


def test_import_does_not_pull_heavy_dependencies():
    code = (
        "import sys\n"
        "import smart_batching.data.lengths, smart_batching.data, smart_batching.data.formats\n"
        "import smart_batching.data.tokenizers, smart_batching.data.default_data\n"
        "heavy = [m for m in ('transformers', 'datasets', 'matplotlib', 'torch', 'pyarrow') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    heavy = [m for m in out.stdout.strip().split(",") if m]
    assert not {"transformers", "datasets", "matplotlib"} & set(heavy), heavy
