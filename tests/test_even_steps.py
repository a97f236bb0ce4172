"""EvenSteps: per-rank batch streams advance in lockstep (real gloo processes), null batches train nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ports import store_init

from smart_batching.distributed.even_steps import EvenSteps, null_batch
from smart_batching.errors import ConfigError


def _batch(tag: int, rows: int = 2, width: int = 3) -> dict[str, torch.Tensor]:
    ids = torch.full((rows, width), tag)
    return {"input_ids": ids, "labels": ids.clone()}


def _tags(batches) -> list[int]:
    """The tag of a real batch, -1 for a null one."""
    out = []
    for b in batches:
        labels = b["labels"]
        out.append(-1 if bool((labels == -100).all()) else int(b["input_ids"][0, 0]))
    return out


def test_null_batch_masks_every_label_and_keeps_the_shape() -> None:
    b = _batch(7)
    b["shift_labels"] = b["labels"][:, 1:].clone()
    n = null_batch(b)
    assert (n["labels"] == -100).all() and (n["shift_labels"] == -100).all()
    assert n["input_ids"] is b["input_ids"] and n["labels"].shape == b["labels"].shape
    assert (b["labels"] == 7).all()  # the original is untouched
    with pytest.raises(ConfigError, match="labels"):
        null_batch({"input_ids": torch.ones(1, 2)})


def test_null_batch_gives_zero_loss_and_zero_gradient() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from smart_batching.loss import token_loss_sum

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            use_cache=False,
        )  # fmt: skip
    )
    batch = null_batch(_batch(5, rows=2, width=6))
    logits = model(input_ids=batch["input_ids"]).logits
    loss = token_loss_sum(logits, batch["labels"], shift_labels=True)
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_one_process_pads_to_a_multiple_only() -> None:
    batches = [_batch(t) for t in range(5)]
    even = EvenSteps(batches, multiple=3)
    assert _tags(even) == [0, 1, 2, 3, 4, -1]
    assert even.num_null_batches == 1
    assert _tags(EvenSteps(batches)) == [0, 1, 2, 3, 4]
    assert list(EvenSteps([], multiple=4)) == []  # an empty stream stays empty
    with pytest.raises(ConfigError, match="multiple="):
        EvenSteps(batches, multiple=0)


class _Epochs:
    def __init__(self) -> None:
        self.epoch = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter([])


def test_set_epoch_reaches_the_batches_or_their_dataset() -> None:
    direct = _Epochs()
    EvenSteps(direct).set_epoch(3)
    assert direct.epoch == 3
    loader = torch.utils.data.DataLoader(_EpochsDataset(), batch_size=None)
    EvenSteps(loader).set_epoch(2)
    assert loader.dataset.epoch == 2


class _EpochsDataset(torch.utils.data.IterableDataset):
    def __init__(self) -> None:
        self.epoch = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter([])


# Rank r's stream: rank 0 has 5 batches, rank 1 has 2, rank 2 (of 3) has none.
COUNTS = {0: 5, 1: 2, 2: 0}


def _rank_main(rank: int, world_size: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        mine = [_batch(10 * rank + i) for i in range(COUNTS[rank])]
        report: dict = {}
        for multiple in (1, 4):
            even = EvenSteps(mine, multiple=multiple)
            try:
                report[str(multiple)] = {"tags": _tags(even), "nulls": even.num_null_batches}
            except ConfigError as e:
                report[str(multiple)] = {"error": str(e)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, world_size: int) -> list[dict]:
    mp.spawn(_rank_main, args=(world_size, store_init(tmp_path), str(tmp_path)), nprocs=world_size, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_two_ranks_step_in_lockstep(tmp_path: Path) -> None:
    reports = _run(tmp_path, 2)
    # Same count on both ranks; every real batch once and in order; the short rank pads with nulls.
    assert reports[0]["1"] == {"tags": [0, 1, 2, 3, 4], "nulls": 0}
    assert reports[1]["1"] == {"tags": [10, 11, -1, -1, -1], "nulls": 3}
    # Padded to a multiple of 4 on both ranks (the last accumulation step is complete).
    assert reports[0]["4"]["tags"] == [0, 1, 2, 3, 4, -1, -1, -1]
    assert reports[1]["4"]["tags"] == [10, 11, -1, -1, -1, -1, -1, -1]


def test_a_rank_with_no_data_is_reported(tmp_path: Path) -> None:
    reports = _run(tmp_path, 3)
    # Every rank raises together (no rank is left waiting in a collective), naming the cause.
    for report in reports:
        assert "1 of the 3 processes got no example" in report["1"]["error"]
        assert "fewer examples" in report["4"]["error"]
