"""User text (run, checkpoint and tag names, tokens, messages that quote them) made inert in the documents a report
writes: report.md (Markdown rendered as HTML by GitHub, Jupyter, CommonMark), the CSVs (opened in spreadsheets) and
report.html's figures (plotly's label markup). Nothing here changes a number."""
from __future__ import annotations

import csv
import html
import re
import unicodedata
from pathlib import Path

import pandas as pd

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # OWASP's CSV injection: a cell a spreadsheet reads as a formula
_INVISIBLE = ("Zs", "Cc", "Cf", "Zl", "Zp")  # white space, controls, format characters (U+200B, U+FEFF)
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(inf|nan)", re.IGNORECASE)


def visible(text: str) -> str:
    """``text`` with its control and format characters (newline, escape, bidi overrides: Unicode categories Cc, Cf,
    Zl, Zp) shown as escapes (``\\n``, ``\\x1b``, ``\\u202e``), and text of white space alone as escapes
    (``\\x20``); other text, accents included, as it is."""
    def shown(c: str) -> str:
        if unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp"):
            return c
        return c.encode("unicode_escape").decode("ascii") if c in "\n\r\t" or ord(c) < 0x100 else f"\\u{ord(c):04x}"
    if str(text) and not str(text).strip():  # only white space: each character shown (a run named " ")
        return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}" for c in str(text))
    return "".join(shown(c) for c in str(text))


def drawn(name) -> str:
    """A name as a figure or a plot draws it: white space alone (a run named ``" "``) as escapes (:func:`visible`),
    so its legend entry is not blank; any other name as it is."""
    text = str(name)
    return visible(text) if text and not text.strip() else text


def md_name(name, table: bool = False) -> str:
    """A name as Markdown inline code that no renderer reads as markup: its controls shown as escapes (a newline
    cannot start a heading), a backtick as ``\\x60`` (it cannot close the code span), ``|`` as ``\\|`` in a table
    cell (GFM's table syntax; inside code it renders as ``|``). Raw HTML inside inline code is text in CommonMark.

    Parameters
    ----------
    name
        The name (any value: shown as its ``str``).
    table
        Whether it goes into a table cell.

    Returns
    -------
    str
    """
    text = visible(name).replace("`", "\\x60")
    return "`" + (text.replace("|", "\\|") if table else text) + "`"


def md_text(text) -> str:
    """Plain Markdown text that may quote names: controls shown as escapes, ``& < >`` as HTML entities (no raw HTML,
    which CommonMark passes through), the rest (inline code, bold) as it is."""
    return html.escape(visible(text), quote=False)


def md_names(df: pd.DataFrame, columns=("run", "checkpoint", "tag")) -> pd.DataFrame:
    """A copy of a table for ``to_markdown`` with its name columns as :func:`md_name` table cells (missing stays
    missing)."""
    out = df.copy()
    for c in columns:
        if c in out:
            out[c] = out[c].map(lambda v: v if pd.isna(v) else md_name(v, table=True)).astype(object)
    return out


def spreadsheet_safe(df: pd.DataFrame) -> pd.DataFrame:
    """A copy of a table to write as CSV whose text cells that begin with ``= + - @``, tab or CR (a formula to a
    spreadsheet: ``=HYPERLINK(...)``) begin with ``'`` instead, as OWASP advises; numeric columns, and text cells that
    are plain numbers (``-0.5``), are left as they are.

    Parameters
    ----------
    df
        The table.

    Returns
    -------
    pandas.DataFrame
    """
    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_object_dtype(out[c]) or pd.api.types.is_string_dtype(out[c]):
            out[c] = out[c].map(_cell)
    return out


def write_csv(df: pd.DataFrame, path: Path) -> None:
    """Write a table as CSV, guarded (:func:`spreadsheet_safe`); where a text cell holds a carriage return, every
    text cell is quoted (Python's csv quotes a bare CR in no other mode, and a reader would start a row there)."""
    safe = spreadsheet_safe(df)
    text = [c for c in safe.columns if pd.api.types.is_object_dtype(safe[c]) or pd.api.types.is_string_dtype(safe[c])]
    cr = any(safe[c].map(lambda v: isinstance(v, str) and "\r" in v).any() for c in text)
    safe.to_csv(path, index=False, quoting=csv.QUOTE_NONNUMERIC if cr else csv.QUOTE_MINIMAL)


def _cell(v):
    """A text cell guarded: one starting with a formula's sign (:data:`FORMULA_START`), also after white space or
    invisible characters (a space, U+00A0, U+200B, a BOM: a spreadsheet may skip them), unless a plain number."""
    if not isinstance(v, str):
        return v
    bare = v.lstrip("".join(c for c in v[:64] if unicodedata.category(c) in _INVISIBLE))
    if v.startswith(FORMULA_START) and not _NUMBER.fullmatch(v) or \
            bare.startswith(FORMULA_START) and not _NUMBER.fullmatch(bare):
        return "'" + v
    return v


def plotly_text(text) -> str:
    """A name as plotly draws it as text, not as its label markup (``<a href>``, ``<b>``, ``<br>``): ``& < >`` as
    the entities plotly turns back into those characters."""
    return html.escape(str(text), quote=False)
