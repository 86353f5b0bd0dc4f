"""Placement where the placement pass applied: ``autoopt.prefetch`` and ``jax.device_put``.

What an expert does to a host-fed loop ``for batch in batches: state = step(state, batch)``:

- an argument that changes every iteration (it comes from the loop variable) is placed ahead of
  the step that needs it: ``for batch in autoopt.prefetch(batches):`` (batched, double-buffered);
- an argument that does not change in the loop (a host table, a constant) is placed once, before
  it: ``table = jax.device_put(table)``.

The loop is the one around the finding's line (the call site, when the function was called
before the report was made), or else the loop in this file that calls the analysed function by
name. Which argument: ``details["arg"]`` (position or keyword), or the leaves the pass names
(``"leaf"``, ``"leaves"``: ``batch['x']`` belongs to parameter ``batch``) mapped to positions
through the function's signature (``details["params"]``, added by ``plan_source_edits``).
``details["strategy"]`` picks the edit: ``"pack"``/``"prefetch"`` -> prefetch, ``"constant"``/
``"device_put"`` -> device_put; scalar and recompile findings have no source edit. Anything else
is reported, not guessed.
"""

from __future__ import annotations

import libcst as cst

from autoopt.codemod import FindingCommand, OwnScopeVisitor, finding_line

__all__ = ["PlacementCommand"]


class _Loops(cst.CSTVisitor):
    def __init__(self) -> None:
        self.loops: list[cst.For] = []

    def visit_For(self, node: cst.For) -> bool:
        self.loops.append(node)
        return True


class _Names(cst.CSTVisitor):
    """Names read in an expression."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> bool:
        self.names.add(node.value)
        return False


class _Assigned(cst.CSTVisitor):
    """Names (re)bound anywhere in a block."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def _add(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            self.names.add(target.value)
        elif isinstance(target, cst.Tuple | cst.List):
            for el in target.elements:
                self._add(el.value)
        elif isinstance(target, cst.StarredElement):
            self._add(target.value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
        self._add(node.target)
        return True

    def visit_AugAssign(self, node: cst.AugAssign) -> bool:
        self._add(node.target)
        return True

    def visit_AnnAssign(self, node: cst.AnnAssign) -> bool:
        self._add(node.target)
        return True

    def visit_For(self, node: cst.For) -> bool:
        self._add(node.target)
        return True


# The pass's strategies with a source edit, and the edit each one asks for (None: decide from
# where the argument comes from).
_STRATEGY = {
    None: None,
    "constant": "device_put",
    "device_put": "device_put",
    "pack": "prefetch",
    "prefetch": "prefetch",
}
_EDITABLE = frozenset(_STRATEGY)


def _root(name: str) -> str:
    """``"batch['x']"`` -> ``"batch"``: the argument a leaf name belongs to."""
    for sep in ("[", "."):
        name = name.split(sep)[0]
    return name


def _arguments(details: dict, call: cst.Call) -> list[cst.BaseExpression]:
    """The call's argument expressions the finding is about (by position, keyword or name)."""
    positional = [a.value for a in call.args if a.keyword is None and a.star == ""]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    arg = details.get("arg")
    if isinstance(arg, int) and not isinstance(arg, bool) and 0 <= arg < len(positional):
        return [positional[arg]]
    if isinstance(arg, str) and arg in keywords:
        return [keywords[arg]]
    # ``params``: (position, parameter name) of each argument, from the function's signature.
    found = []
    for pos, name in details.get("params") or ():
        if isinstance(pos, int) and 0 <= pos < len(positional):
            found.append(positional[pos])
        elif name in keywords:
            found.append(keywords[name])
    if found:
        return found
    names = [details[k] for k in ("name", "leaf") if isinstance(details.get(k), str)]
    names += [n for n in details.get("leaves") or () if isinstance(n, str)]
    out: list[cst.BaseExpression] = []
    for root in dict.fromkeys(_root(n) for n in names):
        if root in keywords:
            out.append(keywords[root])
        else:
            out.extend(e for e in positional if isinstance(e, cst.Name) and e.value == root)
    return out


class _Touched(_Assigned):
    """Names a block rebinds, or mutates through an attribute or item assignment or a method
    call (``env.step(a)``, ``buf[i] = x``, ``cfg.t = 1``)."""

    def _root(self, node: cst.BaseExpression) -> None:
        while isinstance(node, cst.Attribute | cst.Subscript):
            node = node.value
        if isinstance(node, cst.Name):
            self.names.add(node.value)

    def _add(self, target: cst.BaseExpression) -> None:
        super()._add(target)
        if isinstance(target, cst.Attribute | cst.Subscript):
            self._root(target)

    def __init__(self) -> None:
        super().__init__()
        # Imported modules the block draws random numbers from (``np.random.rand()``,
        # ``random.random()``): a call of one changes the module's own state, which a batch
        # made ahead of the body would have drawn from first.
        self.stateful: set[str] = set()

    def visit_Call(self, node: cst.Call) -> bool:
        if isinstance(node.func, cst.Attribute):
            self._root(node.func.value)
            attrs, root = [], node.func
            while isinstance(root, cst.Attribute):
                attrs.append(root.attr.value)
                root = root.value
            if (
                isinstance(root, cst.Name)
                and root.value != "jax"
                and (root.value == "random" or "random" in attrs[1:])
            ):
                self.stateful.add(root.value)  # (jax.random is functional: keys, no state)
        return True


class _EarlyExit(OwnScopeVisitor):
    """Whether a loop's body can leave it before its iterable is exhausted: a ``break`` of
    this loop, a ``return`` or ``yield`` of its function (nested functions and loops are their
    own)."""

    def __init__(self) -> None:
        self.found = False
        self._loops = 0

    def visit_For(self, node: cst.For) -> bool:
        self._loops += 1
        return True

    def leave_For(self, original_node: cst.For) -> None:
        self._loops -= 1

    def visit_While(self, node: cst.While) -> bool:
        self._loops += 1
        return True

    def leave_While(self, original_node: cst.While) -> None:
        self._loops -= 1

    def visit_Break(self, node: cst.Break) -> None:
        self.found = self.found or self._loops == 0

    def visit_Return(self, node: cst.Return) -> None:
        self.found = True

    def visit_Yield(self, node: cst.Yield) -> None:
        self.found = True


def _names_in(node: cst.CSTNode) -> set[str]:
    v = _Names()
    node.visit(v)
    return v.names


class PlacementCommand(FindingCommand):
    DESCRIPTION = (
        "Place what the placement pass placed: loop-fed batches through "
        "`autoopt.prefetch(...)`, loop-invariant host arrays once with `jax.device_put`."
    )
    KIND = "placement"
    INSERTS_STATEMENTS = True  # a `jax.device_put` line before the loop
    HINT = (
        "iterate over `autoopt.prefetch(batches)` and `jax.device_put` constant host arrays "
        "once, before the loop"
    )

    @classmethod
    def wants(cls, finding) -> bool:
        # Scalars and recompile triggers are fixed by options, not by placement in the source.
        return finding.applied and finding.details.get("strategy") in _EDITABLE

    def visit_Module(self, node: cst.Module) -> bool:
        super().visit_Module(node)
        finder = _Loops()
        node.visit(finder)
        self._loop_spans = [self.span(loop) for loop in finder.loops]
        self._stack: list[cst.For] = []
        self._calls: dict[int, list[cst.Call]] = {}
        return True

    def _calls_function(self, call: cst.Call) -> bool:
        f = call.func
        name = (
            f.value
            if isinstance(f, cst.Name)
            else f.attr.value
            if isinstance(f, cst.Attribute)
            else None
        )
        return name is not None and name == self.function

    def visit_For(self, node: cst.For) -> bool:
        self._stack.append(node)
        self._calls[id(node)] = []
        return True

    def visit_Call(self, node: cst.Call) -> bool:
        if self._stack:
            self._calls[id(self._stack[-1])].append(node)
        return True

    def _in_some_loop(self, line: int | None) -> bool:
        return line is not None and any(a <= line <= b for a, b in self._loop_spans)

    def _call_for(self, finding, calls: list[cst.Call]) -> cst.Call | None:
        """The call a finding is about: the innermost call on its line (a call site), or, when
        its line is outside every loop (the def), a call of the function by name."""
        line = finding_line(finding)
        if line is not None:
            on_line = [c for c in calls if self.span(c)[0] <= line <= self.span(c)[1]]
            if on_line:
                return min(on_line, key=lambda c: self.span(c)[1] - self.span(c)[0])
        if not self._in_some_loop(line):
            return next((c for c in calls if self._calls_function(c)), None)
        return None

    def leave_For(self, original_node: cst.For, updated_node: cst.For):
        self._stack.pop()
        calls = self._calls.pop(id(original_node), [])
        if self._stack:  # an inner loop's calls belong to the outer loop too
            self._calls[id(self._stack[-1])].extend(calls)
        chosen = {
            i: c
            for i, f in self.targets.items()
            if i not in self.outcomes and (c := self._call_for(f, calls)) is not None
        }
        if not chosen:
            return updated_node
        loop_vars = _names_in(original_node.target)
        assigned = _Assigned()
        original_node.body.visit(assigned)
        prefetch, put = False, []
        for i, call in chosen.items():
            action, detail = self._decide(self.targets[i].details, call, loop_vars, assigned.names)
            if action == "prefetch":
                if self._is_prefetch(original_node.iter):
                    self.outcomes[i] = "the loop already iterates over autoopt.prefetch(...)"
                elif (why := self._fed_back(original_node)) is not None:
                    self.outcomes[i] = why
                else:
                    prefetch = True
                    self.outcomes[i] = None
            elif action == "device_put":
                if self._placed_before(original_node, detail):
                    self.outcomes[i] = f"`{detail}` is already placed before the loop"
                else:
                    put.append(detail)
                    self.outcomes[i] = None
            else:
                self.outcomes[i] = detail
        new_loop = updated_node
        if prefetch:
            new_loop = new_loop.with_changes(
                iter=cst.Call(func=self.ref("autoopt.prefetch"), args=[cst.Arg(updated_node.iter)])
            )
        if not put:
            return new_loop
        stmts = [
            cst.SimpleStatementLine(
                body=[
                    cst.Assign(
                        targets=[cst.AssignTarget(cst.Name(n))],
                        value=cst.Call(
                            func=self.ref("jax.device_put"), args=[cst.Arg(cst.Name(n))]
                        ),
                    )
                ]
            )
            for n in dict.fromkeys(put)
        ]
        stmts[0] = stmts[0].with_changes(leading_lines=new_loop.leading_lines)
        return cst.FlattenSentinel([*stmts, new_loop.with_changes(leading_lines=[])])

    def _fed_back(self, loop: cst.For) -> str | None:
        """Why the loop's batches may depend on what its body does (prefetching would make
        them from an earlier state: an RL loop stepping its environment, a sampler reading the
        last parameters, a body drawing from the random stream the batches draw from), or why
        the loop may stop before they end (a batch made ahead is then taken from an iterable
        the code after the loop may read); None when the file shows neither. The iterable's
        names (and, for a call of a function of this file, every name that function reads)
        must be neither rebound in the body nor mutated there: no ``x.attr = ``, ``x[i] = `` or
        method call ``x.method(...)`` on them, nor a random draw from a module they use."""
        exits = _EarlyExit()
        loop.body.visit(exits)
        if exits.found:
            return (
                "the loop can end before its batches do (a break or return): prefetching "
                "would take batches past that point from the iterable"
            )
        reads = _names_in(loop.iter)
        if isinstance(loop.iter, cst.Call) and isinstance(loop.iter.func, cst.Name):
            for stmt in self.module.body if self.module is not None else ():
                if isinstance(stmt, cst.FunctionDef) and stmt.name.value == loop.iter.func.value:
                    reads |= _names_in(stmt.body)
        touched = _Touched()
        loop.body.visit(touched)
        fed = sorted((reads & touched.names) - (self._imported() - touched.stateful))
        if fed:
            return (
                f"the loop body changes `{fed[0]}`, which the batches are made from: a "
                "prefetched batch would be made before that change"
            )
        return None

    def _imported(self) -> set[str]:
        """Names the file's top-level imports bind (modules: ``np.mean(x)`` in the body
        mutates nothing the batches are made from)."""
        names: set[str] = set()
        for stmt in self.module.body if self.module is not None else ():
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.Import | cst.ImportFrom) and not isinstance(
                    small.names, cst.ImportStar
                ):
                    for alias in small.names:
                        bound = alias.asname.name if alias.asname else alias.name
                        while isinstance(bound, cst.Attribute):  # import a.b binds a
                            bound = bound.value
                        if isinstance(bound, cst.Name):
                            names.add(bound.value)
        return names

    def _decide(self, details: dict, call: cst.Call, loop_vars: set, assigned: set):
        """``("prefetch", None)``, ``("device_put", name)`` or ``(None, reason)``."""
        strategy = details.get("strategy")
        kind = _STRATEGY.get(strategy)
        exprs = _arguments(details, call)
        candidates = exprs or [a.value for a in call.args]
        if kind in (None, "prefetch") and any(_names_in(e) & loop_vars for e in candidates):
            return "prefetch", None
        names = [e.value for e in exprs if isinstance(e, cst.Name)]
        if (
            kind in (None, "device_put")
            and names
            and all(n not in assigned and n not in loop_vars for n in names)
        ):
            return "device_put", names[0]
        if not exprs and kind != "prefetch":
            return None, "the finding does not say which argument to place"
        if kind == "prefetch":
            return None, (
                "the host arrays do not come from the loop variable; place them where they are made"
            )
        return None, (
            "the argument neither comes from the loop variable nor stays the same through the loop"
        )

    def _is_prefetch(self, node: cst.BaseExpression) -> bool:
        imports = self.imports
        return (
            imports is not None
            and isinstance(node, cst.Call)
            and (imports.qualified(node.func) or "").endswith("prefetch")
        )

    def _placed_before(self, loop: cst.For, name: str | None) -> bool:
        from libcst.metadata import ParentNodeProvider

        imports = self.imports
        if name is None or imports is None:
            return False
        parent = self.get_metadata(ParentNodeProvider, loop, None)
        body: tuple = tuple(getattr(parent, "body", None) or ())
        at = next((k for k, s in enumerate(body) if s is loop), None)
        if at is None:
            return False
        for stmt in body[:at]:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if (
                    isinstance(small, cst.Assign)
                    and isinstance(small.value, cst.Call)
                    and imports.qualified(small.value.func) == "jax.device_put"
                    and any(
                        isinstance(t.target, cst.Name) and t.target.value == name
                        for t in small.targets
                    )
                ):
                    return True
        return False
