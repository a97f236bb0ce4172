"""The order in which requests go to an engine: prefix groups kept together, long work first.

An engine such as vLLM schedules requests first come, first served and caches prefixes
automatically, but which requests share a prefix and in what order they arrive is left to the caller.
Sent in input order, requests with several interleaved prefixes (system prompts, few-shot sets) keep
every prefix resident at once, and under KV-memory pressure a prefix is evicted between two of its
requests and computed again. Here the whole request set is analysed at once (the BatchLLM idea):

* a prefix tree over token ids: :func:`find_prefix_groups` groups prompts sharing at least
  ``min_prefix`` tokens, and the grouping recurses into each group's suffixes, so nested prefixes
  (a shared system prompt, then distinct few-shot sets) are kept together at every level;
* each unit (a group, or a prompt in no group) is ordered by its expected work, longest first:
  ``prompt tokens + expected new tokens`` (the caller's hint, else ``max_new_tokens``), so the longest
  requests start early and the tail of the run is short.

Pure NumPy: O(n * L * depth) for n prompts of at most L tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.inference._prefix import find_prefix_groups


def expected_work(
    token_id_lists: Sequence[Sequence[int]],
    max_new_tokens: int,
    expected_output_lengths: Sequence[float] | None = None,
) -> np.ndarray:
    """Expected tokens of each request, ``(n,)`` float64: its prompt plus its expected new tokens
    (capped at ``max_new_tokens``; None: ``max_new_tokens`` for all)."""
    n = len(token_id_lists)
    prompt = np.fromiter((len(t) for t in token_id_lists), dtype=np.float64, count=n)
    if expected_output_lengths is None:
        return prompt + max_new_tokens
    out = np.asarray(expected_output_lengths, dtype=np.float64)
    if out.shape != (n,) or not np.all(np.isfinite(out)) or (out < 0).any():
        raise ConfigError(f"expected_output_lengths= must hold one non-negative number per prompt ({n})")
    return prompt + np.minimum(out, max_new_tokens)


def submission_order(
    token_id_lists: Sequence[Sequence[int]], work: np.ndarray, *, min_prefix: int = 32
) -> np.ndarray:
    """Order of the requests, ``(n,)`` int64: every prefix group contiguous (recursively), and the
    units of each level in decreasing expected work (a group counts as its costliest member).

    Args:
        token_id_lists: Token ids of each request.
        work: ``(n,)`` expected work of each request (:func:`expected_work`).
        min_prefix: Shortest shared prefix, in tokens, that makes a group.

    Example (``min_prefix=2``)::

        prompts  0: A A x    1: B B y y y    2: A A z z    3: C
        groups   {0, 2} share "A A"; 1 and 3 share nothing
        work     3  5  4  1  ->  order [1, 2, 0, 3]: B's request, then A's group (costliest first), C
    """
    n = len(token_id_lists)
    work = np.asarray(work, dtype=np.float64)
    if work.shape != (n,):
        raise ConfigError(f"work must hold one number per request ({n}), got shape {work.shape}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)

    def order(members: np.ndarray, start: int) -> np.ndarray:
        groups = find_prefix_groups([token_id_lists[i][start:] for i in members], min_prefix=min_prefix)
        keys: list[float] = []
        units: list[np.ndarray] = []
        grouped = np.zeros(len(members), dtype=bool)
        for local, prefix in groups:
            grouped[local] = True
            units.append(order(members[local], start + prefix))
            keys.append(float(work[members[local]].max()))
        for i in members[~grouped]:
            units.append(np.array([i], dtype=np.int64))
            keys.append(float(work[i]))
        ranked = np.argsort(-np.asarray(keys), kind="stable")
        return np.concatenate([units[u] for u in ranked])

    return order(np.arange(n, dtype=np.int64), 0)


def shared_prefix_tokens(token_id_lists: Sequence[Sequence[int]]) -> int:
    """Prompt tokens a perfect prefix cache would not compute: the prompt tokens minus the nodes of
    the prefix tree over all prompts (the sum, over prompts sorted lexicographically, of each one's
    longest common prefix with its predecessor)."""
    n = len(token_id_lists)
    if n < 2:
        return 0
    ranked = sorted(range(n), key=lambda i: list(token_id_lists[i]))
    total = 0
    for a, b in zip(ranked[:-1], ranked[1:], strict=True):
        x, y = token_id_lists[a], token_id_lists[b]
        m = min(len(x), len(y))
        k = 0
        while k < m and x[k] == y[k]:
            k += 1
        total += k
    return total
