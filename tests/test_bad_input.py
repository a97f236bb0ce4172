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
