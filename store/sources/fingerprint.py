"""A checkpoint's weights identified cheaply: the size and the first and last MiB of each weight file, in every
layout but an adapter's (load.weights_fingerprint adds the base's to an adapter's own)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ncanalyze.store.sources.discover import fsdp_dirs, layout, zero_dirs


def plain_fingerprint(path: Path) -> str:
    """The fingerprint of the weight files of a model folder (``.safetensors``/``.bin``), FSDP's or ZeRO's shards
    included."""
    kind = layout(path)
    files = [p for p in path.iterdir() if p.name.endswith((".safetensors", ".bin"))]
    for shards in fsdp_dirs(path) + zero_dirs(path) if kind in ("fsdp", "zero") else []:
        files += [p for p in shards.iterdir() if p.is_file() and not p.is_symlink()]
    return files_fingerprint(files)


def files_fingerprint(files: list[Path]) -> str:
    """:func:`plain_fingerprint` of ``files``: 16 hex digits."""
    h = hashlib.sha256()
    for w in sorted(files):
        size = w.stat().st_size
        h.update(f"{w.name}:{size}".encode())
        with open(w, "rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]
