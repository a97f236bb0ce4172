"""Models: the offline real assets by alias (:mod:`.assets`: SmolLM2-135M-Instruct from its GGUF file,
all-MiniLM-L6-v2) and the models the bench and ``smart-batching train`` fine-tune by name
(:mod:`.zoo`: ``tiny-llama``, ``smollm2``, ``minilm``, with one set of initial weights for every run).

Importing this package loads neither torch nor transformers; the functions do, when called.
"""

from __future__ import annotations

from smart_batching.models.assets import (
    MODEL_ALIASES,
    default_device,
    hf_folder,
    load_model,
    load_model_and_tokenizer,
    resolve_dtype,
    save_hf_folder,
)
from smart_batching.models.zoo import BENCH_MODELS, TINY_LLAMA, TrainingModel, load_training_model

__all__ = [
    "BENCH_MODELS",
    "MODEL_ALIASES",
    "TINY_LLAMA",
    "TrainingModel",
    "default_device",
    "hf_folder",
    "load_model",
    "load_model_and_tokenizer",
    "load_training_model",
    "resolve_dtype",
    "save_hf_folder",
]
