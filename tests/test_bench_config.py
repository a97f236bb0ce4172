"""BenchConfig: one frozen, validated value for every bench setting; run_bench takes it or keywords."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from smart_batching.bench.config import BenchConfig
from smart_batching.errors import ConfigError


def test_defaults_are_valid_and_frozen():
    config = BenchConfig()
    assert config.strategies[0] == "random" and config.seeds == (0,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.epochs = 2  # type: ignore[misc]


def test_keyword_only():
    with pytest.raises(TypeError):
        BenchConfig("default")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"epochs": 0}, "epochs"),
        ({"batch_size": -1}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"eval_examples": 1.5}, "eval_examples"),
        ({"nproc": 0}, "nproc"),
        ({"max_steps": 0}, "max_steps"),
        ({"capacity": "4096"}, "capacity"),
        ({"threads": 0}, "threads"),
        ({"num_generations": -1}, "num_generations"),
        ({"lr": 0.0}, "lr"),
        ({"lr": "1e-3"}, "lr"),
        ({"lr_schedule": "sawtooth"}, "lr_schedule"),
        ({"strategies": ()}, "strategies"),
        ({"strategies": "random,packed"}, "strategies"),
        ({"strategies": ("random", "no_such")}, "no_such"),
        ({"seeds": ()}, "seeds"),
        ({"seeds": ("a",)}, "seeds"),
        ({"seeds": (-1,)}, "seeds"),
        ({"match_steps": "yes"}, "match_steps"),
        ({"model_options": [("hidden_size", 8)]}, "model_options"),
        ({"nproc": 2, "callbacks": [object()]}, "callbacks"),
        ({"precision": "fp16"}, "precision"),
    ],
)
def test_a_bad_field_is_refused_by_name(changes, field):
    with pytest.raises(ConfigError, match=field):
        BenchConfig(**changes)


def test_sequences_are_normalised_to_tuples():
    config = BenchConfig(strategies=["random", "packed"], seeds=[3, 4], callbacks=[])
    assert config.strategies == ("random", "packed") and config.seeds == (3, 4) and config.callbacks == ()
    assert config == BenchConfig(strategies=("random", "packed"), seeds=(3, 4))


def test_train_examples_reads_max_steps_unless_num_examples_is_given():
    assert BenchConfig().train_examples is None
    assert BenchConfig(max_steps=5, batch_size=4).train_examples == 20
    assert BenchConfig(max_steps=5, batch_size=4, num_examples=7).train_examples == 7


def test_of_builds_and_replaces():
    base = BenchConfig(strategies=("random",), max_steps=3)
    assert BenchConfig.of(base) is base
    assert BenchConfig.of(base, seeds=(1, 2)).seeds == (1, 2)
    assert BenchConfig.of("x.jsonl", epochs=2) == BenchConfig(data="x.jsonl", epochs=2)
    with pytest.raises(ConfigError, match="data"):
        BenchConfig.of("x.jsonl", data="y.jsonl")
    with pytest.raises(ConfigError, match="no field nope"):
        base.replace(nope=1)
    with pytest.raises(ConfigError, match="epochs"):
        base.replace(epochs=0)  # replacements are validated too


def test_every_field_is_documented():
    documented = inspect.getdoc(BenchConfig).split("Attributes:", 1)[1]
    for f in dataclasses.fields(BenchConfig):
        assert f"    {f.name}: " in documented, f"BenchConfig.{f.name} has no line under Attributes:"


def test_run_bench_refuses_a_bad_config_before_loading_anything():
    from smart_batching.bench import run_bench

    with pytest.raises(ConfigError, match="epochs"):
        run_bench(BenchConfig(), epochs=0)
    with pytest.raises(ConfigError, match="no field batchsize"):
        run_bench("default", batchsize=8)


@pytest.mark.parametrize(
    ("budgets", "message"),
    [
        ({"token_budget": {"max_tokens": 512}}, "not among strategies"),
        ({"packed": {"max_tokens": 0}}, r"budgets\['packed'\]\['max_tokens'\]"),
        ({"packed": {"window": 64}}, r"budgets\['packed'\]=.*must be"),
        ({"packed": 2048}, r"budgets\['packed'\]=2048 must be"),
        ([("packed", 2048)], "budgets= must be a dict"),
    ],
)
def test_budgets_are_checked_by_name(budgets, message):
    with pytest.raises(ConfigError, match=message):
        BenchConfig(strategies=("random", "packed"), budgets=budgets)


def test_budgets_are_used_as_given_for_a_micro_batch(tmp_path):
    """budgets= give a row its budget as is: a [mix_steps=2] row's is a micro-batch's (max_tokens= would be
    halved), and it wins over match_steps for the row it names."""
    from smart_batching.bench import run_bench

    micro = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 1}  # fmt: skip
    rows = ("token_budget[mix_steps=2]", "packed")
    records = run_bench(
        "default", model="tiny-llama", model_options=micro, strategies=rows, num_examples=16, batch_size=4,
        max_tokens=4096, match_steps=True, budgets={"token_budget[mix_steps=2]": {"max_tokens": 1000}},
        eval_examples=2, num_generations=0, out_dir=tmp_path, progress=False, render=False,
    )  # fmt: skip
    by = {r["strategy"]: r for r in records}
    assert by["token_budget[mix_steps=2]"]["strategy_options"]["max_tokens"] == 1000
    assert (
        by["packed"]["settings"]["budgets"]["packed"]["capacity"]
        == by["packed"]["strategy_options"]["capacity"]
    )
    assert by["packed"]["settings"]["budgets"]["token_budget[mix_steps=2]"] == {"max_tokens": 1000}
