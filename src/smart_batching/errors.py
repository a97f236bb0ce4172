"""Errors raised by smart-batching.

Every message names the setting to change, so a user can fix the call without reading the source.
"""

from __future__ import annotations


class SmartBatchingError(Exception):
    """Base class for all errors raised by smart-batching."""


class ConfigError(SmartBatchingError, ValueError):
    """A setting is invalid. The message names the setting (e.g. ``capacity=``) to change."""


class DataError(SmartBatchingError, ValueError):
    """The data cannot be used: empty, malformed, missing a column, or with invalid lengths."""


class OverlongError(ConfigError):
    """An example is longer than the limit and the overlong policy is ``"error"``."""


class MissingExtraError(SmartBatchingError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


def require(module: str, extra: str):
    """Import an optional dependency or raise :class:`MissingExtraError` naming the extra.

    Args:
        module: Importable module name, e.g. ``"transformers"``.
        extra: The ``smart-batching[...]`` extra that provides it, e.g. ``"hf"``.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingExtraError(
            f"{module!r} is required for this feature: pip install 'smart-batching[{extra}]'"
        ) from exc
