"""Collator layouts on literal inputs (golden tables), label boundaries and prompt masking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from smart_batching.collate import PackingCollator, PaddingCollator
from smart_batching.errors import ConfigError, DataError

M = -100  # label_pad_token_id


def _lists(batch):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


FEATURES = [
    {"input_ids": [11, 12, 13]},
    {"input_ids": [21, 22]},
    {"input_ids": [31, 32, 33, 34]},
]


# ------------------------------------------------------------------------------------------------
# PaddingCollator
# ------------------------------------------------------------------------------------------------


def test_padding_right_golden():
    out = _lists(PaddingCollator(0, return_position_ids=True)(FEATURES))
    assert out == {
        "input_ids": [[11, 12, 13, 0], [21, 22, 0, 0], [31, 32, 33, 34]],
        "attention_mask": [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]],
        "labels": [[11, 12, 13, M], [21, 22, M, M], [31, 32, 33, 34]],
        "position_ids": [[0, 1, 2, 0], [0, 1, 0, 0], [0, 1, 2, 3]],
    }


def test_padding_left_golden():
    out = _lists(PaddingCollator(9, padding_side="left", return_position_ids=True)(FEATURES))
    assert out == {
        "input_ids": [[9, 11, 12, 13], [9, 9, 21, 22], [31, 32, 33, 34]],
        "attention_mask": [[0, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]],
        "labels": [[M, 11, 12, 13], [M, M, 21, 22], [31, 32, 33, 34]],
        "position_ids": [[0, 0, 1, 2], [0, 0, 0, 1], [0, 1, 2, 3]],
    }


def test_padding_dtypes_and_keys():
    out = PaddingCollator(0)(FEATURES)
    assert list(out) == ["input_ids", "attention_mask", "labels"]
    assert all(v.dtype == torch.int64 for v in out.values())


@pytest.mark.parametrize(("multiple", "width"), [(None, 4), (1, 4), (4, 4), (8, 8), (3, 6)])
def test_pad_to_multiple_of(multiple, width):
    out = PaddingCollator(0, pad_to_multiple_of=multiple)(FEATURES)
    assert out["input_ids"].shape == (3, width)
    assert out["attention_mask"].sum().item() == 9
    assert (out["labels"][out["attention_mask"] == 0] == M).all()


def test_padding_prompt_masking_and_explicit_labels():
    features = [
        {"input_ids": [1, 2, 3, 4], "prompt_length": 2},
        {"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]},
        {"input_ids": [8, 9], "labels": [80, 90]},
    ]
    out = _lists(PaddingCollator(0, label_pad_token_id=-1)(features))
    assert out["labels"] == [[-1, -1, 3, 4], [-1, 6, 7, -1], [80, 90, -1, -1]]


def test_padding_truncation_to_max_length():
    out = _lists(PaddingCollator(0, max_length=2)(FEATURES))
    assert out["input_ids"] == [[11, 12], [21, 22], [31, 32]]
    assert out["attention_mask"] == [[1, 1], [1, 1], [1, 1]]


def test_padding_accepts_arrays_and_tensors():
    features = [{"input_ids": np.array([1, 2])}, {"input_ids": torch.tensor([3])}]
    assert _lists(PaddingCollator(0)(features))["input_ids"] == [[1, 2], [3, 0]]


def test_padding_token_type_ids_are_carried():
    features = [
        {"input_ids": [1, 2, 3], "token_type_ids": [0, 1, 1]},
        {"input_ids": [4], "token_type_ids": [1]},
    ]
    out = _lists(PaddingCollator(0)(features))
    assert out["token_type_ids"] == [[0, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"padding_side": "middle"}, "padding_side"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
        ({"max_length": 0}, "max_length"),
    ],
)
def test_padding_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        PaddingCollator(0, **kwargs)


def test_data_errors():
    with pytest.raises(DataError, match="empty"):
        PaddingCollator(0)([])
    with pytest.raises(DataError, match="input_ids"):
        PaddingCollator(0)([{"labels": [1]}])
    with pytest.raises(DataError, match="labels"):
        PaddingCollator(0)([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(DataError, match="same keys"):
        PaddingCollator(0)([{"input_ids": [1]}, {"input_ids": [2], "token_type_ids": [0]}])


# ------------------------------------------------------------------------------------------------
# PackingCollator
# ------------------------------------------------------------------------------------------------


def test_packing_golden():
    out = PackingCollator()(FEATURES)
    assert out["cu_seq_lens_q"].dtype == torch.int32 and out["seq_idx"].dtype == torch.int32
    assert out["cu_seq_lens_q"] is out["cu_seq_lens_k"]
    assert _lists(out) == {
        "input_ids": [[11, 12, 13, 21, 22, 31, 32, 33, 34]],
        "labels": [[M, 12, 13, M, 22, M, 32, 33, 34]],
        "position_ids": [[0, 1, 2, 0, 1, 0, 1, 2, 3]],
        "cu_seq_lens_q": [0, 3, 5, 9],
        "cu_seq_lens_k": [0, 3, 5, 9],
        "max_length_q": 4,
        "max_length_k": 4,
        "seq_idx": [[0, 0, 0, 1, 1, 2, 2, 2, 2]],
    }
    assert "attention_mask" not in out


def test_packing_options_drop_keys():
    out = PackingCollator(return_flash_kwargs=False, return_seq_idx=False)(FEATURES)
    assert list(out) == ["input_ids", "labels", "position_ids"]


def test_packing_label_boundaries_with_prompt_masking():
    features = [
        {"input_ids": [1, 2, 3, 4], "prompt_length": 2},
        {"input_ids": [5, 6, 7], "completion_mask": [0, 0, 1]},
        {"input_ids": [8, 9], "labels": [80, 90]},
    ]
    out = _lists(PackingCollator()(features))
    assert out["labels"] == [[M, M, 3, 4, M, M, 7, M, 90]]


def test_packing_segments_slice_examples():
    features = [
        {"input_ids": [1, 2, 3, 4, 5, 6], "prompt_length": 3, "segment_start": 2, "segment_length": 3},
        {"input_ids": [7, 8, 9], "segment_start": 1},
        {"input_ids": [10, 11, 12, 13], "segment_length": 2},
    ]
    out = _lists(PackingCollator()(features))
    assert out["input_ids"] == [[3, 4, 5, 8, 9, 10, 11]]
    # prompt_length 3 shifted by the slice start 2: one prompt token (3) left, and it starts the segment
    assert out["labels"] == [[M, 4, 5, M, 9, M, 11]]
    assert out["position_ids"] == [[0, 1, 2, 0, 1, 0, 1]]
    assert out["cu_seq_lens_q"] == [0, 3, 5, 7]
    with pytest.raises(DataError, match="segment_start"):
        PackingCollator()([{"input_ids": [1, 2], "segment_start": 1, "segment_length": 5}])


def test_packing_truncation_and_empty_examples():
    out = _lists(PackingCollator(max_length=2)(FEATURES))
    assert out["input_ids"] == [[11, 12, 21, 22, 31, 32]]
    assert out["cu_seq_lens_q"] == [0, 2, 4, 6]
    with pytest.raises(DataError, match="feature 1 has no tokens"):
        PackingCollator()([{"input_ids": [1]}, {"input_ids": []}])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=12))
def test_packing_invariants(lengths):
    features = [{"input_ids": list(range(100 * i, 100 * i + n))} for i, n in enumerate(lengths)]
    out = PackingCollator()(features)
    total = sum(lengths)
    cu = out["cu_seq_lens_q"].tolist()
    assert out["input_ids"].shape == (1, total)
    assert cu == [0, *np.cumsum(lengths).tolist()]
    assert out["max_length_q"] == max(lengths)
    pos = out["position_ids"][0]
    starts = cu[:-1]
    assert (pos[starts] == 0).all() and (out["labels"][0, starts] == M).all()
    # every non-start label is the token itself (causal LM targets before the model's shift)
    not_start = torch.ones(total, dtype=torch.bool)
    not_start[starts] = False
    assert torch.equal(out["labels"][0, not_start], out["input_ids"][0, not_start])
    assert torch.equal(
        out["seq_idx"][0].long(), torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    )


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=10),
    st.sampled_from(["right", "left"]),
    st.sampled_from([None, 8]),
)
def test_padding_invariants(lengths, side, multiple):
    features = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    out = PaddingCollator(0, padding_side=side, pad_to_multiple_of=multiple, return_position_ids=True)(
        features
    )
    mask = out["attention_mask"]
    assert mask.sum(1).tolist() == lengths
    width = mask.shape[1]
    assert width >= max(lengths) and (multiple is None or width % multiple == 0)
    for row, n in enumerate(lengths):
        real = out["input_ids"][row][mask[row].bool()].tolist()
        assert real == list(range(1, n + 1))
        assert out["position_ids"][row][mask[row].bool()].tolist() == list(range(n))
    assert (out["labels"][mask == 0] == M).all()
