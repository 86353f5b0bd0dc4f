"""``Finding``: one thing a pass found, applied or not, and why. The report renders these."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

Kind = Literal["donate", "scatter_to_dus", "remat", "placement", "transfer"]
KINDS: tuple[str, ...] = ("donate", "scatter_to_dus", "remat", "placement", "transfer")


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
            raise ValueError(f"Finding kind {self.kind!r} is not one of {KINDS}.")

    def replace(self, **changes: Any) -> Finding:
        return dataclasses.replace(self, **changes)
