"""The embedded default dataset: real stdlib text, deterministic, long-tailed, quick to build."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import numpy as np
import pytest

from smart_batching.data.default_data import MAX_OUTPUT_CHARS, MIN_CHARS, load_default_dataset
from smart_batching.data.formats import detect_format
from smart_batching.errors import ConfigError


@pytest.fixture(scope="module")
def records():
    return load_default_dataset()


def test_shape_and_size(records):
    assert 1500 <= len(records) <= 10_000
    assert all(set(r) == {"instruction", "input", "output"} for r in records)
    assert all(isinstance(v, str) for r in records for v in r.values())
    assert detect_format(records[0]) == "alpaca"
    outputs = [r["output"] for r in records]
    assert len(set(outputs)) == len(outputs)  # deduplicated
    assert min(map(len, outputs)) >= MIN_CHARS and max(map(len, outputs)) <= MAX_OUTPUT_CHARS
    kinds = {r["instruction"].split()[0] for r in records}
    assert kinds == {"Explain", "Document"}  # reference topics and docstrings
    assert any(r["input"].startswith("Signature: ") for r in records)


def test_lengths_are_long_tailed(records):
    chars = np.array([len(r["instruction"]) + len(r["input"]) + len(r["output"]) for r in records])
    assert chars.max() >= 20 * np.median(chars)
    assert np.percentile(chars, 99) >= 5 * np.median(chars)


def test_max_examples_is_a_prefix(records):
    assert load_default_dataset(max_examples=10) == records[:10]
    assert load_default_dataset(max_examples=0) == []
    with pytest.raises(ConfigError, match="max_examples"):
        load_default_dataset(max_examples=-1)
    # a prefix mixes both sources (fixed shuffle)
    head = load_default_dataset(max_examples=300)
    assert {r["instruction"].split()[0] for r in head} == {"Explain", "Document"}


def test_returns_fresh_lists(records):
    first = load_default_dataset(max_examples=1)
    first[0]["output"] = "changed"
    assert load_default_dataset(max_examples=1)[0]["output"] != "changed"


def test_deterministic_across_processes_and_fast():
    """Same records in a clean interpreter as here, after pytest and transformers patched stdlib."""
    from smart_batching.data import default_data

    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401 - it adds methods to logging.Logger on import
    default_data._build.cache_clear()
    records = load_default_dataset()
    code = (
        "import hashlib, json, time\n"
        "t = time.perf_counter()\n"
        "from smart_batching.data.default_data import load_default_dataset\n"
        "rows = load_default_dataset()\n"
        "print(time.perf_counter() - t, hashlib.sha256(json.dumps(rows).encode()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, digest = out.stdout.split()
    import hashlib
    import json

    assert digest == hashlib.sha256(json.dumps(records).encode()).hexdigest()
    assert float(seconds) < 5.0  # about 0.3-0.7 s; loose for busy CI machines


def test_as_hf_dataset(records):
    pytest.importorskip("datasets")
    from smart_batching.data.default_data import default_dataset_as_hf

    ds = default_dataset_as_hf()
    assert ds.num_rows == len(records) and ds.column_names == ["instruction", "input", "output"]
    assert ds[0] == records[0]
    assert default_dataset_as_hf(max_examples=5).num_rows == 5


def test_token_lengths_with_a_real_tokenizer():
    pytest.importorskip("transformers")
    from smart_batching.data.lengths import compute_lengths

    lengths = compute_lengths(load_default_dataset(max_examples=500), "gpt2", progress=False)
    assert lengths.shape == (500,) and lengths.min() > 5
    assert lengths.max() > 10 * np.median(lengths)
