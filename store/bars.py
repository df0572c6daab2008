"""Progress bars: tqdm's, drawn unless the command line asked for quiet (``ncanalyze -q`` prints only warnings and
errors). Every bar of the store's work is made here."""
from __future__ import annotations

import logging
from typing import Any

from tqdm.auto import tqdm

LOGGER = "ncanalyze"  # the logger whose level ``-q`` raises (ncanalyze.cli.main)


def quiet() -> bool:
    """Whether ``-q`` set the ``ncanalyze`` logger above INFO (a library caller that set no level gets bars)."""
    return logging.getLogger(LOGGER).level > logging.INFO


def progress_bar(*args: Any, **kwargs: Any) -> tqdm:
    """``tqdm(*args, **kwargs)``, off under ``-q``."""
    if quiet():
        kwargs["disable"] = True
    return tqdm(*args, **kwargs)
