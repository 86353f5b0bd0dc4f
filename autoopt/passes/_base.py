"""The pass protocol: every pass takes a ClosedJaxpr and a PassContext and returns a PassResult.

NB: the analogue is torch.fx's ``PassBase``/``PassResult``. Passes stay pure: they never mutate
their input, never compile the user's function on the call path, and report through findings.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from jax.extend.core import ClosedJaxpr

from autoopt._finding import Finding
from autoopt._options import Option, Options


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the program.

    ``in_leaf_names`` names each flat input as the user sees it (``"state['w']"``);
    ``in_arg_of_leaf``
    maps each flat input to its top-level argument (an int position or a keyword name);
    ``out_leaf_names`` likewise for outputs. ``backend`` is the platform the program compiles for.
    ``fn_location`` is the user's ``def`` line.
    """

    options: Options
    in_leaf_names: tuple[str, ...] = ()
    in_arg_of_leaf: tuple[int | str, ...] = ()
    out_leaf_names: tuple[str, ...] = ()
    backend: str = "cpu"
    fn_name: str = "<fn>"
    fn_location: str | None = None
    # True when the user differentiates the optimized function from outside (jax.grad(opt(f))):
    # known only to passes that inspect the outer trace; remat uses it.
    under_autodiff: bool = False
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What every pass returns: the new program, whether it changed, and what was found."""

    jaxpr: ClosedJaxpr
    changed: bool = False
    findings: tuple[Finding, ...] = ()

    @classmethod
    def unchanged(cls, jaxpr: ClosedJaxpr, findings=()) -> PassResult:
        return cls(jaxpr=jaxpr, changed=False, findings=tuple(findings))


PassFn = Callable[[ClosedJaxpr, PassContext], PassResult]


def _always(options: Options) -> bool:
    return True


def _no_jit_options(options: Options, backend: str | None) -> Mapping[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Pass:
    """A pass, declared once: everything the manager, the options, the report and the codemods
    need to know about it. ``autoopt.passes.register(PASS)`` is the only other step.

    NB: torch.fx's ``PassManager`` takes order as constraints between passes
    (``this_before_that_pass_constraint``); here each pass states its own, by name.

    - ``kinds``: the ``Finding.kind`` values it emits (its package's call-time findings too).
    - ``after`` / ``before``: names of passes it must run after / before. The manager sorts the
      registered passes by these (ties broken by name), and refuses unknown names and cycles.
    - ``options``: the ``optimize`` keywords it owns (``Option(name, default, check, doc)``);
      read back as ``options.<name>``. ``check_options(values)`` sees every pass option at once,
      for checks across options (it raises; it returns nothing).
    - ``enabled(options)``: whether the user's options turn it on.
    - ``jit_options(options, backend)``: compile options it needs for every signature, decided
      when the wrapper is built (jax.jit takes compiler_options per jit object, not per
      signature). ``backend`` is jax.jit's ``backend=`` keyword, or None for the default
      backend, which is not asked for then: asking starts JAX's backend, and a user may still
      configure devices after wrapping a function at import time.
    - ``codemod``: ``"module:Class"`` of its ``FindingCommand``, imported only when source edits
      are planned (so importing autoopt does not import libcst).
    - ``report_section``: ``"module:function"`` (or the function) called as
      ``section(report, console)`` after the summary, for a table of its own.
    """

    name: str
    run: PassFn
    kinds: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    before: tuple[str, ...] = ()
    options: tuple[Option, ...] = ()
    enabled: Callable[[Options], bool] = _always
    jit_options: Callable[[Options, str | None], Mapping[str, Any]] = _no_jit_options
    check_options: Callable[[Mapping[str, Any]], None] | None = None
    codemod: str | None = None
    report_section: str | Callable[..., None] | None = None


def resolve(ref: str | Callable | None) -> Any:
    """``"package.module:attr"`` -> the attribute (imported now); anything else as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)
