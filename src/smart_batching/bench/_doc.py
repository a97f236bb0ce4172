"""A report document: one list of blocks, rendered to Markdown and to self-contained HTML."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------
# Document: one list of blocks, rendered to Markdown and to HTML
# --------------------------------------------------------------------------------------------------


class _Doc:
    def __init__(self) -> None:
        self.blocks: list[tuple[str, Any]] = []

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[str]], *, wrap: bool = False) -> None:
        """A table; ``wrap=True`` lets long cells (generated text) wrap in HTML, left-aligned."""
        self.blocks.append(("table", (headers, rows, wrap)))

    def img(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def pre(self, text: str) -> None:
        self.blocks.append(("pre", text))

    def markdown(self, base: Path) -> str:
        out = []
        for kind, value in self.blocks:
            if kind == "h":
                out.append(f"{'#' * value[0]} {value[1]}")
            elif kind == "p":
                out.append(value)
            elif kind == "ul":
                out.append("\n".join(f"- {item}" for item in value))
            elif kind == "table":
                headers, rows, _ = value
                esc = [[c.replace("|", "\\|").replace("\n", " ") for c in r] for r in [headers, *rows]]
                out.append("\n".join(["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(headers)]
                                     + ["| " + " | ".join(r) + " |" for r in esc[1:]]))  # fmt: skip
            elif kind == "img":
                out.append(f"![{value[1]}]({os.path.relpath(value[0], base)})")
            elif kind == "pre":
                out.append("```text\n" + value + "\n```")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body = []
        for kind, value in self.blocks:
            if kind == "h":
                body.append(f"<h{value[0]}>{_inline(value[1])}</h{value[0]}>")
            elif kind == "p":
                body.append(f"<p>{_inline(value)}</p>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in value) + "</ul>")
            elif kind == "table":
                headers, rows, wrap = value
                head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
                cells = "".join(
                    "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
                )
                css = " class='wrap'" if wrap else ""
                body.append(
                    f"<div class='scroll'><table{css}><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table></div>"
                )
            elif kind == "img":
                data = base64.b64encode(Path(value[0]).read_bytes()).decode("ascii")
                body.append(f"<img alt='{html.escape(value[1])}' src='data:image/png;base64,{data}'>")
            elif kind == "pre":
                body.append(f"<pre>{html.escape(value)}</pre>")
        return _HTML.format(title=html.escape(title), body="\n".join(body))


def _inline(text: str) -> str:
    """Markdown ``code`` and **bold** to HTML, everything else escaped."""
    import re

    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }}
th, td {{ border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }}
th {{ background: #f0f0f0; }} td:first-child, th:first-child {{ text-align: left; }}
table.wrap td {{ white-space: pre-wrap; text-align: left; }} .scroll {{ overflow-x: auto; }} img {{ max-width: 100%; margin: 0.5em 0; }}
pre {{ background: #f7f7f7; padding: 0.6em; white-space: pre-wrap; font-size: 0.85em; }}
code {{ background: #f3f3f3; padding: 0 3px; }}
</style></head><body>
{body}
</body></html>
"""
