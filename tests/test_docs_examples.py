"""Every Python block of the documentation runs (docs/**/*.md and the README).

A page's ```python blocks run top to bottom in one namespace, in a fresh working directory, the way a
reader pastes them. A block right after an HTML comment ``<!-- requires: WHAT -->`` (``gpu``,
``several-processes``, ``vllm``) is not run: the page says so in a note above it, which
``test_marked_blocks_say_so_on_the_page`` checks.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
REQUIRES = re.compile(r"<!-- requires: ([a-z-]+) -->")
MARKERS = {"gpu": "GPU", "several-processes": "several processes", "vllm": "vLLM"}


def blocks(page: Path) -> list[tuple[str | None, str, str]]:
    """``(requirement or None, code, text before the block)`` for each python block of ``page``."""
    text = page.read_text()
    out, last = [], 0
    for match in FENCE.finditer(text):
        before = text[last : match.start()]
        marks = REQUIRES.findall(before)
        out.append((marks[-1] if marks else None, match.group(1), before))
        last = match.end()
    return out


PAGES = [ROOT / "README.md"] + sorted(
    p for p in DOCS.rglob("*.md") if any(req is None for req, _, _ in blocks(p))
)


def test_the_docs_have_runnable_blocks():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    expected = {"README.md", "docs/index.md", "docs/getting-started.md", "docs/guides/hf-trainer.md"}
    assert expected | {"docs/guides/trl-sft.md", "docs/guides/trl-dpo.md", "docs/guides/trl-grpo.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run(page, tmp_path, monkeypatch, one_thread):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # upstream deprecations are not what a page is about
        for i, (req, code, _) in enumerate(blocks(page)):
            if req is None:
                exec(compile(code, f"{page.relative_to(ROOT)} block {i + 1}", "exec"), namespace)


def test_marked_blocks_say_so_on_the_page():
    marked = [(p, req, before) for p in DOCS.rglob("*.md") for req, _, before in blocks(p) if req]
    assert marked, "no marked block found: the marker's pattern no longer matches"
    for page, req, before in marked:
        assert req in MARKERS, f"{page}: unknown marker {req!r}; known: {sorted(MARKERS)}"
        note = before[before.rindex(f"<!-- requires: {req} -->") :]
        assert f'!!! note "Needs {MARKERS[req]}"' in note, f"{page}: a {req} block without its visible note"
