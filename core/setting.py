"""The settings mechanism: a setting is a dataclass field that says, once, its default, its validation, its flag,
its help and its ``--help`` section (:func:`setting`); :func:`check_fields` checks every value when the settings
are made, so the library, the training callback and the CLI refuse a bad value with the same line:
``batch_size (--batch-size) must be between 1 and 65536, got 0``.

Here too: the settings several commands share (:data:`SHARED`: ``min_count``, ``seed``, ``device``, ``threads``,
each default written once), the one device parser (:func:`device_of`) and the constants the store's settings share
(:data:`DTYPES`, :data:`CAP_MODES`, :data:`MAX_TOKENS`). The commands' own registries build on it:
ncanalyze.analyzer.registry (measure, report), ncanalyze.store.extraction.settings (extract). Light on purpose:
``--help`` imports it.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, field, fields
from typing import Any

from ncanalyze.core.errors import UserError

MAX_TOKENS = 2**53  # the most tokens any count or cap may say: exact in float64 (what the statistics hold)
DTYPES = ("float32", "bfloat16", "float16", "float64")  # model dtypes (extract --dtype)
STORED_DTYPES = tuple(d for d in DTYPES if d != "bfloat16")  # what numpy and Zarr store (--embeddings-dtype)
CAP_MODES = ("spread", "prefix")  # how a token cap reads a split (extract --cap-mode)
DEVICE_RULE = "auto, cpu, cuda or cuda:N"


def setting(default: Any = None, *, required: bool = False, section: str, help: str, kind: type | None = None,
            flag: str | None = None, metavar: str | None = None, minimum: float | None = None,
            maximum: float | None = None, choices: Sequence[str] | None = None,
            check: Callable[[Any], Any] | None = None, multiple: bool = False, shown: str | None = None,
            helps: dict[str, str] | None = None, **more: Any):
    """A setting: a dataclass field and everything said about it once.

    Parameters
    ----------
    default
        Its default value.
    required
        It has no default.
    section
        Its section of the command's ``--help``.
    help
        Its help text.
    kind
        Its type: ``int``, ``float``, ``str``, ``bool`` or ``tuple`` (strings; comma-separated on the command line)
        [default: the default's type, else ``str``].
    flag
        Its command-line flag [default: ``--`` and the name with dashes].
    metavar
        The value's name in ``--help``.
    minimum, maximum, choices
        The values it accepts (None: any of its type).
    check
        ``check(value) -> value``: converts a value or raises ``ValueError("must be ...")``; for a ``str`` setting
        it replaces the checks above (a value of its own syntax), else it runs after them.
    multiple
        A ``tuple`` setting given by repeating its flag (``--checkpoint A --checkpoint B``), not by commas.
    shown
        How ``--help`` says the default, where not the value itself (``all of them``).
    helps
        Another command's help text, by command, where the setting means something slightly different there.
    more
        More metadata (extraction's ``hashed``).

    Returns
    -------
    dataclasses.Field
        The field, all of the above in its metadata.
    """
    kind = kind or (type(default) if default is not None else str)
    return field(default=MISSING if required else default, metadata={
        "section": section, "help": help, "kind": kind, "flag": flag, "metavar": metavar, "minimum": minimum,
        "maximum": maximum, "choices": None if choices is None else tuple(choices), "check": check,
        "multiple": multiple, "shown": shown, "helps": helps or {}, **more})


def _device(value: str) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (whether it is there is asked where it is used)."""
    if not isinstance(value, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value.strip().lower()):
        raise ValueError(f"must be {DEVICE_RULE}")
    return value.strip().lower()


def device_of(value: Any) -> str:
    """A ``--device`` value checked as the settings check it (the one parser, the one message): ``auto``, ``cpu``,
    ``cuda`` or ``cuda:N``, lower case; else ``device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'``."""
    try:
        return _device(value)
    except ValueError as e:
        raise UserError(f"device (--device) {e}, got {value!r}") from None


def whole_number(value: int | str, maximum: int) -> int:
    """A whole number from 1 to ``maximum``: an int, or its ASCII digits (``"²"`` and other Unicode digits are not
    digits here, as the command line means them).

    Raises
    ------
    ValueError
        "must be auto or an integer from 1 to MAXIMUM" (said in one line with the flag).
    """
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= maximum:
        return value
    text = value.strip() if isinstance(value, str) else ""
    if re.fullmatch(r"[0-9]{1,19}", text) and 1 <= int(text) <= maximum:
        return int(text)
    raise ValueError(f"must be auto or an integer from 1 to {maximum}")


MAX_THREADS = 1024  # --threads N: more is no machine's core count, and torch's pool allocates per thread


def parse_threads(value: int | str | None) -> int | str:
    """``auto`` (None too) or a whole number from 1 to :data:`MAX_THREADS` (an int, or its digits): ``--threads``
    (ncanalyze.core.threads).

    Raises
    ------
    ValueError
        "must be auto or an integer from 1 to 1024" (said in one line with the flag).
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    return whole_number(value, MAX_THREADS)


THREADS_HELP = ("Threads of torch's CPU kernels: auto (the cores other processes leave idle, within this process's "
                "CPU affinity and cgroup quota, measured again every few seconds between batches: on a shared "
                "machine extra threads wait at every barrier for a descheduled one) or N. The caller's setting is "
                "restored afterwards.")


SHARED: dict[str, dict[str, Any]] = {  # the settings of several commands: flag, default and rule, once
    "min_count": dict(default=1, minimum=1, maximum=MAX_TOKENS),
    "seed": dict(default=0, minimum=0, maximum=2**63 - 1),
    "device": dict(default="auto", check=_device),
    "threads": dict(default="auto", kind=str, metavar="auto|N", check=parse_threads, maximum=MAX_THREADS),
}


def default(name: str) -> Any:
    """The default of the shared setting ``name`` (:data:`SHARED`), for a library signature: written once, here."""
    return SHARED[name]["default"]


def shared(name: str, **how: Any):
    """The field of the shared setting ``name`` (:data:`SHARED`) in one command's registry: its section and help."""
    return setting(**SHARED[name], **how)


def flag_of(f) -> str:
    """The command-line flag of the setting ``f`` (a dataclass field)."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def refused(f, reason: str, value: Any) -> UserError:
    """The one-line refusal of a setting's value: ``batch_size (--batch-size) must be between 1 and 65536, got 0``."""
    return UserError(f"{f.name} ({flag_of(f)}) {reason}, got {value!r}")


def field_of(cls: type, name: str):
    """The field ``name`` of the settings class ``cls``."""
    return next(f for f in fields(cls) if f.name == name)


def check_fields(settings: Any) -> None:
    """Check and convert every setting of a settings dataclass in place (frozen ones too): the one place a value is
    refused, in one line, whoever made the settings."""
    for f in fields(settings):
        if "section" in f.metadata:
            object.__setattr__(settings, f.name, checked(f, getattr(settings, f.name)))


def _items(f, value: Any) -> tuple[str, ...]:
    """A ``tuple`` setting's strings: a comma-separated string (empty items dropped) or a sequence of strings."""
    if isinstance(value, str) and not f.metadata["multiple"]:
        return tuple(x for x in value.split(",") if x.strip())
    if isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(x, str) for x in value):
        return tuple(value)
    raise refused(f, "must be strings (comma-separated on the command line)", value)


def checked(f, value: Any) -> Any:
    """A setting's value as checked and converted by its field's metadata; a bad one is :func:`refused` in one
    line."""
    meta = f.metadata
    kind, check = meta["kind"], meta["check"]
    if value is None and f.default is None:
        return None
    if kind is tuple:
        value = _items(f, value)
    elif check is not None and kind is str:  # a value of its own syntax (a size, auto|K, layers, a device)
        try:
            return check(value)
        except ValueError as e:
            raise refused(f, str(e), value) from None
    else:
        ok = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[kind]
        if not isinstance(value, ok) or (kind is not bool and isinstance(value, bool)):
            raise refused(f, f"must be {'a' if kind is not int else 'an'} {kind.__name__}", value)
    low, high, choices = meta["minimum"], meta["maximum"], meta["choices"]
    if low is not None and high is not None and not low <= value <= high:  # nan too
        raise refused(f, f"must be between {low} and {high}", value)
    if choices is not None and value not in choices:
        raise refused(f, f"must be one of {', '.join(choices)}", value)
    if check is not None:
        try:
            value = check(value)
        except ValueError as e:
            raise refused(f, str(e), value) from None
    return float(value) if kind is float else value
