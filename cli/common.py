"""What the commands share: where the store is, and how a command takes it."""
from __future__ import annotations

from collections.abc import Callable

import click

from ncanalyze.store import layout


def default_store() -> str:
    """``$NCANALYZE_STORE`` or ``./ncanalyze.zarr`` (ncanalyze.store.layout.default_store)."""
    return layout.default_store()


def store_option(f: Callable) -> Callable:
    """``--store PATH`` (default ``$NCANALYZE_STORE`` or ./ncanalyze.zarr), passed as ``store``."""
    return click.option("--store", type=click.Path(), default=None, metavar="PATH",
                        help="Zarr store [default: $NCANALYZE_STORE, else ./ncanalyze.zarr].")(f)


def store_argument(f: Callable) -> Callable:
    """The store as a positional ``[STORE]`` (passed as ``store_positional``) or ``--store PATH``; the command
    reconciles the two with :func:`resolve_store`."""
    return click.argument("store_positional", required=False, metavar="[STORE]")(store_option(f))


def resolve_store(positional: str | None, option: str | None) -> str:
    """The one store a command was given (either form; both must agree), else the default."""
    if positional and option and positional != option:
        raise click.UsageError(f"two stores given: {positional} and --store {option}; pass one")
    return positional or option or default_store()
