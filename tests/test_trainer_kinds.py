"""Trainer kinds as adapters: one contract for every registered kind (the built-in ones and a toy registered
from here, ``tests/toy_trainer_kind.py``), on real tiny trainers: recognised as instance and class, applied
and trained one step, refusals by name, an unknown kind refused with the kinds there are, and refusal
advice that the same kind accepts. Then every piece of advice a ``DPOTrainer`` is given, applied.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from smart_batching import compat  # noqa: E402
from smart_batching.errors import ConfigError, OverlongError  # noqa: E402
from smart_batching.hf import (  # noqa: E402
    apply_smart_batching,
    kinds,  # noqa: E402
    with_smart_batching,
)
from smart_batching.hf.adapter import TrainerKind  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DPO_EX = _load("trl_dpo_example", ROOT / "examples" / "trl_dpo.py")
TOY = _load("toy_trainer_kind", Path(__file__).with_name("toy_trainer_kind.py"))
GRPO_SETUP = _load("grpo_setup", Path(__file__).with_name("grpo_setup.py"))
GRPO_PROMPTS = GRPO_SETUP.prompts(4, words=6)
PAIRS = DPO_EX.preference_task(8, seed=5)
VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def _toy_registered(one_thread):
    """The toy kind, matched before the generic Trainer (a ToyTrainer is a Trainer)."""
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    kinds.register(TOY.TOY, before="Trainer")
    yield
    kinds.unregister(TOY.TOY.name)
    datasets.enable_progress_bars()


def _examples(num: int = 12) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, VOCAB, size=int(n)).tolist() for n in rng.integers(4, 30, size=num)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _args(tmp_path, **config):
    values = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    return transformers.TrainingArguments(**{**values, **config})


def _plain(cls):
    def make(tmp_path, **config):
        return cls(model=_llama(), args=_args(tmp_path, **config), train_dataset=_examples())

    return make


def _dpo(tmp_path, **config):
    return DPO_EX.dpo_trainer(PAIRS, output_dir=str(tmp_path / "out"), **config)


@functools.cache
def _grpo_model() -> str:
    return GRPO_SETUP.save_model()


def _grpo(tmp_path, **config):
    # TRL's GRPOConfig refuses auto_find_batch_size itself: it is set after construction, where a user can too.
    auto = config.pop("auto_find_batch_size", False)
    trainer = GRPO_SETUP.grpo_trainer(_grpo_model(), GRPO_PROMPTS, output_dir=str(tmp_path / "out"), **config)
    trainer.args.auto_find_batch_size = auto
    return trainer


# One case per registered kind: a real tiny trainer of it, a budget every unit fits and one none fits.
CASES = {
    "DPOTrainer": (_dpo, 400, 20),
    "GRPOTrainer": (_grpo, 200, 8),  # prompts of 7 tokens: a completion with its prompt never fits 8
    "ToyTrainer": (_plain(TOY.ToyTrainer), 64, 15),
    "Trainer": (_plain(transformers.Trainer), 64, 15),
}


def test_the_kinds_match_most_specific_first():
    assert REFUSING == ["DPOTrainer", "GRPOTrainer", "ToyTrainer"]
    assert kinds.kind_names() == ("DPOTrainer", "GRPOTrainer", "ToyTrainer", "Trainer")
    assert set(CASES) == set(kinds.kind_names()), "every registered kind has a contract case"
    assert all(isinstance(k, TrainerKind) for k in kinds.KINDS.values())
    # SFTTrainer is the generic kind's; TRL's DPOTrainer subclasses Trainer but is its own kind.
    assert kinds.kind_of(trl.SFTTrainer).name == "Trainer"
    assert kinds.kind_of(trl.DPOTrainer).name == "DPOTrainer"
    assert kinds.kind_of(trl.GRPOTrainer).name == "GRPOTrainer"
    assert kinds.kind_of(type("MyGRPOTrainer", (trl.GRPOTrainer,), {})).name == "GRPOTrainer"


@pytest.mark.parametrize("name", list(CASES))
def test_a_kind_recognises_its_trainers_and_applies_to_them(tmp_path, name):
    make, fits, _ = CASES[name]
    trainer = make(tmp_path)
    kind = kinds.KINDS[name]
    cls = type(trainer)
    assert kinds.kind_of(trainer) is kind and kinds.kind_of(cls) is kind
    assert apply_smart_batching(trainer, "token_budget", max_tokens=fits) is trainer
    assert type(trainer) is with_smart_batching(cls) is kind.with_class(cls)
    assert with_smart_batching(type(trainer)) is type(trainer)  # already switched: as it is
    assert kinds.kind_of(trainer) is kind  # still its kind once switched
    assert trainer.smart_batching.spec.max_tokens == fits
    assert trainer.sb_accepts is kind.accepts
    assert np.isfinite(trainer.train().training_loss)


# The kinds that refuse options of apply_smart_batching (the toy is registered only while the tests run).
REFUSING = [n for n in CASES if (kinds.KINDS.get(n) or TOY.TOY).refusals]


@pytest.mark.parametrize("name", REFUSING)
def test_a_kind_refuses_its_refused_options_by_name(tmp_path, name):
    kind = kinds.KINDS[name]
    assert kind.refusals, f"{name} declares no refusals to test"
    values = {"batch_schedule": "0:64", "lr_scaling": "sqrt", "oom_backoff": True}
    for option in kind.refusals:
        trainer = CASES[name][0](tmp_path)
        with pytest.raises(ConfigError, match=f"{option} is not supported on a {name}: "):
            apply_smart_batching(
                trainer, "token_budget", max_tokens=CASES[name][1], **{option: values[option]}
            )
        assert not hasattr(trainer, "smart_batching")  # refused before anything changed


def test_an_unknown_kind_is_refused_with_the_kinds_there_are():
    class NotATrainer:
        pass

    for what in (NotATrainer(), NotATrainer):
        with pytest.raises(
            ConfigError, match="NotATrainer is not a trainer kind smart batching supports"
        ) as err:
            if isinstance(what, type):
                with_smart_batching(what)
            else:
                apply_smart_batching(what, "token_budget")
        for name in kinds.kind_names():
            assert name in str(err.value)


def test_rloo_trainer_is_the_grpo_kind():
    """TRL's RLOOTrainer (and a subclass) subclasses Trainer but trains on completions it generates, scored
    by the same method as GRPOTrainer's: it takes the GRPOTrainer kind, never the Trainer kind's plan of a
    dataset of examples."""
    mine = type("MyRLOOTrainer", (trl.RLOOTrainer,), {})
    assert transformers.Trainer in trl.RLOOTrainer.__mro__  # what would otherwise make it the Trainer kind
    for cls in (trl.RLOOTrainer, mine):
        assert kinds.kind_of(cls).name == "GRPOTrainer"
        made = with_smart_batching(cls)
        assert made.__name__ == f"SmartBatching{cls.__name__}" and issubclass(made, cls)


def test_a_trl_online_trainer_no_kind_plans_is_refused_by_name(monkeypatch):
    """An online TRL trainer that no kind plans is refused by name (a subclass too) instead of being planned
    as a dataset of examples. TRL 1.16 has none left (GRPOTrainer and RLOOTrainer have their kind), so
    TRL's KTOTrainer stands in: listed as online, it must leave the Trainer kind."""
    monkeypatch.setattr(compat, "TRL_ONLINE_TRAINERS", (*compat.TRL_ONLINE_TRAINERS, "KTOTrainer"))
    mine = type("MyKTOTrainer", (trl.KTOTrainer,), {})
    for cls in (trl.KTOTrainer, mine):
        with pytest.raises(ConfigError, match="TRL's KTOTrainer trains on completions it generates") as err:
            with_smart_batching(cls)
        for kind in kinds.kind_names():
            assert kind in str(err.value)


def test_register_places_a_kind_and_refuses_what_is_not_one():
    with pytest.raises(ConfigError, match="no such trainer kind"):
        kinds.register(TOY.TOY, before="NoSuchKind")
    with pytest.raises(ConfigError, match="must be a TrainerKind"):
        kinds.register(object())
    assert kinds.kind_names() == ("DPOTrainer", "GRPOTrainer", "ToyTrainer", "Trainer")  # unchanged


# -- advice that the kind accepts -------------------------------------------------------------------


def _works(trainer, strategy, **options):
    """Applied, and a first batch drawn: not refused. A GRPOTrainer's units are the completions it generates,
    so it trains its step."""
    apply_smart_batching(trainer, strategy, **options)
    if kinds.kind_of(trainer).name == "GRPOTrainer":
        trainer.train()
    assert next(iter(trainer.get_train_dataloader())) is not None
    return trainer


@pytest.mark.parametrize("name", list(CASES))
def test_the_auto_find_batch_size_advice_is_accepted_by_the_kind(tmp_path, name):
    make, fits, _ = CASES[name]
    with pytest.raises(ConfigError, match="auto_find_batch_size=True") as err:
        apply_smart_batching(make(tmp_path, auto_find_batch_size=True), "token_budget", max_tokens=fits)
    advises_auto = "'auto'" in str(err.value)
    assert advises_auto == kinds.KINDS[name].accepts.auto_budget, str(err.value)
    if not advises_auto:  # "give max_tokens= a number": the number is accepted
        assert "a number of tokens" in str(err.value)
        _works(make(tmp_path, auto_find_batch_size=False), "token_budget", max_tokens=fits)


@pytest.mark.parametrize("name", list(CASES))
def test_every_overlong_policy_advised_is_accepted_by_the_kind(tmp_path, name):
    make, fits, tight = CASES[name]
    with pytest.raises(OverlongError, match="Raise max_tokens=") as err:
        _works(make(tmp_path), "token_budget", max_tokens=tight)
    advised = re.findall(r"'(\w+)'", str(err.value).split("choose overlong=", 1)[-1])
    accepted = kinds.KINDS[name].accepts.overlong
    if accepted == ("error",):  # units that are never cut or dropped: only the budget is advised
        assert "choose overlong" not in str(err.value)
        advised = []
    else:
        assert advised, str(err.value)
    assert set(advised) <= set(accepted), str(err.value)
    for policy in advised:
        _works(make(tmp_path), "token_budget", max_tokens=tight, overlong=policy)
    _works(make(tmp_path), "token_budget", max_tokens=fits)  # raised


# -- every piece of advice a DPOTrainer is given ------------------------------------------------------


class _OwnCollator:
    def __init__(self, trl_collator):
        self.trl = trl_collator

    def __call__(self, features):
        return self.trl(features)


# (what is refused: config, strategy, options), and each piece of advice: (its words in the message,
# what applying it changes: config, strategy, options).
DPO_ADVICE = {
    "auto_find_batch_size": (
        ({"auto_find_batch_size": True}, "token_budget", {"max_tokens": 400}),
        [("auto_find_batch_size=False", ({"auto_find_batch_size": False}, None, {}))],
    ),
    "auto budget": (
        ({}, "token_budget", {"max_tokens": "auto"}),
        [("give a number of tokens", ({}, None, {"max_tokens": 400}))],
    ),
    "overlong pair": (
        ({}, "packed", {"capacity": 20}),
        [
            ("Raise capacity=", ({}, None, {"capacity": 400})),
            ("overlong='drop'", ({}, None, {"overlong": "drop"})),
        ],
    ),
    "a pair cut": (
        ({}, "token_budget", {"max_tokens": 400, "overlong": "split"}),
        [("'error'", ({}, None, {"overlong": "error"})), ("'drop'", ({}, None, {"overlong": "drop"}))],
    ),
    "padding_free": (
        ({"padding_free": True}, "token_budget", {"max_tokens": 400}),
        [
            ("strategy='packed'", ({}, "packed", {"capacity": 400})),
            ("set padding_free=False", ({"padding_free": False}, None, {})),
        ],
    ),
    "pad_to_multiple_of": (
        ({"pad_to_multiple_of": 8}, "packed", {}),
        [
            ("set pad_to_multiple_of=None", ({"pad_to_multiple_of": None}, None, {})),
            ("token_budget", ({}, "token_budget", {"max_tokens": 400})),
            ("group_by_length", ({}, "group_by_length", {})),
        ],
    ),
    "dataloader_drop_last": (
        ({"dataloader_drop_last": True}, "packed", {}),
        [("set dataloader_drop_last=False", ({"dataloader_drop_last": False}, None, {}))],
    ),
    "train_sampling_strategy": (
        ({"train_sampling_strategy": "group_by_length"}, "packed", {}),
        [
            ("set train_sampling_strategy='random'", ({"train_sampling_strategy": "random"}, None, {})),
            ("strategy='group_by_length'", ({}, "group_by_length", {})),
        ],
    ),
    "label_names": (
        ({"label_names": ["score"]}, "packed", {}),
        [("set label_names=None", ({"label_names": None}, None, {}))],
    ),
    "batch_schedule": (
        ({}, "token_budget", {"max_tokens": 400, "batch_schedule": "0:800"}),
        [("remove it", ({}, None, {"batch_schedule": None}))],
    ),
    "own collator": (
        ({"own_collator": True}, "packed", {}),
        [("use a padded strategy", ({}, "token_budget", {"max_tokens": 400}))],
    ),
}

# What a DPOTrainer refuses: a refusal must not advise any of it.
DPO_REFUSED = ("'auto'", "'truncate'", "'split'", "your own data_collator")


def _dpo_trainer(tmp_path, config):
    config = dict(config)
    own = config.pop("own_collator", False)
    trainer = _dpo(tmp_path, **config)
    if own:
        trainer.data_collator = _OwnCollator(trainer.data_collator)
    return trainer


@pytest.mark.parametrize("case", list(DPO_ADVICE))
def test_every_piece_of_advice_given_on_a_dpo_trainer_is_accepted(tmp_path, case):
    (config, strategy, options), advice = DPO_ADVICE[case]
    with pytest.raises(ConfigError) as err:
        _works(_dpo_trainer(tmp_path, config), strategy, **options)
    message = str(err.value)
    quoted = {repr(v) for v in {**config, **options}.values() if isinstance(v, str)}  # what was refused
    for refused in set(DPO_REFUSED) - quoted:
        assert refused not in message, f"{case}: advises {refused}: {message}"
    for words, (new_config, new_strategy, new_options) in advice:
        assert words in message, f"{case}: {message}"
        applied = new_options if new_strategy else {**options, **new_options}  # another strategy: its options
        applied = {k: v for k, v in applied.items() if v is not None}
        _works(_dpo_trainer(tmp_path, {**config, **new_config}), new_strategy or strategy, **applied)
