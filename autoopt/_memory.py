"""Memory figures: compiled (from XLA's ``memory_analysis()``) and static (liveness over a jaxpr).

On XLA:CPU ``temp_size_in_bytes`` tracks the measured peak RSS (``peak_memory_in_bytes`` does
not; benchmarks/RESULTS.md compares them), so reports and remat decisions use argument + output
+ temp - alias as "peak".
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend.core import ClosedJaxpr, Literal


def format_bytes(n: int | None) -> str:
    """``n`` bytes for a reader: "12.3 MiB", "512 B"; "-" for None."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def as_dict(self) -> dict[str, int]:
        d = dataclasses.asdict(self)
        d["peak_bytes"] = self.peak_bytes
        return d


def compiled_memory(compiled) -> CompiledMemory | None:
    """Figures from a ``jax.stages.Compiled``; None when the backend gives none."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise NotImplementedError
        return None
    if m is None:
        return None
    return CompiledMemory(
        int(m.argument_size_in_bytes),
        int(m.output_size_in_bytes),
        int(m.alias_size_in_bytes),
        int(m.temp_size_in_bytes),
    )


def aval_bytes(aval) -> int:
    """Bytes of an array's value: its dtype's itemsize, which extended dtypes (PRNG keys: 8 for
    threefry) carry too, where ``np.dtype(key<fry>)`` raises; 0 for non-arrays and float0."""
    if not hasattr(aval, "shape"):
        return 0
    return int(np.prod(aval.shape, dtype=np.int64)) * int(aval.dtype.itemsize)


def live_bytes_timeline(closed: ClosedJaxpr) -> list[int]:
    """Bytes live after each top-level equation (inputs included, freed after last use).

    A static estimate in program order, before XLA's fusion and scheduling: good for pictures
    and for comparing two versions of one program, not an allocator's figure.
    """
    j = closed.jaxpr
    last_use: dict = {}
    for i, eqn in enumerate(j.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
    for v in j.outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(j.eqns)
    live = {v: aval_bytes(v.aval) for v in list(j.invars) + list(j.constvars)}
    total = sum(live.values())
    out = []
    for i, eqn in enumerate(j.eqns):
        for v in eqn.outvars:
            b = aval_bytes(v.aval)
            live[v] = b
            total += b
        for v in {v for v in eqn.invars if not isinstance(v, Literal)}:
            if last_use.get(v) == i and v in live:
                total -= live.pop(v)
        for v in eqn.outvars:
            if v not in last_use and v in live:  # dead on arrival
                total -= live.pop(v)
        out.append(total)
    return out


def peak_live_bytes(closed: ClosedJaxpr) -> int:
    t = live_bytes_timeline(closed)
    return max(t) if t else sum(aval_bytes(v.aval) for v in closed.jaxpr.invars)
