"""Record shapes and how a record becomes the text that is tokenised.

Four shapes are recognised from the column names, in this order (the first match wins):

==================  ======================================================================
format              columns
==================  ======================================================================
messages            ``messages``: a list of ``{"role", "content"}`` (chat)
alpaca              ``instruction`` + ``output``; optional ``input``, ``history`` (a list of
                    ``[user, assistant]`` pairs for earlier turns) and ``system``
prompt_completion   ``prompt`` + ``completion`` (strings, or TRL's lists of messages), or
                    ``question`` + ``answer`` (as GSM8K)
text                the first of ``text``, ``sentence``, ``content``
==================  ======================================================================

Every record renders to a *prompt* and a *completion* whose concatenation is the full text, so a
collator can mask the prompt in ``labels`` (``-100``) without re-rendering::

    text = prompt + completion
           |<- masked ->|<- trained ->|

Rendering rules:

* **Chat template.** ``messages`` (and conversational ``prompt``/``completion``, lists of
  messages as in TRL) use the tokenizer's chat template when it has one. ``alpaca``
  uses it only when the data has a ``history`` column (multi-turn data is chat data) and the
  tokenizer has a template; single-turn ``alpaca``, ``prompt_completion`` and ``text`` are plain
  text, so their lengths are the content alone. ``use_chat_template=True`` forces the template for
  every shape but ``text``; ``False`` never uses it. The decision is per dataset, never per row.
* **Chat prompt/completion.** The completion is the last assistant turn as the template writes it
  (with its end-of-turn marker); the prompt is the template applied to the earlier turns with
  ``add_generation_prompt=True``. A conversation that does not end with an assistant turn is all
  prompt. If a template rewrites earlier turns so that the prompt is not a prefix of the full
  text, the whole text becomes completion.
* **Plain text.** Turns and fields are joined with ``"\\n"`` (instruction and input with
  ``"\\n\\n"``); the prompt ends with ``"\\n"`` unless the prompt already ends, or the completion
  already starts, with whitespace (TRL-style ``prompt``/``completion`` data owns its separator).
  Chat data without a chat template renders as the message contents joined by ``"\\n"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from smart_batching.errors import ConfigError, DataError

FORMATS = ("messages", "alpaca", "prompt_completion", "text")
TEXT_COLUMNS = ("text", "sentence", "content")
PROMPT_COMPLETION_COLUMNS = (("prompt", "completion"), ("question", "answer"))

_SHAPES_HELP = (
    "messages (a 'messages' list of {role, content}), alpaca ('instruction' + 'output', optional "
    "'input', 'history', 'system'), prompt_completion ('prompt' + 'completion' or 'question' + "
    "'answer'), text (a 'text', 'sentence' or 'content' column)"
)


def detect_format(column_names: Iterable[str]) -> str:
    """Name the record shape of a dataset from its column names.

    Returns:
        One of :data:`FORMATS`.

    Raises:
        DataError: no shape matches; the message lists the columns found and the shapes supported.
    """
    cols = set(column_names)
    if "messages" in cols:
        return "messages"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if any(set(pair) <= cols for pair in PROMPT_COMPLETION_COLUMNS):
        return "prompt_completion"
    if any(c in cols for c in TEXT_COLUMNS):
        return "text"
    raise DataError(
        f"cannot tell the record format from the columns {sorted(cols)}; supported shapes: "
        f"{_SHAPES_HELP}. Rename a column, or pass column= naming token lengths or input_ids"
    )


def resolve_format(format: str, column_names: Iterable[str]) -> str:
    """``detect_format`` for ``"auto"``; otherwise check that the named format's columns exist.

    Raises:
        ConfigError: ``format`` is not ``"auto"`` or one of :data:`FORMATS`.
        DataError: the columns that format needs are missing.
    """
    cols = list(column_names)
    if format == "auto":
        return detect_format(cols)
    if format not in FORMATS:
        raise ConfigError(f"format={format!r} is not supported; use 'auto' or one of {', '.join(FORMATS)}")
    have = set(cols)
    ok = {
        "messages": "messages" in have,
        "alpaca": {"instruction", "output"} <= have,
        "prompt_completion": any(set(p) <= have for p in PROMPT_COMPLETION_COLUMNS),
        "text": any(c in have for c in TEXT_COLUMNS),
    }[format]
    if not ok:
        raise DataError(
            f"format={format!r} does not fit the columns {sorted(have)}; supported: {_SHAPES_HELP}"
        )
    return format


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def is_conversational(batch: Mapping[str, Sequence[Any]]) -> bool:
    """Whether ``prompt``/``completion`` hold lists of messages (TRL's conversational form)."""
    values = batch.get("prompt")
    if values is None:
        return False
    first = next((v for v in values if v is not None), None)
    return isinstance(first, list)


def uses_chat_template(
    format: str,
    column_names: Iterable[str],
    tokenizer: Any,
    use_chat_template: bool | None = None,
    *,
    conversational: bool = False,
) -> bool:
    """Whether records of this shape render through the tokenizer's chat template (see module doc).

    ``conversational``: the prompt/completion columns hold lists of messages (then the default is
    to use the template, as for ``messages``).

    Raises:
        ConfigError: ``use_chat_template=True`` but the tokenizer has no chat template.
    """
    if format == "text" or use_chat_template is False:
        return False
    available = tokenizer is not None and has_chat_template(tokenizer)
    if use_chat_template:
        if not available:
            raise ConfigError(
                "use_chat_template=True but the tokenizer has no chat template; pass "
                "use_chat_template=None or a chat tokenizer (e.g. 'smollm2')"
            )
        return True
    if format == "messages" or (format == "prompt_completion" and conversational):
        return available
    if format == "alpaca":
        return available and "history" in set(column_names)
    return False


@dataclass(frozen=True)
class RenderedBatch:
    """Texts of a batch of records, split into the prompt and the completion of each.

    Attributes:
        prompts: Text before the trained part (masked in ``labels``); ``""`` for plain text.
        completions: The trained part.
        chat_template: True when the texts came from the tokenizer's chat template. Tokenise such
            text with ``add_special_tokens=False``: the template already wrote BOS and the like.
        assistant_spans: with ``render_batch(..., assistant_spans=True)``, the ``[start, end)``
            character spans of every assistant turn in each full text, in order (:func:`assistant_spans`);
            else None.
    """

    prompts: list[str]
    completions: list[str]
    chat_template: bool
    assistant_spans: list[list[tuple[int, int]]] | None = None

    @property
    def texts(self) -> list[str]:
        """Full texts, ``prompt + completion``."""
        return [p + c for p, c in zip(self.prompts, self.completions, strict=True)]


def render_texts(
    batch: Mapping[str, Sequence[Any]],
    tokenizer: Any = None,
    *,
    format: str = "auto",
    use_chat_template: bool | None = None,
) -> list[str]:
    """Full texts of a batch of records (a dict of columns, as ``Dataset.map(batched=True)`` gives).

    Cheaper than :func:`render_batch` for chat data: it renders each conversation once.
    """
    return render_full(batch, tokenizer, format=format, use_chat_template=use_chat_template)[0]


def render_full(
    batch: Mapping[str, Sequence[Any]],
    tokenizer: Any = None,
    *,
    format: str = "auto",
    use_chat_template: bool | None = None,
) -> tuple[list[str], bool]:
    """Like :func:`render_texts`, and whether the chat template was used (then tokenise the texts
    with ``add_special_tokens=False``)."""
    fmt = resolve_format(format, batch.keys())
    chat = uses_chat_template(
        fmt, batch.keys(), tokenizer, use_chat_template, conversational=is_conversational(batch)
    )
    if chat:
        convs = _conversations(fmt, batch)
        return _apply_template(tokenizer, [c for c, _ in convs]), True
    return render_batch(batch, tokenizer, format=fmt, use_chat_template=False).texts, False


def render_batch(
    batch: Mapping[str, Sequence[Any]],
    tokenizer: Any = None,
    *,
    format: str = "auto",
    use_chat_template: bool | None = None,
    assistant_spans: bool = False,
) -> RenderedBatch:
    """Render a batch of records to prompt and completion texts.

    Args:
        batch: Columns of the records, each a list of one value per record.
        tokenizer: A HF tokenizer; only its chat template is used. None renders plain text.
        format: ``"auto"`` (:func:`detect_format`) or one of :data:`FORMATS`.
        use_chat_template: None: the per-shape default of the module docstring; True: always
            (except ``text``); False: never.
        assistant_spans: also locate every assistant turn in the full texts
            (:attr:`RenderedBatch.assistant_spans`, see :func:`assistant_spans`).

    Returns:
        A :class:`RenderedBatch` with one prompt and one completion per record.

    Raises:
        DataError: ``assistant_spans=True`` and the chat template writes an earlier turn differently
            once a later one follows (an assistant turn cannot be located in the full text).
    """
    fmt = resolve_format(format, batch.keys())
    chat = uses_chat_template(
        fmt, batch.keys(), tokenizer, use_chat_template, conversational=is_conversational(batch)
    )
    if fmt == "text":
        col = next(c for c in TEXT_COLUMNS if c in batch)
        texts = [_s(t) for t in batch[col]]
        spans = [[(0, len(t))] if t else [] for t in texts] if assistant_spans else None
        return RenderedBatch([""] * len(texts), texts, False, spans)
    convs = _conversations(fmt, batch)
    spans = None
    if chat:
        prompts, completions = _split_with_template(tokenizer, convs)
        if assistant_spans:
            fulls = [p + c for p, c in zip(prompts, completions, strict=True)]
            spans = _template_spans(tokenizer, convs, fulls)
    else:
        prompts, completions = _split_plain(convs)
        if assistant_spans:
            spans = _plain_spans(convs, prompts, completions)
    return RenderedBatch(prompts, completions, chat, spans)


def assistant_spans(
    batch: Mapping[str, Sequence[Any]],
    tokenizer: Any = None,
    *,
    format: str = "auto",
    use_chat_template: bool | None = None,
) -> list[list[tuple[int, int]]]:
    """The ``[start, end)`` character spans of every assistant turn in each record's full text.

    What ``loss_on="assistant"`` trains on (TRL's ``assistant_only_loss``, without needing a chat template
    with ``{% generation %}`` markers). With a chat template, a turn runs from the end of the template
    applied to the turns before it with ``add_generation_prompt=True`` to the end of the template applied
    up to and including it, so it holds the reply and its end-of-turn marker::

        <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user ...
                                                             |<- span 1 ------->|

    Without a template (plain text), a turn is its content and the ``"\n"`` after it. ``text`` records
    are one span, the whole text; ``prompt_completion`` records one span, the completion (its assistant
    messages when conversational). A record without an assistant turn has no span.

    >>> assistant_spans({"messages": [[{"role": "user", "content": "Hi"},
    ...                                {"role": "assistant", "content": "Hello"},
    ...                                {"role": "user", "content": "Bye"},
    ...                                {"role": "assistant", "content": "See you"}]]})
    [[(3, 9), (13, 20)]]

    Raises:
        DataError: the chat template writes an earlier turn differently once a later one follows, so a
            turn cannot be located in the full text (use ``loss_on="completion"``, the last reply).
    """
    spans = render_batch(
        batch, tokenizer, format=format, use_chat_template=use_chat_template, assistant_spans=True
    ).assistant_spans
    assert spans is not None
    return spans


def _s(value: Any) -> str:
    return "" if value is None else str(value)


def _clean(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    # Arrow unifies struct fields across rows, so a message may carry keys set to None
    # (e.g. tool_calls); templates test for presence, so drop them.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


class BadRecordError(DataError):
    """A record whose fields do not have the shape's form; ``row`` is its index in the batch rendered."""

    def __init__(self, row: int, problem: str) -> None:
        super().__init__(f"record {row + 1} of its batch: {problem}")
        self.row, self.problem = row, problem


def _check_messages(msgs: Any, row: int) -> None:
    if msgs is None:
        return
    if isinstance(msgs, str) or not isinstance(msgs, Sequence):
        raise BadRecordError(
            row, f"'messages' is a {type(msgs).__name__}, expected a list of {{role, content}} messages"
        )
    for k, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise BadRecordError(row, f"message {k + 1} is a {type(m).__name__}, expected {{role, content}}")
        if not m.get("role"):
            raise BadRecordError(row, f"message {k + 1} has no 'role' (user, assistant or system)")


def _conversations(fmt: str, batch: Mapping[str, Sequence[Any]]) -> list[tuple[list[dict], int]]:
    """Each record as (messages, number of leading prompt messages)."""
    n = len(next(iter(batch.values()))) if batch else 0
    out: list[tuple[list[dict], int]] = []
    if fmt == "messages":
        for i, msgs in enumerate(batch["messages"]):
            _check_messages(msgs, i)
            msgs = _clean(msgs or [])
            last_is_reply = bool(msgs) and msgs[-1].get("role") == "assistant"
            out.append((msgs, len(msgs) - 1 if last_is_reply else len(msgs)))
    elif fmt == "alpaca":
        inputs = batch.get("input") or [None] * n
        histories = batch.get("history") or [None] * n
        systems = batch.get("system") or [None] * n
        for instr, inp, out_text, hist, system in zip(
            batch["instruction"], inputs, batch["output"], histories, systems, strict=True
        ):
            msgs: list[dict] = []
            if system:
                msgs.append({"role": "system", "content": _s(system)})
            for pair in hist or []:
                user, reply = (list(pair) + [None, None])[:2]
                msgs += [{"role": "user", "content": _s(user)}, {"role": "assistant", "content": _s(reply)}]
            user = _s(instr) + (f"\n\n{inp}" if inp else "")
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": _s(out_text)}]
            out.append((msgs, len(msgs) - 1))
    else:  # prompt_completion
        p_col, c_col = next(pair for pair in PROMPT_COMPLETION_COLUMNS if set(pair) <= set(batch))
        for i, (prompt, completion) in enumerate(zip(batch[p_col], batch[c_col], strict=True)):
            if isinstance(prompt, list) or isinstance(
                completion, list
            ):  # TRL conversational prompt/completion
                if not (isinstance(prompt, list | type(None)) and isinstance(completion, list | type(None))):
                    raise BadRecordError(
                        i, f"{p_col!r} and {c_col!r} must both be messages or both be text, not one of each"
                    )
                _check_messages(prompt, i)
                _check_messages(completion, i)
                prompt = prompt or []
                p_msgs, c_msgs = _clean(prompt), _clean(completion or [])
                out.append((p_msgs + c_msgs, len(p_msgs)))
            else:
                msgs = [
                    {"role": "user", "content": _s(prompt)},
                    {"role": "assistant", "content": _s(completion)},
                ]
                out.append((msgs, 1))
    return out


def _apply_template(tokenizer: Any, convs: list[list[dict]], **kwargs: Any) -> list[str]:
    if not convs:
        return []
    rendered = tokenizer.apply_chat_template(convs, tokenize=False, **kwargs)
    return [rendered] if isinstance(rendered, str) else list(rendered)


def _split_with_template(tokenizer: Any, convs: list[tuple[list[dict], int]]) -> tuple[list[str], list[str]]:
    fulls = _apply_template(tokenizer, [msgs for msgs, _ in convs])
    prompts = [""] * len(convs)
    completions = list(fulls)
    # Render only the prefixes that have a completion after them, in one batched call.
    todo = [i for i, (msgs, k) in enumerate(convs) if k < len(msgs)]
    prefixes = _apply_template(
        tokenizer, [convs[i][0][: convs[i][1]] for i in todo], add_generation_prompt=True
    )
    for i, prefix in zip(todo, prefixes, strict=True):
        if fulls[i].startswith(prefix):
            prompts[i], completions[i] = prefix, fulls[i][len(prefix) :]
    for i, (msgs, k) in enumerate(convs):
        if k == len(msgs):
            prompts[i], completions[i] = fulls[i], ""
    return prompts, completions


def _template_spans(
    tokenizer: Any, convs: list[tuple[list[dict], int]], fulls: list[str]
) -> list[list[tuple[int, int]]]:
    """Assistant turns of templated conversations: two batched template calls over all their prefixes."""
    todo = [
        (i, j)
        for i, (msgs, _) in enumerate(convs)
        for j, m in enumerate(msgs)
        if m.get("role") == "assistant"
    ]
    starts = _apply_template(tokenizer, [convs[i][0][:j] for i, j in todo], add_generation_prompt=True)
    # Through a conversation's last message is the whole conversation, rendered already (``fulls``).
    inner = iter(
        _apply_template(tokenizer, [convs[i][0][: j + 1] for i, j in todo if j + 1 < len(convs[i][0])])
    )
    ends = [next(inner) if j + 1 < len(convs[i][0]) else fulls[i] for i, j in todo]
    spans: list[list[tuple[int, int]]] = [[] for _ in convs]
    for (i, j), before, through in zip(todo, starts, ends, strict=True):
        full = fulls[i]
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise BadRecordError(
                i,
                f"the chat template writes the turns before assistant message {j + 1} differently once later "
                "turns follow, so that turn cannot be located in the full text; train on the last reply "
                "(loss_on='completion') or use a template that renders earlier turns unchanged",
            )
        spans[i].append((len(before), len(through)))
    return spans


def _plain_spans(
    convs: list[tuple[list[dict], int]], prompts: list[str], completions: list[str]
) -> list[list[tuple[int, int]]]:
    """Assistant turns of plain-text conversations (the contents joined by ``"\n"``, see _split_plain)."""
    spans: list[list[tuple[int, int]]] = []
    for (msgs, k), prompt, completion in zip(convs, prompts, completions, strict=True):
        out: list[tuple[int, int]] = []
        start = 0
        for m in msgs[:k]:  # the prompt: contents joined by "\n"
            end = start + len(_s(m.get("content")))
            if m.get("role") == "assistant":
                out.append((start, min(end + 1, len(prompt))))
            start = end + 1
        if completion and any(m.get("role") == "assistant" for m in msgs[k:]):
            out.append((len(prompt), len(prompt) + len(completion)))
        spans.append(out)
    return spans


def _with_sep(prompt: str, completion: str) -> str:
    if not prompt or prompt[-1].isspace() or completion[:1].isspace():
        return prompt
    return prompt + "\n"


def _split_plain(convs: list[tuple[list[dict], int]]) -> tuple[list[str], list[str]]:
    prompts: list[str] = []
    completions: list[str] = []
    for msgs, k in convs:
        prompt = "\n".join(_s(m.get("content")) for m in msgs[:k])
        completion = "\n".join(_s(m.get("content")) for m in msgs[k:])
        prompts.append(_with_sep(prompt, completion) if completion else prompt)
        completions.append(completion)
    return prompts, completions
