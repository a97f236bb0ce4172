"""The policy and reference models under ``DPOTrainer``: log-probabilities computed from a packed row
(or only at the target positions of a padded batch), handed to TRL in its own padded layout.

TRL's ``DPOTrainer`` computes per-token log-probabilities with its fused LM head:
``model(input_ids, attention_mask, labels, fused_lm_head=True)`` returns ``log_probs`` (and entropy,
mean logit, top-1 and, for WPO, ``log_sum_sq_probs``) of shape ``(2 * pairs, width - 1)``, 0 where the
label is -100, and every loss and metric of TRL reads them there. :class:`PairForward` hooks the model
so that TRL's call runs something cheaper and returns the same tensors:

* **packed batches** (a ``packed_pairs`` entry, :class:`~smart_batching.hf.dpo.collate.PairCollator`):
  the backbone runs on the padding-free row (prompt once per pair with prompt sharing);
* **padded batches** (``target_logits_only``): the backbone runs on TRL's batch as it is;

then, in both, the hidden states that predict a target token are gathered (``source``) and TRL's own
fused LM head scores them as pre-shifted ``shift_labels`` (so the LM head runs only at target
positions, as TRL's GPU path does), and the per-token outputs are scattered back to
``(2 * pairs, width - 1)``. TRL's loss code, metrics, ``ld_alpha``, ``use_weighting`` and every
``loss_type`` then run on values equal to its padded computation (to floating-point summation order).

Before step 1 each model that will take packed rows runs a probe pair both ways (:func:`check_pair_layout`)
and is refused if the packed row's hidden states differ from the padded ones: a model whose attention does
not follow the layout is never trained on leaking rows.
"""

from __future__ import annotations

from typing import Any

import torch

from smart_batching import compat
from smart_batching.errors import ConfigError, DataError
from smart_batching.hf.dpo.collate import PACKED_PAIRS, PairCollator
from smart_batching.units import IGNORE_INDEX


class PairForward:
    """Forward hooks on one model (policy or reference) that compute TRL's per-token outputs from a
    packed row or at the target positions only; see the module docstring.

    Args:
        model: The module ``DPOTrainer`` calls (unwrapped from accelerate/DDP).
        target_logits_only: Also take padded batches to the target positions (False: TRL's own path).
        attention: Attention implementations allowed for packed rows (checked at every packed call).
    """

    def __init__(self, model: Any, *, target_logits_only: bool, attention: tuple[str, ...]) -> None:
        self.model = model
        self.target_logits_only = target_logits_only
        self.attention = attention
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        backbone = compat.trl_backbone(model)
        self.handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True, prepend=True),
            backbone.register_forward_hook(self._gather),
            model.register_forward_hook(self._scatter, with_kwargs=True),
        ]

    def remove(self) -> None:
        """Uninstall the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _before(
        self, module: Any, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[tuple, dict[str, Any]] | None:
        self._pending = None
        packed = kwargs.pop(PACKED_PAIRS, None)
        labels = kwargs.get("labels")
        if not kwargs.get("fused_lm_head") or labels is None or args:
            if packed is not None:
                raise ConfigError(
                    "a packed pair batch reached the model outside DPOTrainer's log-probability call "
                    "(model(..., labels=..., fused_lm_head=True)); only DPOTrainer's training loss reads it"
                )
            return None
        if packed is None and not self.target_logits_only:
            return None
        valid = labels[:, 1:] != IGNORE_INDEX  # (2 * pairs, width - 1): TRL's scored positions
        targets = labels[:, 1:][valid]  # (targets,)
        kwargs.pop("labels")
        if packed is None:
            rows, cols = valid.nonzero(as_tuple=True)
            source = rows * labels.shape[1] + cols  # flat position of the hidden state predicting each
        else:
            self._check_attention(module)
            source = packed["source"]
            if source.shape[0] != targets.shape[0]:
                raise DataError(
                    f"the packed row predicts {source.shape[0]} target tokens, the padded view has "
                    f"{targets.shape[0]}: build the batch with PairCollator"
                )
            kwargs.pop("input_ids", None)
            kwargs.pop("attention_mask", None)
            kwargs.update({k: v for k, v in packed.items() if k != "source"})
        kwargs["shift_labels"] = targets[None]
        self._pending = (source, valid)
        return args, kwargs

    def _gather(self, module: Any, args: tuple, output: Any) -> Any:
        if self._pending is None:
            return None
        hidden = output.last_hidden_state  # (rows, tokens, hidden)
        output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self._pending[0])[
            None
        ]
        return output

    def _scatter(self, module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        valid = pending[1]
        for name in compat.TRL_FUSED_LM_HEAD_FIELDS:
            value = getattr(output, name, None)
            if value is not None:
                output[name] = value.new_zeros(valid.shape).masked_scatter(valid, value.reshape(-1))
        return output

    def _check_attention(self, module: Any) -> None:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if impl not in self.attention:
            raise ConfigError(
                f"a packed pair row reached {type(module).__name__} with attention {impl!r}, which would let "
                f"its sequences attend to each other; smart batching set {self.attention[0]!r}: do not switch "
                "the attention implementation after apply_smart_batching"
            )


def pair_models(trainer: Any) -> list[Any]:
    """The models ``DPOTrainer`` runs: the policy, and the reference model when it keeps one."""
    unwrap = trainer.accelerator.unwrap_model
    models = [unwrap(trainer.model)]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(unwrap(trainer.ref_model))
    return models


def check_pair_layout(model: Any, *, prompt_sharing: bool) -> None:
    """Run a probe pair through ``model`` padded and packed, and refuse the model if they disagree.

    Raises:
        ConfigError: the packed row's hidden states differ from the padded sequences' (its attention
            does not follow the layout), naming the model and its attention implementation.
    """
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 16)
    ids = [t % vocab for t in (5, 6, 7, 8, 9, 10, 11, 12)]
    pair = {"prompt_ids": ids[:3], "chosen_ids": ids[3:5], "rejected_ids": ids[5:]}
    batch = PairCollator(pad_token_id=0, layout="shared" if prompt_sharing else "unshared")([pair])
    packed = batch[PACKED_PAIRS]
    backbone = compat.trl_backbone(model)
    device = next(model.parameters()).device
    to = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            padded = backbone(
                input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)
            ).last_hidden_state  # (2, width, hidden)
            row = backbone(**{k: v for k, v in to.items() if k != "source"}).last_hidden_state[0]
    finally:
        model.train(was_training)
    mask = batch["attention_mask"].bool().to(device)
    rows, cols = mask.nonzero(as_tuple=True)
    # Row position of every real token of the view: sequences in order, prompt reused with sharing.
    positions = torch.cat([torch.arange(5), torch.arange(3) if prompt_sharing else torch.arange(5, 8)])
    positions = torch.cat([positions, torch.arange(5, 8) if prompt_sharing else torch.arange(8, 11)])
    expected, got = padded[rows, cols].float(), row[positions.to(device)].float()
    tolerance = 1e-3 if padded.dtype == torch.float32 else 5e-2
    scale = expected.abs().max().clamp(min=1.0)
    if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance * scale):
        impl = getattr(config, "_attn_implementation", None)
        raise ConfigError(
            f"{type(model).__name__} (attention {impl!r}) does not keep the sequences of a packed pair row "
            f"apart: its hidden states differ from the padded ones by {float((got - expected).abs().max()):.3g}. "
            "Its attention does not follow the layout; use a padded strategy (token_budget, group_by_length)"
            + (" or prompt_sharing=False" if prompt_sharing else "")
        )
