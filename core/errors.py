"""The exception types for bad input: the CLI prints them as a one-line error and exits non-zero.

They live on the ground floor (``ncanalyze.core``) so that every package can raise them; nothing else here is shared
but the one check every subpackage makes on import (:func:`refuse_a_shadowing_clone`).
"""
import sys


class UserError(Exception):
    """Bad input or a state the user can fix; the message names the problem and the fix."""


class CheckpointError(UserError):
    """A checkpoint that is bad in itself (unreadable weights, NaN features): it fails alone, and a run over many
    checkpoints goes on with the others."""


def refuse_a_shadowing_clone() -> None:
    """An ImportError in one line where ``ncanalyze`` was found as a namespace package: a source clone folder named
    ``ncanalyze`` with Python run from the folder above it (the current folder comes first on sys.path), which
    shadows the installed package and would half-work (no xarray accessor, no version). Each subpackage's
    ``__init__`` calls it."""
    package = sys.modules.get("ncanalyze")
    if package is not None and getattr(package, "__file__", None) is None:
        folder = next(iter(getattr(package, "__path__", [])), "?")
        raise ImportError(f"'import ncanalyze' found the source folder {folder} (a clone named ncanalyze), not the "
                          "package, because Python runs from the folder above it: run Python from another folder "
                          "(the clone itself, or anywhere else)")
