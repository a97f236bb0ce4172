"""The analysis room: what each strategy would cost on given lengths, as tables, JSON and plots.

``tables`` plans every strategy side by side and reports padding, efficiency and the packing lower
bound (:func:`analyze`, :func:`format_table`); ``randomness`` measures what grouping costs in batch
randomness over two epochs (:func:`batch_randomness`); ``weights`` what a plan does to the weight of a
token per length quarter (:func:`token_weights`); ``plots`` draws them (matplotlib, imported on use).
"""

from smart_batching.analysis.randomness import batch_randomness
from smart_batching.analysis.tables import (
    DEFAULT_STRATEGIES,
    TOKEN_ROUNDING,
    analyze,
    default_max_tokens,
    format_schedule,
    format_table,
    length_summary,
    parse_strategy,
)
from smart_batching.analysis.weights import token_weights

__all__ = [
    "DEFAULT_STRATEGIES",
    "TOKEN_ROUNDING",
    "analyze",
    "batch_randomness",
    "default_max_tokens",
    "format_schedule",
    "format_table",
    "length_summary",
    "parse_strategy",
    "token_weights",
]
