"""Helpers shared by the commands: store location, user errors."""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version as _pkg_version

import click

DEFAULT_STORE = "ncanalyze.zarr"


def version() -> str:
    try:
        return _pkg_version("ncanalyze")
    except PackageNotFoundError:
        return "0+unknown"


def default_store() -> str:
    """``$NCANALYZE_STORE`` or ``./ncanalyze.zarr``."""
    return os.environ.get("NCANALYZE_STORE", DEFAULT_STORE)


store_option = click.option(
    "--store", type=click.Path(file_okay=False), default=default_store, show_default="./ncanalyze.zarr or $NCANALYZE_STORE",
    help="Zarr store to write to / read from.",
)
