"""Checkpoint wrappers where the remat pass applied: ``block(h, p)`` -> ``jax.checkpoint(block)(h, p)``.

The remat finding's line is where the recomputed values come from. What an expert wraps there:
the body of a loop primitive on that line (``lax.scan(body, ...)`` -> ``lax.scan(
jax.checkpoint(body), ...)``, likewise ``fori_loop``, ``while_loop``, ``lax.map``), or else the
outermost call of a user function on that line. When the finding names the function
(``details["function"]``) and its ``def`` is in the file, the ``def`` gets ``@jax.checkpoint``
instead. A policy in ``details["policy"]`` (a ``jax.checkpoint_policies`` name) is passed along.
A line of library calls only (``h = jnp.tanh(h @ w)``) is not rewritten: the finding says to
move it into a function first.
"""

from __future__ import annotations

import libcst as cst

from autoopt.codemod._base import FindingCommand, dotted_name

__all__ = ["RematCommand"]

# Loop primitives and the position of their body function.
_BODY_ARG = {"jax.lax.scan": 0, "jax.lax.fori_loop": 2, "jax.lax.while_loop": 1, "jax.lax.map": 0}
_CHECKPOINTS = ("jax.checkpoint", "jax.remat", "jax.ad_checkpoint.checkpoint")


class RematCommand(FindingCommand):
    DESCRIPTION = ("Wrap what the remat pass rematerialized in `jax.checkpoint`: a loop body, a "
                   "call of a user function, or its def.")
    KIND = "remat"
    HINT = "wrap the layer function at that line in jax.checkpoint (or use @autoopt.optimize)"

    def _policy_args(self, idxs: list[int]) -> list[cst.Arg]:
        for i in idxs:
            policy = self.targets[i].details.get("policy")
            if isinstance(policy, str) and policy.isidentifier():
                return [cst.Arg(keyword=cst.Name("policy"),
                                value=self.ref(f"jax.checkpoint_policies.{policy}"),
                                equal=cst.AssignEqual(cst.SimpleWhitespace(""),
                                                      cst.SimpleWhitespace("")))]
        return []

    def _checkpoint(self, fn: cst.BaseExpression, idxs: list[int]) -> cst.Call:
        args = [cst.Arg(fn)]
        extra = self._policy_args(idxs)
        if extra:
            args = [args[0].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                    *extra]
        return cst.Call(func=self.ref("jax.checkpoint"), args=args)

    def _is_checkpoint(self, node: cst.BaseExpression) -> bool:
        target = node.func if isinstance(node, cst.Call) else node
        return self.imports.qualified(target) in _CHECKPOINTS

    def _named(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, f in self.targets.items():
            name = f.details.get("function")
            if isinstance(name, str):
                out.setdefault(name, []).append(i)
        return out

    # --- a named def gets the decorator --------------------------------------------------------

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        idxs = [i for i in self._named().get(original_node.name.value, []) if i not in self.outcomes]
        if not idxs:
            return updated_node
        if any(self._is_checkpoint(d.decorator) for d in original_node.decorators):
            for i in idxs:
                self.outcomes[i] = f"`{original_node.name.value}` is already checkpointed"
            return updated_node
        dec = self.ref("jax.checkpoint")
        extra = self._policy_args(idxs)
        if extra:
            dec = cst.Call(func=self.ref("functools.partial"), args=[
                cst.Arg(dec, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *extra])
        for i in idxs:
            self.outcomes[i] = None
        return updated_node.with_changes(
            decorators=[cst.Decorator(decorator=dec), *updated_node.decorators])

    # --- a line: a loop body, or a call of a user function -------------------------------------

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        self._line_targets = [i for i in self.targets_within(node) if i not in self.outcomes
                              and not isinstance(self.targets[i].details.get("function"), str)]
        self._wrapped_one = False
        return True

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        idxs = getattr(self, "_line_targets", [])
        if not idxs or self._wrapped_one:
            return updated_node
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

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine,
                                  updated_node: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
        idxs = getattr(self, "_line_targets", [])
        self._line_targets = []
        if not idxs or self._wrapped_one:
            return updated_node
        # The outermost call of a user function in the statement.
        finder = _OutermostUserCall(self)
        updated_node.visit(finder)
        call = finder.found
        if call is None:
            for i in idxs:
                self.outcomes.setdefault(i, finder.reason or (
                    "the line calls library functions only; move it into a function and wrap "
                    "that in jax.checkpoint"))
            return updated_node
        new_call = call.with_changes(func=self._checkpoint(call.func, idxs))
        self._finish(idxs)
        return updated_node.deep_replace(call, new_call)

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
