"""Pass registry and manager.

The manager owns order, checks and error context; passes stay pure (NB: torch.fx's
``PassManager``). Order matters: rewrites first (scatter_to_dus, then remat, which must see the
final forward/backward), analyses last (donation and transfers read the final program).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from collections.abc import Sequence

from jax.extend.core import ClosedJaxpr

from autoopt import _jaxpr
from autoopt._errors import PassError
from autoopt._finding import Finding
from autoopt.passes._base import Pass, PassContext, PassResult

__all__ = [
    "Pass",
    "PassContext",
    "PassResult",
    "PassError",
    "PipelineResult",
    "registered_passes",
    "registered_pass_names",
    "run_pipeline",
]

log = logging.getLogger("autoopt")

# Module per pass, in pipeline order. Each module defines ``PASS: Pass``.
_ORDER = ("in_place", "remat", "donation", "placement")

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

    def info(self, pass_name: str) -> dict:
        for name, r in self.results:
            if name == pass_name:
                return dict(r.info)
        return {}


_REGISTRY: dict[str, Pass] | None = None


def registered_passes() -> dict[str, Pass]:
    global _REGISTRY
    if _REGISTRY is None:
        reg = {}
        for mod in _ORDER:
            p = importlib.import_module(f"autoopt.passes.{mod}").PASS
            reg[p.name] = p
        _REGISTRY = reg
    return _REGISTRY


def registered_pass_names() -> tuple[str, ...]:
    return tuple(registered_passes())


def enabled_passes(options) -> list[Pass]:
    wanted = options.passes
    return [p for name, p in registered_passes().items()
            if (wanted is None or name in wanted) and p.enabled(options)]


def jit_options_for(options, backend: str) -> dict:
    """Compile options every enabled pass needs, merged (compiler_options dicts are united)."""
    merged: dict = {}
    for p in enabled_passes(options):
        for k, v in p.jit_options(options, backend).items():
            if k == "compiler_options":
                merged.setdefault(k, {}).update(v)
            else:
                merged[k] = v
    return merged


def run_pipeline(closed: ClosedJaxpr, ctx: PassContext) -> PipelineResult:
    """Run every enabled pass in order. Raises PassError (never a bare exception) on failure."""
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
        except Exception as e:  # noqa: BLE001 - the manager adds context; the API decides fallback
            raise PassError(name, done, ctx.fn_location, e) from e
        done.append(name)
        results.append((name, result))
        findings.extend(f if f.pass_name else f.replace(pass_name=name) for f in result.findings)
        if result.changed:
            current = result.jaxpr
            log.debug("pass %s changed the program", name)
    return PipelineResult(closed, current, tuple(findings), tuple(results))
