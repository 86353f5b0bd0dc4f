"""The pass protocol: every pass takes a ClosedJaxpr and a PassContext and returns a PassResult.

NB: the analogue is torch.fx's ``PassBase``/``PassResult``. Passes stay pure: they never mutate
their input, never compile the user's function on the call path, and report through findings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax.extend.core import ClosedJaxpr

from autoopt._options import Options
from autoopt._finding import Finding


@dataclasses.dataclass(frozen=True)
class PassContext:
    """What a pass may know besides the program.

    ``in_leaf_names`` names each flat input as the user sees it (``"state['w']"``); ``in_arg_of_leaf``
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
    """What every pass returns: the new program, whether it changed, and what was found.

    ``info`` is pass-specific data for other layers (donation's aliasable leaves), never text.
    """

    jaxpr: ClosedJaxpr
    changed: bool = False
    findings: tuple[Finding, ...] = ()
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def unchanged(cls, jaxpr: ClosedJaxpr, findings=(), info=None) -> PassResult:
        return cls(jaxpr=jaxpr, changed=False, findings=tuple(findings), info=info or {})


PassFn = Callable[[ClosedJaxpr, PassContext], PassResult]


@dataclasses.dataclass(frozen=True)
class Pass:
    """A registered pass. ``enabled(options)`` says whether the user's options turn it on."""

    name: str
    run: PassFn
    enabled: Callable[[Options], bool] = lambda options: True
    # A rewrite changes the program; an analysis only reports. The manager re-checks types after
    # every rewrite when checks are on.
    rewrites: bool = True
    # Compile options this pass needs for every signature of a function, decided from the options
    # and the backend before anything is traced (jax.jit takes compiler_options per jit object,
    # not per signature). Example: remat on XLA:CPU may need xla_disable_hlo_passes.
    jit_options: Callable[[Options, str], Mapping[str, Any]] = lambda options, backend: {}
