"""The ``smart-batching`` command line (also ``python -m smart_batching``).

Each subcommand is a module of this package that defines ``add_parser(subparsers)``: it adds its
parser and sets ``func`` (a function of the parsed arguments returning an exit code) with
``set_defaults``. Modules are found by name, so a new command (``train``, ``bench``, ``infer``,
``report``) is one new file here; :data:`COMMAND_ORDER` only orders the help listing.

Command modules import only the standard library and light project modules at import time;
transformers, datasets and matplotlib are imported inside ``func``, so ``--help`` stays fast.

Errors a user can fix (a bad setting, an empty dataset, a missing column, an overlong example under
``--overlong error``) print one line, ``error: ...``, and exit with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from smart_batching.errors import SmartBatchingError

COMMAND_ORDER = ("analyze", "demo", "train", "bench", "infer", "report")

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERNAL = 1


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose usage errors are one ``error: ...`` line (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"error: {message} (see '{self.prog} --help')\n")


def command_modules() -> list[str]:
    """Names of the subcommand modules in this package, in help order."""
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    rank = {name: i for i, name in enumerate(COMMAND_ORDER)}
    return sorted(found, key=lambda name: (rank.get(name, len(rank)), name))


def build_parser() -> ArgumentParser:
    """The top-level parser with every subcommand registered."""
    from smart_batching import __version__

    parser = ArgumentParser(
        prog="smart-batching",
        description="Plan padding-free batches and measure what they save.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of a failure (anywhere on the line; or SMART_BATCHING_DEBUG=1)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name in command_modules():
        module = importlib.import_module(f"{__name__}.{name}")
        add = getattr(module, "add_parser", None)
        if add is not None:
            add(subparsers)
    return parser


def print_error(exc: BaseException, *, hint: str | None = None) -> None:
    """Print an exception as one ``error: ...`` line on stderr (its type too, unless it is one of
    ours, whose messages say what to change)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, UnicodeDecodeError):
        message = (
            f"the input is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "convert the file to UTF-8"
        )
    elif not isinstance(exc, SmartBatchingError | OSError):
        message = f"{type(exc).__name__}: {message}"
    print(f"error: {message}" + (f" ({hint})" if hint else ""), file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 user error).

    Args:
        argv: arguments without the program name; None means ``sys.argv[1:]``.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug anywhere on the line (or SMART_BATCHING_DEBUG=1): tracebacks instead of one-line errors.
    debug = "--debug" in argv or os.environ.get("SMART_BATCHING_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(func(args) or EXIT_OK)
    except BrokenPipeError:  # output piped into `head` and closed: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (SmartBatchingError, OSError, UnicodeDecodeError, ValueError) as exc:
        if debug:
            raise
        print_error(exc)
        return EXIT_USAGE
    except Exception as exc:  # a bug or an upstream failure: still one line, the traceback on --debug
        if debug:
            raise
        print_error(exc, hint="run again with --debug for the traceback")
        return EXIT_INTERNAL


__all__ = ["ArgumentParser", "build_parser", "command_modules", "main", "print_error"]
