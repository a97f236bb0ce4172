"""``PackingCollator`` against transformers' ``DataCollatorWithFlattening`` and TRL's padding-free
``DataCollatorForLanguageModeling``: the same model inputs for the same features.

Cases ported from transformers ``tests/trainer/test_data_collator.py::test_data_collator_with_flattening``
(three features of 3, 6 and 7 tokens) and TRL's padding-free collator cases
(``tests/test_sft_trainer.py``, ``DataCollatorForLanguageModeling(padding_free=True)``, including rows
packed by ``pack_dataset`` that carry ``seq_lengths``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import DataCollatorWithFlattening  # noqa: E402

from smart_batching.collate import PackingCollator  # noqa: E402

FEATURES = [
    {"input_ids": [10, 11, 12]},
    {"input_ids": [20, 21, 22, 23, 24, 25]},
    {"input_ids": [30, 31, 32, 33, 34, 35, 36]},
]
WITH_LABELS = [
    {"input_ids": [10, 11, 12], "labels": [-100, 11, 12]},
    {"input_ids": [20, 21, 22, 23], "labels": [-100, -100, 22, 23]},
    {"input_ids": [30, 31], "labels": [30, 31]},
]


def ours(features):
    return PackingCollator(return_flash_kwargs=True, return_seq_idx=True)([dict(f) for f in features])


@pytest.mark.parametrize("features", [FEATURES, WITH_LABELS], ids=["input_ids", "labels"])
def test_equals_data_collator_with_flattening(features):
    theirs = DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_seq_idx=True, return_tensors="pt"
    )([dict(f) for f in features])
    mine = ours(features)
    for key in ("input_ids", "position_ids", "labels"):
        assert mine[key].tolist() == theirs[key].tolist(), f"DataCollatorWithFlattening's {key} moved"
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        assert mine[key].tolist() == theirs[key].tolist(), f"DataCollatorWithFlattening's {key} moved"
    for key in ("max_length_q", "max_length_k"):
        assert int(mine[key]) == int(theirs[key]), f"DataCollatorWithFlattening's {key} moved"
    assert mine["seq_idx"].tolist() == theirs["seq_idx"].tolist(), (
        "DataCollatorWithFlattening's seq_idx moved"
    )
    assert "attention_mask" not in theirs and "attention_mask" not in mine


def test_ported_flattening_case():
    """transformers test_data_collator_with_flattening's literal expectations, on ours."""
    batch = ours(FEATURES)
    assert batch["input_ids"].shape == (1, 16)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]


def trl_collator():
    pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, return_tensors="pt")


@pytest.mark.parametrize(
    "features",
    [
        FEATURES,
        WITH_LABELS,
        # Rows packed by TRL's pack_dataset (bfd): several documents per row, with seq_lengths.
        [
            {"input_ids": [4, 5, 6, 7], "labels": [4, 5, 6, 7], "seq_lengths": [4]},
            {"input_ids": [1, 2, 3, 8], "labels": [1, 2, 3, 8], "seq_lengths": [3, 1]},
        ],
    ],
    ids=["input_ids", "labels", "seq_lengths"],
)
def test_equals_trl_padding_free_collator(features):
    theirs = trl_collator()([dict(f) for f in features])
    mine = ours(features)
    for key in ("input_ids", "position_ids", "labels", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        assert mine[key].tolist() == theirs[key].tolist(), f"TRL's padding-free {key} moved"
    assert int(mine["max_length_q"]) == int(theirs["max_length_q"]), "TRL's padding-free max_length_q moved"
    # TRL's packed rows: our seq_lengths reading gives its document boundaries.
    assert mine["cu_seq_lens_q"].diff().tolist() == [
        n for f in features for n in f.get("seq_lengths", [len(f["input_ids"])])
    ]
