"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

* ``<!-- cli-help: NAME -->`` in a page becomes the ``--help`` text of that subcommand
  (``<!-- cli-help -->`` alone: the top-level command), read from the parser itself, so the CLI
  reference cannot drift from the code.
* The docstrings are Google-style with Sphinx roles for cross-references (``:class:`~a.b.C```) and
  ``::`` before literal blocks, as the IDEs and ``help()`` show them. On the rendered API pages a role
  becomes its code text (``C`` for ``~a.b.C``, else the whole path) and a ``::`` a ``:``.
"""

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


ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const):<code>(~?)([\w.]+)(\(\))?</code>")


def _role(match: re.Match) -> str:
    path = match.group(2).lstrip(".")
    return f"<code>{path.rsplit('.', 1)[-1] if match.group(1) else path}{match.group(3) or ''}</code>"


def on_page_content(html: str, page: object, **_: object) -> str:
    if not getattr(page, "file", None) or not page.file.src_uri.startswith("reference/"):  # type: ignore[attr-defined]
        return html
    html = ROLE.sub(_role, html)
    html = html.replace("<p>::</p>", "")
    return html.replace("::</p>", ":</p>")


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARK.sub(lambda m: "```text\n" + _help(m.group(1)).rstrip() + "\n```", markdown)
