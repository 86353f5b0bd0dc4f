"""``@jax.jit`` -> ``@partial(jax.jit, donate_argnums=...)``, or -> ``@autoopt.optimize``.

The donation analysis says which arguments an output can reuse (``details["aliasable"]``). An
argument that a recorded call site keeps using after the call (a call-site finding not applied)
is left out: donating it would invalidate the caller's array. ``donate_argnums`` is a promise
for every caller, so under ``style="jax"`` an argument is also left out unless the file shows
every caller's array dead after the call: every call of the function (directly, or through a
function of this module it is passed to) rebinds the very name it passes
(``state = step(state, batch)``), and an allow-list holds for that name (``_second_holder``):
it is bound only to new arrays (results of the function itself, of array constructors such
as ``jnp.zeros`` and ``jax.random.normal``, dict/list/tuple displays of those, or calls of this
file's undecorated functions whose every ``return`` is such a value, like ``init_state()``)
and otherwise only read for metadata
(``w.shape``) or returned; and the function is not passed around otherwise. Anything else is
refused with its line: ``w[:]``, ``w.T``, ``w.astype(w.dtype)``, ``jnp.reshape`` and
``jnp.asarray`` can all return the array itself, and a closure keeps it. The outcome says
which call fails and why, and ``style="autoopt"`` is the safe edit (it proves donation per call
site, at run time). Forms handled, for the analysed
function's ``def``: ``@jax.jit``, ``@jit``, ``@jax.jit(...)``, ``@partial(jax.jit, ...)`` and
module-level ``jax.jit(fn, ...)`` calls. A function already donating, or under
``@autoopt.optimize`` (which donates per call site), is left alone.

With ``style="autoopt"`` the jit is replaced by ``autoopt.optimize`` (keeping its keywords),
which proves donation per call site instead of promising it for every caller.
"""

from __future__ import annotations

import os
import re
from typing import cast

import libcst as cst
from libcst.metadata import CodeRange, ParentNodeProvider, PositionProvider

from autoopt._finding import Finding
from autoopt.codemod import FindingCommand, OwnScopeVisitor, comma_separated

__all__ = ["DonateCommand"]

_DONATE_KEYWORDS = ("donate_argnums", "donate_argnames")


def _tuple_text(values) -> str:
    items = [repr(v) for v in values]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


class DonateCommand(FindingCommand):
    DESCRIPTION = (
        "Donate the arguments an output can reuse: `@jax.jit` -> "
        "`@partial(jax.jit, donate_argnums=...)`, or -> `@autoopt.optimize` "
        "with style='autoopt'."
    )
    KIND = "donate"
    HINT = "pass donate_argnums=(...) to jax.jit for these arguments, or use @autoopt.optimize"

    @classmethod
    def wants(cls, finding: Finding) -> bool:
        return finding.details.get("aliasable") is True and "arg" in finding.details

    def visit_Module(self, node: cst.Module) -> bool:
        super().visit_Module(node)
        # Arguments some call site reuses after the call: never suggested.
        self._reused = {
            f.details.get("arg"): f.details.get("site") or f.location
            for f in self.findings
            if f.kind == "donate" and not f.applied and f.details.get("site")
        }
        self._args: dict = {}
        for i, f in self.targets.items():
            arg = f.details["arg"]
            if arg in self._reused:
                self.outcomes[i] = (
                    f"a call site keeps using it after the call ({self._reused[arg]})"
                )
            else:
                self._args.setdefault(arg, []).append(i)
        if not self._args:
            return False
        self._unproven = {}
        if self.style == "jax" and self.function and self.function != "<lambda>":
            self._unproven = _unproven_callers(node, self.function, self._args, self)
            outside = _imported_elsewhere(self.context.filename, self.function)
            if outside is not None:
                self._unproven = dict.fromkeys(self._args, outside)
        if not self.function or self.function == "<lambda>":
            what = "a lambda" if self.function else "not a plain function"
            self._done(f"the function is {what}: there is no def to decorate; {self.HINT}")
            return False
        return True

    def _drop_unproven(self) -> str | None:
        """Leave out the arguments no call in this file shows dead (``_unproven_callers``), with
        their reason; the reason also when none is left to donate."""
        why = None
        for arg, reason in self._unproven.items():
            why = (
                f"{reason}; donate_argnums could delete an array the caller still holds. Use "
                "@autoopt.optimize (rewrite --style autoopt), which donates per call site"
            )
            for i in self._args.pop(arg, ()):
                self.outcomes[i] = why
        return why if not self._args else None

    def _keywords(self) -> list[cst.Arg]:
        nums = sorted(a for a in self._args if isinstance(a, int))
        names = sorted(a for a in self._args if isinstance(a, str))
        out = []
        if nums:
            out.append(("donate_argnums", _tuple_text(nums)))
        if names:
            out.append(("donate_argnames", _tuple_text(names)))
        return [
            cst.Arg(
                keyword=cst.Name(k),
                value=cst.parse_expression(v),
                equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""),
                    whitespace_after=cst.SimpleWhitespace(""),
                ),
            )
            for k, v in out
        ]

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

    def leave_FunctionDef(
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.FunctionDef:
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
        assert imp is not None  # set by visit_Module, which runs before any node inside it
        q = imp.qualified(expr.func if isinstance(expr, cst.Call) else expr)
        if q in ("autoopt.optimize", "autoopt._jit._function.optimize"):
            return None, "already under @autoopt.optimize, which donates per call site"
        if q == "jax.jit":
            if not isinstance(expr, cst.Call):  # @jax.jit
                if self.style == "autoopt":
                    return self.ref("autoopt.optimize"), None
                if (why := self._drop_unproven()) is not None:
                    return None, why
                args = comma_separated([cst.Arg(expr.deep_clone()), *self._keywords()])
                return cst.Call(func=self.ref("functools.partial"), args=args), None
            return self._add_keywords(expr, jit_first=False)
        if (
            q == "functools.partial"
            and isinstance(expr, cst.Call)
            and expr.args
            and imp.qualified(expr.args[0].value) == "jax.jit"
        ):
            return self._add_keywords(expr, jit_first=True)
        return None, None

    def _add_keywords(self, call: cst.Call, jit_first: bool):
        present = [a.keyword.value for a in call.args if a.keyword is not None]
        if self.style == "autoopt":
            kept = [
                a
                for a in call.args[1 if jit_first else 0 :]
                if a.keyword is None or a.keyword.value not in _DONATE_KEYWORDS
            ]
            opt = self.ref("autoopt.optimize")
            if not kept:
                return opt, None
            return cst.Call(func=opt, args=comma_separated(kept)), None
        if any(k in present for k in _DONATE_KEYWORDS):
            return None, "the jit already names the arguments it donates"
        if (why := self._drop_unproven()) is not None:
            return None, why
        return call.with_changes(args=comma_separated([*call.args, *self._keywords()])), None

    # --- module-level jax.jit(fn) calls, when the def is not decorated -------------------------

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not self._args or not original_node.args:
            return updated_node
        assert self.imports is not None  # set by visit_Module, which runs first
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
                    i, f"`{self.function}` is not jitted in this file; " + self.HINT
                )
        return super().leave_Module(original_node, updated_node)


# --- the calls in this file: does every one rebind what it donates? --------------------------


def _bound_names(target: cst.BaseExpression) -> set[str]:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Tuple | cst.List):
        return (
            set().union(*(_bound_names(e.value) for e in target.elements))
            if target.elements
            else set()
        )
    return set()


class _Uses(cst.CSTVisitor):
    """Every Name node spelling one of ``names``, and every assignment ``alias = jax.jit(fn)``."""

    def __init__(self, fn: str, cmd) -> None:
        self.fn, self.cmd = fn, cmd
        self.names = {fn}
        self.refs: list[cst.Name] = []
        self.jit_wraps: set[int] = set()  # id of the Name wrapped by jax.jit(fn, ...)
        self.defs: set[int] = set()  # id of a Name that a def or an alias binds

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.defs.add(id(node.name))

    def visit_Assign(self, node: cst.Assign) -> None:
        v = node.value
        if (
            isinstance(v, cst.Call)
            and v.args
            and isinstance(v.args[0].value, cst.Name)
            and v.args[0].value.value == self.fn
            and self.cmd.imports.qualified(v.func) == "jax.jit"
        ):
            self.jit_wraps.add(id(v.args[0].value))
            for t in node.targets:
                for name in _bound_names(t.target):
                    self.names.add(name)
                if isinstance(t.target, cst.Name):
                    self.defs.add(id(t.target))

    def visit_Name(self, node: cst.Name) -> None:
        self.refs.append(node)


# Folders never searched for importers: tools' and environments' own files.
_NOT_SEARCHED = {
    ".git",
    ".hg",
    "__pycache__",
    "node_modules",
    "site-packages",
    "dist-packages",
    ".tox",
    ".nox",
    ".mypy_cache",
    ".pytest_cache",
}
_PROJECT_MARKERS = (".git", ".hg", "pyproject.toml", "setup.py", "setup.cfg")
_MAX_SEARCHED = 5000  # Python files and notebooks; past this the search gives up and refuses


def _search_root(path: str) -> str:
    """Where the callers of ``path``'s functions may be: the project it belongs to (the nearest
    folder above it with a ``.git``, ``pyproject.toml``, ``setup.py`` or ``setup.cfg``: a ``src``
    layout's scripts and tests sit beside ``src``), else the folder above the one its outermost
    package sits in (a script beside ``src/``, or beside a namespace package's folder)."""
    folder = os.path.dirname(path)
    probe = folder
    while True:
        if any(os.path.exists(os.path.join(probe, m)) for m in _PROJECT_MARKERS):
            return probe
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder = os.path.dirname(folder)
    return os.path.dirname(folder)


def _names_of_module(path: str) -> list[str]:
    """The names another file reaches ``path``'s functions by: the module's own name and each
    package above it (an ``__init__.py`` may re-export the function: ``from pkg import step``)."""
    folder, base = os.path.split(path)
    names = [] if base == "__init__.py" else [os.path.splitext(base)[0]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        names.append(os.path.basename(folder))
        folder = os.path.dirname(folder)
    return names


def _imported_elsewhere(path: str | None, fn: str) -> str | None:
    """Why ``donate_argnums`` on ``fn`` cannot be promised from this file alone, or None: another
    Python file or notebook of the project names ``fn`` and the module (or a package above it),
    so it may call ``fn``, and its calls are callers this file does not show. Conservative, by
    text: both names anywhere in the file are enough. Imports by string (``importlib``) and
    code outside the project are not seen."""
    if path is None or not os.path.isfile(path):
        return None
    mine = os.path.realpath(path)
    module = re.compile(r"\b(?:" + "|".join(map(re.escape, _names_of_module(mine))) + r")\b")
    name = re.compile(rf"\b{re.escape(fn)}\b")
    root = _search_root(mine)
    searched = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in _NOT_SEARCHED
            and not os.path.isfile(os.path.join(folder, d, "pyvenv.cfg"))
            and not os.path.isdir(os.path.join(folder, d, "conda-meta"))
        )
        for f in sorted(files):
            other = os.path.join(folder, f)
            if not f.endswith((".py", ".ipynb")) or os.path.realpath(other) == mine:
                continue
            searched += 1
            if searched > _MAX_SEARCHED:
                return (
                    f"more than {_MAX_SEARCHED} Python files under {root}: the files that may "
                    f"import `{fn}` and call it could not all be checked"
                )
            try:
                with open(other, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError:
                continue
            found = name.search(text)
            if found is None or module.search(text) is None:
                continue
            line = text.count("\n", 0, found.start()) + 1
            return (
                f"{other}:{line} names `{fn}` and its module: its calls are callers this file "
                "does not show"
            )
    return None


def _unproven_callers(module: cst.Module, fn: str, args, cmd) -> dict:
    """``{arg: why}`` for the donated arguments some call in ``module`` keeps using after the
    call, or that no call visibly rebinds."""
    uses = _Uses(fn, cmd)
    module.visit(uses)
    defs = {d.name.value: d for d in module.body if isinstance(d, cst.FunctionDef)}
    calls, escapes = [], []
    # (scope, names): where a name refers to the function; one level of indirection through
    # a function of this module it is passed to (`run(train_step)` calling `step(...)`).
    todo = [(uses.refs, uses.names, True)]
    while todo:
        refs, names, follow = todo.pop()
        for ref in refs:
            if ref.value not in names or id(ref) in uses.defs or id(ref) in uses.jit_wraps:
                continue
            parent = cmd.get_metadata(ParentNodeProvider, ref, None)
            if isinstance(parent, cst.Call) and parent.func is ref:
                calls.append(parent)
                continue
            if isinstance(parent, cst.Decorator):
                continue
            param = _param_passed_to(ref, parent, defs, cmd) if follow else None
            if param is None:
                escapes.append(ref)
                continue
            callee, pname = param
            inner = _Uses(pname, cmd)
            callee.body.visit(inner)
            todo.append((inner.refs, {pname}, False))
    out = {}
    for arg in args:
        if escapes:
            line = cmd.span(escapes[0])[0]
            out[arg] = (
                f"`{escapes[0].value}` is passed around on line {line}, so its callers "
                "cannot all be seen"
            )
            continue
        if not calls:
            out[arg] = f"no call of `{fn}` in this file shows the caller rebinding the argument"
            continue
        # Every call's own statement first, then what else each donated name meets: the first
        # call that fails is the one the reason names.
        for check in (_not_rebound, _second_holder):
            failed = next(
                ((c, why) for c in calls if (why := check(c, arg, cmd, calls)) is not None), None
            )
            if failed is not None:
                call, why = failed
                out[arg] = (
                    f"the call on line {cmd.span(call)[0]} (`{cmd.code(call)}`) does not show "
                    f"the argument dead after it: {why}"
                )
                break
    return out


def _param_passed_to(ref: cst.Name, parent, defs: dict, cmd):
    """``(def, parameter name)`` when ``ref`` is passed positionally to a call of a function
    ``defs`` holds (defined at the top of this module), else None."""
    if not isinstance(parent, cst.Arg) or parent.keyword is not None or parent.star:
        return None
    call = cmd.get_metadata(ParentNodeProvider, parent, None)
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name):
        return None
    callee = defs.get(call.func.value)
    if callee is None or any(a.star for a in call.args):
        return None
    k = [a for a in call.args if a.keyword is None].index(parent)
    params = [*callee.params.posonly_params, *callee.params.params]
    return (callee, params[k].name.value) if k < len(params) else None


def _passed(call: cst.Call, arg) -> cst.BaseExpression | None:
    """The expression ``call`` passes for ``arg`` (a position or a keyword), or None."""
    if isinstance(arg, int):
        positional = [a for a in call.args if a.keyword is None]
        return positional[arg].value if arg < len(positional) else None
    return next(
        (a.value for a in call.args if a.keyword is not None and a.keyword.value == arg), None
    )


def _not_rebound(call: cst.Call, arg, cmd, calls: list) -> str | None:
    """Why ``call``'s own statement does not rebind the name it passes for ``arg`` (None when
    it does: ``w = step(w, x)``, ``w, opt = step(w, opt)``)."""
    if any(a.star for a in call.args):
        return "it unpacks its arguments, so which array is donated cannot be seen"
    passed = _passed(call, arg)
    if passed is None:
        how = "by position" if isinstance(arg, int) else "by keyword"
        return f"it does not pass the argument {how}"
    if not isinstance(passed, cst.Name):
        return "it passes an expression, not a name the statement rebinds"
    stmt = cmd.get_metadata(ParentNodeProvider, call, None)
    if not isinstance(stmt, cst.Assign) or stmt.value is not call:
        return f"its result is not assigned back to `{passed.value}`"
    if len(stmt.targets) != 1 or passed.value not in _bound_names(stmt.targets[0].target):
        return f"the statement does not rebind `{passed.value}` (alone)"
    return None


# Calls known to return a new array, never one of their arguments: the array constructors.
# Anything else may hand back its input (``x[:]``, ``x.T``, ``x.astype(x.dtype)``,
# ``jnp.reshape``, ``jnp.asarray``, ``jnp.full(shape, array)`` all can), so it is refused.
_FRESH = frozenset(
    [
        f"jax.numpy.{n}"
        for n in (
            "zeros",
            "ones",
            "empty",
            "zeros_like",
            "ones_like",
            "empty_like",
            "arange",
            "linspace",
            "eye",
            "identity",
        )
    ]
    + [
        f"jax.random.{n}"
        for n in (
            "normal",
            "uniform",
            "randint",
            "bernoulli",
            "truncated_normal",
            "exponential",
            "gumbel",
            "laplace",
            "logistic",
            "cauchy",
        )
    ]
)
# Fresh only with a number as the fill value (a fill array of the full shape comes back as is).
_FRESH_WITH_NUMBER_FILL = frozenset({"jax.numpy.full", "jax.numpy.full_like"})
# Attributes that read metadata, never the array.
_METADATA = frozenset({"shape", "dtype", "ndim", "size"})


def _is_number(node: cst.CSTNode | None) -> bool:
    if isinstance(node, cst.UnaryOperation):
        return _is_number(node.expression)
    return isinstance(node, cst.Integer | cst.Float)


def _fresh_call(value: cst.BaseExpression, ids: set[int], cmd) -> bool:
    """Whether ``value`` is a call returning an array no other name holds: a call of the
    donating function (``ids``), or an array constructor (``_FRESH``)."""
    if not isinstance(value, cst.Call):
        return False
    if id(value) in ids:
        return True
    q = cmd.imports.qualified(value.func) or ""
    if q in _FRESH:
        return True
    if q in _FRESH_WITH_NUMBER_FILL:
        fill = next(
            (a.value for a in value.args if a.keyword and a.keyword.value == "fill_value"), None
        )
        positional = [a.value for a in value.args if a.keyword is None]
        return _is_number(
            fill if fill is not None else positional[1] if len(positional) > 1 else None
        )
    return False


def _fresh_value(value: cst.BaseExpression, ids: set[int], cmd, depth: int = 0) -> bool:
    """Whether ``value`` holds only arrays no other name holds: a fresh call
    (``_fresh_call``), a dict, list or tuple display of fresh values (no ``*``/``**``
    unpacking), or a call of a fresh function of this file (``_fresh_function``), such as
    ``state = init_state()``."""
    if _fresh_call(value, ids, cmd) or _is_number(value):
        return True  # (a Python number holds no device buffer)
    if isinstance(value, cst.Dict):
        return all(
            isinstance(e, cst.DictElement) and _fresh_value(e.value, ids, cmd, depth)
            for e in value.elements
        )
    if isinstance(value, cst.List | cst.Tuple):
        return all(
            isinstance(e, cst.Element) and _fresh_value(e.value, ids, cmd, depth)
            for e in value.elements
        )
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name) and depth < 4:
        name = value.func.value
        return not _shadowed(value, name, cmd) and _fresh_function(name, cmd, depth + 1)
    return False


def _shadowed(call: cst.Call, name: str, cmd) -> bool:
    """Whether ``name`` at ``call`` may mean something other than the file's top-level
    binding: in some enclosing function (or lambda, class or comprehension) it is a
    parameter, or appears other than as the callee of a call (an assignment, a loop target, an
    import, a ``global``: conservatively, any other use). A star import at the top makes
    ``_fresh_function`` refuse (it binds names the file does not show)."""
    node = cmd.get_metadata(ParentNodeProvider, call, None)
    while node is not None and not isinstance(node, cst.Module):
        if isinstance(node, cst.FunctionDef | cst.Lambda):
            params = node.params
            every = [
                *params.params,
                *params.kwonly_params,
                *params.posonly_params,
                *([params.star_arg] if isinstance(params.star_arg, cst.Param) else []),
                *([params.star_kwarg] if params.star_kwarg is not None else []),
            ]
            if any(p.name.value == name for p in every):
                return True
        if isinstance(node, cst.FunctionDef | cst.Lambda | cst.ClassDef | cst.BaseComp):
            for n in _walk(node.body if not isinstance(node, cst.BaseComp) else node):
                if isinstance(n, cst.Name) and n.value == name:
                    parent = cmd.get_metadata(ParentNodeProvider, n, None)
                    # (an import, a ``global``, an assignment or a loop target is a Name too)
                    if not (isinstance(parent, cst.Call) and parent.func is n):
                        return True
        node = cmd.get_metadata(ParentNodeProvider, node, None)
    return False


def _fresh_function(name: str, cmd, depth: int) -> bool:
    """Whether ``name`` is a function defined once at the top of this file, undecorated (a
    cache decorator would hand out one array twice), not a generator, declaring nothing
    global, no other top-level binding of the name, and every ``return`` of it (outside
    nested functions) returns a fresh value (``_fresh_value``): each call builds new arrays."""
    defs = []
    for stmt in cmd.module.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            defs.append(stmt)
            continue
        for n in _walk(stmt):
            if isinstance(n, cst.ImportStar):
                return False  # binds names the file does not show
            if isinstance(n, cst.Name) and n.value == name:
                parent = cmd.get_metadata(ParentNodeProvider, n, None)
                if not (isinstance(parent, cst.Call) and parent.func is n):
                    return False  # rebound, aliased or passed around elsewhere in the file
    if len(defs) != 1:
        return False
    fn = defs[0]
    if fn.decorators or fn.asynchronous is not None:
        return False
    returns = _Returns()
    fn.body.visit(returns)
    if returns.other or not returns.values:
        return False
    return all(v is not None and _fresh_value(v, set(), cmd, depth) for v in returns.values)


def _walk(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _walk(child)


class _Returns(OwnScopeVisitor):
    """The values of a function body's ``return`` statements (None for a bare ``return``),
    outside nested functions; ``other`` when it yields or declares a global/nonlocal."""

    def __init__(self) -> None:
        self.values: list[cst.BaseExpression | None] = []
        self.other = False

    def visit_Return(self, node: cst.Return) -> None:
        self.values.append(node.value)

    def visit_Yield(self, node: cst.Yield) -> None:
        self.other = True

    def visit_Global(self, node: cst.Global) -> None:
        self.other = True

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.other = True


def _second_holder(call: cst.Call, arg, cmd, calls: list) -> str | None:
    """Why the name ``call`` donates may have a second holder, or None when it provably has
    none. An allow-list, in the scope around ``call`` (its function, or the module): the name
    is bound only to fresh arrays (``_fresh_call``, as the only target of its statement) and
    read only as the donated argument of a call that rebinds it, for metadata (``w.shape``), or
    returned, or anything once no call of the function can follow (``_after_every_call``).
    Everything else is refused: a parameter, a loop target, ``w = w0``, ``w[:]``, ``w.T``,
    ``print(w)``, ``hist.append(w)``, a closure, a ``global``."""
    name = cast(cst.Name, _passed(call, arg)).value  # _not_rebound checked it is a Name
    scope = _scope_of(call, cmd)
    if scope is None:
        return f"`{name}` is not in a function or at module level"
    names = _Names(name)
    (scope.body if isinstance(scope, cst.FunctionDef) else scope).visit(names)
    if isinstance(scope, cst.FunctionDef) and names._shadows(scope.params):
        return f"`{name}` is a parameter of `{scope.name.value}`, so its caller holds the array too"
    if names.declared:
        return f"`{name}` is declared global or nonlocal, so other code can hold it"
    ids = {id(c) for c in calls}
    lines = cmd.module.code.splitlines()
    here = [c for c in calls if _scope_of(c, cmd) is scope]
    for ref in names.found:
        line = cmd.span(ref)[0]
        where = f"line {line} (`{lines[line - 1].strip()}`)"
        if _nested(ref, scope, cmd):
            return f"a nested function or lambda refers to `{name}` on {where}, keeping the array"
        if _after_every_call(ref, here, scope, cmd):
            continue  # (a second holder made here meets no donating call: `print(w)` at the end)
        parent = cmd.get_metadata(ParentNodeProvider, ref, None)
        if isinstance(parent, cst.Arg) and parent.value is ref:
            owner = cmd.get_metadata(ParentNodeProvider, parent, None)
            if (
                isinstance(owner, cst.Call)
                and id(owner) in ids
                and _passed(owner, arg) is ref
                and _not_rebound(owner, arg, cmd, calls) is None
                and sum(isinstance(a.value, cst.Name) and a.value.value == name for a in owner.args)
                == 1
            ):
                continue  # the donated argument (once) of a call of the function rebinding it
            return f"`{name}` is passed to another call on {where}, which may keep it"
        if isinstance(parent, cst.Attribute) and parent.value is ref:
            if parent.attr.value in _METADATA:
                continue
            return (
                f"`{name}.{parent.attr.value}` on {where} may return the same array "
                "(only .shape, .dtype, .ndim and .size are known not to)"
            )
        if _returned(ref, parent, cmd):
            continue
        assign = _assigned_by(ref, parent, cmd)
        if assign is not None:
            if len(assign.targets) == 1 and _fresh_value(assign.value, ids, cmd):
                continue
            return (
                f"`{name}` is bound on {where} to a value that may be held elsewhere (only "
                "results of the function, of array constructors such as jnp.zeros, of "
                "displays of those, and of this file's functions that return only such "
                "values are known to be new arrays)"
            )
        return f"`{name}` is read on {where} in a way that may keep a second reference"
    return None


def _scope_of(node: cst.CSTNode, cmd) -> cst.CSTNode | None:
    """The function or module whose names ``node`` reads."""
    scope = cmd.get_metadata(ParentNodeProvider, node, None)
    while scope is not None and not isinstance(scope, cst.FunctionDef | cst.Module):
        scope = cmd.get_metadata(ParentNodeProvider, scope, None)
    return scope


def _after_every_call(ref: cst.CSTNode, calls: list, scope: cst.CSTNode, cmd) -> bool:
    """``ref`` can only run after every one of ``calls`` (the function's calls in ``scope``,
    the scope ``ref`` reads the name in): it comes after the last of them in the source, and
    no loop around it holds one (a loop is the only way back to an earlier line of a scope; a
    new call of the scope's function has names of its own). Positions tell both: a loop around
    ``ref`` ends after every call, so it holds one exactly when it starts before the last."""
    if not calls:
        return False

    def span(node) -> CodeRange:
        return cast(CodeRange, cmd.get_metadata(PositionProvider, node))

    def at(p) -> tuple[int, int]:
        return p.line, p.column

    if at(span(ref).start) <= max(at(span(c).end) for c in calls):
        return False
    last_start = max(at(span(c).start) for c in calls)
    node = cmd.get_metadata(ParentNodeProvider, ref, None)
    while node is not None and node is not scope:
        if isinstance(node, cst.For | cst.While) and at(span(node).start) <= last_start:
            return False
        node = cmd.get_metadata(ParentNodeProvider, node, None)
    return True


def _nested(ref: cst.CSTNode, scope: cst.CSTNode, cmd) -> bool:
    """Whether ``ref`` is inside a function, lambda or class within ``scope``."""
    node = cmd.get_metadata(ParentNodeProvider, ref, None)
    while node is not None and node is not scope:
        if isinstance(node, cst.FunctionDef | cst.Lambda | cst.ClassDef):
            return True
        node = cmd.get_metadata(ParentNodeProvider, node, None)
    return False


def _returned(ref: cst.Name, parent, cmd) -> bool:
    """``return w`` or ``return w, opt``: the scope ends with it."""
    node = parent
    while isinstance(node, cst.Element | cst.Tuple):
        node = cmd.get_metadata(ParentNodeProvider, node, None)
    return isinstance(node, cst.Return)


def _assigned_by(ref: cst.Name, parent, cmd) -> cst.Assign | None:
    """The ``Assign`` whose target (alone or inside a tuple/list target) is ``ref``."""
    node = parent
    while isinstance(node, cst.Element | cst.Tuple | cst.List):
        node = cmd.get_metadata(ParentNodeProvider, node, None)
    if isinstance(node, cst.AssignTarget):
        stmt = cmd.get_metadata(ParentNodeProvider, node, None)
        return stmt if isinstance(stmt, cst.Assign) else None
    return None


class _LocalBinding(OwnScopeVisitor):
    """Whether a function body binds ``name`` itself (an assignment, augmented or annotated, a
    ``for``, ``with ... as``, ``import ... as``, a walrus or ``del`` target), outside nested
    functions and classes, and declares it neither ``global`` nor ``nonlocal``: then every use
    of the name in the function is the function's own variable (Python decides per function)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.binds = False
        self.declared = False

    def visit_Global(self, node: cst.Global) -> None:
        self.declared |= any(n.name.value == self.name for n in node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.declared |= any(n.name.value == self.name for n in node.names)

    def _target(self, target: cst.CSTNode | None) -> None:
        if target is None:
            return
        if isinstance(target, cst.Name):
            self.binds |= target.value == self.name
        elif isinstance(target, cst.Tuple | cst.List):
            for element in target.elements:
                self._target(element.value)
        elif isinstance(target, cst.StarredElement):
            self._target(target.value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._target(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:
        self._target(node.name)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self._target(node.target)

    def visit_Del(self, node: cst.Del) -> None:
        self._target(node.target)


def _binds_locally(fn: cst.FunctionDef, name: str) -> bool:
    binding = _LocalBinding(name)
    fn.body.visit(binding)
    return binding.binds and not binding.declared


class _Names(cst.CSTVisitor):
    """Every Name node spelling ``name`` in this scope, nested functions and lambdas included
    (a closure over it is a second holder) unless they take a parameter of that name (another
    variable)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.found: list[cst.Name] = []
        self.declared = False  # a ``global`` or ``nonlocal`` statement names it

    def _shadows(self, params: cst.Parameters) -> bool:
        every = [*params.posonly_params, *params.params, *params.kwonly_params]
        every += [q for q in (params.star_arg, params.star_kwarg) if isinstance(q, cst.Param)]
        return any(q.name.value == self.name for q in every)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        # (a function that binds the name itself reads its own variable everywhere in it)
        return not self._shadows(node.params) and not _binds_locally(node, self.name)

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return not self._shadows(node.params)

    def visit_Global(self, node: cst.Global) -> None:
        self.declared |= any(n.name.value == self.name for n in node.names)

    def visit_Nonlocal(self, node: cst.Nonlocal) -> None:
        self.declared |= any(n.name.value == self.name for n in node.names)

    # ``obj.w`` and ``f(w=...)`` spell the name without referring to the variable.
    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == self.name:
            self.found.append(node)
