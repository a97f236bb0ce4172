"""The analysis room: what each strategy would cost on given lengths, as tables, JSON and plots.

``tables`` plans every strategy side by side and reports padding, efficiency and the packing lower
bound (:func:`analyze`, :func:`format_table`); ``plots`` draws them (matplotlib, imported on use).
"""

from smart_batching.analysis.tables import (
    DEFAULT_STRATEGIES,
    TOKEN_ROUNDING,
    analyze,
    default_max_tokens,
    format_table,
    length_summary,
    parse_strategy,
)

__all__ = [
    "DEFAULT_STRATEGIES",
    "TOKEN_ROUNDING",
    "analyze",
    "default_max_tokens",
    "format_table",
    "length_summary",
    "parse_strategy",
]
