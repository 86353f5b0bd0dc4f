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

from autoopt._jit._dispatch import REFUSALS_BEFORE_NARROWING


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

    What the calls did at each call site (``"safe"``): ``site_calls``, ``file:line`` ->
    ``SiteCalls``, the run-time checks' record. ``site_shift``: a call site's argument ``k``
    is the program's argument ``k + site_shift`` (an equinox function's inner program takes
    three arguments of its own first).

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
    site_calls: Mapping[str, SiteCalls] = dataclasses.field(default_factory=dict)
    site_shift: int = 0
    # a wrapper of the optimized function, so that ``jit`` keeps its programs while this lives
    keeps: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The function for static leaves takes the split arguments; ``jit.lower(*args)`` must
        # take what the user passed to ``fast`` (an equinox module), as the README promises.
        key = getattr(self.function, "static_key", None)
        if key is not None and not isinstance(self.jit, StaticLeafJit):
            object.__setattr__(self, "jit", StaticLeafJit(self.jit, key, self.options))


@dataclasses.dataclass(frozen=True)
class SiteCalls:
    """What the run-time checks did at one call site's calls (under ``"safe"``), as recorded
    so far; keys are the site's arguments (positions as the caller wrote them, or names).

    Recorded only where a call takes the general path, never by a cached plan that runs (the
    calls that repeat pay nothing for it): ``refused`` counts every call whose check refused an
    argument (another reference held it, ...: ``why``, the last reason); ``donated`` counts the
    calls seen to donate it, a lower bound. ``exact``: every call between two refusals was
    observed, so no ``donated`` and some ``refused`` means every call so far refused.
    ``narrowed``: the arguments the site's calls were refused so many times in a row that it
    now runs an executable not donating them, after ``narrowed_after`` in a row
    (``REFUSALS_BEFORE_NARROWING``)."""

    location: str
    refused: Mapping[Any, int]
    why: Mapping[Any, str]
    donated: Mapping[Any, int]
    exact: bool
    narrowed: frozenset
    narrowed_after: int = 0


def site_calls(sites) -> dict[str, SiteCalls]:
    """``file:line`` -> ``SiteCalls`` of the ``_program.Site`` objects ``sites`` (those
    recorded at one line added up)."""
    out: dict[str, SiteCalls] = {}
    for site in sites:
        location = site.proof.location
        outcomes = getattr(site, "outcomes", None)
        if not location or outcomes is None:
            continue
        narrowed = frozenset(
            p for row in list(site.refusals.values()) if row.narrowed for p in row.positions
        )
        refused, why, donated = dict(outcomes.refused), dict(outcomes.why), dict(outcomes.donated)
        exact = not outcomes.unobserved
        if not (refused or donated or narrowed):
            continue
        had = out.get(location)
        if had is not None:
            for mine, theirs in ((refused, had.refused), (donated, had.donated)):
                for k, n in theirs.items():
                    mine[k] = mine.get(k, 0) + n
            why = {**had.why, **why}
            exact = exact and had.exact
            narrowed = narrowed | had.narrowed
        out[location] = SiteCalls(
            location, refused, why, donated, exact, narrowed, REFUSALS_BEFORE_NARROWING
        )
    return out


class StaticLeafJit:
    """A jit object of the function for static leaves that takes the user's own arguments
    (non-array leaves in them), split as a call splits them; arguments already split, and every
    other attribute, go to the jit object as they are."""

    def __init__(self, jit: Any, key: tuple, options: Any):
        self._jit, self._key, self._options = jit, key, options

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        from autoopt._jit import _static_leaves

        o = self._options
        split = _static_leaves.split_if_static(args, kwargs, o.static_argnums, o.static_argnames)
        if split is None:
            return args, kwargs
        if split.key != self._key:
            raise ValueError(
                "these arguments hold other non-array leaves than those inspect() was given: "
                "call fast.inspect(*args) with the arguments you lower."
            )
        return split.args, split.kwargs

    def lower(self, *args, **kwargs):
        args, kwargs = self._split(args, kwargs)
        return self._jit.lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        args, kwargs = self._split(args, kwargs)
        return self._jit.trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        args, kwargs = self._split(args, kwargs)
        return self._jit.eval_shape(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jit, name)
