"""Sizes in bytes written for people: the one byte formatter (memory, disk and estimates say sizes alike)."""
from __future__ import annotations


def bytes_text(n: float) -> str:
    """A size in the largest binary unit it reaches, to three significant figures: '512 B', '1.23 MiB', '40 GiB'."""
    if abs(n) < 1023.5:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1023.5:
            return f"{n:.3g} {unit}"
    return f"{n / 1024:,.3g} TiB"
