"""Source rewrites (libcst), one command per module. Filled in by the explain/codemod issue."""

from __future__ import annotations


def source_diff_for(fn, findings) -> str:
    return ""
