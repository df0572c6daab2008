"""The names of runs and checkpoints: checked wherever they come from (the user, the Trainer, folders on disk), and
shown safely wherever they are printed.

A name is one level of the store's hierarchy (a run's folder ``<run>``, a checkpoint's ``<run>/<checkpoint>``): it
must not climb out of it or split it. :func:`shown` is the one helper every text output uses to print a name, so that
a terminal escape or a bidi control in a folder's name is printed escaped, never obeyed by the terminal.

It lives on the ground floor (``ncanalyze.core``), so that the store, the commands and the report all use the same one.
"""
from __future__ import annotations

import unicodedata

from ncanalyze.core.errors import UserError

_HIDDEN = {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}  # controls, format (bidi) and line separators, unassigned


def _escape(ch: str) -> str:
    """One character as Python writes it escaped: ``\\x1b``, ``\\u202e``, ``\\U000e0001``."""
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def shown(name: object) -> str:
    """``name`` safe to print on a terminal or in a text file: every control, format (bidi override, zero-width)
    and line- or paragraph-separator character escaped as ``\\x1b`` or ``\\u202e``, and a name of white space
    alone escaped whole (``\\x20``); other text as it is.

    Parameters
    ----------
    name
        A run's, checkpoint's or group's name (anything: it is made a string).

    Returns
    -------
    str
        The name, escaped where it must be.
    """
    text = str(name)
    if text and not text.strip():  # white space alone (a run named " "): every character shown
        return "".join(_escape(c) for c in text)
    return "".join(_escape(c) if unicodedata.category(c) in _HIDDEN else c for c in text)


def name_problem(name: str, controls: bool = True) -> str | None:
    """Why ``name`` cannot be one level of the store (a run's or a checkpoint's name), or None: empty, ``.`` or
    ``..``, starting with ``.`` (the store hides those), holding a path separator (``/`` or ``\\``) or a control
    or invisible formatting character (what :func:`shown` escapes: a terminal escape, a bidi override), or only
    white space.

    Parameters
    ----------
    name
        The name.
    controls
        Refuse control characters too (a new name); without, only what breaks the path (a name read from the
        store's folders, shown escaped by :func:`shown`).

    Returns
    -------
    str or None
        The problem, as a phrase.
    """
    if not name:
        return "is empty"
    if name in (".", ".."):
        return "is a path's . or .."
    if name.startswith("."):
        return "starts with . (the store hides such names)"
    if "/" in name or "\\" in name:
        return "holds a path separator (/ or \\)"
    if controls and not name.strip():
        return "is only white space (invisible wherever it is shown)"
    if controls and any(unicodedata.category(c) in _HIDDEN for c in name):
        return "holds a control or invisible formatting character (a terminal escape, a bidi control)"
    return None


def check_name(name: str, what: str, fix: str, controls: bool = True) -> str:
    """``name`` when it can be one level of the store (:func:`name_problem`), else a one-line UserError.

    Parameters
    ----------
    name
        The name.
    what
        What it names, for the message (``the run name``, ``the run folder /x/y``).
    fix
        What to do instead.
    controls
        As :func:`name_problem`'s.

    Returns
    -------
    str
        ``name``.
    """
    problem = name_problem(name, controls)
    if problem:
        raise UserError(f"{what} {shown(repr(name))} {problem}, so it cannot name a group of the store: {fix}")
    return name
