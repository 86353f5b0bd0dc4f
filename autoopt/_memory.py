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


# --- how much memory a program may take (remat="fit") ----------------------------------------

# The test hook (``autoopt.testing.simulated_device_memory``): a device of this many bytes, empty
# before the call, in place of the real one; also read from the environment variable below, in
# bytes or a string such as "64MiB".
SIMULATED_MEMORY_ENV = "AUTOOPT_SIMULATED_DEVICE_MEMORY"
_simulated: list[tuple[int, bool]] = []  # (bytes, whether memory_stats() would report them)


def push_simulated_memory(nbytes: int, reported: bool = True) -> None:
    _simulated.append((int(nbytes), reported))


def pop_simulated_memory() -> None:
    _simulated.pop()


def simulated_memory() -> tuple[int, bool] | None:
    """``(bytes, reported)`` of the simulated device, or None for the real one."""
    if _simulated:
        return _simulated[-1]
    import os

    value = os.environ.get(SIMULATED_MEMORY_ENV)
    if not value:
        return None
    from autoopt._options import parse_bytes

    n = parse_bytes(value, SIMULATED_MEMORY_ENV)
    return None if n is None else (n, True)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What a program may allocate: ``free_bytes`` beyond what is already in use, where the
    arguments already live (``arguments_resident``: a real device's ``bytes_in_use`` counts
    them; the simulated device is empty before the call)."""

    free_bytes: int
    arguments_resident: bool
    source: str  # for messages: "the device's free memory", "available host memory", ...

    def fits(self, memory: CompiledMemory) -> bool:
        return self.needed(memory) <= self.free_bytes

    def needed(self, memory: CompiledMemory) -> int:
        if self.arguments_resident:
            return memory.peak_bytes - memory.argument_bytes
        return memory.peak_bytes

    def budget(self, memory: CompiledMemory) -> int:
        """The compiled peak a plan must reach to fit."""
        if self.arguments_resident:
            return self.free_bytes + memory.argument_bytes
        return self.free_bytes


def device_memory(device) -> DeviceMemory | None:
    """The memory a program on ``device`` may take, or None when the backend does not say:
    ``memory_stats()`` (bytes_limit - bytes_in_use) on GPU/TPU; on CPU the host's available
    memory (``MemAvailable`` of /proc/meminfo, Linux only)."""
    sim = simulated_memory()
    if sim is not None:
        n, reported = sim
        return DeviceMemory(n, False, "the simulated device memory") if reported else None
    if device is None:
        return None
    if getattr(device, "platform", None) == "cpu":
        free = _mem_available()
        return None if free is None else DeviceMemory(free, True, "the host's available memory")
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return DeviceMemory(free, True, f"the free memory of {device}")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def is_out_of_memory(error: BaseException) -> bool:
    """An out-of-memory error of XLA's (compiling or running): jax's runtime error whose status
    is RESOURCE_EXHAUSTED. Only the status, which leads the message: a host callback's own
    exception that mentions RESOURCE_EXHAUSTED (a quota error of some service) reaches the
    caller inside an INTERNAL status, and is the user's error to see, raised once, as jax.jit
    raises it (taking it for an out-of-memory error re-planned the program and ran the whole
    step, callbacks included, again)."""
    import jax

    return isinstance(error, jax.errors.JaxRuntimeError) and str(error).lstrip().startswith(
        "RESOURCE_EXHAUSTED"
    )


def bytes_named_in(error: BaseException) -> int | None:
    """The memory an out-of-memory message says the device has (XLA:TPU "... 15.48G of 15.75G
    hbm", XLA:GPU "... bytes_limit=..."), or None. Only the device's size is taken: the size of
    the allocation that failed says nothing of what would fit."""
    import re

    text = str(error)
    m = re.search(r"of\s+([0-9.]+)\s*([KMGT])i?B?\s+hbm", text, re.IGNORECASE)
    if m:
        scale = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
        return int(float(m.group(1)) * scale)
    m = re.search(r"(?:bytes_limit|memory limit|limit)\D{0,3}([0-9]+)\s*(?:bytes|B)?", text)
    if m:
        return int(m.group(1))
    return None


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """A value live at the static peak of a program: its bytes, type and source line."""

    bytes: int
    type: str
    location: str | None


def live_at_peak(closed: ClosedJaxpr, location_of, n: int = 5) -> list[LiveBuffer]:
    """The ``n`` largest values live at the peak of ``live_bytes_timeline`` (inputs included),
    largest first. ``location_of(eqn)`` names the source line that made a value (None for
    inputs, which the caller passes)."""
    j = closed.jaxpr
    timeline = live_bytes_timeline(closed)
    if not timeline:
        return []
    at = max(range(len(timeline)), key=timeline.__getitem__)
    last_use: dict = {}
    for i, eqn in enumerate(j.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                last_use[v] = i
    for v in j.outvars:
        if not isinstance(v, Literal):
            last_use[v] = len(j.eqns)
    made: dict = {}
    for i, eqn in enumerate(j.eqns[: at + 1]):
        for v in eqn.outvars:
            made[v] = (i, eqn)
    live = []
    for v in [*j.invars, *j.constvars]:
        if last_use.get(v, -1) > at:
            live.append(LiveBuffer(aval_bytes(v.aval), _type(v.aval), None))
    for v, (_i, eqn) in made.items():
        if last_use.get(v, -1) > at:
            live.append(LiveBuffer(aval_bytes(v.aval), _type(v.aval), location_of(eqn)))
    live.sort(key=lambda b: -b.bytes)
    return live[:n]


def _type(aval) -> str:
    try:
        return aval.str_short()
    except Exception:  # noqa: BLE001
        return str(aval)
