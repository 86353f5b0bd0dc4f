"""``Finding``: one thing a pass found, applied or not, and why. The report renders these."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

# The kinds a finding may have are the kinds the registered passes declare (``Pass(kinds=...)``):
# ``autoopt.passes.register`` fills this table, keyed by pass name, and unregistering a pass
# takes its kinds away (unless another pass declares them too). This module imports nothing of
# the passes: it is the bottom of the import graph.
_KINDS_BY_PASS: dict[str, tuple[str, ...]] = {}


def register_kinds(pass_name: str, kinds: Iterable[str]) -> None:
    _KINDS_BY_PASS[pass_name] = tuple(kinds)


def unregister_kinds(pass_name: str) -> None:
    _KINDS_BY_PASS.pop(pass_name, None)


def kinds() -> tuple[str, ...]:
    """Every kind a registered pass declares, in registration order."""
    return tuple(dict.fromkeys(k for ks in _KINDS_BY_PASS.values() for k in ks))


class _Kinds(Sequence):
    """``KINDS``: a live, read-only view of ``kinds()``, so ``from ... import KINDS`` stays current
    when a pass is registered later."""

    def __getitem__(self, i):
        return kinds()[i]

    def __len__(self) -> int:
        return len(kinds())

    def __iter__(self) -> Iterator[str]:
        return iter(kinds())

    def __contains__(self, kind: object) -> bool:
        return any(kind in ks for ks in _KINDS_BY_PASS.values())

    def __repr__(self) -> str:
        return repr(kinds())


KINDS: Sequence[str] = _Kinds()


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a pass found.

    ``location`` is the user's ``"path.py:LINE"`` (from the equation's source info, or the call
    site for donation), or None when there is no user source (a lambda built elsewhere, a library).
    ``bytes_saved`` counts only what is guaranteed (an aliased buffer, a removed copy); None when
    not measurable. ``details`` carries pass-specific data for the report and the codemods
    (never parsed back out of ``message``).
    """

    kind: str
    applied: bool
    message: str
    location: str | None = None
    bytes_saved: int | None = None
    transfers_avoided: int | None = None
    pass_name: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"Finding kind {self.kind!r} is not one of {kinds()}: a pass declares "
                "the kinds it emits (Pass(kinds=...)) and registering it makes them "
                "valid."
            )

    def replace(self, **changes: Any) -> Finding:
        return dataclasses.replace(self, **changes)
