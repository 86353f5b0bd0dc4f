"""Placeholder: the transfers pass (filled in by its own issue)."""

from __future__ import annotations

from autoopt.passes._base import Pass, PassResult


def transfers(closed, ctx) -> PassResult:
    return PassResult.unchanged(closed)


PASS = Pass(name="transfers", run=transfers, rewrites=False)
