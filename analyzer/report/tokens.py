"""The per-token table (the paper's Table 5): tokens given as strings or ids resolved against a checkpoint's
vocabulary, their per-class statistics and the average token, per checkpoint."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import pandas as pd
import xarray as xr

from ncanalyze.core.errors import UserError

TOKEN_VARIABLES = {"count": "count", "variance": "variance", "class_norm": "norm", "class_cdnv": "mean CDNV",
                   "class_interference": "mean interference", "class_duality": "duality cos", "class_nc4": "NC4 rate"}
AVERAGE_TOKEN = "(average token)"


class GroupReader(Protocol):
    """Gives a checkpoint's dataset (its per-class variables, lazily) by group name ``run/checkpoint``, or raises
    a :class:`UserError` naming the group; on a store, its ``Store.read`` (``ncanalyze.store.Store.at(path).read``)."""

    def __call__(self, group: str) -> xr.Dataset: ...


class TokenNote(UserWarning):
    """A token resolved other than as written (e.g. 'the' as ' the'), or left out: said in report.md and printed."""


class NotOneToken(UserError):
    """A token string the checkpoint's tokenizer makes several tokens of: the report leaves it out with a note."""


def _by_string(spec: str, strings: np.ndarray) -> int | None:
    """The id of a decoded token. A bare word means its space-prefixed token where the vocabulary has one (byte-level
    BPEs write a word after a space that way: 'and' is ' and', not the rare line-initial 'and'), with a
    :class:`TokenNote`; else an exact match; else a unique match ignoring surrounding spaces (with a
    :class:`TokenNote`); None where none matches."""
    exact = np.flatnonzero(strings == spec)
    spaced = np.flatnonzero(strings == " " + spec) if spec and not spec[0].isspace() else []
    if len(spaced):
        i = int(spaced[0])
        itself = f"; for the token {spec!r} itself pass its id {int(exact[0])}" if len(exact) else ""
        warnings.warn(TokenNote(f"token {spec!r} read as {strings[i]!r} (id {i}), the word after a space{itself}"),
                      stacklevel=3)
        return i
    if len(exact):
        return int(exact[0])
    near = np.flatnonzero(pd.Series(strings).str.strip() == spec.strip())
    if len(near) > 1:
        raise UserError(f"token {spec!r} is ambiguous: {', '.join(repr(strings[i]) for i in near)}; pass the "
                        "exact string (with its spaces) or the id")
    if len(near) == 1:
        i = int(near[0])
        warnings.warn(TokenNote(f"token {spec!r} is not in the vocabulary as written: using {strings[i]!r} "
                                f"(id {i}); pass {strings[i]!r} or {i} to say so"), stacklevel=3)
        return i
    return None


def _by_tokenizer(spec: str, tokenizer: str) -> int:
    """The id of ``spec`` if the checkpoint's tokenizer encodes it as one token."""
    from transformers import AutoTokenizer

    try:
        ids = AutoTokenizer.from_pretrained(tokenizer).encode(spec, add_special_tokens=False)
    except (OSError, ValueError, KeyError) as e:  # a missing or unreadable tokenizer folder
        raise UserError(f"cannot load the checkpoint's tokenizer {tokenizer!r} to resolve {spec!r} ({e}); pass "
                        "token ids instead") from None
    if len(ids) == 1:
        return int(ids[0])
    raise NotOneToken(f"{spec!r} is {len(ids)} tokens ({ids}) for this checkpoint's tokenizer, not one; pass a "
                      "single token (e.g. with its leading space) or an id")


def resolve_token(spec: str, strings: np.ndarray | None, tokenizer: str | None, vocab_size: int) -> int:
    """A token id from an integer or a token string.

    An integer is an id; a string is looked up in the decoded ``token`` coordinate (a bare word as its
    space-prefixed token where there is one, as ``examples/explore_store.py`` reads it; else an exact match; else a
    unique match ignoring surrounding spaces; a :class:`TokenNote` warning where read otherwise than written), else
    encoded by the checkpoint's tokenizer if it makes one token (:class:`NotOneToken` if several).

    Parameters
    ----------
    spec
        The token as the user gave it.
    strings
        The decoded tokens by id, or None where the store has none.
    tokenizer
        The checkpoint's tokenizer (name or folder), or None.
    vocab_size
        The vocabulary's size (an id must be below it).

    Returns
    -------
    int
        The token id; a :class:`UserError` where it is outside the vocabulary, ambiguous or not found.
    """
    if spec.strip().isdigit():
        i = int(spec)
        if i >= vocab_size:
            raise UserError(f"token id {i} is outside the vocabulary (size {vocab_size})")
        return i
    found = _by_string(spec, strings) if strings is not None else None
    if found is not None:
        return found
    if tokenizer:
        return _by_tokenizer(spec, tokenizer)
    raise UserError(f"token {spec!r} not found: the store has no decoded tokens or tokenizer; pass token ids")


def token_table(read_group: GroupReader, groups: Sequence[str], tokens: Sequence[str]) -> pd.DataFrame:
    """Per group and token: id, count, variance, norm, mean CDNV to the other kept classes, mean interference,
    duality and NC4 rate where measured, and an average-token row (the mean over the kept classes).

    Parameters
    ----------
    read_group
        Gives a checkpoint's dataset by group (:class:`GroupReader`).
    groups
        The checkpoints, ``run/checkpoint``.
    tokens
        The tokens (strings as decoded, or ids), resolved by :func:`resolve_token` in each checkpoint.

    Returns
    -------
    pandas.DataFrame
        Columns checkpoint, token, id (nullable integer; empty for the average token) and the statistics, count an
        integer (the average token's: the mean count over the kept classes, rounded).
    """
    rows = []
    for g in groups:
        ds = read_group(g)
        strings = np.array(ds["token"].values.tolist(), dtype=object) if "token" in ds.coords else None
        ids = [i for i in (_one_token(t, strings, ds, g) for t in tokens) if i is not None]
        per_class = ds[[v for v in TOKEN_VARIABLES if v in ds]].load()
        kept = per_class["class_cdnv"].notnull() if "class_cdnv" in per_class else per_class["count"] > 0
        for i in ids:
            tok = strings[i] if strings is not None else str(i)
            rows.append({"checkpoint": g, "token": tok, "id": i,
                         **{TOKEN_VARIABLES[v]: float(per_class[v][i]) for v in per_class.data_vars}})
        avg = per_class.where(kept).mean("vocab")
        rows.append({"checkpoint": g, "token": AVERAGE_TOKEN, "id": None,
                     **{TOKEN_VARIABLES[v]: float(avg[v]) for v in per_class.data_vars}})
    out = pd.DataFrame(rows).astype({"id": "Int64"})
    if "count" in out:
        out["count"] = out["count"].round().astype("Int64")  # the average token's: its mean, rounded
    return out


def _one_token(spec: str, strings: np.ndarray | None, ds: xr.Dataset, group: str) -> int | None:
    """:func:`resolve_token` in one checkpoint; a string its tokenizer makes several tokens of is left out with a
    :class:`TokenNote` (the report goes on) rather than raised."""
    try:
        return resolve_token(spec, strings, ds.attrs.get("tokenizer"), ds.sizes["vocab"])
    except NotOneToken as e:
        warnings.warn(TokenNote(f"{e} (left out of {group})"), stacklevel=3)
        return None


def per_token(read_group: GroupReader, groups: Sequence[str], tokens: Sequence[str]) -> tuple[pd.DataFrame, list[str]]:
    """:func:`token_table` with each token listed once per checkpoint, however often or in whichever spelling it
    was given.

    Parameters
    ----------
    read_group, groups, tokens
        As for :func:`token_table`.

    Returns
    -------
    table, notes
        The table, and a note for each token resolved other than as written or given twice.
    """
    specs = list(dict.fromkeys(tokens))
    notes = [f"token {t!r} given more than once: listed once" for t in specs if list(tokens).count(t) > 1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TokenNote)
        tok = token_table(read_group, groups, specs)
    for w in caught:
        if issubclass(w.category, TokenNote):
            notes.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    twice = tok[tok.id.notna() & tok.duplicated(["checkpoint", "id"])]
    for t in dict.fromkeys(twice.token):
        notes.append(f"token {t!r} given more than once (in different spellings): listed once")
    return tok.drop(index=twice.index).reset_index(drop=True), list(dict.fromkeys(notes))


def latest_checkpoints(df: pd.DataFrame) -> list[str]:
    """``run/checkpoint`` of each run's latest checkpoint (by global_step) among the rows.

    Parameters
    ----------
    df
        Checkpoints with run, checkpoint and global_step columns.

    Returns
    -------
    list of str
        One group per run, in order of run name (as text); a run's ties in global_step go to the last row.
    """
    key = df.assign(_run=df["run"].astype(str), _step=pd.to_numeric(df["global_step"], errors="coerce"))
    last = key.sort_values(["_run", "_step"], kind="stable", na_position="first").groupby("_run", sort=True).tail(1)
    return [f"{r}/{c}" for r, c in zip(last.run, last.checkpoint)]


def token_rows(t: pd.DataFrame, quote: Callable[[str], str]) -> pd.DataFrame:
    """A checkpoint's token rows for display: tokens quoted with ``quote``, ids as integers.

    Parameters
    ----------
    t
        One checkpoint's rows of the token table.
    quote
        How a token is written (``repr`` for Markdown, ``ascii`` for LaTeX); the average token is written as is.

    Returns
    -------
    pandas.DataFrame
        The rows without the checkpoint column.
    """
    return t.drop(columns="checkpoint").assign(token=[x if x == AVERAGE_TOKEN else quote(x) for x in t.token],
                                               id=t.id.map(lambda i: "" if pd.isna(i) else str(int(i))))
