"""The options several commands share, each defined once and applied by name: ``@option("min_count", "measure")``.

An option's flag, type and default live here only; where it means something slightly different to a command, the
registry holds that command's help text beside the common one (``Shared.helps``). Light on purpose: importing this
module (as ``ncanalyze --help`` does) imports click and nothing of the store or the analyzer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"


@dataclass(frozen=True)
class Shared:
    """One shared option: click's declarations and settings, its help, and the commands' own help texts."""

    decls: tuple[str, ...]
    help: str
    settings: dict[str, Any] = field(default_factory=dict)
    helps: dict[str, str] = field(default_factory=dict)  # command -> help, where it differs from ``help``


_SCHEDULER = ("a Dask distributed scheduler: tcp://host:8786 or a scheduler file .json [env: DASK_SCHEDULER_ADDRESS; "
              "default: {default}]. Its workers must see {paths} at the same paths.")

OPTIONS: dict[str, Shared] = {
    "store": Shared(
        ("--store",), "Zarr store [default: $NCANALYZE_STORE, else ./ncanalyze.zarr].",
        dict(type=click.Path(), default=None, metavar="PATH")),
    "scheduler": Shared(
        ("--scheduler",), "Measure on " + _SCHEDULER.format(default="local threads", paths="the store"),
        dict(envvar=SCHEDULER_ENV, metavar="ADDRESS"),
        helps={
            "extract": "Run each checkpoint as a task on " + _SCHEDULER.format(
                default="this process", paths="the checkpoints, the data and the store")
            + " Workers started with --resources GPU=1 take one checkpoint at a time, on the GPU their "
              "CUDA_VISIBLE_DEVICES gives.",
            "report": "Measure what is new on " + _SCHEDULER.format(default="local threads", paths="the store"),
        }),
    "min_count": Shared(
        ("--min-count",), "Keep only classes with at least this many train tokens.",
        dict(type=click.IntRange(1), default=1, show_default=True),
        helps={
            "extract": "Classes with fewer train tokens are left out of NC4's decisions (fixed at extraction: "
                       "measuring with another --min-count reports NC4 as nan).",
            "report": "Keep only classes with at least this many train tokens (when measuring what is new).",
        }),
    "device": Shared(
        ("--device",), "auto (CUDA when present, else CPU), cpu, cuda, cuda:N.",
        dict(default="auto", show_default=True),
        helps={"measure": "Where the pairwise sums and the d x d work run: auto (torch float64 on CUDA when present, "
                          "else the numba pass on the CPU), cpu, cuda, cuda:N."}),
    "tile": Shared(
        ("--tile",), "Classes per tile of the pairwise sums [default: from the available memory, at most 2048].",
        dict(type=click.IntRange(1))),
    "seed": Shared(
        ("--seed",), "Random seed.", dict(type=click.IntRange(0, 2**63 - 1), default=0, show_default=True),
        helps={"extract": "Seed of the reservoir sample and of the blocks a token cap draws (--cap-mode spread).",
               "report": "Seed of the permutations."}),
}


def option(name: str, command: str | None = None) -> Callable[[Callable], Callable]:
    """The click decorator of the shared option ``name``, with ``command``'s help text where it has its own.

    Parameters
    ----------
    name
        A key of :data:`OPTIONS` (the parameter's name, e.g. ``"min_count"``).
    command
        The command it decorates (``"extract"``, ``"measure"``, ``"report"``), for its own help text.

    Returns
    -------
    Callable
        ``click.option(...)`` for that option.
    """
    shared = OPTIONS[name]
    return click.option(*shared.decls, name, help=shared.helps.get(command, shared.help), **shared.settings)


def store_argument(command: str) -> Callable[[Callable], Callable]:
    """The store as a positional ``[STORE]`` (passed as ``store_positional``) or ``--store PATH``; the command
    reconciles the two with :func:`ncanalyze.cli.common.resolve_store`."""
    def decorate(f: Callable) -> Callable:
        return click.argument("store_positional", required=False, metavar="[STORE]")(option("store", command)(f))

    return decorate
