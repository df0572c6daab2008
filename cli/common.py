"""What the commands share: where the store is, and the one store a command was given (its options: options.py)."""
from __future__ import annotations

import click
from ncanalyze.store import layout


def default_store() -> str:
    """``$NCANALYZE_STORE`` or ``./ncanalyze.zarr`` (ncanalyze.store.layout.default_store)."""
    return layout.default_store()


def resolve_store(positional: str | None, option: str | None) -> str:
    """The one store a command was given (either form; both must agree), else the default."""
    if positional and option and positional != option:
        raise click.UsageError(f"two stores given: {positional} and --store {option}; pass one")
    return positional or option or default_store()
