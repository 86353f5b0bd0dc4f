"""``@jax.jit`` -> ``@partial(jax.jit, donate_argnums=...)``, or -> ``@autoopt.optimize``.

The donation analysis says which arguments an output can reuse (``details["aliasable"]``). An
argument that a recorded call site keeps using after the call (a call-site finding not applied)
is left out: donating it would invalidate the caller's array. Forms handled, for the analysed
function's ``def``: ``@jax.jit``, ``@jit``, ``@jax.jit(...)``, ``@partial(jax.jit, ...)`` and
module-level ``jax.jit(fn, ...)`` calls. A function already donating, or under
``@autoopt.optimize`` (which donates per call site), is left alone.

With ``style="autoopt"`` the jit is replaced by ``autoopt.optimize`` (keeping its keywords),
which proves donation per call site instead of promising it for every caller.
"""

from __future__ import annotations

import libcst as cst

from autoopt.codemod._base import FindingCommand, comma_separated
from autoopt.explain._finding import Finding

__all__ = ["DonateCommand"]

_DONATE_KEYWORDS = ("donate_argnums", "donate_argnames")


def _tuple_text(values) -> str:
    items = [repr(v) for v in values]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


class DonateCommand(FindingCommand):
    DESCRIPTION = ("Donate the arguments an output can reuse: `@jax.jit` -> "
                   "`@partial(jax.jit, donate_argnums=...)`, or -> `@autoopt.optimize` "
                   "with style='autoopt'.")
    KIND = "donate"
    HINT = "pass donate_argnums=(...) to jax.jit for these arguments, or use @autoopt.optimize"

    @classmethod
    def wants(cls, finding: Finding) -> bool:
        return finding.details.get("aliasable") is True and "arg" in finding.details

    def visit_Module(self, node: cst.Module) -> bool:
        super().visit_Module(node)
        # Arguments some call site reuses after the call: never suggested.
        self._reused = {f.details.get("arg"): f.details.get("site") or f.location
                        for f in self.findings
                        if f.kind == "donate" and not f.applied and f.details.get("site")}
        self._args: dict = {}
        for i, f in self.targets.items():
            arg = f.details["arg"]
            if arg in self._reused:
                self.outcomes[i] = f"a call site keeps using it after the call ({self._reused[arg]})"
            else:
                self._args.setdefault(arg, []).append(i)
        if not self._args:
            return False
        if not self.function or self.function == "<lambda>":
            what = "a lambda" if self.function else "not a plain function"
            self._done(f"the function is {what}: there is no def to decorate; {self.HINT}")
            return False
        return True

    def _keywords(self) -> list[cst.Arg]:
        nums = sorted(a for a in self._args if isinstance(a, int))
        names = sorted(a for a in self._args if isinstance(a, str))
        out = []
        if nums:
            out.append(("donate_argnums", _tuple_text(nums)))
        if names:
            out.append(("donate_argnames", _tuple_text(names)))
        return [cst.Arg(keyword=cst.Name(k), value=cst.parse_expression(v),
                        equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                              whitespace_after=cst.SimpleWhitespace("")))
                for k, v in out]

    def _done(self, reason: str | None) -> None:
        for idxs in self._args.values():
            for i in idxs:
                self.outcomes[i] = reason

    def _is_our_def(self, node: cst.FunctionDef) -> bool:
        if node.name.value != self.function:
            return False
        if self.function_line is None:
            return True
        lines = [self.span(d)[0] for d in node.decorators] + [self.span(node)[0]]
        return self.function_line in lines

    # --- the def's decorators -----------------------------------------------------------------

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if not self._args or not self._is_our_def(original_node):
            return updated_node
        decorators = list(updated_node.decorators)
        for k, dec in enumerate(decorators):
            new, reason = self._decorator(dec.decorator)
            if new is None and reason is None:
                continue  # not a jit decorator
            self._done(reason)
            if new is not None:
                decorators[k] = dec.with_changes(decorator=new)
                return updated_node.with_changes(decorators=decorators)
            return updated_node
        return updated_node

    def _decorator(self, expr: cst.BaseExpression):
        """``(new decorator, None)``, ``(None, reason)``, or ``(None, None)`` if not a jit."""
        imp = self.imports
        q = imp.qualified(expr.func if isinstance(expr, cst.Call) else expr)
        if q in ("autoopt.optimize", "autoopt._api.optimize"):
            return None, "already under @autoopt.optimize, which donates per call site"
        if q == "jax.jit":
            if not isinstance(expr, cst.Call):  # @jax.jit
                if self.style == "autoopt":
                    return self.ref("autoopt.optimize"), None
                args = comma_separated([cst.Arg(expr.deep_clone()), *self._keywords()])
                return cst.Call(func=self.ref("functools.partial"), args=args), None
            return self._add_keywords(expr, jit_first=False)
        if q == "functools.partial" and isinstance(expr, cst.Call) and expr.args and \
                imp.qualified(expr.args[0].value) == "jax.jit":
            return self._add_keywords(expr, jit_first=True)
        return None, None

    def _add_keywords(self, call: cst.Call, jit_first: bool):
        present = [a.keyword.value for a in call.args if a.keyword is not None]
        if self.style == "autoopt":
            kept = [a for a in call.args[1 if jit_first else 0:]
                    if a.keyword is None or a.keyword.value not in _DONATE_KEYWORDS]
            opt = self.ref("autoopt.optimize")
            if not kept:
                return opt, None
            return cst.Call(func=opt, args=comma_separated(kept)), None
        if any(k in present for k in _DONATE_KEYWORDS):
            return None, "the jit already names the arguments it donates"
        return call.with_changes(args=comma_separated([*call.args, *self._keywords()])), None

    # --- module-level jax.jit(fn) calls, when the def is not decorated -------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not self._args or not original_node.args:
            return updated_node
        if self.imports.qualified(original_node.func) != "jax.jit":
            return updated_node
        first = original_node.args[0].value
        if not (isinstance(first, cst.Name) and first.value == self.function):
            return updated_node
        new, reason = self._add_keywords(updated_node, jit_first=False)
        self._done(reason)
        return updated_node if new is None else new

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for idxs in getattr(self, "_args", {}).values():
            for i in idxs:
                self.outcomes.setdefault(
                    i, f"`{self.function}` is not jitted in this file; " + self.HINT)
        return super().leave_Module(original_node, updated_node)

