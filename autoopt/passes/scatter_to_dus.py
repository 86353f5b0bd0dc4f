"""Placeholder: the scatter_to_dus pass (filled in by its own issue)."""

from __future__ import annotations

from autoopt.passes._base import Pass, PassResult


def scatter_to_dus(closed, ctx) -> PassResult:
    return PassResult.unchanged(closed)


PASS = Pass(name="scatter_to_dus", run=scatter_to_dus, rewrites=False)
