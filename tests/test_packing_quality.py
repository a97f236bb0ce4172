"""Packing quality on real data: rows ≤ 1.005 × the lower bound on every shared dataset."""

from __future__ import annotations

from pathlib import Path

import pytest

import smart_batching as sb

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DATASETS = {
    "gsm8k": "gsm8k/train.jsonl",
    "lima": "lima/lima.json",
    "sgd_dialogues": "sgd_dialogues/train.jsonl.gz",
    "sst2": "sst2/train.tsv",
}


@pytest.mark.skipif(not DATA.exists(), reason="shared data folder absent")
@pytest.mark.parametrize("name", list(DATASETS))
def test_packed_rows_near_lower_bound(name: str) -> None:
    from smart_batching.data.lengths import compute_lengths

    lengths = compute_lengths(str(DATA / DATASETS[name]), tokenizer="smollm2", progress=False)
    for capacity in (1024, 2048, 4096):
        plan = sb.plan_batches(lengths, "packed", capacity=capacity, overlong="split")
        s = plan.stats()
        assert s.real_tokens == int(lengths.sum())  # split loses no token
        assert s.num_rows <= 1.005 * s.lower_bound_rows, (name, capacity, s.num_rows, s.lower_bound_rows)
        bfd = sb.plan_batches(lengths, "packed", capacity=capacity, overlong="split", algorithm="bfd")
        assert s.num_rows <= bfd.stats().num_rows
