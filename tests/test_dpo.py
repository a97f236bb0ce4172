"""Preference pairs as planning units, their packed rows, and shared-prefix attention.

Upstream comparisons (TRL's collator, TRL's loss on the same pairs) are in
``tests/conformance/test_vs_trl_dpo.py``; here: pair lengths and costs (golden tables), the packed row's
invariants, shared-prefix attention against the dense mask it stands for (and on real tiny models
against the sequences run alone, guarded against vacuous passes), every strategy planning pairs, the
distributed balance of pair costs, and the step's pair-weighted loss.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

import torch.nn.functional as F  # noqa: E402

from smart_batching.attention.prefix_sharing import (  # noqa: E402
    PREFIX_SHARED_ATTENTION,
    build_shared_plan,
    enable_prefix_shared_attention,
    shared_prefix_attention,
)
from smart_batching.errors import ConfigError  # noqa: E402
from smart_batching.hf import apply_smart_batching  # noqa: E402
from smart_batching.hf.dpo import pair_log_probs, preference_dataloader, prepare_pair_model  # noqa: E402
from smart_batching.hf.dpo.collate import PACKED_PAIRS, PairCollator, pair_lengths  # noqa: E402
from smart_batching.hf.dpo.model import check_pair_layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("trl_dpo_example", ROOT / "examples" / "trl_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EX = _example()


pytestmark = pytest.mark.usefixtures("one_thread", "quiet_hf")


@pytest.fixture(scope="module")
def pairs():
    return EX.preference_task(20, seed=3)


# -- pair lengths and costs: golden tables -------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_length", "mode", "chosen", "rejected", "shared"),
    [
        (None, "keep_start", [7, 6, 3], [5, 11, 3], [3, 5, 1]),
        (8, "keep_start", [7, 6, 3], [5, 8, 3], [3, 5, 1]),
        (6, "keep_start", [6, 6, 3], [5, 6, 3], [3, 5, 1]),
        # keep_end: pair 0 loses 1 and 0 tokens (no common prompt), pair 1 loses 0 and 5 (none either)
        (6, "keep_end", [6, 6, 3], [5, 6, 3], [0, 0, 1]),
        (4, "keep_end", [4, 4, 3], [4, 4, 3], [0, 0, 1]),
    ],
)
def test_pair_lengths_golden(max_length, mode, chosen, rejected, shared):
    lengths = pair_lengths([3, 5, 1], [4, 1, 2], [2, 6, 2], max_length=max_length, truncation_mode=mode)
    assert lengths.chosen.tolist() == chosen
    assert lengths.rejected.tolist() == rejected
    assert lengths.shared.tolist() == shared
    c, r, s = np.array(chosen), np.array(rejected), np.array(shared)
    assert lengths.costs("padded").tolist() == (2 * np.maximum(c, r)).tolist()
    assert lengths.costs("unshared").tolist() == (c + r).tolist()
    assert lengths.costs("shared").tolist() == (c + r - s).tolist()


def test_keep_end_shares_the_prompt_when_both_sequences_lose_as_many_tokens():
    lengths = pair_lengths([6], [4], [4], max_length=8, truncation_mode="keep_end")
    assert lengths.shared.tolist() == [4]  # both lose 2 prompt tokens: the other 4 line up


def test_costs_of_an_unknown_layout_are_refused():
    with pytest.raises(ConfigError, match="layout='rows'"):
        pair_lengths([1], [1], [1], max_length=None).costs("rows")


def test_dataset_pair_lengths_read_arrow_offsets(pairs):
    trainer = apply_smart_batching(EX.dpo_trainer(pairs, max_length=20), "packed")
    data, lengths = trainer.train_dataset, trainer.pair_lengths()
    assert len(lengths.chosen) == len(data) > 0
    for i in range(len(data)):
        p, c, r = (len(data[i][k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids"))
        assert lengths.chosen[i] == min(p + c, 20) and lengths.rejected[i] == min(p + r, 20)
        assert lengths.shared[i] == p  # TRL dropped the pairs whose prompt fills max_length


# -- the packed row ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["shared", "unshared"])
@pytest.mark.parametrize(("max_length", "mode"), [(None, "keep_start"), (12, "keep_start"), (12, "keep_end")])
def test_every_target_is_predicted_from_its_own_token_at_its_own_position(pairs, layout, max_length, mode):
    """For each target of TRL's padded view (row r, column j + 1), the row position ``source`` names holds
    the token at (r, j), with the position id j: the hidden state TRL's padded forward uses."""
    trainer = EX.dpo_trainer(pairs)
    examples = [trainer.train_dataset[i] for i in range(7)]
    batch = PairCollator(pad_token_id=0, layout=layout, max_length=max_length, truncation_mode=mode)(examples)
    row = batch[PACKED_PAIRS]
    valid = batch["completion_mask"][:, 1:] == 1
    source = row["source"]
    assert source.numel() == int(valid.sum()) > 0
    assert torch.equal(row["input_ids"][0, source], batch["input_ids"][:, :-1][valid])
    columns = torch.arange(valid.shape[1]).expand_as(valid)[valid]
    assert torch.equal(row["position_ids"][0, source], columns)
    lengths = pair_lengths(
        *[[len(e[k]) for e in examples] for k in ("prompt_ids", "chosen_ids", "rejected_ids")],
        max_length=max_length, truncation_mode=mode,
    )  # fmt: skip
    assert row["input_ids"].shape[1] == int(lengths.costs(layout).sum())
    if layout == "shared":
        assert row["shared_prefix_lengths"].sum() == row["input_ids"].shape[1]
        assert row["input_ids"].shape[1] < int(lengths.costs("unshared").sum())  # the prompts, once


def test_pair_collator_refuses_bad_settings():
    with pytest.raises(ConfigError, match="layout="):
        PairCollator(pad_token_id=0, layout="dense")
    with pytest.raises(ConfigError, match="only layout='padded' pads"):
        PairCollator(pad_token_id=0, layout="shared", pad_to_multiple_of=8)
    with pytest.raises(ConfigError, match="truncation_mode"):
        PairCollator(pad_token_id=0, truncation_mode="middle")


# -- shared-prefix attention --------------------------------------------------------------------------


def _dense_mask(groups, window=None):
    """The (T, T) mask the module docstring draws, built token by token from the layout."""
    pos, grp, branch = [], [], []
    for g, (prefix, *branches) in enumerate(groups):
        pos += list(range(prefix))
        grp += [g] * prefix
        branch += [-1] * prefix
        for b, n in enumerate(branches):
            pos += list(range(prefix, prefix + n))
            grp += [g] * n
            branch += [b] * n
    pos, grp, branch = map(torch.tensor, (pos, grp, branch))
    idx = torch.arange(len(pos))
    mask = (grp[:, None] == grp[None]) & (idx[None] <= idx[:, None])
    mask &= (branch[None] == -1) | (branch[None] == branch[:, None])
    if window is not None:
        mask &= pos[None] > pos[:, None] - window
    return mask


GROUPS = [[3, 2, 3], [2, 1, 2], [0, 2, 2], [4, 0, 3], [5, 3, 3], [1, 4, 1], [2, 2, 0], [6, 1, 9, 2]]


@pytest.mark.parametrize("window", [None, 3])
def test_shared_prefix_attention_equals_the_dense_mask(window):
    torch.manual_seed(0)
    groups = GROUPS[:-1] + [GROUPS[-1][:3]]  # three branches are checked below
    total = sum(map(sum, groups))
    q = torch.randn(total, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, 2, 8, dtype=torch.float64, requires_grad=True)
    plan = build_shared_plan(groups, total, torch.device("cpu"))
    out = shared_prefix_attention(q, k, v, plan, window=window, scale=None, dropout=0.0)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=_dense_mask(groups, window)[None, None], enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
    # not vacuous: plain causal attention over the row differs (branches would see each other)
    causal = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=True,
    )[0].transpose(0, 1)
    assert not torch.allclose(out, causal)


def test_three_branches_and_many_sizes_bucket_the_further_branches():
    torch.manual_seed(1)
    groups = [[p, c, r, s] for p, c, r, s in np.random.default_rng(0).integers(0, 30, size=(40, 4)).tolist()]
    groups[0] = [40, 5, 60, 1]  # one long group: bucketing must not pad every block to it
    total = sum(map(sum, groups))
    q, k, v = (torch.randn(total, 2, 4, dtype=torch.float64) for _ in range(3))
    plan = build_shared_plan(groups, total, torch.device("cpu"))
    assert len(plan.blocks) > 1
    out = shared_prefix_attention(q, k, v, plan, window=None, scale=None, dropout=0.0)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=_dense_mask(groups)[None, None],
    )[0].transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out, ref)


def test_a_layout_that_does_not_tile_the_row_is_refused():
    with pytest.raises(ConfigError, match="add up to the row's 9 tokens"):
        build_shared_plan([[3, 2, 3]], 9, torch.device("cpu"))


TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def _models():
    return {
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**TINY, num_key_value_heads=2, vocab_size=64)
        ),
        "qwen2": lambda: transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**TINY, num_key_value_heads=2, vocab_size=64)
        ),
        "mistral-window": lambda: transformers.MistralForCausalLM(
            transformers.MistralConfig(**TINY, num_key_value_heads=2, vocab_size=64, sliding_window=4)
        ),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral-window"])
@pytest.mark.parametrize("prompt_sharing", [True, False])
def test_packed_pair_log_probs_equal_the_padded_ones(family, prompt_sharing):
    """Each pair's summed completion log-probabilities from one packed row equal those of the padded
    batch (its sequences run alone), for llama, qwen2 and mistral with a sliding window shorter than
    the prompts."""
    torch.manual_seed(0)
    model = _models()[family]().eval()
    rng = np.random.default_rng(0)
    examples = [
        {
            k: rng.integers(3, 60, size=n).tolist()
            for k, n in zip(("prompt_ids", "chosen_ids", "rejected_ids"), s, strict=True)
        }
        for s in rng.integers(1, 12, size=(6, 3))
    ]
    padded = PairCollator(pad_token_id=0, layout="padded")(examples)
    with torch.no_grad():
        expected = pair_log_probs(model, padded)
        prepare_pair_model(model, prompt_sharing=prompt_sharing)
        layout = "shared" if prompt_sharing else "unshared"
        got = pair_log_probs(model, PairCollator(pad_token_id=0, layout=layout)(examples))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    assert model.config._attn_implementation == PREFIX_SHARED_ATTENTION


def test_pair_log_probs_equal_full_logits(pairs):
    """The target-only LM head of pair_log_probs against log_softmax over the model's full logits."""
    torch.manual_seed(0)
    model = _models()["llama"]().eval()
    trainer = EX.dpo_trainer(pairs)
    examples = [trainer.train_dataset[i] for i in range(5)]
    batch = PairCollator(pad_token_id=0, layout="padded")(examples)
    with torch.no_grad():
        chosen, rejected = pair_log_probs(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]
    sums = (logp * batch["completion_mask"][:, 1:]).sum(1)
    torch.testing.assert_close(torch.cat([chosen, rejected]), sums, rtol=1e-5, atol=1e-4)


def test_a_model_whose_attention_ignores_the_layout_is_refused():
    """sdpa does not read shared_prefix_lengths: the rejected tokens would see the chosen ones."""
    model = _models()["llama"]()
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ConfigError, match="does not keep the sequences of a packed pair row apart"):
        check_pair_layout(model, prompt_sharing=True)
    enable_prefix_shared_attention(model)
    check_pair_layout(model, prompt_sharing=True)  # passes once switched


# -- the plan: every strategy, pairs as units ---------------------------------------------------------


def _pairs_of(batch, dataset_prompts):
    """The pair indices of a collated batch (chosen rows first, then rejected: row i and row n + i are
    one pair, found by their prompt)."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    n = ids.shape[0] // 2
    found = []
    for i in range(n):
        prompts = []
        for row in (i, n + i):
            first = (
                int(completion[row].nonzero()[0])
                if completion[row].any()
                else int(batch["attention_mask"][row].sum())
            )
            prompts.append(tuple(ids[row, :first].tolist()))
        assert prompts[0] == prompts[1], "chosen and rejected of one pair in different rows"
        found.append(dataset_prompts.index(prompts[0]))
    return found


STRATEGIES = {
    "random": {"batch_size": 3},
    "max_length": {"batch_size": 3},
    "group_by_length": {"batch_size": 3},
    "token_budget": {"max_tokens": 160},
    "packed": {"capacity": 96},
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_plans_whole_pairs_once_within_its_limits(strategy):
    data = EX.preference_task(16, seed=7, prompt_words=(2, 12))
    trainer = EX.dpo_trainer(data)
    apply_smart_batching(trainer, strategy, **STRATEGIES[strategy])
    prompts = [tuple(x) for x in trainer.train_dataset["prompt_ids"]]
    assert len(set(prompts)) == len(prompts)
    seen, widths = [], set()
    for batch in trainer.get_train_dataloader():
        seen += _pairs_of(batch, prompts)
        widths.add(batch["input_ids"].shape[1])
        if strategy == "token_budget":
            assert batch["input_ids"].numel() <= 160
        if strategy == "packed":
            assert batch[PACKED_PAIRS]["input_ids"].shape[1] <= 96
    assert sorted(seen) == list(range(len(prompts)))
    if strategy == "max_length":
        assert len(widths) == 1  # one padded width for every batch


def test_pairs_are_balanced_across_ranks_by_cost():
    """The distributed sampler over pair costs: every pair once over two ranks, and each step's cost
    (the planned tokens of its micro-batches) close across ranks."""
    from smart_batching.distributed import World
    from smart_batching.distributed.sampler import DistributedSmartBatchSampler

    data = EX.preference_task(64, seed=11)
    trainer = EX.dpo_trainer(data)
    apply_smart_batching(trainer, "packed", capacity=160)
    costs = trainer.pair_lengths().costs("shared")
    samplers = [
        DistributedSmartBatchSampler(
            costs, trainer.smart_batching.spec, world=World(r, 2), accum_steps=1, seed=0
        )
        for r in range(2)
    ]
    batches = [list(s) for s in samplers]
    indices = sorted(i for rank in batches for batch in rank for i in batch)
    assert indices == list(range(len(costs)))
    assert len(batches[0]) == len(batches[1])
    per_step = np.array([[costs[b].sum() for b in rank] for rank in batches])  # (ranks, steps)
    assert (per_step <= 160).all()
    assert per_step.min(axis=0).sum() >= 0.8 * per_step.max(axis=0).sum()


# -- the step's loss -----------------------------------------------------------------------------------


def test_the_step_loss_is_the_mean_over_its_pairs_when_micro_batches_differ(pairs):
    """Two micro-batches of 1 and 3 pairs in one step (gradient_accumulation_steps=2): the step's loss
    and gradient are those of TRL's loss over the 4 pairs as one batch (sigmoid loss: per pair)."""
    trainer = EX.dpo_trainer(pairs, gradient_accumulation_steps=2)
    examples = [trainer.train_dataset[i] for i in range(4)]
    model = trainer.model.train()
    trl_collator = trainer.data_collator

    model.zero_grad()
    whole = trainer.compute_loss(model, trl_collator(examples))
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]

    apply_smart_batching(trainer, "token_budget", max_tokens=512)
    micro = [trl_collator(examples[:1]), trl_collator(examples[1:])]
    trainer.get_batch_samples(iter(micro), 2, torch.device("cpu"))
    assert trainer.smart_batching.step_pairs == 4
    model.zero_grad()
    total = 0.0
    for batch in micro:
        loss = trainer.compute_loss(model, batch) / 2  # the Trainer divides by the step's micro-batches
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(whole.item(), rel=1e-5)
    for a, b in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # Equal micro-batches: weight 1, TRL's own loss exactly.
    trainer.get_batch_samples(iter([micro[1], micro[1]]), 2, torch.device("cpu"))
    from trl import DPOTrainer

    assert (
        trainer.compute_loss(model, micro[1]).item()
        == DPOTrainer.compute_loss(trainer, model, micro[1]).item()
    )


# -- the library's own API ---------------------------------------------------------------------------


def test_preference_dataloader_plans_packed_rows_for_a_loop_of_your_own(pairs):
    trainer = EX.dpo_trainer(pairs)
    loader = preference_dataloader(trainer.train_dataset, "packed", capacity=128, seed=0)
    rows = list(loader)
    assert sum(b["completion_mask"].shape[0] // 2 for b in rows) == len(trainer.train_dataset)
    assert all(b[PACKED_PAIRS]["input_ids"].shape[1] <= 128 for b in rows)
    torch.manual_seed(0)
    model = prepare_pair_model(_models()["llama"]())
    chosen, rejected = pair_log_probs(model, rows[0])
    assert chosen.shape == rejected.shape == (rows[0]["completion_mask"].shape[0] // 2,)
    assert bool((chosen < 0).all())
    with pytest.raises(ConfigError, match="a pair is one unit"):
        preference_dataloader(trainer.train_dataset, "token_budget", max_tokens=64, overlong="truncate")


def test_apply_twice_removes_the_first_hooks(pairs):
    trainer = EX.dpo_trainer(pairs)
    apply_smart_batching(trainer, "packed")
    hooks = len(trainer.model._forward_pre_hooks)
    apply_smart_batching(trainer, "packed", prompt_sharing=False)
    assert len(trainer.model._forward_pre_hooks) == hooks
    apply_smart_batching(trainer, "token_budget", target_logits_only=False)
    assert len(trainer.model._forward_pre_hooks) == hooks - 1
    assert type(trainer.data_collator).__name__ == "DataCollatorForPreference"  # TRL's, restored


# -- the example and the benchmark ---------------------------------------------------------------------


def test_the_example_trains_with_packed_prompt_shared_rows():
    summary = EX.main(["--steps", "4", "--pairs", "32"])
    assert summary["trainer"] == "SmartBatchingDPOTrainer"
    assert summary["attn_implementation"] == PREFIX_SHARED_ATTENTION and summary["prompt_sharing"]
    assert np.isfinite(summary["train_loss"]) and summary["first_loss"] == pytest.approx(np.log(2), rel=1e-5)


@pytest.mark.slow
def test_dpo_throughput_benchmark_smoke():
    """The benchmark's records: every method trains the same pairs, and each one's first step equals TRL
    alone's on the same pairs (loss and log-probabilities). Slow: TRL's fused LM head on CPU walks
    SmolLM2's 49,152-token vocabulary at every scored position (over 2 minutes on 2 busy cores)."""
    if not (ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl").is_file():
        pytest.skip("../shared/data is absent")
    spec = importlib.util.spec_from_file_location("dpo_throughput", ROOT / "benchmarks" / "dpo_throughput.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    records = bench.main(
        ["--datasets", "gsm8k", "--pairs", "6", "--batch-size", "3", "--hidden", "32", "--layers", "1",
         "--methods", "random", "packed", "packed+prompt_sharing", "--json"]
    )  # fmt: skip
    assert [r["strategy"] for r in records] == ["random", "packed", "packed+prompt_sharing"]
    assert {r["pairs"] for r in records} == {6}
    assert all(r["first_step_match"] for r in records)
    assert records[2]["model_tokens"] < records[1]["model_tokens"]  # the prompts, once
    assert records[0]["gradient_checkpointing"] is False and records[0]["dtype"] == "float32"


def test_with_smart_batching_of_the_dpo_trainer_class(pairs):
    """The library's own API: a DPOTrainer subclass that takes the strategy as constructor arguments."""
    import copy
    import tempfile

    from trl import DPOConfig, DPOTrainer

    from smart_batching.hf import with_smart_batching

    cls = with_smart_batching(DPOTrainer)
    assert cls.__name__ == "SmartBatchingDPOTrainer" and with_smart_batching(cls) is cls
    tokenizer = EX.word_tokenizer()
    model = EX.tiny_llama(len(tokenizer))
    config = DPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, gradient_checkpointing=False, bf16=False,
        max_steps=1, disable_tqdm=True,
    )  # fmt: skip
    trainer = cls(
        model=model, ref_model=copy.deepcopy(model), args=config, train_dataset=pairs, processing_class=tokenizer,
        strategy="packed", strategy_options={"capacity": 256}, prompt_sharing=False,
    )  # fmt: skip
    assert trainer.smart_batching.layout == "unshared" and trainer.smart_batching.spec.capacity == 256
    trainer.train()
    assert trainer.state.global_step == 1
