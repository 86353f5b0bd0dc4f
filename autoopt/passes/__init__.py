"""Pass registry and manager.

The manager owns order, checks and error context; passes stay pure (NB: torch.fx's
``PassManager``). Each pass is one ``Pass(...)`` declaration (``_base.py``); from the registered
declarations come the pipeline order (a topological sort of their ``after``/``before``
constraints), the options ``optimize`` accepts (``make_options``), the finding kinds
(``autoopt._finding.KINDS``), the codemod commands (``autoopt.codemod``) and the report's
sections. The built-in passes are the subpackages here that define ``PASS``; their constraints
give: rewrites first (scatter_to_dus, then remat, which must see the final forward/backward),
analyses last (donation and transfers read the final program).
"""

from __future__ import annotations

import dataclasses
import heapq
import importlib
import logging
import os
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from jax.extend.core import ClosedJaxpr

from autoopt import _finding, _jaxpr, _options
from autoopt._errors import PassError, ProcessMismatchError
from autoopt._finding import Finding
from autoopt._options import Option, Options
from autoopt.passes._base import Pass, PassContext, PassResult, resolve

__all__ = [
    "Option",
    "Pass",
    "PassContext",
    "PassResult",
    "PassError",
    "PipelineResult",
    "enabled_passes",
    "jit_options_for",
    "make_options",
    "option_names",
    "register",
    "registered_passes",
    "registered_pass_names",
    "report_sections",
    "run_pipeline",
    "value_specialized",
]

log = logging.getLogger("autoopt")

# Type-check every rewritten program (tests turn this on; it costs a walk per pass).
CHECK_REWRITES = os.environ.get("AUTOOPT_CHECK", "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class PipelineResult:
    original: ClosedJaxpr
    jaxpr: ClosedJaxpr
    findings: tuple[Finding, ...]
    results: tuple[tuple[str, PassResult], ...]

    @property
    def changed(self) -> bool:
        return self.jaxpr is not self.original


# --- the registry --------------------------------------------------------------------------------

# name -> Pass, in registration order (the pipeline order is derived, see ``_ordered``).
_REGISTRY: dict[str, Pass] = {}


class Registration:
    """What ``register`` returns: call it (or leave its ``with`` block) to unregister the pass,
    putting back the pass it replaced, if any."""

    def __init__(self, p: Pass, replaced: Pass | None):
        self.pass_ = p
        self._replaced = replaced
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        if _REGISTRY.get(self.pass_.name) is not self.pass_:
            return  # replaced since: the newer registration owns the name
        if self._replaced is not None:
            _put(self._replaced)
        else:
            _remove(self.pass_.name)

    def __enter__(self) -> Pass:
        return self.pass_

    def __exit__(self, *exc) -> None:
        self()


def register(p: Pass, *, replace: bool = False) -> Registration:
    """Add ``p`` to the pipeline; returns the callable that removes it again.

    Refused (nothing registered): a name already taken (unless ``replace``: then unregistering
    puts the old pass back), an option name another pass or ``optimize`` itself already has,
    order constraints that name an unknown pass or make a cycle.
    """
    if not isinstance(p, Pass):
        raise TypeError(f"register() takes a Pass, got {type(p).__name__}.")
    old = _REGISTRY.get(p.name)
    if old is not None and not replace:
        raise ValueError(
            f"a pass named {p.name!r} is already registered; unregister it first or "
            "pass replace=True."
        )
    _check_options_free(p)
    _put(p)
    try:
        _ordered()
    except ValueError:
        if old is not None:
            _put(old)
        else:
            _remove(p.name)
        raise
    return Registration(p, old)


def _put(p: Pass) -> None:
    _REGISTRY[p.name] = p
    _finding.register_kinds(p.name, p.kinds)


def _remove(name: str) -> None:
    dependents = sorted(
        q.name for q in _REGISTRY.values() if q.name != name and name in (*q.after, *q.before)
    )
    if dependents:
        raise ValueError(
            f"cannot unregister pass {name!r}: the order constraints of "
            f"{', '.join(map(repr, dependents))} name it; unregister those first."
        )
    del _REGISTRY[name]
    _finding.unregister_kinds(name)


def _check_options_free(p: Pass) -> None:
    taken = {o.name: q.name for q in _REGISTRY.values() if q.name != p.name for o in q.options}
    for o in p.options:
        if o.name in _options.CORE_KEYWORDS or o.name in _options.JIT_KEYWORDS:
            raise ValueError(
                f"pass {p.name!r} declares option {o.name!r}, which is optimize()'s "
                "own keyword; name the option after the pass."
            )
        if o.name in taken:
            raise ValueError(
                f"pass {p.name!r} declares option {o.name!r}, which pass "
                f"{taken[o.name]!r} already declares; name the option after the pass."
            )


def _ordered() -> list[Pass]:
    """The registered passes, sorted by their ``after``/``before`` constraints.

    Kahn's algorithm; among passes whose constraints are met the first by name runs first, so the
    order never depends on import or registration order. Raises ValueError naming the passes
    for a constraint on an unknown pass or a cycle.
    """
    reg = _REGISTRY
    edges: dict[str, set[str]] = {n: set() for n in reg}  # n -> passes that must run after n
    for p in reg.values():
        for other, first, then in [(o, o, p.name) for o in p.after] + [
            (o, p.name, o) for o in p.before
        ]:
            if other not in reg:
                raise ValueError(
                    f"pass {p.name!r} is ordered relative to {other!r}, which is not "
                    f"a registered pass (registered: {', '.join(sorted(reg))})."
                )
            edges[first].add(then)
    indegree = {n: 0 for n in reg}
    for targets in edges.values():
        for t in targets:
            indegree[t] += 1
    ready = [n for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        n = heapq.heappop(ready)
        order.append(n)
        for t in edges[n]:
            indegree[t] -= 1
            if indegree[t] == 0:
                heapq.heappush(ready, t)
    if len(order) < len(reg):
        raise ValueError(
            "the order constraints of passes form a cycle: "
            f"{_cycle(edges, set(reg) - set(order))}. "
            "Drop one of the after=/before= constraints."
        )
    return [reg[n] for n in order]


def _cycle(edges: Mapping[str, set[str]], left: set[str]) -> str:
    """One cycle among ``left`` (the passes Kahn's algorithm could not order), as 'a -> b -> a'."""
    path = [min(left)]
    while True:
        nxt = min(t for t in edges[path[-1]] if t in left)
        if nxt in path:
            cyc = path[path.index(nxt) :] + [nxt]
            return " -> ".join(cyc)
        path.append(nxt)


def registered_passes() -> dict[str, Pass]:
    """Name -> Pass, in pipeline order (a new dict: ``register`` changes the registry)."""
    return {p.name: p for p in _ordered()}


def registered_pass_names() -> tuple[str, ...]:
    return tuple(p.name for p in _ordered())


def enabled_passes(options) -> list[Pass]:
    wanted = options.passes
    return [p for p in _ordered() if (wanted is None or p.name in wanted) and p.enabled(options)]


def jit_options_for(options, backend: str | None) -> dict:
    """Compile options every enabled pass needs, merged (compiler_options dicts are united)."""
    merged: dict = {}
    for p in enabled_passes(options):
        for k, v in p.jit_options(options, backend).items():
            if k == "compiler_options":
                merged.setdefault(k, {}).update(v)
            else:
                merged[k] = v
    return merged


def report_sections() -> list[Callable[..., None]]:
    """The report sections passes declare, in pipeline order: ``section(report, console)``."""
    return [resolve(p.report_section) for p in _ordered() if p.report_section is not None]


def codemods() -> list[Any]:
    """The ``FindingCommand`` classes the passes declare, in pipeline order (importing them
    imports libcst)."""
    return [resolve(p.codemod) for p in _ordered() if p.codemod is not None]


# --- options -------------------------------------------------------------------------------------


def _declared_options() -> dict[str, Option]:
    return {o.name: o for p in _ordered() for o in p.options}


def option_names() -> tuple[str, ...]:
    """Every keyword ``optimize`` takes: the passes' options, its own, and jax.jit's."""
    return (*_declared_options(), *_options.CORE_KEYWORDS, *_options.JIT_KEYWORDS)


def make_options(**kwargs: Any) -> Options:
    """Validated ``Options`` from ``optimize``'s keywords: each pass option by its declaration's
    ``check``, then each pass's ``check_options`` across options, then the core options."""
    passes = _ordered()
    declared = {o.name: o for p in passes for o in p.options}
    core, given, jit_kwargs = _options.split_keywords(kwargs, tuple(declared))
    values: dict[str, Any] = {}
    for name, opt in declared.items():
        if name not in given:
            values[name] = opt.default
        else:
            values[name] = opt.check(given[name]) if opt.check is not None else given[name]
    for p in passes:
        if p.check_options is not None:
            p.check_options(values)
    return _options.build_options(core, values, jit_kwargs, tuple(p.name for p in passes))


# --- running -------------------------------------------------------------------------------------


def run_pipeline(closed: ClosedJaxpr, ctx: PassContext) -> PipelineResult:
    """Run every enabled pass in order. Raises PassError (never a bare exception) on failure.

    A shape-polymorphic program (``jax.export`` with ``symbolic_shape``, a ``lower`` of one)
    runs no pass: their analyses (sizes, bounds, memory) read concrete dimensions, and jax.jit
    lowers such a program as it is."""
    if _symbolic(closed):
        return PipelineResult(closed, closed, (), ())
    done: list[str] = []
    results: list[tuple[str, PassResult]] = []
    findings: list[Finding] = []
    current = closed
    for p in enabled_passes(ctx.options):
        name = p.name
        try:
            result = p.run(current, ctx)
            if not isinstance(result, PassResult):
                raise TypeError(f"pass returned {type(result).__name__}, not PassResult")
            if result.changed:
                if not _jaxpr.same_avals(current, result.jaxpr):
                    raise TypeError("rewrite changed the program's input or output types")
                if CHECK_REWRITES:
                    _jaxpr.check(result.jaxpr)
        except ProcessMismatchError:
            raise  # never a fall-back: one process falling back alone would hang the job
        except Exception as e:  # noqa: BLE001 - the manager adds context; the API decides fallback
            raise PassError(name, done, ctx.fn_location, e) from e
        done.append(name)
        results.append((name, result))
        findings.extend(f if f.pass_name else f.replace(pass_name=name) for f in result.findings)
        if result.changed:
            current = result.jaxpr
            log.debug("pass %s changed the program", name)
    return PipelineResult(closed, current, tuple(findings), tuple(results))


def _symbolic(closed: ClosedJaxpr) -> bool:
    """Whether an input or output of the program has a symbolic dimension."""
    return any(
        not isinstance(d, int)
        for a in (*closed.in_avals, *closed.out_avals)
        for d in getattr(a, "shape", ())
    )


def value_specialized(
    closed: ClosedJaxpr, ctx: PassContext, general: PipelineResult
) -> tuple[tuple[tuple[int, int, int], ...], PipelineResult] | None:
    """``(((input index, lo, hi), ...), the pipeline run assuming those inputs in those
    ranges)``, where the assumption proves writes ``general`` (the program for any value) had
    to guard, blend or leave a scatter (``in_place.value_bounds``: a row, block, window or tile
    written at Python ints the caller passes). The caller runs the second program only for
    calls whose arguments it checked on the host. None where nothing more would be proven, or
    scatter_to_dus is off."""
    if not any(p.name == "scatter_to_dus" for p in enabled_passes(ctx.options)):
        return None
    if not any(
        f.kind == "scatter_to_dus"
        and (
            (f.applied and (f.details or {}).get("guard") in ("blend", "cond", "select"))
            or (not f.applied and "bounds are not proven" in f.message)
        )
        for f in general.findings
    ):
        return None  # (no write to prove: no analysis, a first call costs nothing more)
    from autoopt.passes.in_place import value_bounds

    try:
        found = value_bounds(closed, ctx)
    except Exception as e:  # noqa: BLE001 - the manager adds context; the API decides fallback
        raise PassError("scatter_to_dus", [], ctx.fn_location, e) from e
    if found is None:
        return None
    ranges = {k: (lo, hi) for k, lo, hi in found}
    assumed = dataclasses.replace(ctx, extra={**ctx.extra, "assume_ranges": ranges})
    special = run_pipeline(closed, assumed)

    def proven(result: PipelineResult) -> int:
        return sum(
            1
            for f in result.findings
            if f.kind == "scatter_to_dus" and f.applied and (f.details or {}).get("guard") == "none"
        )

    return (found, special) if proven(special) > proven(general) else None


def _register_builtins() -> None:
    """Every subpackage here that defines ``PASS`` is a built-in pass (no list to keep)."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        p = getattr(importlib.import_module(f"{__name__}.{info.name}"), "PASS", None)
        if isinstance(p, Pass):
            _check_options_free(p)
            _REGISTRY[p.name] = p
    # Constraints between the built-ins checked once all of them are known; their kinds listed
    # in pipeline order.
    for p in _ordered():
        _finding.register_kinds(p.name, p.kinds)


_register_builtins()
