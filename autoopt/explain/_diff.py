"""Equation-level diff of two jaxprs.

Pretty-printed jaxprs cannot be diffed as text: variables are renumbered, so one changed
equation renames every line after it. Here equations are matched structurally (primitive,
parameters, operand types; never variable names) with a longest-common-subsequence matcher,
variables of matched equations are given the same names on both sides, and only changed
equations are shown, with a little context. Sub-jaxprs (loop bodies, branches) of matched
equations are diffed recursively where they changed. Each changed equation is annotated with the
user's source line.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal

from autoopt import _jaxpr

_CONTEXT = 2


def _param_text(v) -> str:
    if isinstance(v, ClosedJaxpr | Jaxpr):
        return "{...}"
    if isinstance(v, tuple) and v and all(isinstance(x, ClosedJaxpr | Jaxpr) for x in v):
        return "(" + ", ".join("{...}" for _ in v) + ")"
    text = repr(v) if not callable(v) else getattr(v, "__name__", "fn")
    return text if len(text) <= 80 else text[:77] + "..."


def _aval_text(v) -> str:
    aval = v.aval
    return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


def eqn_key(eqn: JaxprEqn) -> tuple:
    """Structure of an equation, independent of variable names."""
    params = tuple(sorted((k, _param_text(v)) for k, v in eqn.params.items()))
    ins = tuple(("lit", repr(v.val)) if isinstance(v, Literal) else _aval_text(v) for v in eqn.invars)
    outs = tuple(_aval_text(v) for v in eqn.outvars)
    return (eqn.primitive.name, params, ins, outs)


class _Names:
    """Readable, stable variable names shared by both sides of a diff."""

    def __init__(self) -> None:
        self.names: dict = {}
        self.counter = 0

    def get(self, v, side: str) -> str:
        if isinstance(v, Literal):
            return repr(v.val)
        key = (side, v)
        if key not in self.names:
            self.names[key] = _name(self.counter)
            self.counter += 1
        return self.names[key]

    def alias(self, before_var, after_var) -> None:
        """Give ``before_var`` the name ``after_var`` has (or gets)."""
        self.names[("b", before_var)] = self.get(after_var, "a")


def _name(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    s = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        s = letters[r] + s
    return s


def _eqn_text(eqn: JaxprEqn, names: _Names, side: str) -> str:
    outs = " ".join(f"{names.get(v, side)}:{_aval_text(v)}" for v in eqn.outvars)
    params = [f"{k}={_param_text(v)}" for k, v in sorted(eqn.params.items())
              if k not in ("jaxpr", "branches", "body_jaxpr", "cond_jaxpr", "call_jaxpr")]
    ptxt = f"[{', '.join(params)}]" if params else ""
    if len(ptxt) > 120:
        ptxt = ptxt[:117] + "...]"
    ins = " ".join(names.get(v, side) for v in eqn.invars)
    return f"{outs} = {eqn.primitive.name}{ptxt} {ins}".rstrip()


def _loc(eqn: JaxprEqn) -> str:
    loc = _jaxpr.user_location(eqn)
    return f"  # {loc}" if loc else ""


def _sub(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def diff_jaxprs(before: ClosedJaxpr | Jaxpr, after: ClosedJaxpr | Jaxpr, *, indent: str = "",
                names: _Names | None = None) -> list[str]:
    """Lines of the diff: ``"  "`` context, ``"- "`` removed, ``"+ "`` added."""
    names = names or _Names()
    b, a = _sub(before), _sub(after)
    for vb, va in zip(list(b.invars) + list(b.constvars), list(a.invars) + list(a.constvars)):
        names.alias(vb, va)
    bk = [eqn_key(e) for e in b.eqns]
    ak = [eqn_key(e) for e in a.eqns]
    sm = difflib.SequenceMatcher(a=bk, b=ak, autojunk=False)
    # Name matched outputs first so removed/added lines refer to shared names.
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for eb, ea in zip(b.eqns[i1:i2], a.eqns[j1:j2]):
                for vb, va in zip(eb.outvars, ea.outvars):
                    names.alias(vb, va)
    rows: list[tuple[str, str]] = []  # (mark, text)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for eb, ea in zip(b.eqns[i1:i2], a.eqns[j1:j2]):
                subs_b, subs_a = _jaxpr.subjaxprs(eb), _jaxpr.subjaxprs(ea)
                inner: list[str] = []
                for (nb, ib, jb), (_na, _ia, ja) in zip(subs_b, subs_a):
                    if jb is not ja and _sub(jb) is not _sub(ja):
                        sub_lines = diff_jaxprs(jb, ja, indent=indent + "    ", names=names)
                        if any(line.startswith(("-", "+")) for line in (s.lstrip() for s in sub_lines)):
                            label = f"{nb}" + (f"[{ib}]" if ib is not None else "")
                            inner.append(f"{indent}    ~ {label}:")
                            inner.extend(sub_lines)
                if inner:
                    rows.append(("~", _eqn_text(ea, names, "a") + _loc(ea)))
                    rows.extend(("sub", line) for line in inner)
                else:
                    rows.append((" ", _eqn_text(ea, names, "a")))
        else:
            for e in b.eqns[i1:i2]:
                rows.append(("-", _eqn_text(e, names, "b") + _loc(e)))
            for e in a.eqns[j1:j2]:
                rows.append(("+", _eqn_text(e, names, "a") + _loc(e)))
    outs_b = " ".join(names.get(v, "b") for v in b.outvars)
    outs_a = " ".join(names.get(v, "a") for v in a.outvars)
    if outs_b != outs_a:
        rows.append(("-", f"return {outs_b}"))
        rows.append(("+", f"return {outs_a}"))
    return _with_context(rows, indent)


def _with_context(rows: Sequence[tuple[str, str]], indent: str) -> list[str]:
    changed = [i for i, (m, _) in enumerate(rows) if m != " "]
    if not changed:
        return []
    keep = set()
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
            out.append(f"{indent}{mark if mark != '~' else ' '} {text}")
        last = i
    return out


def equation_diff(before: ClosedJaxpr, after: ClosedJaxpr) -> str:
    """The diff as text; ``""`` when the programs are structurally identical."""
    if before is after:
        return ""
    return "\n".join(diff_jaxprs(before, after))
