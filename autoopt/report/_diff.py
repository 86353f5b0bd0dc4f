"""Equation-level diff of two jaxprs.

Pretty-printed jaxprs cannot be diffed as text: variables are renumbered, so one changed
equation renames every line after it. Here equations are matched structurally (primitive,
parameters, operand types; never variable names) with a longest-common-subsequence matcher,
variables are linked across the two sides (inputs, outputs of matched equations, and outputs of
replaced equations that have the same type), and names are handed out in printing order from one
table, so a one-equation rewrite prints as exactly one ``-`` and one ``+`` line. Only changed
equations are shown, with a little context. Sub-jaxprs (loop bodies, branches, inner jits) of
matched equations are diffed recursively where they changed. Each changed equation is annotated
with the user's source line.

NB: the analogue is ``git diff --minimal`` over a canonical printing; JAX's own printer
(``jax.core.pp_jaxpr``) names variables per program, which is exactly what a diff cannot use.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from autoopt import _jaxpr

__all__ = ["equation_diff", "diff_jaxprs", "diff_counts", "eqn_key"]

_CONTEXT = 2
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _param_text(v) -> str:
    if isinstance(v, _jaxpr.JAXPR_TYPES):
        return "{...}"
    if isinstance(v, tuple) and v and all(isinstance(x, _jaxpr.JAXPR_TYPES) for x in v):
        return "(" + ", ".join("{...}" for _ in v) + ")"
    if isinstance(v, np.dtype):
        return v.name  # as jax prints it: new_dtype=int32
    text = repr(v) if not callable(v) else getattr(v, "__name__", type(v).__name__)
    if "\n" in text:  # a multi-line repr (a wrapped function) breaks the diff's lines
        text = type(v).__name__
    text = _ADDRESS.sub("", text)  # object addresses differ between two traces of one program
    return text if len(text) <= 80 else text[:77] + "..."


def _aval_text(v) -> str:
    aval = v.aval
    return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


def _literal_text(v: Literal) -> str:
    try:
        val = np.asarray(v.val)
        shown = repr(val.item()) if val.ndim == 0 else repr(val.tolist())
    except Exception:  # noqa: BLE001 - an exotic literal still prints as something
        shown = repr(v.val)
    return f"{shown}:{_aval_text(v)}"


def eqn_key(eqn: JaxprEqn) -> tuple:
    """Structure of an equation, independent of variable names (sub-jaxprs compare as equal)."""
    params = tuple(sorted((k, _param_text(v)) for k, v in eqn.params.items()))
    ins = tuple(_literal_text(v) if isinstance(v, Literal) else _aval_text(v) for v in eqn.invars)
    outs = tuple(_aval_text(v) for v in eqn.outvars)
    return (eqn.primitive.name, params, ins, outs)


class _Names:
    """One naming table for both sides: before-side variables linked to an after-side variable
    print with its name; every name is handed out on first use, so letters follow the diff."""

    def __init__(self) -> None:
        self.names: dict = {}
        self.links: dict = {}
        self.counter = 0

    def link(self, before_var, after_var) -> None:
        if not isinstance(before_var, Literal) and not isinstance(after_var, Literal):
            self.links[before_var] = after_var

    def get(self, v, side: str) -> str:
        if isinstance(v, Literal):
            return _literal_text(v)
        if side == "b" and v in self.links:
            v, side = self.links[v], "a"
        key = (side, v)
        if key not in self.names:
            self.names[key] = _name(self.counter)
            self.counter += 1
        return self.names[key]


def _name(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = letters[r] + s
    return s


def _eqn_text(eqn: JaxprEqn, names: _Names, side: str) -> str:
    ins = " ".join(names.get(v, side) for v in eqn.invars)
    outs = " ".join(f"{names.get(v, side)}:{_aval_text(v)}" for v in eqn.outvars)
    # None-valued parameters (accuracy=None, out_dtype=None) are noise in a diff; they still
    # count in ``eqn_key``.
    params = [
        f"{k}={_param_text(v)}"
        for k, v in sorted(eqn.params.items())
        if v is not None and not _jaxpr_valued(v)
    ]
    ptxt = f"[{', '.join(params)}]" if params else ""
    if len(ptxt) > 120:
        ptxt = ptxt[:117] + "...]"
    return f"{outs} = {eqn.primitive.name}{ptxt} {ins}".rstrip()


def _jaxpr_valued(v) -> bool:
    return isinstance(v, _jaxpr.JAXPR_TYPES) or (
        isinstance(v, tuple) and bool(v) and all(isinstance(x, _jaxpr.JAXPR_TYPES) for x in v)
    )


def _loc(eqn: JaxprEqn) -> str:
    loc = _jaxpr.user_location(eqn)
    return f"  # {loc}" if loc else ""


def _sub(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def _link_replaced(
    names: _Names,
    removed: Sequence[JaxprEqn],
    added: Sequence[JaxprEqn],
    later_b: set,
    later_a: set,
) -> None:
    """Link outputs of a replaced block so the equations after it print unchanged.

    One-for-one replacements link output to output where the types agree (``sin`` -> ``tanh``
    prints as ``- f = sin a`` / ``+ f = tanh a``); otherwise the block's live-out values are
    linked in order where the types agree.
    """
    if len(removed) == len(added):
        for eb, ea in zip(removed, added):
            for vb, va in zip(eb.outvars, ea.outvars):
                if _aval_text(vb) == _aval_text(va):
                    names.link(vb, va)
        return
    outs_b = [v for e in removed for v in e.outvars if v in later_b]
    outs_a = [v for e in added for v in e.outvars if v in later_a]
    if len(outs_b) == len(outs_a):
        for vb, va in zip(outs_b, outs_a):
            if _aval_text(vb) == _aval_text(va):
                names.link(vb, va)


def _used_after(j: Jaxpr, start: int) -> set:
    used = {v for e in j.eqns[start:] for v in e.invars if not isinstance(v, Literal)}
    used.update(v for v in j.outvars if not isinstance(v, Literal))
    return used


def diff_jaxprs(
    before: ClosedJaxpr | Jaxpr,
    after: ClosedJaxpr | Jaxpr,
    *,
    indent: str = "",
    names: _Names | None = None,
) -> list[str]:
    """Lines of the diff: ``"  "`` context, ``"- "`` removed, ``"+ "`` added; a changed
    sub-jaxpr appears under its equation, indented, after a ``~ param:`` line."""
    names = names or _Names()
    b, a = _sub(before), _sub(after)
    for vb, va in zip(b.invars, a.invars):
        names.link(vb, va)
    if len(b.constvars) == len(a.constvars):
        for vb, va in zip(b.constvars, a.constvars):
            names.link(vb, va)
    bk = [eqn_key(e) for e in b.eqns]
    ak = [eqn_key(e) for e in a.eqns]
    opcodes = difflib.SequenceMatcher(a=bk, b=ak, autojunk=False).get_opcodes()
    # Link every matched or replaced output first, so rows refer to shared names.
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            for eb, ea in zip(b.eqns[i1:i2], a.eqns[j1:j2]):
                for vb, va in zip(eb.outvars, ea.outvars):
                    names.link(vb, va)
        elif tag == "replace":
            _link_replaced(
                names, b.eqns[i1:i2], a.eqns[j1:j2], _used_after(b, i2), _used_after(a, j2)
            )
    rows: list[tuple[str, str]] = []  # (mark, text); mark "sub" rows are pre-formatted
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            for eb, ea in zip(b.eqns[i1:i2], a.eqns[j1:j2]):
                head = _eqn_text(ea, names, "a")
                inner = _diff_subjaxprs(eb, ea, indent, names)
                if inner:
                    rows.append(("~", head + _loc(ea)))
                    rows.extend(("sub", line) for line in inner)
                else:
                    rows.append((" ", head))
        else:
            rows.extend(("-", _eqn_text(e, names, "b") + _loc(e)) for e in b.eqns[i1:i2])
            for e in a.eqns[j1:j2]:
                rows.append(("+", _eqn_text(e, names, "a") + _loc(e)))
                rows.extend(_wrapped_body(e, names))
    outs_b = " ".join(names.get(v, "b") for v in b.outvars)
    outs_a = " ".join(names.get(v, "a") for v in a.outvars)
    if outs_b != outs_a:
        rows.append(("-", f"return {outs_b}"))
        rows.append(("+", f"return {outs_a}"))
    return _with_context(rows, indent)


def _wrapped_body(eqn: JaxprEqn, names: _Names) -> list[tuple[str, str]]:
    """An added ``custom_jvp_call`` (a rewrite made differentiable, as the in-place blend is)
    computes its body: shown under it as added lines, named after the call's operands, so the
    diff shows what the program does rather than one opaque call."""
    body = eqn.params.get("call_jaxpr") if eqn.primitive.name == "custom_jvp_call" else None
    if body is None:
        return []
    inner = _sub(body)
    for outer, v in [*zip(eqn.invars, inner.invars), *zip(eqn.outvars, inner.outvars)]:
        if not isinstance(outer, Literal) and not isinstance(v, Literal):
            names.names[("a", v)] = names.get(outer, "a")
    return [("+", "    " + _eqn_text(e, names, "a") + _loc(e)) for e in inner.eqns]


def _diff_subjaxprs(eb: JaxprEqn, ea: JaxprEqn, indent: str, names: _Names) -> list[str]:
    inner: list[str] = []
    subs_b, subs_a = _jaxpr.subjaxprs(eb), _jaxpr.subjaxprs(ea)
    for (nb, ib, jb), (_na, _ia, ja) in zip(subs_b, subs_a):
        if jb is ja or _sub(jb) is _sub(ja):
            continue
        sub_lines = diff_jaxprs(jb, ja, indent=indent + "    ", names=names)
        if any(s.lstrip().startswith(("-", "+")) for s in sub_lines):
            label = nb + (f"[{ib}]" if ib is not None else "")
            inner.append(f"{indent}    ~ {label}:")
            inner.extend(sub_lines)
    return inner


def _with_context(rows: Sequence[tuple[str, str]], indent: str) -> list[str]:
    changed = [i for i, (m, _) in enumerate(rows) if m not in (" ",)]
    if not changed:
        return []
    keep: set[int] = set()
    for i in changed:
        keep.update(range(max(0, i - _CONTEXT), min(len(rows), i + _CONTEXT + 1)))
    out, last = [], -1
    for i in sorted(keep):
        if last >= 0 and i != last + 1:
            out.append(f"{indent}  ...")
        mark, text = rows[i]
        if mark == "sub":
            out.append(text)
        else:
            out.append(f"{indent}{' ' if mark == '~' else mark} {text}")
        last = i
    return out


def diff_counts(diff: str) -> tuple[int, int]:
    """``(removed, added)`` equation lines in a diff from ``equation_diff``, at any depth."""
    lines = [s.lstrip() for s in diff.splitlines()]
    return (sum(s.startswith("- ") for s in lines), sum(s.startswith("+ ") for s in lines))


def equation_diff(before: ClosedJaxpr | None, after: ClosedJaxpr | None) -> str:
    """The diff as text; ``""`` when the programs are structurally identical."""
    if before is None or after is None or before is after:
        return ""
    return "\n".join(diff_jaxprs(before, after))
