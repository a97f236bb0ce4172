"""Planning units (smart_batching.units): empty and fully masked examples left out before planning,
packed rows split into their documents; the collators' reading of labels, masks and packed rows; the
samplers' keys through the units."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from strategy_cases import cases

import smart_batching
from smart_batching.collate import PackingCollator, PaddingCollator
from smart_batching.errors import ConfigError, DataError
from smart_batching.plan import Segment
from smart_batching.sampler import SmartBatchSampler
from smart_batching.units import EmptyExamplesWarning, plan_units

# Every registered strategy, with the first option set its spec gives for units of at most 12 tokens.
STRATEGIES = cases(12, first_only=True)


# -- plan_units ---------------------------------------------------------------------------------------


def test_rows_are_units_when_nothing_is_skipped_or_split():
    units = plan_units([5, 4, 3])
    assert units.identity and not units.splits_rows and units.skipped.num_skipped == 0
    assert units.lengths.tolist() == [5, 4, 3]


def test_documents_of_packed_rows_become_units():
    #   row 0: a a a b b      seq_lengths [3, 2]
    #   row 1: c c c c        seq_lengths [4]
    #   row 2: d e e          seq_lengths [1, 2]
    units = plan_units([5, 4, 3], documents=(np.array([3, 2, 4, 1, 2]), np.array([2, 1, 2])))
    assert units.lengths.tolist() == [3, 2, 4, 1, 2]
    assert units.example.tolist() == [0, 0, 1, 2, 2]
    assert units.start.tolist() == [0, 3, 0, 0, 1]
    keys = units.keys(np.array([4, 1]), np.array([0, 0]), np.array([2, 2]), segments=False)
    assert keys == [Segment(2, 1, 2), Segment(0, 3, 2)]


def test_documents_must_cover_their_rows():
    with pytest.raises(ConfigError, match="row 1 has 4 tokens but its seq_lengths add up to 3"):
        plan_units([5, 4], documents=(np.array([3, 2, 3]), np.array([2, 1])))
    with pytest.raises(ConfigError, match="do not match the dataset"):
        plan_units([5, 4], documents=(np.array([5, 4]), np.array([1, 2])))


def test_empty_and_masked_are_skipped_counted_and_named_once():
    masked = np.array([False, False, True, False, False, True])
    with pytest.warns(EmptyExamplesWarning) as caught:
        units = plan_units([4, 0, 6, 2, 0, 3], masked=masked)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "2 empty example(s)" in message and "2 fully masked example(s)" in message
    assert "dataset rows 1, 2, 4, 5" in message and "empty_examples='error'" in message
    assert units.example.tolist() == [0, 3]
    assert units.lengths.tolist() == [4, 2]
    assert (units.skipped.num_empty, units.skipped.num_masked) == (2, 2)
    assert units.skipped.first_rows == (1, 2, 4, 5)


def test_empty_examples_error_names_the_rows_and_the_setting():
    with pytest.raises(DataError, match=r"1 empty example\(s\).*dataset rows 2.*empty_examples='skip'"):
        plan_units([3, 4, 0], empty_examples="error")
    with pytest.raises(ConfigError, match="empty_examples='drop' must be one of skip, error"):
        plan_units([3], empty_examples="drop")


def test_a_packed_row_without_documents_counts_as_empty():
    with pytest.warns(EmptyExamplesWarning, match="1 empty"):
        units = plan_units([3, 0], documents=(np.array([3]), np.array([1, 0])))
    assert units.skipped.first_rows == (1,)


# -- samplers through the units -------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "options"), STRATEGIES)
def test_sampler_skips_empty_examples_and_uses_every_other_once(name, options):
    lengths = np.array([5, 0, 7, 3, 0, 8, 2, 6, 1, 0, 4])
    with pytest.warns(EmptyExamplesWarning, match="3 empty"):
        sampler = SmartBatchSampler(lengths, name, seed=3, **options)
    for _ in range(2):  # two epochs
        keys = [k for batch in sampler for k in batch]
        assert sorted(keys) == [i for i in range(lengths.size) if lengths[i] > 0]
    assert sampler.units.skipped.num_empty == 3


@pytest.mark.parametrize(("name", "options"), STRATEGIES)
def test_sampler_plans_documents_of_packed_rows(name, options):
    rng = np.random.default_rng(0)
    docs_per_row = rng.integers(1, 4, size=20)
    doc_lengths = rng.integers(1, 8, size=int(docs_per_row.sum()))
    rows = np.repeat(np.arange(20), docs_per_row)
    row_lengths = np.bincount(rows, weights=doc_lengths).astype(np.int64)
    units = plan_units(row_lengths, documents=(doc_lengths, docs_per_row))
    sampler = SmartBatchSampler(row_lengths, name, seed=1, units=units, **options)
    assert sampler.yields_segments
    keys = [k for batch in sampler for k in batch]
    # Every document exactly once, as its own window of its row.
    got = sorted((k.example, k.start, k.length) for k in keys)
    starts = np.concatenate([np.cumsum(doc_lengths[rows == r]) - doc_lengths[rows == r] for r in range(20)])
    assert got == sorted(zip(rows.tolist(), starts.tolist(), doc_lengths.tolist(), strict=True))


# -- collators --------------------------------------------------------------------------------------------


def test_labels_column_is_used_as_is_over_masks():
    """HF and TRL use a labels column as given; a leftover completion_mask must not drop the prompt."""
    batch = PaddingCollator(0)(
        [
            {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "completion_mask": [0, 0, 1]},
            {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "assistant_masks": [0, 1, 1], "prompt_length": 2},
        ]
    )
    assert batch["labels"].tolist() == [[5, 6, 7], [5, 6, 7]]


def test_masks_apply_without_labels():
    batch = PaddingCollator(0)(
        [
            {"input_ids": [5, 6, 7], "completion_mask": [0, 0, 1]},
            {"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 1]},
        ]
    )
    assert batch["labels"].tolist() == [[-100, -100, 7], [-100, 6, 7]]


@pytest.mark.parametrize("column", ["seq_lengths", "position_ids"])
def test_packing_collator_keeps_the_documents_of_a_packed_row_apart(column):
    row = {"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]}
    row[column] = [3, 2] if column == "seq_lengths" else [0, 1, 2, 0, 1]
    batch = PackingCollator()([row, {"input_ids": [7, 8], "labels": [7, 8], column: _one(column, 2)}])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 7]
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, 5, -100, 8]]
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert batch["max_length_q"] == 3


def _one(column: str, n: int) -> list[int]:
    return [n] if column == "seq_lengths" else list(range(n))


def test_padding_collator_refuses_a_row_of_several_documents():
    with pytest.raises(DataError, match="packed row of 2 documents.*attend to each other"):
        PaddingCollator(0)([{"input_ids": [1, 2, 3], "seq_lengths": [1, 2]}])


def test_a_window_is_one_document_and_may_not_cross_a_boundary():
    row = {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}
    batch = PaddingCollator(0)([{**row, "segment_start": 3, "segment_length": 2}])
    assert batch["input_ids"].tolist() == [[4, 5]]
    with pytest.raises(DataError, match="crosses a document boundary"):
        PackingCollator()([{**row, "segment_start": 2, "segment_length": 2}])


def test_seq_lengths_must_add_up():
    with pytest.raises(DataError, match="do not add up"):
        PackingCollator()([{"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}])


# -- datasets.Dataset columns (Arrow, vectorised) -----------------------------------------------------------


def test_dataset_units_reads_documents_and_targets_from_arrow():
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    from smart_batching.hf.data import dataset_lengths, dataset_units

    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3, 4, 5], [6, 7], [], [8, 9, 10]],
            "labels": [[-100, 2, -100, -100, -100], [-100, -100], [], [8, 9, 10]],
            "seq_lengths": [[3, 2], [2], [], [1, 2]],
        }
    )
    with pytest.warns(EmptyExamplesWarning) as caught:
        units = dataset_units(ds, dataset_lengths(ds))
    # Documents: (0: [0,3) target 2) (0: [3,5) none) (1: [0,2) none) (3: [0,1) its first token only: none,
    # the collator masks a document's first label) (3: [1,3)); row 2 empty.
    assert units.example.tolist() == [0, 3]
    assert units.start.tolist() == [0, 1]
    assert (units.skipped.num_empty, units.skipped.num_masked) == (1, 3)
    assert "dataset rows 0, 1, 2, 3" in str(caught[0].message)
    # A shuffled view (indices mapping) reads the same rows in its own order.
    view = ds.select([3, 0])
    with pytest.warns(EmptyExamplesWarning, match="2 fully masked example.*rows 0, 1"):
        units = dataset_units(view, dataset_lengths(view))
    assert units.example.tolist() == [0, 1] and units.lengths.tolist() == [2, 3]


def test_dataset_units_from_position_ids_and_prompt_length():
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    from smart_batching.hf.data import dataset_lengths, dataset_units

    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2, 3, 4], [5, 6]], "position_ids": [[0, 1, 0, 1], [0, 1]]}
    )
    units = dataset_units(ds, dataset_lengths(ds))
    assert units.lengths.tolist() == [2, 2, 2] and units.start.tolist() == [0, 2, 0]
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]], "prompt_length": [1, 2]})
    with pytest.warns(EmptyExamplesWarning, match="1 fully masked"):
        units = dataset_units(ds, dataset_lengths(ds))
    assert units.example.tolist() == [0]


# -- one rule for the target tokens, wherever they are read ---------------------------------------------------


def _examples() -> list[dict]:
    """Examples covering every column the rule reads, and its edges (a target on the first token only,
    masks and a prompt that disagree, label lists of another length: a seq2seq set)."""
    return [
        {"input_ids": [1, 2, 3], "labels": [1, -100, -100]},  # its first token only: no target
        {"input_ids": [1, 2, 3], "labels": [-100, -100, 3]},
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 0], "prompt_length": 3},  # disagree: none
        {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 1, 1, 1], "prompt_length": 3},
        {"input_ids": [1, 2, 3], "assistant_masks": [1, 0, 0]},  # first token only
        {"input_ids": [1, 2, 3], "assistant_masks": [0, 1, 0], "completion_mask": [1, 1, 0]},
        {"input_ids": [1, 2], "prompt_length": 1},
        {"input_ids": [1, 2], "prompt_length": 2},
    ]


def _column(example: dict, column: str) -> object:
    """``example``'s value of ``column``, or one that marks nothing (a mask of ones, no prompt)."""
    if column in example:
        return example[column]
    return [1] * len(example["input_ids"]) if column.endswith("mask") or column.endswith("masks") else 0


def _collated_targets(example: dict) -> int:
    """What the collator trains: labels other than -100 after the shift (its first label never counts)."""
    labels = PaddingCollator(0)([example])["labels"][0].tolist()
    return sum(label != -100 for label in labels[1:])


def test_no_target_token_follows_what_the_collator_trains():
    from smart_batching.units import no_target_token

    examples = _examples()
    assert [no_target_token(ex) for ex in examples] == [_collated_targets(ex) == 0 for ex in examples]
    assert [no_target_token(ex) for ex in examples] == [True, False, True, False, True, False, False, True]
    # Scalar labels (classification), a seq2seq set's labels, no target column: never "no target".
    assert not no_target_token({"input_ids": [1, 2], "labels": 1})
    assert not no_target_token({"input_ids": [1, 2, 3], "labels": [-100, 7]})
    assert not no_target_token({"input_ids": [1]})


def test_every_reader_of_the_target_columns_counts_the_same():
    """The planner's skip (dataset_units), the loss normalisation's and the bench's counts
    (target_token_counts, dataset_target_counts) and the streaming batcher's per-example check
    (no_target_token) read one rule; the collator trains it."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    from smart_batching.data.lengths import dataset_target_counts, dataset_target_tokens
    from smart_batching.hf.data import dataset_lengths, dataset_units
    from smart_batching.hf.step_weight import target_token_counts
    from smart_batching.units import no_target_token

    for keep in (
        [0, 1],  # labels
        [2, 3, 4, 5, 6, 7],  # masks and prompts
    ):
        examples = [_examples()[i] for i in keep]
        columns = sorted({k for ex in examples for k in ex})
        ds = datasets.Dataset.from_dict({c: [_column(ex, c) for ex in examples] for c in columns})
        rows = [ds[i] for i in range(len(ds))]
        trained = [_collated_targets(r) for r in rows]
        lengths = dataset_lengths(ds)
        assert target_token_counts(ds, lengths).tolist() == trained
        assert dataset_target_counts(ds, lengths).tolist() == trained
        assert [no_target_token(r) for r in rows] == [t == 0 for t in trained]
        with pytest.warns(EmptyExamplesWarning, match=f"{trained.count(0)} fully masked"):
            units = dataset_units(ds, lengths)
        assert units.example.tolist() == [i for i, t in enumerate(trained) if t]
        assert dataset_target_tokens(ds, lengths) is not None


def test_the_ignore_index_has_one_home():
    """``-100`` is written once, in ``smart_batching.units``; every other module imports it (a second literal
    could drift from it unseen). Found by walking each module's syntax tree, docstrings and comments aside."""
    root = Path(smart_batching.__file__).parent
    literals = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.UnaryOp)
                and isinstance(node.op, ast.USub)
                and isinstance(node.operand, ast.Constant)
                and node.operand.value == 100
            ):
                literals.append(f"{path.relative_to(root)}:{node.lineno}")
    assert literals == ["units.py:" + str(_ignore_index_line(root / "units.py"))], literals


def _ignore_index_line(path: Path) -> int:
    return next(
        i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith("IGNORE_INDEX = -100")
    )
