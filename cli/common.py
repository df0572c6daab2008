"""What the commands share: where the store is, and the one store a command was given, resolved once into the
``Store`` it passes down (its options: options.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import click
from ncanalyze.store import layout

if TYPE_CHECKING:
    from ncanalyze.store.store import Store


def resolve_store(positional: str | None, option: str | None) -> str:
    """The one store a command was given (either form; both must agree), else the default."""
    if positional and option and positional != option:
        raise click.UsageError(f"two stores given: {positional} and --store {option}; pass one")
    return positional or option or layout.default_store()


def open_store(positional: str | None, option: str | None) -> Store:
    """:func:`resolve_store` as the :class:`~ncanalyze.store.store.Store` the command passes down (its layout resolved
    once; zarr loads here, not at ``--help``)."""
    from ncanalyze.store.store import Store

    return Store.at(resolve_store(positional, option))
