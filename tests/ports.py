"""Where the tests' ``torch.distributed`` workers meet: ``mp.spawn`` workers through a ``file://`` init
method (a ``FileStore`` in the test's own folder, which no other test's processes can take), and
``torchrun`` launches with ``--standalone`` (torchrun binds its own port). Ports picked and released
by a test could be taken by another process before the launcher bound them; no test does that now.
"""

from __future__ import annotations

from pathlib import Path


def store_init(folder: str | Path) -> str:
    """``file://<folder>/dist-store``, an init method for ``init_process_group`` (the file must not exist
    yet: one per launch, in a fresh folder)."""
    path = Path(folder).resolve() / "dist-store"
    if path.exists():
        raise FileExistsError(f"{path}: a file store is for one launch; give a fresh folder")
    return path.as_uri()
