"""The commands' options: those generated from a settings registry (:func:`setting_option`, :func:`setting_groups`;
the settings themselves: ncanalyze.analyzer.registry, ncanalyze.store.extraction.settings), and the few that say
where a command works rather than what it computes, shared by name: ``@option("store", "measure")``.

An option's flag, type and default live in one place; where it means something slightly different to a command, the
registry holds that command's help text beside the common one (``helps``). Light on purpose: importing this module
(as ``ncanalyze --help`` does) imports click, cloup and the registry's light module, nothing of the store.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import click
import cloup
from ncanalyze.core.setting import flag_of, refused

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
}


def option(name: str, command: str | None = None) -> Callable[[Callable], Callable]:
    """The click decorator of the shared option ``name``, with ``command``'s help text where it has its own.

    Parameters
    ----------
    name
        A key of :data:`OPTIONS` (the parameter's name, e.g. ``"scheduler"``).
    command
        The command it decorates (``"extract"``, ``"measure"``, ``"report"``), for its own help text.

    Returns
    -------
    Callable
        ``click.option(...)`` for that option.
    """
    shared = OPTIONS[name]
    return click.option(*shared.decls, name, help=shared.helps.get(command, shared.help), **shared.settings)


store_positional = click.argument("store_positional", required=False, metavar="[STORE]")  # or --store (OPTIONS)


def store_argument(command: str) -> Callable[[Callable], Callable]:
    """The store as a positional ``[STORE]`` (passed as ``store_positional``) or ``--store PATH``; the command
    reconciles the two with :func:`ncanalyze.cli.common.resolve_store`."""
    def decorate(f: Callable) -> Callable:
        return store_positional(option("store", command)(f))

    return decorate


def setting_option(f: dataclasses.Field, command: str | None = None) -> Callable[[Callable], Callable]:
    """The click option of one setting, made from its field: flag, help (``command``'s own where it has one), default
    and metavar. Its value is checked by the settings class itself (so the command and the library refuse alike, in
    one line); ``--help`` shows its range or choices."""
    meta, name = f.metadata, f.name
    flag, kind, text = flag_of(f), meta["kind"], meta["helps"].get(command, meta["help"])
    default = None if f.default is dataclasses.MISSING else f.default
    if kind is bool:
        if default is False:
            return click.option(flag, name, is_flag=True, default=False, help=text)
        return click.option(f"{flag}/--no-{flag[2:]}", name, default=True, show_default=True, help=text)
    if kind is tuple and meta["multiple"]:
        return click.option(flag, name, multiple=True, default=default, metavar=meta["metavar"], help=text)
    if kind is tuple:
        default = ",".join(default)
    choices = meta["choices"] and "[" + "|".join(meta["choices"]) + "]"
    typ = SettingNumber(f) if kind in (int, float) else click.STRING
    return click.option(flag, name, cls=SettingOption, type=typ, default=default,
                        show_default=meta["shown"] or default not in (None, ""),
                        required=f.default is dataclasses.MISSING, metavar=meta["metavar"] or choices, help=text,
                        bounds=_bounds(meta))


def _bounds(meta: dict) -> str | None:
    """A setting's range as ``--help`` shows it (``x>=1``, ``0<=x<=99``), or None."""
    low, high = meta["minimum"], meta["maximum"]
    if low is None:
        return None
    return f"x>={low}" if high is None or high > 2**32 else f"{low}<=x<={high}"


class SettingNumber(click.ParamType):
    """A number setting's value from the command line: ASCII digits only (``²`` and other Unicode digits are not
    numbers here), else refused with the setting's rule in its one line, as the library refuses a value."""

    def __init__(self, f: dataclasses.Field):
        self.f, self.kind = f, f.metadata["kind"]
        self.name = "integer" if self.kind is int else "float"

    def convert(self, value: Any, param, ctx) -> Any:
        if not isinstance(value, str):
            return value
        try:
            if not value.isascii():
                raise ValueError(value)
            return int(value) if self.kind is int else float(value)
        except ValueError:
            low, high = self.f.metadata["minimum"], self.f.metadata["maximum"]
            what = "an integer" if self.kind is int else "a number"
            raise refused(self.f, f"must be {what} from {low} to {high}", value) from None


class SettingOption(click.Option):
    """A setting's option: ``--help`` shows its range beside its default, as click's own ranges do."""

    def __init__(self, *args, bounds: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds = bounds

    def get_help_extra(self, ctx: click.Context) -> dict:
        extra = super().get_help_extra(ctx)
        if self.bounds:
            extra["range"] = self.bounds
        return extra


def setting_groups(titles: Iterable[str], command: str, *registries: type,
                   more: dict[str, list[Callable]] | None = None) -> Callable[[Callable], Callable]:
    """Every option of ``command`` in its ``--help`` section, in the order of ``titles``: the settings' generated
    from the registries' fields (each field's ``section``), then ``more`` (the command's own options by section)."""
    settings = [f for cls in registries for f in dataclasses.fields(cls) if "section" in f.metadata]

    def decorate(func: Callable) -> Callable:
        for title in reversed(list(titles)):
            group = [setting_option(f, command) for f in settings if f.metadata["section"] == title]
            func = cloup.option_group(title, *group, *(more or {}).get(title, []))(func)
        return func

    return decorate


def settings_of(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` made from a command's parameters: those that are its settings (the others stay with the command)."""
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})
