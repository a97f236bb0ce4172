"""Target-only logits in SmartBatchingTrainer: the LM head runs only where the loss looks, with the same
loss and gradients as full logits, and only where that is exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks, reset_fallbacks  # noqa: E402
from smart_batching.hf import SmartBatchingTrainer, with_smart_batching  # noqa: E402
from smart_batching.loss import kept_token_loss_sum, target_positions, token_loss_sum  # noqa: E402

VOCAB = 384


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).float()


def prompt_dataset(num_examples: int = 24, seed: int = 0) -> datasets.Dataset:
    """Prompt + answer rows; loss on the answer only (``prompt_length`` leading tokens are not targets)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, 70, size=num_examples)
    prompts = (lengths * rng.uniform(0.4, 0.8, size=num_examples)).astype(int)
    rows = [rng.integers(1, VOCAB, size=n).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": rows, "prompt_length": prompts.tolist()})


def sgd_args(tmp_path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], optim="sgd", learning_rate=1.0,
        weight_decay=0.0, max_grad_norm=0.0, max_steps=1, lr_scheduler_type="constant", save_strategy="no",
        disable_tqdm=True, seed=0, gradient_accumulation_steps=2,
    )  # fmt: skip
    values.update(overrides)
    return TrainingArguments(**values)


class HeadRows:
    """Counts the positions the LM head computes."""

    def __init__(self, model) -> None:
        self.rows = 0
        model.lm_head.register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        self.rows += int(np.prod(args[0].shape[:-1]))


def run(
    tmp_path, strategy: str, options: dict, *, target_logits_only: bool, trainer_cls=SmartBatchingTrainer
):
    model = tiny_llama()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head = HeadRows(model)
    trainer = trainer_cls(
        model=model,
        args=sgd_args(tmp_path / f"{strategy}-{target_logits_only}"),
        train_dataset=prompt_dataset(),
        strategy=strategy,
        strategy_options=options,
        target_logits_only=target_logits_only,
    )
    loss = float(trainer.train().training_loss)
    grads = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    return trainer, loss, grads, head.rows


@pytest.mark.parametrize(
    ("strategy", "options"), [("packed", {"capacity": 192}), ("token_budget", {"max_tokens": 256})]
)
def test_target_only_logits_give_the_same_loss_and_gradients_with_fewer_head_rows(
    tmp_path, strategy, options
):
    fast, loss, grads, rows = run(tmp_path, strategy, options, target_logits_only=True)
    full, ref_loss, ref_grads, ref_rows = run(tmp_path, strategy, options, target_logits_only=False)
    assert fast.smart_batching.target_logits is True and full.smart_batching.target_logits is False
    assert abs(loss - ref_loss) <= 1e-5
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) <= 1e-5
    assert max(float(g.abs().max()) for g in ref_grads.values()) > 1e-3  # a real update was compared
    # About half of every row is prompt: the head skips those positions (for packing, nearly all of them).
    assert rows < 0.8 * ref_rows


def test_positions_and_kept_loss_match_the_full_token_loss():
    torch.manual_seed(1)
    labels = torch.randint(0, VOCAB, (3, 10))
    labels[:, :4] = -100
    labels[0, 7:] = -100
    labels[2, :] = -100
    logits = torch.randn(3, 10, VOCAB)
    keep = target_positions(labels)
    assert keep.tolist() == [3, 4, 5, 6, 7, 8]  # position t predicts labels[:, t + 1]
    full = token_loss_sum(logits, labels)
    assert torch.allclose(kept_token_loss_sum(logits[:, keep], labels, keep), full)
    # No target at all: one position is still kept, so the LM head takes part in the backward pass.
    none = torch.full((2, 5), -100)
    assert target_positions(none).tolist() == [0]
    assert float(kept_token_loss_sum(logits[:2, :1], none, target_positions(none))) == 0.0


class MetricsTrainer(Trainer):
    """A subclass that reads full logits in compute_loss (as TRL's SFTTrainer does for its metrics)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        width = inputs["input_ids"].shape[1]
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        self.logit_widths = [*getattr(self, "logit_widths", []), (outputs.logits.shape[1], width)]
        return (loss, outputs) if return_outputs else loss


def test_a_subclass_compute_loss_or_a_label_smoother_keeps_full_logits(tmp_path):
    with pytest.warns(FallbackWarning, match=r"MetricsTrainer\.compute_loss overrides the loss") as seen:
        trainer, *_ = run(
            tmp_path,
            "packed",
            {"capacity": 192},
            target_logits_only=True,
            trainer_cls=with_smart_batching(MetricsTrainer),
        )
    assert trainer.smart_batching.target_logits is False
    assert sum(w.category is FallbackWarning for w in seen) == 1  # once, not per step
    assert recorded_fallbacks() == {"trainer.target_logits": 1}
    assert all(got == width for got, width in trainer.logit_widths)  # every position of the packed row
    smoothed = SmartBatchingTrainer(
        model=tiny_llama(),
        args=sgd_args(tmp_path / "smooth", label_smoothing_factor=0.1),
        train_dataset=prompt_dataset(),
        strategy="packed",
        strategy_options={"capacity": 192},
    )
    reset_fallbacks()
    with pytest.warns(FallbackWarning, match="label smoother"):
        smoothed.train()
    assert smoothed.smart_batching.target_logits is False


def test_asking_for_full_logits_is_no_fallback(tmp_path, recwarn):
    trainer, *_ = run(tmp_path, "packed", {"capacity": 192}, target_logits_only=False)
    assert trainer.smart_batching.target_logits is False
    assert not [w for w in recwarn if w.category is FallbackWarning] and recorded_fallbacks() == {}


def test_one_pass_cross_entropy_equals_torch_including_underflow_and_ignored_rows():
    torch.manual_seed(2)
    logits = (torch.randn(1, 9, VOCAB) * 4).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, 10))
    labels[0, 3] = -100
    with torch.no_grad():
        logits[0, 0, 7] = 300.0  # a confident wrong prediction: its target's probability underflows to 0
    labels[0, 1] = 8
    keep = torch.arange(9)
    ours = kept_token_loss_sum(logits, labels, keep)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = token_loss_sum(torch.cat([logits, logits[:, -1:]], dim=1), labels)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert torch.isfinite(ours) and float(ours.detach()) > 290.0
    assert torch.allclose(ours, ref, rtol=1e-6)
    assert torch.allclose(g_ours, g_ref, atol=1e-6)


def _head_case(seed: int = 3, rows: int = 2, seq: int = 40, hidden: int = 24, bias: bool = False):
    torch.manual_seed(seed)
    h = torch.randn(rows, seq, hidden, requires_grad=True)
    head = torch.nn.Linear(hidden, VOCAB, bias=bias)
    targets = torch.randint(0, VOCAB, (rows, seq))
    targets[0, :7] = -100
    targets[1, 30:] = -100
    return h, head, targets


@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_loss_gradients_and_metrics_equal_the_logits_path(monkeypatch, bias):
    """The LM head fused with the loss (in chunks, gradients formed in the forward pass) equals
    F.linear + cross-entropy: loss, the three gradients, and TRL's entropy / argmax metrics."""
    from smart_batching import loss as loss_module
    from smart_batching.loss import linear_token_loss_sum

    monkeypatch.setattr(loss_module, "_CHUNK_LOGITS", 7 * VOCAB)  # chunks of 64 tokens, the last one short
    h, head, targets = _head_case(bias=bias, seq=90)
    with torch.no_grad():  # vocabulary entries 5 and 9 tie as the largest logit wherever h . w_5 > 0
        head.weight[5] = head.weight[5] * 8
        head.weight[9] = head.weight[5]
        if bias:
            head.bias[9] = head.bias[5]
        top = torch.nn.functional.linear(h, head.weight, head.bias).argmax(-1)
    hits = targets.ne(-100) & (torch.arange(targets.shape[1]) % 3 == 0)
    targets[hits] = top[hits]  # a third of the targets are the argmax...
    ties = targets.ne(-100) & (torch.arange(targets.shape[1]) % 3 == 1) & top.eq(5)
    targets[ties] = 9  # ...and some are the later of two tied maxima, which is no hit (argmax: the first)
    total, entropy, correct, scored = linear_token_loss_sum(h, head.weight, head.bias, targets, metrics=True)
    grads = torch.autograd.grad(2.5 * total, [h, *head.parameters()])
    logits = torch.nn.functional.linear(h, head.weight, head.bias)
    ref = token_loss_sum(logits, targets, shift_labels=False)
    ref_grads = torch.autograd.grad(2.5 * ref, [h, *head.parameters()])
    torch.testing.assert_close(total, ref, rtol=1e-6, atol=1e-4)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    valid = targets.ne(-100)
    logp = torch.log_softmax(logits.detach()[valid], dim=-1)
    assert int(scored) == int(valid.sum()) > 64  # two chunks
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(), rtol=1e-5, atol=1e-4)
    assert int(correct) == int((logp.argmax(-1) == targets[valid]).sum()) > 10
    assert int(ties.sum()) > 3


def test_fused_head_under_bf16_autocast_runs_its_products_in_the_dtype_asked():
    """Under bf16 autocast the fused head multiplies in bf16 (as autocast's F.linear does) or, where
    the CPU has no bf16 instructions, in float32; the loss matches the autocast logits path within
    bf16 rounding, and float32 products match the float32 loss closely."""
    from smart_batching.loss import linear_token_loss_sum

    h, head, targets = _head_case(seq=64, hidden=64)
    fp32 = token_loss_sum(torch.nn.functional.linear(h, head.weight), targets, shift_labels=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = token_loss_sum(torch.nn.functional.linear(h, head.weight), targets, shift_labels=False)
        (ref_grad,) = torch.autograd.grad(ref, [h])
        half = linear_token_loss_sum(h, head.weight, None, targets)[0]  # autocast's dtype: bf16
        (half_grad,) = torch.autograd.grad(half, [h])
        full = linear_token_loss_sum(h, head.weight, None, targets, matmul_dtype=torch.float32)[0]
    assert ref.dtype == half.dtype == full.dtype == torch.float32
    torch.testing.assert_close(half, ref, rtol=2e-3, atol=0.0)
    torch.testing.assert_close(half_grad, ref_grad, rtol=0.05, atol=2e-3)
    torch.testing.assert_close(full, fp32, rtol=1e-6, atol=1e-4)  # float32 products: no bf16 rounding
    assert float((half - fp32).detach().abs()) > float((full - fp32).detach().abs())  # bf16 did round


class ScaledLlamaForCausalLM(LlamaForCausalLM):
    """A causal LM whose forward rescales the logits without a config attribute saying so."""

    def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = out.logits * 1.0
        return out


def test_a_forward_that_transforms_the_head_output_falls_back_to_logits(tmp_path):
    """The fused loss is used only where the forward returns the head's output unchanged; otherwise the
    step is recomputed from the logits (same loss as with target_logits_only's logits), said once."""
    torch.manual_seed(0)
    model = ScaledLlamaForCausalLM(tiny_llama().config)
    model.load_state_dict(tiny_llama().state_dict())
    trainer = SmartBatchingTrainer(
        model=model, args=sgd_args(tmp_path / "scaled"), train_dataset=prompt_dataset(), strategy="packed",
        strategy_options={"capacity": 192},
    )  # fmt: skip
    with pytest.warns(FallbackWarning, match="transforms its LM head's output"):
        loss = float(trainer.train().training_loss)
    assert trainer.smart_batching.fused_head is False and trainer.smart_batching.target_logits is True
    assert recorded_fallbacks() == {"trainer.fused_lm_head": 1}
    _, ref, _, _ = run(tmp_path, "packed", {"capacity": 192}, target_logits_only=True)
    assert abs(loss - ref) <= 1e-5
