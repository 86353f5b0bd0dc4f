"""``x.at[i].set(v)`` -> ``lax.dynamic_update_index_in_dim(x, v, i, 0)`` behind an exact guard.

The expert's in-place update, in the form the scatter_to_dus pass chose (``details["guard"]``),
for every shape: the source serves every call, where the pass's bounds proof holds for the
shapes and static values it traced (``_guard_kind``). ``"cond"`` (and a proof) keeps a
``lax.cond`` bounds guard, since ``.at[i]`` drops an out-of-bounds update (mode
``FILL_OR_DROP``) where ``dynamic_update_slice`` clamps the start; ``"select"`` (inside loop
bodies and off CPU, where a cond copies the buffer every iteration) writes
``jnp.where(in_bounds, v, x[i])`` back, a no-op when out of bounds; ``"blend"`` (a block
``i + jnp.arange(k)`` whose bounds are not proven) becomes ``autoopt.update_window(x, i, v,
size=k, op=...)``, the pass's own branch-free form behind one call. Only an update the source
itself says is in bounds (``mode="promise_in_bounds"``, or ``mode="clip"`` on one row) is bare.
Negative indices need no care: ``dynamic_update_*`` normalizes them exactly as ``.at`` does.
The written value is broadcast to the window and cast to the array's dtype as ``.at`` does it
(``_new_value``): ``dynamic_update_slice`` does neither.

Handled: ``set``, ``add``, ``subtract``, ``multiply``, ``min``, ``max`` at a single index, at a
window ``i + jnp.arange(k)`` / ``jnp.arange(i, i + k)``, and at a static slice ``a:b``; on the
read side, a window ``x[i + jnp.arange(k)]`` -> ``lax.dynamic_slice_in_dim(x, i, k, 0)`` under
a cond whose else is the original read. A tile ``x.at[i + jnp.arange(k)[:, None], j +
jnp.arange(m)]`` becomes ``autoopt.update_window(x, (i, j), v, size=(k, m))``. Left as they
are, with the reason in the finding: several scalar axes (``x.at[i, j]``), other modes, and
updates already inside a ``lax.cond`` branch (which is where the guarded form puts the original
scatter, so a second run changes nothing).
"""

from __future__ import annotations

import libcst as cst

from autoopt.codemod import FindingCommand, dotted_name, template

__all__ = ["ScatterToDUSCommand"]

_OPS = {
    "set": None,
    "add": "+",
    "subtract": "-",
    "multiply": "*",
    "min": "minimum",
    "max": "maximum",
}


def _guard_kind(details: dict) -> str:
    """``"select"``, ``"blend"`` or ``"cond"``: the guard the source form keeps, from the one the
    pass used. A bounds proof (``"none"``, ``"clamp"``) holds for the shapes and static values
    the pass traced, and the source serves every call: ``buf.at[3].set(row)``, proven for an
    8-row ``buf``, drops the row of a 2-row one, where a bare ``dynamic_update_slice`` clamps
    it into row 1. So a proven update keeps the exact cond guard in the source (which XLA folds
    away where the bounds are known when it compiles); only ``mode="promise_in_bounds"``,
    written in the source, drops it (``_replacement``)."""
    guard = details.get("guard")
    return guard if guard in ("select", "blend") else "cond"


def _is_gather(finding) -> bool:
    return finding.details.get("op") == "gather"


def _simple(node: cst.CSTNode) -> bool:
    """An expression cheap and safe to repeat (the guard mentions it twice)."""
    if isinstance(node, cst.Name | cst.Integer):
        return True
    if isinstance(node, cst.Attribute):
        return _simple(node.value)
    if isinstance(node, cst.UnaryOperation):
        return _simple(node.expression)
    if isinstance(node, cst.BinaryOperation):
        return _simple(node.left) and _simple(node.right)
    if isinstance(node, cst.Subscript):
        return _simple(node.value) and all(
            isinstance(e.slice, cst.Index) and _simple(e.slice.value) for e in node.slice
        )
    return False


def _literal(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.UnaryOperation):
        return _literal(node.expression)
    return isinstance(node, cst.Integer | cst.Float) or (
        isinstance(node, cst.Name) and node.value in ("True", "False")
    )


class _AtUpdate:
    """The parts of ``BASE.at[INDEX].OP(VALUE, **kw)``."""

    def __init__(self, base, element, op, value, keywords):
        self.base, self.element, self.op, self.value, self.keywords = (
            base,
            element,
            op,
            value,
            keywords,
        )


def _match(node: cst.Call) -> _AtUpdate | None:
    func = node.func
    if not (isinstance(func, cst.Attribute) and func.attr.value in _OPS):
        return None
    sub = func.value
    if not (
        isinstance(sub, cst.Subscript)
        and isinstance(sub.value, cst.Attribute)
        and sub.value.attr.value == "at"
    ):
        return None
    positional = [a for a in node.args if a.keyword is None and a.star == ""]
    if len(positional) != 1:
        return None
    keywords = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
    return _AtUpdate(sub.value.value, sub.slice, func.attr.value, positional[0].value, keywords)


def _arange_window(index: cst.BaseExpression, imports) -> tuple | None:
    """``(start, size)`` for ``i + jnp.arange(k)``, ``jnp.arange(k) + i`` and
    ``jnp.arange(i, i + k)``."""

    def arange_args(n):
        if (
            isinstance(n, cst.Call)
            and (dotted_name(n.func) or "").endswith("arange")
            and imports.is_library(n.func)
            and all(a.keyword is None for a in n.args)
        ):
            return [a.value for a in n.args]
        return None

    if isinstance(index, cst.BinaryOperation) and isinstance(index.operator, cst.Add):
        for start, other in ((index.left, index.right), (index.right, index.left)):
            args = arange_args(other)
            if args is not None and len(args) == 1:
                return start, args[0]
    args = arange_args(index)
    if args is not None and len(args) == 2:
        lo, hi = args
        if (
            isinstance(hi, cst.BinaryOperation)
            and isinstance(hi.operator, cst.Add)
            and hi.left.deep_equals(lo)
        ):
            return lo, hi.right
    return None


def _expansion(node: cst.BaseExpression) -> tuple[cst.BaseExpression, int, int] | None:
    """``(inner, entries, position)`` for ``inner[:, None]``-style axis expansion (``:`` once,
    every other entry ``None``); ``(node, 1, 0)`` for anything else."""
    if not isinstance(node, cst.Subscript):
        return node, 1, 0
    colons = []
    for j, e in enumerate(node.slice):
        if isinstance(e.slice, cst.Slice):
            if e.slice.lower or e.slice.upper or e.slice.step:
                return None
            colons.append(j)
        elif not (
            isinstance(e.slice, cst.Index)
            and isinstance(e.slice.value, cst.Name)
            and e.slice.value.value == "None"
        ):
            return None
    if len(colons) != 1:
        return None
    return node.value, len(node.slice), colons[0]


def _tile_axis(index: cst.BaseExpression, imports, rank: int) -> tuple | None:
    """``(start, size, axis)`` for one index of a tile: ``i + jnp.arange(k)[:, None]``,
    ``(i + jnp.arange(k))[:, None]``, ``jnp.arange(m) + j``; ``axis`` is the tile axis the
    arange runs along once the indices broadcast together (right-aligned, as numpy does)."""
    outer = _expansion(index)
    if outer is None:
        return None
    inner, entries, pos = outer
    if entries > 1:  # the whole sum expanded
        window = _arange_window(inner, imports)
        return None if window is None else (*window, rank - entries + pos)
    if not (isinstance(inner, cst.BinaryOperation) and isinstance(inner.operator, cst.Add)):
        return None
    for start, other in ((inner.left, inner.right), (inner.right, inner.left)):
        expanded, start_expanded = _expansion(other), _expansion(start)
        if expanded is None or (start_expanded is not None and start_expanded[1] > 1):
            continue
        arange, entries, pos = expanded
        window = _arange_window(
            cst.BinaryOperation(left=start, operator=cst.Add(), right=arange), imports
        )
        if window is not None:
            return (*window, rank - entries + pos)
    return None


class ScatterToDUSCommand(FindingCommand):
    DESCRIPTION = (
        "Rewrite `x.at[i].set(v)` (and add, subtract, multiply, min, max) where the "
        "scatter_to_dus pass applied as `lax.dynamic_update_*`, keeping a `lax.cond` "
        "bounds guard (the pass's proof holds for the shapes it traced; the source serves "
        "every shape) unless the update says mode='promise_in_bounds'."
    )
    KIND = "scatter_to_dus"
    HINT = (
        "write `x = lax.dynamic_update_index_in_dim(x, v, i, 0)` in place of "
        "`x = x.at[i].set(v)`, inside `lax.cond(in_bounds, ...)` unless i is known in bounds"
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._cond_depth = 0

    def _is_cond(self, node: cst.Call) -> bool:
        return self.imports is not None and (self.imports.qualified(node.func) or "") in (
            "jax.lax.cond",
            "jax.lax.switch",
        )

    def visit_Call(self, node: cst.Call) -> bool:
        if self._is_cond(node):
            self._cond_depth += 1
        return True

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if self._is_cond(original_node):
            self._cond_depth -= 1
            return updated_node
        if _match(original_node) is None:
            return updated_node
        hits = [i for i in self.targets_within(original_node) if not _is_gather(self.targets[i])]
        if not hits:
            return updated_node
        if self._cond_depth:
            reason = "the update is already inside a lax.cond branch (a guarded rewrite)"
            for i in hits:
                self.outcomes.setdefault(i, reason)
            return updated_node
        at = _match(updated_node)
        if at is None:  # original_node matched; a rewritten child can change the shape
            return updated_node
        details: dict = {}
        for i in hits:
            details.update(self.targets[i].details)
        new, reason = self._replacement(at, updated_node, details)
        for i in hits:
            self.outcomes[i] = reason
        return updated_node if new is None else self.fit(original_node, new)

    def leave_Subscript(
        self, original_node: cst.Subscript, updated_node: cst.Subscript
    ) -> cst.BaseExpression:
        """The read side: a window ``x[i + jnp.arange(k)]`` -> ``dynamic_slice_in_dim``, guarded."""
        hits = [i for i in self.targets_within(original_node) if _is_gather(self.targets[i])]
        if (
            not hits
            or len(original_node.slice) != 1
            or not isinstance(original_node.slice[0].slice, cst.Index)
        ):
            return updated_node
        window = _arange_window(original_node.slice[0].slice.value, self.imports)
        if window is None:
            return updated_node
        start, size = window
        x = updated_node.value
        if not (_simple(x) and _simple(start) and _simple(size)):
            for i in hits:
                self.outcomes[i] = "the array, window start or size is an expression; name it first"
            return updated_node
        for i in hits:
            self.outcomes[i] = None
        # Out of bounds, a read's rows are clamped or filled one by one where dynamic_slice
        # shifts the whole window: the original read stays the else (``_guarded_window``).
        new = self._guarded_window(x, start, size, self._slice(x, start, size), updated_node)
        return self.fit(original_node, new)

    # --- building the replacement -------------------------------------------------------------

    def _replacement(self, at: _AtUpdate, original: cst.Call, details: dict):
        if len(at.element) > 1 and all(isinstance(e.slice, cst.Index) for e in at.element):
            tile = self._tile(at, details)
            if tile is not None:
                return tile
        if len(at.element) != 1 or not isinstance(at.element[0].slice, cst.Index | cst.Slice):
            return None, (
                "the update indexes several axes; write lax.dynamic_update_slice with "
                "a start index per axis by hand"
            )
        if not _simple(at.base):
            return None, "the updated array is an expression; assign it to a name first"
        guard = _guard_kind(details)
        mode = at.keywords.get("mode")
        for kw in at.keywords:
            if kw not in ("mode", "indices_are_sorted", "unique_indices"):
                return None, f"the `{kw}=` argument has no dynamic_update_slice equivalent"
        slc = at.element[0].slice
        if isinstance(slc, cst.Slice):
            return self._static_slice(at, slc)
        index = slc.value
        window = _arange_window(index, self.imports)
        if mode is not None:
            mode_text = mode.evaluated_value if isinstance(mode, cst.SimpleString) else None
            if mode_text == "promise_in_bounds":
                guard = "none"
            elif mode_text == "clip" and window is None:
                guard = "none"  # clamping a one-row window is what DUS does
            elif mode_text not in ("drop", "fill"):
                return None, f"mode={self.code(mode)} has no exact dynamic_update_slice form"
        if window is not None:
            start, size = window
            if not (_simple(start) and _simple(size)):
                return None, "the window start or size is an expression; name it first"
            if guard == "select":
                return None, (
                    "a window guarded by select has no exact source form (a partly "
                    "out-of-bounds window writes its in-bounds rows)"
                )
            if guard == "blend":
                return self._blended_window(at, start, size), None
            return self._window(at, original, start, size, guard), None
        if not _simple(index):
            return None, "the index is an expression; assign it to a name first"
        if guard == "blend":  # the pass blends blocks only; a lone row gets the exact cond
            guard = "cond"
        return self._single(at, index, guard), None

    def _new_value(
        self, at: _AtUpdate, old: cst.BaseExpression, shape: cst.BaseExpression
    ) -> cst.BaseExpression:
        """The window's new contents, computed as ``.at[...]`` computes them (``_scatter_impl``
        in jax): the value promoted with ``x`` (a Python scalar as a weak type), combined with
        the old window in that type, broadcast to the window's ``shape`` and cast back to
        ``x.dtype``. ``dynamic_update_slice`` neither broadcasts nor casts, so both are
        written out: a shape-(1,) or lower-rank value, or a float32 value into a bfloat16
        array, stays exact."""
        op = _OPS[at.op]
        v = at.value
        if isinstance(v, cst.List | cst.Tuple):  # .at takes a list (jnp.asarray); jnp ops do not
            v = template("{a}({v})", a=self.ref("jax.numpy.asarray"), v=v)
        if op is None:
            value = template(
                "{b}({v}, {shape})", b=self.ref("jax.numpy.broadcast_to"), v=v, shape=shape
            )
        elif len(op) == 1:
            value = template(f"({{old}} {op} {{v}})", old=old, v=_paren(v))
        else:
            value = template("{f}({old}, {v})", f=self.ref(f"jax.numpy.{op}"), old=old, v=v)
        return template("{value}.astype({x}.dtype)", value=value, x=at.base)

    def _single(self, at: _AtUpdate, index, guard: str) -> cst.BaseExpression:
        x = at.base
        old = template("{x}[{i}]", x=x, i=index)
        new = self._new_value(at, old, template("{x}.shape[1:]", x=x))
        in_bounds = template("(-{x}.shape[0] <= {i}) & ({i} < {x}.shape[0])", x=x, i=index)
        if guard == "select":  # out of bounds: write back what is there (clamped), a no-op
            new = template(
                "{where}({ok}, {new}, {old})",
                where=self.ref("jax.numpy.where"),
                ok=in_bounds,
                new=new,
                old=old,
            )
        dus = template(
            "{f}({x}, {v}, {i}, 0)",
            f=self.ref("jax.lax.dynamic_update_index_in_dim"),
            x=x,
            v=new,
            i=index,
        )
        if guard != "cond":
            return dus
        return template(
            "{cond}({ok}, lambda: {dus}, lambda: {x})",
            cond=self.ref("jax.lax.cond"),
            ok=in_bounds,
            x=x,
            dus=dus,
        )

    def _window(self, at: _AtUpdate, original: cst.Call, start, size, guard: str):
        x = at.base
        old = self._slice(x, start, size)
        dus = template(
            "{f}({x}, {v}, {i}, 0)",
            f=self.ref("jax.lax.dynamic_update_slice_in_dim"),
            x=x,
            v=self._new_value(at, old, template("({k}, *{x}.shape[1:])", k=size, x=x)),
            i=start,
        )
        if guard == "none":
            return dus
        # A window that is partly out of bounds writes only its in-bounds rows, and a negative
        # start wraps row by row: only the original scatter does that, so it stays the else.
        return self._guarded_window(x, start, size, dus, original)

    def _slice(self, x, start, size) -> cst.BaseExpression:
        """``lax.dynamic_slice_in_dim(x, start, size, 0)``."""
        return template(
            "{f}({x}, {i}, {k}, 0)",
            f=self.ref("jax.lax.dynamic_slice_in_dim"),
            x=x,
            i=start,
            k=size,
        )

    def _guarded_window(self, x, start, size, fast, original) -> cst.BaseExpression:
        """``fast`` (a window's slice or update) where the window lies in bounds, else
        ``original`` (the read or scatter as written), for every shape the source serves (the
        pass's proof holds for the shapes it traced only, ``_guard_kind``); for an array of
        fewer rows than the window, ``original`` in both branches (a slice or update larger
        than its operand does not trace, and cond traces both)."""
        return template(
            "{cond}((0 <= {i}) & ({i} + {k} <= {x}.shape[0]), "
            "lambda: {fast} if {k} <= {x}.shape[0] else {orig}, lambda: {orig})",
            cond=self.ref("jax.lax.cond"),
            x=x,
            i=_paren(start),
            k=_paren(size),
            fast=fast,
            orig=original,
        )

    def _blended_window(self, at: _AtUpdate, start, size) -> cst.BaseExpression:
        """``autoopt.update_window(x, i, v, size=k, op=...)``: the pass's branch-free blend of a
        block whose bounds are not proven, behind one readable call (the inline form is a dozen
        lines of clamps and selects); a tile's ``start`` and ``size`` are tuples."""
        op = "" if at.op == "set" else f', op="{at.op}"'
        return template(
            "{f}({x}, {i}, {v}, size={k}" + op + ")",
            f=self.ref("autoopt.update_window"),
            x=at.base,
            i=start,
            v=at.value,
            k=size,
        )

    def _tile(self, at: _AtUpdate, details: dict):
        """A tile ``x.at[i + jnp.arange(k)[:, None], j + jnp.arange(m)]``: one
        ``dynamic_update_slice`` where the pass proved it in bounds, else
        ``autoopt.update_window(x, (i, j), v, size=(k, m))``; None when the indices are not a
        tile in axis order (the caller then gives its reason)."""
        rank = len(at.element)
        indices = [e.slice.value for e in at.element if isinstance(e.slice, cst.Index)]
        found = [_tile_axis(index, self.imports, rank) for index in indices]
        axes = [a for a in found if a is not None]
        if len(axes) != rank or [a[2] for a in axes] != list(range(rank)):
            return None
        if at.keywords:
            return None, "a tile update with keyword arguments; write it by hand"
        if not _simple(at.base):
            return None, "the updated array is an expression; assign it to a name first"
        if not all(_simple(a[0]) and _simple(a[1]) for a in axes):
            return None, "a tile start or size is an expression; name it first"
        starts = cst.Tuple([cst.Element(a[0]) for a in axes])
        sizes = cst.Tuple([cst.Element(a[1]) for a in axes])
        if _guard_kind(details) != "select":  # (a proof is the traced shapes': the blend is
            # exact for every shape; a select-guarded tile the pass writes alone)
            return self._blended_window(at, starts, sizes), None
        return None, "a tile whose bounds are not proven is written by the pass only"

    def _static_slice(self, at: _AtUpdate, slc: cst.Slice):
        def const(n):
            return n is None or _literal(n)

        if not (const(slc.lower) and const(slc.upper)) or (
            slc.step is not None and self.code(slc.step) != "1"
        ):
            return None, "only constant, unit-step slices have an exact dynamic_update_slice form"
        if _literal(at.value) or _OPS[at.op] is not None:
            return None, "a fill or combine over a static slice; XLA already updates it in place"
        lower = slc.lower if slc.lower is not None else cst.Integer("0")
        # x[a:b].shape is the window .at[a:b] writes (bounds clipped as slicing clips them).
        shape = cst.parse_expression(f"{self.code(at.base)}[{self.code(slc)}].shape")
        return template(
            "{f}({x}, {v}, {i}, 0)",
            f=self.ref("jax.lax.dynamic_update_slice_in_dim"),
            x=at.base,
            v=self._new_value(at, at.base, shape),
            i=lower,
        ), None


def _paren(node: cst.BaseExpression) -> cst.BaseExpression:
    """``node`` parenthesized when it would bind looser than an operator next to it."""
    if (
        isinstance(
            node,
            cst.BinaryOperation
            | cst.BooleanOperation
            | cst.Comparison
            | cst.IfExp
            | cst.Lambda
            | cst.UnaryOperation,
        )
        and not node.lpar
    ):
        return node.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return node
