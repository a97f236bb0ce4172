"""Groups of prompts that share a long prefix (a system prompt, few-shot examples)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from smart_batching.errors import ConfigError


@dataclass(frozen=True)
class PrefixGroups:
    """Groups of prompts sharing a prefix, stored flat::

        members        [4 9 1 | 0 7]      # (num_grouped,) prompt indices, group by group
        group_offsets  [0 3 5]            # (num_groups + 1,)
        prefix_lengths [120 48]           # (num_groups,) tokens shared by every member of the group

    Every member has at least one token after its group's prefix.
    """

    members: np.ndarray
    group_offsets: np.ndarray
    prefix_lengths: np.ndarray
    num_prompts: int

    def __len__(self) -> int:
        return len(self.prefix_lengths)

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        for g in range(len(self)):
            yield self.members[self.group_offsets[g] : self.group_offsets[g + 1]], int(self.prefix_lengths[g])

    @property
    def tokens_saved(self) -> int:
        """Prefill tokens saved when each group's prefix is run once instead of once per member."""
        sizes = np.diff(self.group_offsets)
        return int(((sizes - 1) * self.prefix_lengths).sum())


# --------------------------------------------------------------------------------------------------
# Prefix groups
# --------------------------------------------------------------------------------------------------


def find_prefix_groups(
    token_id_lists: Sequence[Sequence[int]], *, min_prefix: int = 32, min_group_size: int = 2
) -> PrefixGroups:
    """Find prompts that share a long common prefix, over the whole input at once.

    The token sequences are sorted lexicographically (sequences with a common prefix become
    neighbours), the longest common prefix (LCP) of each pair of neighbours is computed in one
    vectorised comparison, and maximal runs of neighbours whose LCP is at least ``min_prefix`` form
    the groups; a group's prefix is the smallest LCP inside its run, capped so that every member keeps
    one token of its own. O(n * L) time and memory for n prompts of at most L tokens.

    One level only: prompts sharing a 500-token system prompt, some of which also share 300 more
    tokens of examples, form one group with a 500-token prefix.

    Args:
        token_id_lists: token ids of each prompt.
        min_prefix: shortest shared prefix (tokens) worth a group.
        min_group_size: fewest prompts in a group.

    Returns:
        The groups; prompts in no group are absent from ``members``.
    """
    if min_prefix < 1 or min_group_size < 2:
        raise ConfigError(
            f"min_prefix= must be >= 1 and min_group_size= >= 2; got {min_prefix}, {min_group_size}"
        )
    n = len(token_id_lists)
    lens = np.fromiter((len(t) for t in token_id_lists), dtype=np.int64, count=n)
    empty = PrefixGroups(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64), n)
    if n < min_group_size or lens.max(initial=0) <= min_prefix:
        return empty
    width = int(lens.max())
    grid = np.full((n, width), -1, dtype=np.int64)  # -1 pads: sorts a prefix before its extensions
    grid[np.arange(width) < lens[:, None]] = np.concatenate(
        [np.asarray(t, dtype=np.int64) for t in token_id_lists]
    )
    order = np.lexsort(grid.T[::-1])  # (n,) lexicographic, column 0 first
    rows = grid[order]
    eq = (rows[1:] == rows[:-1]) & (rows[1:] >= 0)  # (n - 1, width): equal real tokens
    lcp = np.logical_and.accumulate(eq, axis=1).sum(axis=1)  # (n - 1,)
    slens = lens[order]
    lcp = np.minimum(lcp, np.minimum(slens[1:], slens[:-1]) - 1)  # every member keeps one own token
    link = lcp >= min_prefix  # (n - 1,) neighbours i, i+1 share a prefix
    starts = np.flatnonzero(np.r_[True, ~link])  # (num_runs,) first sorted position of each run
    sizes = np.diff(np.r_[starts, n])
    keep = sizes >= min_group_size
    if not keep.any():
        return empty
    big = np.iinfo(np.int64).max
    # Between two kept runs lie only non-links (set to `big`), so each segment's min is its run's prefix.
    prefix = np.minimum.reduceat(np.where(link, lcp, big), starts[keep])
    run_of = np.repeat(np.arange(len(starts)), sizes)  # (n,) run of each sorted position
    members = order[keep[run_of]]
    offsets = np.r_[0, np.cumsum(sizes[keep])].astype(np.int64)
    return PrefixGroups(members.astype(np.int64), offsets, prefix.astype(np.int64), n)
