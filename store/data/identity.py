"""Data identified by its content, not by the path that names it: the configuration record's ``data_sha256`` and
its ``dataset``/``val_dataset`` (config.config_record), so that the same file by another path is the same
configuration, and other text under the same path, or a file edited in place, is another one."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ncanalyze.store.data.token_cache import data_fingerprint


def data_name(spec: str | None) -> str | None:
    """How the record names the data: a local file or folder by its own name (its path is not what it is: its
    content is in ``data_sha256``), a Hub dataset by its id.

    Parameters
    ----------
    spec
        ``--dataset`` or ``--val-dataset`` (any form they take), or None.

    Returns
    -------
    str or None
        The name.
    """
    if spec is None:
        return None
    p = Path(spec)
    return p.resolve().name if p.exists() else spec


def data_sha256(*specs: str | None) -> str:
    """A hash of what the data are: the sha256 of each local file's content (a folder's files by their paths
    inside it), a Hub dataset's id (no revision is known: its content is not hashed).

    Parameters
    ----------
    specs
        The train and validation data (None: none).

    Returns
    -------
    str
        16 hex digits of the SHA-256 of their fingerprints.
    """
    prints = [None if s is None else data_fingerprint(s) for s in specs]
    return hashlib.sha256(json.dumps(prints, sort_keys=True).encode()).hexdigest()[:16]
