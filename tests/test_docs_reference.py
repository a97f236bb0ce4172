"""Every public name (``smart_batching.__all__``, ``smart_batching.hf.__all__``) and every CLI subcommand
has its place in the API reference pages (docs/reference/), which mkdocstrings renders from the docstrings."""

from __future__ import annotations

from pathlib import Path

import pytest

import smart_batching
from smart_batching.cli import build_parser

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference"


def test_every_top_level_name_is_in_the_reference():
    page = (REFERENCE / "smart_batching.md").read_text()
    missing = [
        n for n in smart_batching.__all__ if n != "__version__" and f"::: smart_batching.{n}\n" not in page
    ]
    assert not missing, f"docs/reference/smart_batching.md lacks ::: entries for {missing}"
    assert "__version__" in page


def test_every_hf_name_is_in_the_reference():
    hf = pytest.importorskip("smart_batching.hf")
    page = (REFERENCE / "hf.md").read_text()
    missing = [n for n in hf.__all__ if f"::: smart_batching.hf.{n}\n" not in page]
    assert not missing, f"docs/reference/hf.md lacks ::: entries for {missing}"


def test_every_cli_subcommand_is_in_the_reference():
    parser = build_parser()
    commands = [a for a in parser._actions if a.dest == "command"][0].choices
    page = (REFERENCE / "cli.md").read_text()
    assert "<!-- cli-help -->" in page
    missing = [c for c in commands if f"<!-- cli-help: {c} -->" not in page]
    assert not missing, f"docs/reference/cli.md lacks the --help of {missing}"
