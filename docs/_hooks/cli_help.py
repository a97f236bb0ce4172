"""MkDocs hook: ``<!-- cli-help: NAME -->`` in a page becomes the ``--help`` text of that subcommand
(``<!-- cli-help -->`` alone: the top-level command), read from the parser itself, so the CLI
reference cannot drift from the code."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

os.environ.setdefault("COLUMNS", "100")  # the same line breaks on every terminal
MARK = re.compile(r"<!-- cli-help(?:: ([a-z-]+))? -->")


def _help(name: str | None) -> str:
    from smart_batching.cli import build_parser

    parser = build_parser()
    if name is None:
        return parser.format_help()
    actions = [a for a in parser._actions if a.dest == "command"]
    return actions[0].choices[name].format_help()


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARK.sub(lambda m: "```text\n" + _help(m.group(1)).rstrip() + "\n```", markdown)
