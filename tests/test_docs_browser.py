"""The built documentation site, rendered by headless Chromium: the landing page, a guide and an API
page show their titles, code blocks and plots.

Needs the site (``make docs`` builds it into out/site, then runs this file; ``SMART_BATCHING_SITE``
points elsewhere) and a ``chromium`` binary (Debian's ``chromium`` package; ``make docs`` installs it
where it runs as root with apt-get). Without either the tests skip and say which is missing.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("SMART_BATCHING_SITE", ROOT / "out" / "site"))
CHROMIUM = next(
    (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
)

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)"),
    pytest.mark.skipif(not (SITE / "index.html").exists(), reason=f"no built site in {SITE} (run make docs)"),
]


@pytest.fixture(scope="module")
def server():
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def chromium(tmp_path: Path, url: str, *args: str) -> str:
    """Run headless Chromium once on ``url`` with ``args`` (``--dump-dom``, ``--screenshot=...``)."""
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
        f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=3000", *args, url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def rendered(tmp_path, url):
    return chromium(tmp_path, url, "--dump-dom")


def test_landing_page_renders_title_code_and_plot(server, tmp_path):
    dom = rendered(tmp_path, server + "/")
    assert "<title>smart-batching</title>" in dom
    assert re.search(r"<h1[^>]*>smart-batching", dom)
    assert "plan_batches" in dom and "<pre" in dom  # the short example, highlighted
    assert 'src="accuracy_parity_causal.png"' in dom
    assert (SITE / "accuracy_parity_causal.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shot = tmp_path / "landing.png"
    chromium(tmp_path, server + "/", f"--screenshot={shot}", "--window-size=1280,1600")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def test_guide_renders_its_title_and_code_blocks(server, tmp_path):
    dom = rendered(tmp_path, server + "/guides/hf-trainer/")
    assert re.search(r"<h1[^>]*>The HF Trainer", dom)
    assert len(re.findall(r'<div class="highlight"', dom)) >= 3  # the page's code blocks, highlighted
    assert "SmartBatchingTrainer" in dom and "apply_smart_batching" in dom
    assert 'href="../../options/"' in dom  # the link to the option tables resolved


def test_api_page_renders_docstrings(server, tmp_path):
    dom = rendered(tmp_path, server + "/reference/hf/")
    assert re.search(r"<h1[^>]*>smart_batching.hf", dom)
    for name in ("SmartBatchingTrainer", "apply_smart_batching", "with_smart_batching"):
        assert f'id="smart_batching.hf.{name}"' in dom, name
    assert "doc-contents" in dom  # a docstring body, not just the headings
    assert ":class:" not in dom and ":func:" not in dom  # the docstrings' Sphinx roles shown as code
