"""``Inspection``: the one place the report, the fuzzer and the tests read an OptimizedFunction.

``OptimizedFunction.inspect(*args, **kwargs)`` returns one, built from the same preparation a call
runs (the static-leaf split, the program lookup). Nothing outside ``autoopt._jit`` reads the
wrapper's private attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax.extend.core import ClosedJaxpr


@dataclasses.dataclass(frozen=True)
class Inspection:
    """What a call with given arguments runs, and what the function has learned so far.

    About the call's signature:

    - ``program``: the per-signature record (``autoopt._jit._program.Program``); ``traced`` is
      the user's function as traced, ``optimized`` the program after the passes (the same
      object when nothing changed or the passes fell back); ``changed_by`` the passes whose
      result changed the program, in order; ``findings`` the pipeline's; ``fallback`` why the
      passes fell back, or None.
    - ``jit``, ``donated``: the jax.jit object a call with these arguments uses and the
      ``(positions, names)`` it donates. Under ``donate="auto"``: every argument an output can
      alias. Under ``"safe"``: what a call site that rebinds every argument it passes
      (``a, b = f(a, b)``) would donate when nothing else refers to them; another call site
      donates a subset, or nothing. Under ``"off"``: the plain jit object, nothing. With explicit
      ``donate_argnums``/``argnames``: the plain jit object, which carries them, and them as
      the user wrote them. None (and nothing) in the report logged by ``explain=True``
      while tracing, before any call chose one.

    About the function (every signature so far): ``programs`` (trace-side signature ->
    program: how many signatures were traced), ``donation_variants`` (the donated sets a jit
    object exists for, calls having made them before this ``inspect``; ``((), ())`` is the
    plain one), ``call_sites`` (the call-site proofs
    recorded under ``"safe"``, one per source line), ``fast_entries`` (plans cached for the
    fast path, all sites), ``placement`` (the placer's figures, None when no option asks for a
    placer), ``eager_autodiff_watched`` (calls still check for eager ``jax.grad``) and
    ``eager_autodiff_jit`` (the jit object made for such a call, or None).

    Arguments holding non-array leaves are described by the function made for those static
    leaves (its own programs and jit objects).
    """

    function: Callable
    location: str | None
    options: Any  # autoopt._options.Options
    backend: str
    program: Any
    traced: ClosedJaxpr
    optimized: ClosedJaxpr
    changed_by: tuple[str, ...]
    findings: tuple
    fallback: str | None
    jit: Any
    donated: tuple[tuple[int, ...], tuple[str, ...]]
    programs: Mapping[Any, Any]
    donation_variants: frozenset
    call_sites: tuple
    fast_entries: int
    placement: Any  # autoopt.passes.placement._placer.PlacementFigures | None
    eager_autodiff_watched: bool
    eager_autodiff_jit: Any
