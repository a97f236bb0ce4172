"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on 2 real processes (gloo, CPU) with balanced batches.

Each rank trains a tiny Llama sharded with ``fully_shard`` on its share of a
:class:`~smart_batching.distributed.sampler.DistributedSmartBatchSampler` plan (2 accumulation
micro-batches per step, gradient sync on the last one only), with the loss normalised by the target
tokens of the whole step across ranks. After a few SGD steps the gathered parameters equal those of one
process that trains on the same examples with the same global-token normalisation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launched import run_launcher
from ports import store_init

from smart_batching.collate import PackingCollator, PaddingCollator
from smart_batching.distributed import World, shutdown
from smart_batching.distributed.sampler import DistributedSmartBatchSampler
from smart_batching.loss import count_target_tokens, token_loss_sum

LENGTHS = np.random.default_rng(21).integers(4, 60, 150)
VOCAB = 97
ACCUM = 2
NUM_STEPS = 3
LR = 0.5
CASES = [("packed", dict(capacity=128)), ("token_budget", dict(max_tokens=160))]


def _tiny_model(packed: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from smart_batching.attention import enable_packed_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).float()
    if packed:
        enable_packed_attention(model)  # packed examples never attend to each other
    return model


def _collate(strategy: str, ids: list[int]) -> dict[str, torch.Tensor]:
    features = []
    for i in ids:
        g = torch.Generator().manual_seed(int(i))
        features.append({"input_ids": torch.randint(1, VOCAB, (int(LENGTHS[i]),), generator=g).tolist()})
    collator = PackingCollator(return_seq_idx=False) if strategy == "packed" else PaddingCollator(0)
    return collator(features)


def _loss_sum(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return token_loss_sum(model(**inputs).logits, batch["labels"])


def _worker(rank: int, world_size: int, init: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    report: dict = {}
    for strategy, options in CASES:
        sampler = DistributedSmartBatchSampler(
            LENGTHS, strategy, world=World.detect(), accum_steps=ACCUM, seed=4, **options
        )
        micro = list(sampler)[: NUM_STEPS * ACCUM]
        model = _tiny_model(strategy == "packed")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for s in range(NUM_STEPS):
            batches = [_collate(strategy, ids) for ids in micro[s * ACCUM : (s + 1) * ACCUM]]
            # Target tokens of the whole step, every rank: the one denominator of every micro-batch.
            global_tokens = count_target_tokens([b["labels"] for b in batches]).to(torch.float64)
            dist.all_reduce(global_tokens)
            for j, batch in enumerate(batches):
                model.set_requires_gradient_sync(j == len(batches) - 1)  # reduce-scatter once per step
                # FSDP averages gradients over ranks: scale so the average is Σ token loss / global tokens.
                (_loss_sum(model, batch) * world_size / global_tokens.float()).backward()
            opt.step()
            opt.zero_grad()
        params = {n: p.full_tensor().detach().numpy().ravel().tolist() for n, p in model.named_parameters()}
        report[strategy] = {"micro": [[int(i) for i in b] for b in micro], "params": params}
        del model, opt  # the sharded model goes before the process group (gloo threads can abort at exit)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, report)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    shutdown()


def _reference(strategy: str, per_rank_micro: list[list[list[int]]]) -> dict[str, np.ndarray]:
    """One process, the same examples step by step, Σ token loss / the step's target tokens."""
    model = _tiny_model(strategy == "packed")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(NUM_STEPS):
        batches = [
            _collate(strategy, ids) for micro in per_rank_micro for ids in micro[s * ACCUM : (s + 1) * ACCUM]
        ]
        total = count_target_tokens([b["labels"] for b in batches])
        loss = torch.stack([_loss_sum(model, b) for b in batches]).sum() / total
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().numpy().ravel() for n, p in model.named_parameters()}


def test_fsdp2_matches_one_process(tmp_path: Path) -> None:
    init = store_init(tmp_path)
    out = tmp_path / "fsdp.json"
    mp.spawn(_worker, args=(2, init, str(out)), nprocs=2, join=True)
    reports = json.loads(out.read_text())
    for strategy, _ in CASES:
        per_rank = [r[strategy]["micro"] for r in reports]
        # Every rank ran NUM_STEPS * ACCUM micro-batches, none shared between ranks.
        assert all(len(m) == NUM_STEPS * ACCUM for m in per_rank)
        seen = [i for m in per_rank for b in m for i in b]
        assert len(seen) == len(set(seen)) > 0
        ref = _reference(strategy, per_rank)
        initial = {
            n: p.detach().numpy().ravel() for n, p in _tiny_model(strategy == "packed").named_parameters()
        }
        moved = 0.0
        for name, want in ref.items():
            got = np.asarray(reports[0][strategy]["params"][name])
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, err_msg=f"{strategy}: {name}")
            np.testing.assert_array_equal(got, np.asarray(reports[1][strategy]["params"][name]))
            moved = max(moved, float(np.abs(want - initial[name]).max()))
        assert moved > 1e-3, "the parameters did not move: the comparison would be vacuous"


def _trainer_run(tmp_path: Path, *extra: str) -> tuple[list[dict], dict]:
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(root / "examples" / "ddp_trainer.py"), "--strategy", "packed",
        "--out", str(tmp_path), *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = run_launcher(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"strategy"')][-1])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)], summary


@pytest.mark.slow
def test_trainer_deepspeed_zero2_equals_ddp(tmp_path: Path) -> None:
    """HF Trainer + DeepSpeed ZeRO-2 on 2 CPU processes: the balanced batches reach the engine unchanged
    and the training loss equals the DDP run's. Skipped where deepspeed is not installed (it is not a
    dependency of this project)."""
    pytest.importorskip("deepspeed")
    records, summary = _trainer_run(tmp_path / "zero2", "--zero-stage", "2")
    assert summary["wrapper"] == "DeepSpeedEngine"
    assert len({len(r["batches"]) for r in records}) == 1
    assert sorted(i for r in records for b in r["batches"] for i in b) == list(range(240))
    assert summary["max_step_imbalance"] <= 1.02
    _, ddp = _trainer_run(tmp_path / "ddp")
    assert ddp["wrapper"] == "DistributedDataParallel"
    assert summary["train_loss"] == pytest.approx(ddp["train_loss"], rel=1e-5)
