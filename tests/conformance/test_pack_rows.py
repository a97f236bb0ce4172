"""``packed`` against TRL's ``pack_dataset(strategy="bfd")``: on the same lengths and capacity (TRL's
``seq_length``), our plan never has more rows than TRL's packing.

Cases ported from TRL ``tests/test_data_utils.py::TestPackDatasetBfd`` (``test_simple``: lengths 3, 4, 1
at 4 tokens make 2 rows, {4} and {3, 1}), plus random and real length distributions (GSM8K and LIMA
SmolLM2 lengths from ``../shared/data`` where present).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")
from trl.data_utils import pack_dataset  # noqa: E402

from smart_batching.planners import plan_batches  # noqa: E402

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def trl_rows(lengths, capacity: int) -> list[list[int]]:
    """TRL's packed rows as lists of example indices (each example's tokens are its index)."""
    ds = datasets.Dataset.from_dict({"input_ids": [[i] * int(n) for i, n in enumerate(lengths)]})
    packed = pack_dataset(ds, capacity, strategy="bfd")
    rows = []
    for ids, seqs in zip(packed["input_ids"], packed["seq_lengths"], strict=True):
        starts = np.cumsum([0, *seqs[:-1]])
        rows.append([ids[s] for s in starts])
    return rows


def our_rows(lengths, capacity: int) -> list[list[int]]:
    # The tightest packing (`auto`); the default, rows of mixed lengths, may take more rows where few
    # examples share one (tests/test_packed_spread.py).
    plan = plan_batches(np.asarray(lengths), "packed", capacity=capacity, seed=0, algorithm="auto")
    off = plan.row_offsets
    return [plan.example_ids[off[r] : off[r + 1]].tolist() for r in range(off.shape[0] - 1)]


def test_ported_simple_case():
    assert sorted(map(sorted, trl_rows([3, 4, 1], 4))) == [[0, 2], [1]], "TRL's bfd packing moved"
    assert sorted(map(sorted, our_rows([3, 4, 1], 4))) == [[0, 2], [1]]


def _shared_lengths(name: str) -> np.ndarray | None:
    """Approximate token lengths (4 characters a token) of the first 2,000 records of a shared set."""
    path = SHARED / name / ("train.jsonl" if name == "gsm8k" else "lima.json")
    if not path.is_file():
        return None
    if path.suffix == ".jsonl":
        with open(path) as f:
            records = [json.loads(line) for _, line in zip(range(2000), f, strict=False)]
    else:
        records = json.loads(path.read_text())[:2000]
    return np.array([max(1, len(json.dumps(r)) // 4) for r in records])


@pytest.mark.parametrize("case", ["uniform", "lognormal", "many-short", "gsm8k", "lima"])
@pytest.mark.parametrize("capacity", [256, 1024])
def test_never_more_rows_than_trl_bfd(case, capacity):
    rng = np.random.default_rng(0)
    if case == "uniform":
        lengths = rng.integers(1, capacity, size=800)
    elif case == "lognormal":
        lengths = np.clip(rng.lognormal(4.5, 0.9, size=800).astype(int), 1, capacity)
    elif case == "many-short":
        lengths = rng.integers(1, 12, size=3000)
    else:
        lengths = _shared_lengths(case)
        if lengths is None:
            pytest.skip(f"../shared/data/{case} not present")
        lengths = np.minimum(lengths, capacity)
    theirs, mine = trl_rows(lengths, capacity), our_rows(lengths, capacity)
    assert sorted(i for r in theirs for i in r) == list(range(len(lengths))), "TRL's bfd packing moved"
    assert sorted(i for r in mine for i in r) == list(range(len(lengths)))
    assert len(mine) <= len(theirs), f"{len(mine)} rows against TRL's {len(theirs)}"
