"""Placeholder: the remat pass (filled in by its own issue)."""

from __future__ import annotations

from autoopt.passes._base import Pass, PassResult


def remat(closed, ctx) -> PassResult:
    return PassResult.unchanged(closed)


PASS = Pass(name="remat", run=remat, rewrites=False)
