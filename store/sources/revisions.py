"""Revisions of a Hub model as asked for on the command line (SPEC section 2): ``--revision REV``, ``--revisions
PREFIXstart:stop:step`` (a generator, bounded) or ``@FILE``; each checked to be a name that cannot lead through the Hub
cache (:func:`check_revision`); and the training step a revision's name holds (:func:`step_of`).
"""
from __future__ import annotations

import re
from pathlib import Path

from ncanalyze.core.errors import UserError

COMMIT = re.compile(r"^[0-9a-f]{40}$")
_RANGE = re.compile(r"^(?P<prefix>\D*?)(?P<start>\d+):(?P=prefix)?(?P<stop>\d+)(?::(?P<step>\d+))?$")
MAX_REVISIONS = 100_000  # a sane bound on one run's revisions (Pythia's suite has 154)


def check_revision(revision: str) -> str:
    """A revision string that is safe to use as a path in the Hub cache (``refs/<revision>``) and as a group name.

    Parameters
    ----------
    revision
        A revision as given.

    Returns
    -------
    str
        It, unchanged.

    Raises
    ------
    UserError
        For '', '.', '..', a backslash or control character, or a ``/``-separated part that is empty, '.' or '..'.
    """
    parts = revision.split("/")
    if (not revision.strip() or any(p in ("", ".", "..") for p in parts) or "\\" in revision
            or any(ord(c) < 32 for c in revision)):
        raise UserError(f"revision {revision!r} is not a branch, tag or commit name (empty, '.', '..', or a path "
                        "through the cache); pass a name like main, step1000 or a commit hash")
    return revision


def revision_range(spec: str):
    """``PREFIXstart:stop[:step]`` as a generator of revisions (inclusive, the prefix and any zero padding kept:
    ``iter_0001000:0003000:1000`` -> iter_0001000, iter_0002000, iter_0003000), refused in one line beyond
    :data:`MAX_REVISIONS` before any is made.

    Parameters
    ----------
    spec
        One ``--revisions`` value that is not ``@FILE``.

    Returns
    -------
    generator of str
        The revisions, in order.
    """
    m = _RANGE.match(spec)
    if not m:
        raise UserError(f"--revisions {spec!r} is not START:STOP:STEP (e.g. step1000:143000:1000) or @FILE")
    start, stop, step = int(m["start"]), int(m["stop"]), int(m["step"] or 1)
    if step < 1 or stop < start:
        raise UserError(f"--revisions {spec!r}: need STOP >= START and STEP >= 1")
    if (stop - start) // step + 1 > MAX_REVISIONS:
        raise UserError(f"--revisions {spec!r} names {(stop - start) // step + 1:,} revisions, more than "
                        f"{MAX_REVISIONS:,}: raise STEP or narrow START:STOP")
    width = len(m["start"]) if m["start"].startswith("0") and len(m["start"]) > 1 else 0
    return (f"{m['prefix']}{n:0{width}d}" for n in range(start, stop + 1, step))


def _revision_file(spec: str) -> list[str]:
    try:
        lines = Path(spec[1:]).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or "not text"
        raise UserError(f"--revisions {spec}: cannot read {spec[1:]} ({why}); pass a file with one revision per "
                        "line") from None
    out = [s.split("#", 1)[0].strip() for s in lines if s.split("#", 1)[0].strip()]
    if not out:
        raise UserError(f"--revisions {spec}: {spec[1:]} names no revision (empty, or only comments); put one "
                        "revision per line in it")
    return out


def parse_revisions(revisions: tuple[str, ...] | list[str], compact: tuple[str, ...] | list[str] = ()) -> list[str]:
    """Every revision asked for, in order, without repeats, each checked (:func:`check_revision`): ``--revision REV``
    as given; ``--revisions`` as ``PREFIXstart:stop:step`` (:func:`revision_range`) or ``@FILE`` (one revision per
    line; blank lines and ``#`` comments skipped; a file naming none is refused).

    Parameters
    ----------
    revisions
        ``--revision`` values.
    compact
        ``--revisions`` values.

    Returns
    -------
    list of str
        The revisions (``main`` when none), at most :data:`MAX_REVISIONS`.
    """
    out = dict.fromkeys(check_revision(r) for r in revisions)
    for spec in compact:
        for rev in (_revision_file(spec) if spec.startswith("@") else revision_range(spec)):
            out[check_revision(rev)] = None
            if len(out) > MAX_REVISIONS:
                raise UserError(f"--revisions: more than {MAX_REVISIONS:,} revisions in all; run them in parts")
    return list(out) or ["main"]


def step_of(revision: str) -> int | None:
    """The training step a revision's name holds: the number after 'step' (``step1000``, ``step1000-tokens4B``),
    else its only number (``checkpoint-500``, ``iter_0002000``); None for names without one and commit hashes.

    Parameters
    ----------
    revision
        A revision's name.

    Returns
    -------
    int or None
        The step.
    """
    if COMMIT.match(revision):
        return None
    m = re.search(r"step[-_]?(\d+)", revision, re.IGNORECASE)
    if m:
        return int(m.group(1))
    numbers = re.findall(r"\d+", revision)
    return int(numbers[0]) if len(numbers) == 1 else None
