"""Real multi-process torch.distributed (gloo on CPU): balanced sampler, DDP gradients, resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from strategy_cases import cases

from smart_batching.distributed import World, shutdown
from smart_batching.distributed.sampler import DistributedSmartBatchSampler
from smart_batching.errors import ConfigError

LENGTHS = np.random.default_rng(11).integers(4, 60, 203)
# Every registered strategy with the first option set its spec gives for these lengths.
STRATEGIES = [tuple(p.values) for p in cases(int(LENGTHS.max()), first_only=True)]


def _init(rank: int, world_size: int, store: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(cfg).float()


def _tokens(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(i))
    return torch.randint(1, 97, (int(LENGTHS[i]),), generator=g)


def _padded(ids: list[int]) -> dict[str, torch.Tensor]:
    seqs = [_tokens(i) for i in ids]
    width = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for r, s in enumerate(seqs):
        input_ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _token_loss_sum(model, batch) -> tuple[torch.Tensor, int]:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )
    return loss, int((labels != -100).sum())


def _worker(rank: int, world_size: int, store: str, out: str) -> None:
    _init(rank, world_size, store)
    world = World.detect()
    assert world == World(rank, world_size)
    report: dict = {"rank": rank}
    # 1. Every strategy: this rank's keys per micro-batch for two epochs, and a resume at every step.
    for name, options in STRATEGIES:
        sampler = DistributedSmartBatchSampler(LENGTHS, name, world=world, accum_steps=2, seed=3, **options)
        epochs = [list(sampler), list(sampler)]
        report[name] = epochs
        assert len(epochs[0]) == len(sampler.distributed_plan(0).rank_micro_batches(rank))
        first = epochs[0]
        for k in range(len(first) + 1):
            s = DistributedSmartBatchSampler(LENGTHS, name, world=world, accum_steps=2, seed=3, **options)
            it = iter(s)
            for _ in range(k):
                next(it)
            state = json.loads(json.dumps(s.state_dict()))
            resumed = DistributedSmartBatchSampler(
                LENGTHS, name, world=world, accum_steps=2, seed=3, **options
            )
            resumed.load_state_dict(state)
            assert list(resumed) == first[k:], (name, k)
    # 2. DDP gradients over the first optimizer step equal one process's over the same examples.
    sampler = DistributedSmartBatchSampler(
        LENGTHS, "random", world=world, accum_steps=2, seed=5, batch_size=4
    )
    micro = list(sampler)[:2]
    model = _tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    local_tokens = sum(_padded(m)["labels"][:, 1:].ne(-100).sum().item() for m in micro)
    global_tokens = torch.tensor(local_tokens)
    dist.all_reduce(global_tokens)
    for j, m in enumerate(micro):
        batch = _padded(m)
        # DDP averages gradients over ranks: scale so the average is Σ token loss / global tokens.
        if j < len(micro) - 1:
            with ddp.no_sync():
                loss_sum, _ = _token_loss_sum(ddp, batch)
                (loss_sum * world_size / global_tokens).backward()
        else:
            loss_sum, _ = _token_loss_sum(ddp, batch)
            (loss_sum * world_size / global_tokens).backward()
    report["step_examples"] = [i for m in micro for i in m]
    report["grads"] = {
        n: p.grad.detach().numpy().ravel()[:64].tolist()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    del ddp, model  # DDP's reducer goes before the process group (see distributed.shutdown)
    shutdown()


def _run(world_size: int, tmp_path: Path) -> list[dict]:
    store = tmp_path / "store"
    mp.spawn(_worker, args=(world_size, str(store), str(tmp_path)), nprocs=world_size, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_gloo_balanced_sampler_and_ddp(world_size: int, tmp_path: Path) -> None:
    reports = _run(world_size, tmp_path)
    for name, _ in STRATEGIES:
        for epoch in range(2):
            per_rank = [r[name][epoch] for r in reports]
            # Equal step counts on every rank: no collective can hang.
            assert len({len(x) for x in per_rank}) == 1
            seen = [i for batches in per_rank for b in batches for i in b]
            # Every example exactly once per epoch across ranks (nothing dropped or duplicated).
            assert sorted(seen) == list(range(len(LENGTHS))), name
        # Epochs differ.
        assert reports[0][name][0] != reports[0][name][1]
    # DDP gradients equal the single-process gradient over the union of the step's examples.
    examples = [i for r in reports for i in r["step_examples"]]
    model = _tiny_model()
    total = 0
    losses = []
    for r in reports:
        ids = r["step_examples"]
        for chunk in (ids[: len(ids) // 2], ids[len(ids) // 2 :]):
            if chunk:
                loss_sum, n = _token_loss_sum(model, _padded(chunk))
                losses.append(loss_sum)
                total += n
    (torch.stack(losses).sum() / total).backward()
    assert len(set(examples)) == len(examples)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        ref = p.grad.detach().numpy().ravel()[:64]
        for r in reports:
            np.testing.assert_allclose(r["grads"][name], ref, rtol=1e-4, atol=1e-6, err_msg=name)


def test_resume_on_another_world_size_is_refused_or_replanned() -> None:
    s2 = DistributedSmartBatchSampler(LENGTHS, "packed", world=World(0, 2), accum_steps=1, capacity=128)
    it = iter(s2)
    for _ in range(3):
        next(it)
    state = s2.state_dict()
    s4 = DistributedSmartBatchSampler(LENGTHS, "packed", world=World(0, 4), accum_steps=1, capacity=128)
    with pytest.raises(ConfigError, match="world_size=2"):
        s4.load_state_dict(state)
    # Replan: the 3 finished steps of both old ranks are left out; the new world covers the rest once.
    old = [DistributedSmartBatchSampler(LENGTHS, "packed", world=World(r, 2), capacity=128) for r in range(2)]
    consumed = {i for s in old for b in list(s)[:3] for i in b}
    rest = []
    for r in range(4):
        s = DistributedSmartBatchSampler(LENGTHS, "packed", world=World(r, 4), capacity=128)
        s.load_state_dict(state, replan=True)
        rest.append(list(s))
    assert len({len(x) for x in rest}) == 1  # equal step counts on the new world
    flat = sorted(i for x in rest for b in x for i in b)
    assert flat == sorted(set(range(len(LENGTHS))) - consumed)
