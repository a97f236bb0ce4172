"""A batch schedule under FSDP2 (``fully_shard``) on 2 real processes (gloo, CPU): every rank runs its
share of each step of the ramp (as many micro-batches as the other rank, gradients reduce-scattered
once per step), and after a few SGD steps the parameters equal one process trained on the same steps.

The Trainer cannot run FSDP on CPU (accelerate enables it on GPU-like devices only), so this drives
``fully_shard`` directly, as tests/test_fsdp.py does for fixed steps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from ports import store_init

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from test_fsdp import LENGTHS, LR, _collate, _loss_sum, _tiny_model  # noqa: E402

from smart_batching.adaptive.sampler import StepBatchSampler  # noqa: E402
from smart_batching.distributed import World, shutdown  # noqa: E402
from smart_batching.loss import count_target_tokens  # noqa: E402
from smart_batching.sampler import SmartBatchSampler  # noqa: E402

NUM_STEPS = 5
SCHEDULE = "linear:150->900@3000"  # tokens per step, all ranks


def _steps(world: World) -> list[list[list[int]]]:
    inner = SmartBatchSampler(LENGTHS, "token_budget", max_tokens=160, seed=4)
    return list(StepBatchSampler(inner, SCHEDULE, world=world))[:NUM_STEPS]


def _worker(rank: int, world_size: int, init: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    steps = _steps(World.detect())
    model = _tiny_model(False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in steps:
        batches = [_collate("token_budget", ids) for ids in step]
        global_tokens = count_target_tokens([b["labels"] for b in batches]).to(torch.float64)
        dist.all_reduce(global_tokens)
        for j, batch in enumerate(batches):
            model.set_requires_gradient_sync(j == len(batches) - 1)
            (_loss_sum(model, batch) * world_size / global_tokens.float()).backward()
        opt.step()
        opt.zero_grad()
    params = {n: p.full_tensor().detach().numpy().ravel().tolist() for n, p in model.named_parameters()}
    del model, opt
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, {"steps": steps, "params": params})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    shutdown()


@pytest.mark.slow
def test_schedule_under_fsdp2_matches_one_process(tmp_path: Path) -> None:
    init = store_init(tmp_path)
    out = tmp_path / "fsdp.json"
    mp.spawn(_worker, args=(2, init, str(out)), nprocs=2, join=True)
    reports = json.loads(out.read_text())
    steps = [r["steps"] for r in reports]
    assert [len(s) for s in steps[0]] == [len(s) for s in steps[1]]  # as many micro-batches per step
    sizes = [sum(int(LENGTHS[i]) for mb in s for i in mb) for s in steps[0]]
    assert sizes[0] < sizes[-1]  # the ramp
    model = _tiny_model(False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(NUM_STEPS):
        batches = [_collate("token_budget", ids) for rank in steps for ids in rank[s]]
        loss = torch.stack([_loss_sum(model, b) for b in batches]).sum()
        (loss / count_target_tokens([b["labels"] for b in batches])).backward()
        opt.step()
        opt.zero_grad()
    for name, p in model.named_parameters():
        got = np.asarray(reports[0]["params"][name])
        np.testing.assert_allclose(got, p.detach().numpy().ravel(), rtol=1e-4, atol=2e-6, err_msg=name)
        np.testing.assert_array_equal(got, np.asarray(reports[1]["params"][name]))
