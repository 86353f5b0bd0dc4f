"""Every source edit is run before it is offered.

The rewritten file's definitions are executed as a fresh module, the rewritten function is
called under plain ``jax.jit`` on the report's arguments, and its outputs are compared with the
original function's under ``jax.jit``: bit for bit, or within ``autoopt._compare.tolerance``
when the edit rematerializes (recomputation may reassociate floating-point sums). A function the
file itself decorates with ``jax.jit`` is called through that decorator, so an edited
``donate_argnums`` runs too, on copies of the arguments (donation deletes what it is given).

The module's globals are the file's as it ran (a copy of the original module's), with the
rewritten file's imports, ``def``s, classes and the assignments an edit changed
(``step = jax.jit(step, donate_argnums=...)``) executed over them, in the file's order. The rest
of the top level (a script's training loop, its ``__main__`` part) does not run again: only
what defines the function matters to its numbers.

NB: the analogue is ``verify=True`` (``autoopt._compare``), which checks the optimized program
the same way; here the program checked is the one the edited file defines.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import contextvars
import dataclasses
import io
import itertools
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax

from autoopt._compare import assert_trees_equivalent
from autoopt._memory import compiled_memory

__all__ = ["CheckCall", "EditChecker", "checking"]

# Set while a rewritten file runs: a report built by that file's own top-level code plans no
# edits (it would run the file again, without end).
_CHECKING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "autoopt_codemod_checking", default=False
)
_MODULE_NUMBERS = itertools.count()


def checking() -> bool:
    """True while a rewritten file is being run to check an edit."""
    return _CHECKING.get()


@dataclasses.dataclass(frozen=True)
class CheckCall:
    """The report's call: the arguments and the jit's static arguments an edit is checked on."""

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    # The original function's peak under plain jax.jit when the caller has it (the report's
    # memory table "before"), so a check does not compile the original again to read it.
    original_peak: int | None = None
    # The program's callbacks into Python that may have effects (``io_callback``,
    # ``jax.debug.print``; not ``pure_callback``, which promises none): checking an edit runs
    # the function twice, so with any of these no edit is checked, and none is offered.
    effectful_callbacks: tuple[str, ...] = ()
    # What the checks on this call found, by (function, file text, exact): a report plans its
    # edits again when findings are added, and a rewritten text is checked once.
    verdicts: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def jit(self, fn: Callable) -> Callable:
        return jax.jit(fn, static_argnums=self.static_argnums, static_argnames=self.static_argnames)


def effectful_callbacks(closed: Any) -> tuple[str, ...]:
    """``CheckCall.effectful_callbacks`` of the traced program ``closed``."""
    from autoopt.passes.donation import host_callbacks

    return tuple(name for name in host_callbacks(closed) if name != "pure_callback")


def unwrap(fn: Callable) -> Callable:
    """The Python function under ``jax.jit``/``autoopt.optimize`` wrappers."""
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None or getattr(fn, "__code__", None) is not None:
            break
        fn = inner
    return fn


_DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_ASSIGNMENTS = (ast.Assign, ast.AnnAssign, ast.AugAssign)


def _definitions(original: str, code: str, path: str) -> ast.Module:
    """The top-level statements of ``code`` to execute: every import, def and class, and the
    assignments not in ``original`` as they are (an edit changed them)."""
    before = collections.Counter(ast.dump(s) for s in ast.parse(original, path).body)
    body: list[ast.stmt] = [
        s
        for s in ast.parse(code, path).body
        if isinstance(s, _DEFINITIONS) or (isinstance(s, _ASSIGNMENTS) and not before[ast.dump(s)])
    ]
    return ast.Module(body=body, type_ignores=[])


# An edit claiming a memory figure is offered only when its compile is within this much of it.
PEAK_SLACK = 0.10


def _peak_mismatch(
    run: Callable,
    call: CheckCall,
    claimed: int,
    original: Callable[[], int | None],
    checkpointed: bool,
) -> str | None:
    """Why ``run`` (the rewritten function under its jit) does not compile to the claimed peak,
    or None when it does (within ``PEAK_SLACK``, or the backend reports no figures).
    ``original()``: the original function's peak under plain jax.jit, asked only on a mismatch;
    ``checkpointed``: the edit adds ``jax.checkpoint`` calls."""
    try:
        args, kwargs = _copies((call.args, call.kwargs))
        memory = compiled_memory(run.lower(*args, **kwargs).compile())
    except Exception:  # noqa: BLE001 - no figures to compare: the numbers check stands
        return None
    if memory is None:
        return None
    peak = memory.peak_bytes
    if peak <= (1 + PEAK_SLACK) * claimed:
        return None
    before = original() if checkpointed and jax.default_backend() == "cpu" else None
    if before is not None and peak >= before * 0.98:
        # Measured: the source form saves nothing. XLA:CPU expands jax.checkpoint's
        # optimization barriers before CSE outside loop bodies, which merges the
        # recomputation back into the forward (autoopt.passes.remat: "fence_for").
        return (
            "written as jax.checkpoint it saves nothing: XLA:CPU merges the recomputation back "
            f"into the forward (jax-ml/jax#19822), so the rewritten function's peak is "
            f"{peak / 2**20:.1f} MiB under plain jax.jit, the original's {before / 2**20:.1f} "
            f"MiB, not the plan's {claimed / 2**20:.1f} MiB (the plan recomputes inside "
            "conditionals; jax.checkpoint's barriers survive on XLA:CPU only in loop bodies)"
        )
    return (
        f"compiled with plain jax.jit, the rewritten function's peak is {peak / 2**20:.1f} MiB, "
        f"not the {claimed / 2**20:.1f} MiB measured for the plan it writes out (XLA merges "
        "the source form's recomputation back, or keeps other values)"
    )


def _first_line(e: BaseException) -> str:
    text = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _copies(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)


class EditChecker:
    """Checks rewritten versions of one function's file against the original function."""

    def __init__(self, fn: Callable, call: CheckCall) -> None:
        self.fn = fn
        self.call = call
        self._expected: tuple[Any, str | None] | None = None
        self._plain_jit_type = type(jax.jit(lambda: None))

    def _original(self) -> tuple[Any, str | None]:
        if self._expected is None:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    out = self.call.jit(self.fn)(*self.call.args, **self.call.kwargs)
                self._expected = (jax.block_until_ready(out), None)
            except Exception as e:  # noqa: BLE001 - the reason goes into every finding's note
                self._expected = (
                    None,
                    f"the original function does not run under plain jax.jit ({_first_line(e)})",
                )
        return self._expected

    def _original_peak(self) -> int | None:
        """The original function's peak under plain jax.jit (argument + output + temp - alias
        bytes), or None where the backend gives no figures."""
        if self.call.original_peak is not None:
            return self.call.original_peak
        try:
            args, kwargs = _copies((self.call.args, self.call.kwargs))
            memory = compiled_memory(self.call.jit(self.fn).lower(*args, **kwargs).compile())
        except Exception:  # noqa: BLE001 - no figure: the note says what was measured
            return None
        return None if memory is None else memory.peak_bytes

    def why_not(
        self, path: str, original: str, code: str, *, exact: bool, claimed_peak: int | None = None
    ) -> str | None:
        """None when ``code`` (the rewritten ``original`` text of ``path``, the function's file)
        defines the function so that it gives the original's numbers and, with
        ``claimed_peak``, compiles under plain jax.jit to at most ``PEAK_SLACK`` more than that
        peak (argument + output + temp - alias bytes: what the report measured for the plan
        the edit writes out); else why it does not."""
        key = (self.fn, path, code, exact, claimed_peak)
        if key not in self.call.verdicts:
            self.call.verdicts[key] = self._why_not(
                path, original, code, exact=exact, claimed_peak=claimed_peak
            )
        return self.call.verdicts[key]

    def _why_not(
        self, path: str, original: str, code: str, *, exact: bool, claimed_peak: int | None = None
    ) -> str | None:
        expected, why = self._original()
        if why is not None:
            return why
        qualname = getattr(self.fn, "__qualname__", "")
        if not qualname or "<locals>" in qualname:
            return (
                "the function is defined inside another function, where the check cannot reach "
                "the rewritten version"
            )
        try:
            definitions = _definitions(original, code, path)
        except SyntaxError as e:
            return f"the rewritten file does not parse ({_first_line(e)})"
        name = f"__autoopt_check_{next(_MODULE_NUMBERS)}__"
        module = types.ModuleType(name)
        module.__dict__.update(getattr(self.fn, "__globals__", {}))
        module.__name__, module.__file__ = name, path
        token = _CHECKING.set(True)
        sys.modules[name] = module  # dataclasses and typing look a class's module up here
        try:
            try:
                with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    exec(compile(definitions, path, "exec"), module.__dict__)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the file is the user's
                return f"running the rewritten file failed ({_first_line(e)})"
            obj: Any = module
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
            if not callable(obj):
                return f"the rewritten file defines no `{qualname}`"
            # The file's own jax.jit carries the edited keywords (donate_argnums): call it.
            run = obj if type(obj) is self._plain_jit_type else self.call.jit(unwrap(obj))
            args, kwargs = _copies((self.call.args, self.call.kwargs))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = jax.block_until_ready(run(*args, **kwargs))
            except Exception as e:  # noqa: BLE001
                return f"the rewritten function raised {_first_line(e)}"
            try:
                assert_trees_equivalent(expected, got, what="the rewritten function", exact=exact)
            except AssertionError as e:
                return f"{_first_line(e).removeprefix('AssertionError: ')}"
            if claimed_peak is not None:
                checkpointed = code.count("checkpoint(") > original.count("checkpoint(")
                return _peak_mismatch(
                    run, self.call, claimed_peak, self._original_peak, checkpointed
                )
            return None
        finally:
            sys.modules.pop(name, None)
            _CHECKING.reset(token)
