"""A strategy lives in one place: its module in ``planners/``.

1. No module outside ``planners/`` decides by a strategy's name or spec class (an AST scan).
2. A toy strategy registered from this test file, with no other module touched, runs through the
   sampler, the distributed sampler, streaming, the HF Trainer, ``analyze`` and the CLI's choices
   (``test_strategy_contracts.py`` puts it through every contract the built-in strategies meet).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from toy_strategy import LongestFirstSpec, plan_longest_first

from smart_batching import planners
from smart_batching.planners import register, unregister

SRC = Path(__file__).resolve().parents[1] / "src" / "smart_batching"
BUILTIN = set(planners.STRATEGIES)
SPEC_CLASSES = {cls.__name__ for cls, _ in planners.REGISTRY.values()}
# Literals that name something else: HF's own train_sampling_strategy value, a stdlib module.
ALLOWED = {("compat.py", "random"), ("default_data.py", "random")}
# "max_length" is also every padded strategy's option name: as a literal it is only a decision when
# compared with or listed beside other strategy names.
AMBIGUOUS = {"max_length"}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def strategy_decisions(path: Path, root: Path = SRC) -> list[str]:
    """Places in one module that name a strategy or test a spec class (see the module docstring)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):  # f-string pieces are message text
            skip.update(id(v) for v in node.values)
    found = []

    def named(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in BUILTIN:
            return node.value
        return None

    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and id(node) not in skip:
            name = named(node)
            if name and name not in AMBIGUOUS and (path.name, name) not in ALLOWED:
                found.append(f"{where} literal {name!r}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            items = [
                e for s in sides for e in (s.elts if isinstance(s, ast.Tuple | ast.List | ast.Set) else [s])
            ]
            if any(named(e) in AMBIGUOUS for e in items):
                found.append(f"{where} compares with a strategy name")
        elif isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            if sum(named(e) is not None for e in elts if e is not None) >= 2:
                found.append(f"{where} lists strategy names")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            for arg in ast.walk(node.args[1]) if len(node.args) > 1 else ():
                if getattr(arg, "id", getattr(arg, "attr", None)) in SPEC_CLASSES:
                    found.append(f"{where} tests a spec class")
    return found


def test_no_module_outside_planners_decides_by_strategy():
    modules = [p for p in SRC.rglob("*.py") if "planners" not in p.relative_to(SRC).parts]
    assert len(modules) > 50  # the scan saw the package
    found = [f for p in sorted(modules) for f in strategy_decisions(p)]
    assert not found, "ask the spec instead (planners/_spec.py):\n" + "\n".join(found)


def test_the_scan_finds_a_decision(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        'def f(spec, plan):\n    if spec.name == "packed":\n        return 1\n'
        '    return isinstance(spec, PackedSpec) or plan.strategy in ("max_length", "random")\n'
    )
    found = [f.split(" ", 1)[1] for f in strategy_decisions(bad, root=tmp_path)]
    assert sorted(found) == [
        "compares with a strategy name", "lists strategy names", "literal 'packed'", "literal 'random'",
        "tests a spec class",
    ]  # fmt: skip


# -- a toy strategy (toy_strategy.py), registered from here -------------------------------------------


@pytest.fixture
def toy():
    register(LongestFirstSpec, plan_longest_first)
    yield LongestFirstSpec.name
    unregister(LongestFirstSpec.name)


LENGTHS = np.random.default_rng(0).integers(3, 40, size=37)


def _once(batches) -> list[int]:
    return sorted(int(i) for b in batches for i in b)


def test_toy_strategy_in_the_sampler_and_the_distributed_sampler(toy):
    from smart_batching.distributed import World
    from smart_batching.distributed.sampler import DistributedSmartBatchSampler
    from smart_batching.sampler import SmartBatchSampler

    batches = list(SmartBatchSampler(LENGTHS, toy, batch_size=4, seed=0))
    assert _once(batches) == list(range(len(LENGTHS)))
    assert max(LENGTHS[batches[0]]) == LENGTHS.max()  # its own order: longest first
    ranks = [
        list(DistributedSmartBatchSampler(LENGTHS, toy, batch_size=4, world=World(r, 2), seed=0))
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1]) and _once(ranks[0] + ranks[1]) == list(range(len(LENGTHS)))


def test_toy_strategy_streams(toy):
    from smart_batching.streaming import StreamingBatcher

    batches = list(StreamingBatcher(LENGTHS.tolist(), toy, buffer_size=16, batch_size=4))
    assert _once(batches) == list(range(len(LENGTHS))) and all(len(b) <= 4 for b in batches)


def test_toy_strategy_in_analyze_and_the_cli(toy):
    from smart_batching.analysis import analyze
    from smart_batching.cli import build_parser
    from smart_batching.cli.train import strategy_help

    rows = analyze(LENGTHS, batch_size=4)
    assert toy in [r["strategy"] for r in rows]  # the default rows come from the registry
    assert toy in strategy_help()
    args = build_parser().parse_args(["train", "--strategy", toy])
    assert args.strategy == toy


def test_toy_strategy_trains_in_the_hf_trainer(toy, tiny_llama_and_args, one_thread):
    datasets = pytest.importorskip("datasets")
    from smart_batching.hf import SmartBatchingTrainer

    model, args = tiny_llama_and_args(max_steps=3)
    rows = [np.random.default_rng(i).integers(1, 64, size=int(n)).tolist() for i, n in enumerate(LENGTHS)]
    trainer = SmartBatchingTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}),
        strategy=toy, strategy_options={"batch_size": 4},
    )  # fmt: skip
    result = trainer.train()
    assert trainer.state.global_step == 3 and np.isfinite(result.training_loss)
    assert type(trainer.data_collator).__name__ == "PaddingCollator"  # the spec's collator
