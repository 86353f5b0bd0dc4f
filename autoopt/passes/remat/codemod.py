"""Checkpoint wrappers where the remat pass applied:
``block(h, p)`` -> ``jax.checkpoint(block)(h, p)``.

The lines come from the finding: its location and every line its recomputed values come from
(``details["recomputed"][*]["location"]``). What an expert wraps on such a line, first match:

1. the body of a loop primitive (``lax.scan(body, ...)`` -> ``lax.scan(jax.checkpoint(body),
   ...)``, likewise ``fori_loop``, ``while_loop``, ``lax.map``);
2. the outermost call of a user function (``h = block(h, p)``);
3. an assignment of library calls, as a checkpointed function of the local names it reads:
   ``h = jnp.tanh(h @ w)`` -> ``h = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))(h, w)``.

When the finding names a function (``details["function"]``) whose ``def`` is in the file, the
``def`` gets ``@jax.checkpoint`` instead. The policy is ``details["policy"]`` when given; when
every recomputed value is cheap (no matmul or convolution among its primitives) it is
``dots_saveable``, which keeps the matmuls as the pass did.
"""

from __future__ import annotations

import builtins
import os
from typing import cast

import libcst as cst

from autoopt.codemod import FindingCommand, comma_separated, dotted_name

__all__ = ["RematCommand"]

# Loop primitives and the position of their body function.
_BODY_ARG = {"jax.lax.scan": 0, "jax.lax.fori_loop": 2, "jax.lax.while_loop": 1, "jax.lax.map": 0}
_CHECKPOINTS = ("jax.checkpoint", "jax.remat", "jax.ad_checkpoint.checkpoint")
_MATMULS = ("dot_general", "conv_general_dilated")


class RematCommand(FindingCommand):
    DESCRIPTION = (
        "Wrap what the remat pass rematerialized in `jax.checkpoint`: a loop body, a "
        "call of a user function, or its def."
    )
    KIND = "remat"
    HINT = "wrap the layer function at that line in jax.checkpoint (or use @autoopt.optimize)"

    def lines_of(self, finding) -> list[int]:
        """The finding's line and every line of this file its recomputed values come from."""
        lines = set(super().lines_of(finding))
        here = self.context.filename
        for r in finding.details.get("recomputed") or ():
            path, _, n = str(r.get("location", "")).rpartition(":")
            if n.isdigit() and (here is None or os.path.realpath(path) == os.path.realpath(here)):
                lines.add(int(n))
        return sorted(lines)

    def _policy_args(self, idxs: list[int]) -> list[cst.Arg]:
        for i in idxs:
            details = self.targets[i].details
            policy = details.get("policy")
            recomputed = details.get("recomputed") or ()
            if (
                policy is None
                and recomputed
                and not any(p in _MATMULS for r in recomputed for p in r.get("primitives", ()))
            ):
                # Only cheap values are recomputed: keep the matmuls, as the pass did.
                policy = "dots_saveable"
            if isinstance(policy, str) and policy.isidentifier():
                return [
                    cst.Arg(
                        keyword=cst.Name("policy"),
                        value=self.ref(f"jax.checkpoint_policies.{policy}"),
                        equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
                    )
                ]
        return []

    def _checkpoint(self, fn: cst.BaseExpression, idxs: list[int]) -> cst.Call:
        args = [cst.Arg(fn)]
        extra = self._policy_args(idxs)
        if extra:
            args = [
                args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                *extra,
            ]
        return cst.Call(func=self.ref("jax.checkpoint"), args=args)

    def _is_checkpoint(self, node: cst.BaseExpression) -> bool:
        target = node.func if isinstance(node, cst.Call) else node
        assert self.imports is not None  # set by visit_Module, which runs first
        return self.imports.qualified(target) in _CHECKPOINTS

    def _named(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, f in self.targets.items():
            name = f.details.get("function")
            if isinstance(name, str):
                out.setdefault(name, []).append(i)
        return out

    # --- a named def gets the decorator --------------------------------------------------------

    def _decorate(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        idxs = [
            i for i in self._named().get(original_node.name.value, []) if i not in self.outcomes
        ]
        if not idxs:
            return updated_node
        if any(self._is_checkpoint(d.decorator) for d in original_node.decorators):
            for i in idxs:
                self.outcomes[i] = f"`{original_node.name.value}` is already checkpointed"
            return updated_node
        dec = self.ref("jax.checkpoint")
        extra = self._policy_args(idxs)
        if extra:
            dec = cst.Call(
                func=self.ref("functools.partial"),
                args=[
                    cst.Arg(dec, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                    *extra,
                ],
            )
        for i in idxs:
            self.outcomes[i] = None
        return updated_node.with_changes(
            decorators=[cst.Decorator(decorator=dec), *updated_node.decorators]
        )

    # --- a line: a loop body, or a call of a user function -------------------------------------

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        self._line_targets = [
            i
            for i in self.targets_within(node)
            if not isinstance(self.targets[i].details.get("function"), str)
        ]
        self._wrapped_one = False
        return True

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        idxs = getattr(self, "_line_targets", [])
        if not idxs or self._wrapped_one:
            return updated_node
        assert self.imports is not None  # set by visit_Module, which runs first
        q = self.imports.qualified(original_node.func)
        if q in _BODY_ARG:
            k = _BODY_ARG[q]
            positional = [a for a in updated_node.args if a.keyword is None]
            if len(positional) <= k:
                return updated_node
            body = positional[k]
            if isinstance(body.value, cst.Call) and self._is_checkpoint(body.value):
                for i in idxs:
                    self.outcomes.setdefault(i, "the loop body is already checkpointed")
                return updated_node
            args = list(updated_node.args)
            args[args.index(body)] = body.with_changes(value=self._checkpoint(body.value, idxs))
            self._finish(idxs)
            return updated_node.with_changes(args=args)
        return updated_node

    def leave_SimpleStatementLine(
        self, original_node: cst.SimpleStatementLine, updated_node: cst.SimpleStatementLine
    ) -> cst.SimpleStatementLine:
        idxs = getattr(self, "_line_targets", [])
        self._line_targets = []
        if not idxs or self._wrapped_one:
            return updated_node
        # The outermost call of a user function in the statement.
        finder = _OutermostUserCall(self)
        updated_node.visit(finder)
        call = finder.found
        if call is None and finder.reason is None:
            wrapped = self._wrap_expression(updated_node, idxs)
            if wrapped is not None:
                return wrapped
        if call is None:
            for i in idxs:
                self.outcomes.setdefault(
                    i,
                    finder.reason
                    or (
                        "the line is not an assignment of an expression; move it into a function "
                        "and wrap that in jax.checkpoint"
                    ),
                )
            return updated_node
        new_call = call.with_changes(func=self._checkpoint(call.func, idxs))
        self._finish(idxs)
        # ``call`` is inside the statement, so the statement itself comes back
        return cast(cst.SimpleStatementLine, updated_node.deep_replace(call, new_call))

    def _wrap_expression(self, stmt: cst.SimpleStatementLine, idxs: list[int]):
        """``h = jnp.tanh(h @ w + b)`` -> ``h = jax.checkpoint(lambda h, w, b: ...)(h, w, b)``:
        a line of library calls becomes a checkpointed function of the local names it reads."""
        if len(stmt.body) != 1 or not isinstance(stmt.body[0], cst.Assign):
            return None
        value = stmt.body[0].value
        free = _FreeNames()
        value.visit(free)
        if free.has_lambda or not free.has_call:
            return None
        assert self.imports is not None  # set by visit_Module, which runs first
        static = set().union(*getattr(self, "_static_stack", [set()]))
        # Names holding shapes stay closed over: passed to jax.checkpoint they would be traced,
        # and ``reshape(b, s, d)`` of them raises ConcretizationTypeError (issue 28).
        params = [
            n
            for n in free.names
            if n not in self._module_names
            and n not in self.imports.bound
            and n not in dir(builtins)
            and n not in static
        ]
        lam = cst.Lambda(
            params=cst.Parameters(params=[cst.Param(cst.Name(n)) for n in params]),
            body=value.with_changes(lpar=[], rpar=[]),
            colon=cst.Colon(whitespace_after=cst.SimpleWhitespace(" ")),
        )
        call = cst.Call(
            func=self._checkpoint(lam, idxs),
            args=comma_separated([cst.Arg(cst.Name(n)) for n in params]),
        )
        self._finish(idxs)
        new = stmt.with_changes(body=[stmt.body[0].with_changes(value=call)])
        return new

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        finder = _ShapeNames()
        node.body.visit(finder)
        self._static_stack = [*getattr(self, "_static_stack", []), finder.names]
        return True

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
        self._static_stack = getattr(self, "_static_stack", [])[:-1]
        return self._decorate(original_node, updated_node)

    def visit_Module(self, node: cst.Module) -> bool:
        super().visit_Module(node)
        names: set[str] = set()
        for stmt in node.body:
            if isinstance(stmt, cst.FunctionDef | cst.ClassDef):
                names.add(stmt.name.value)
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Assign):
                        for t in small.targets:
                            names |= _target_names(t.target)
                    elif isinstance(small, cst.AnnAssign | cst.AugAssign):
                        names |= _target_names(small.target)
        self._module_names = names
        return True

    def _finish(self, idxs: list[int]) -> None:
        self._wrapped_one = True
        for i in idxs:
            self.outcomes[i] = None


class _OutermostUserCall(cst.CSTVisitor):
    def __init__(self, command: RematCommand) -> None:
        self.command = command
        self.found: cst.Call | None = None
        self.reason: str | None = None

    def visit_Call(self, node: cst.Call) -> bool:
        if self.found is not None:
            return False
        if self.command._is_checkpoint(node.func):
            self.reason = "the call is already checkpointed"
            return False
        if _user_function(node.func, self.command.imports):
            self.found = node
            return False
        return True

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False


def _user_function(func: cst.BaseExpression, imports) -> bool:
    """A plain name that is not library code, ``self.method``, or ``usermodule.fn``.

    Other attribute calls are most often array methods (``x.sum()``, ``x.reshape(...)``)."""
    if isinstance(func, cst.Name):
        return not imports.is_library(func)
    dotted = dotted_name(func)
    if dotted is None:
        return False
    root = dotted.split(".")[0]
    if root in ("self", "cls"):
        return True
    return root in imports.bound and not imports.is_library(func)


def _target_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Tuple | cst.List):
        out: set[str] = set()
        for el in target.elements:
            out |= _target_names(el.value)
        return out
    return set()


class _ShapeNames(cst.CSTVisitor):
    """Names a function assigns from a shape (``b, s, d = x.shape``, ``n = x.shape[0]``,
    ``k = len(xs)``, ``m = x.ndim``): Python integers, static under ``jax.checkpoint`` only
    when closed over."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Assign(self, node: cst.Assign) -> bool:
        probe = _ReadsShape()
        node.value.visit(probe)
        if probe.found:
            for t in node.targets:
                self.names |= _target_names(t.target)
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False  # a nested def is a scope of its own


class _ReadsShape(cst.CSTVisitor):
    def __init__(self) -> None:
        self.found = False

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        if node.attr.value in ("shape", "ndim", "size"):
            self.found = True
        return True

    def visit_Call(self, node: cst.Call) -> bool:
        if isinstance(node.func, cst.Name) and node.func.value == "len":
            self.found = True
        return True


class _FreeNames(cst.CSTVisitor):
    """Names an expression reads, in first-use order (attribute names and keywords excluded)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.has_call = False
        self.has_lambda = False

    def visit_Name(self, node: cst.Name) -> bool:
        if node.value not in self.names:
            self.names.append(node.value)
        return False

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_Call(self, node: cst.Call) -> bool:
        self.has_call = True
        return True

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        self.has_lambda = True
        return False

    def visit_GeneratorExp(self, node: cst.BaseComp) -> bool:
        self.has_lambda = True  # comprehension variables are not free names
        return False

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp
