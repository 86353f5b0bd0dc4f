"""Small text formatters shared by the report and the sections passes add to it."""

from __future__ import annotations

import os


def short_location(loc: str | None) -> str:
    """``"/a/b/file.py:12"`` -> ``"file.py:12"``; ``"-"`` for None."""
    if not loc:
        return "-"
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def format_count(n: float) -> str:
    """``1.5e9`` -> ``"1.5 G"``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f}"
