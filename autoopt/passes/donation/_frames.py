"""Read a running frame's local variable without touching the frame or its dicts.

Before Python 3.13, ``frame.f_locals`` is not a view: reading it copies every local into the
dict the frame keeps, which is the very dict a ``snap = locals()`` of the caller holds (so the
caller's snapshot would change under it, and each local gains a reference, which the donation
checks' reference counts would see). From 3.13 (PEP 667) ``f_locals`` is a proxy that reads the
frame directly, and that is what ``read_local`` uses there.

On 3.10-3.12 the value is read from the frame's own array of locals (``localsplus``) with
ctypes, at an offset found at import by a probe frame whose locals are known (``_calibrate``):
each candidate offset is compared by address only, never dereferenced, so a wrong guess cannot
crash; when no offset matches every probe local exactly once, ``read_local`` returns
``MISSING`` (the caller then proves nothing and donates nothing).

NB: CPython's own accessors (``PyFrame_GetVar`` in 3.12) go through ``PyFrame_GetLocals``,
which fills the dict as ``f_locals`` does.
"""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any

MISSING: Any = object()

_PTR = ctypes.sizeof(ctypes.c_void_p)
_VIEW = sys.version_info >= (3, 13)


def slot_index(code: types.CodeType, name: str) -> int | None:
    """The index of ``name`` in a frame's locals array (arguments and locals, then the cells
    that are not also arguments, then the free variables), as CPython 3.11 and 3.12 lay it out;
    3.10 keeps cells and free variables after the locals too."""
    varnames, cellvars, freevars = code.co_varnames, code.co_cellvars, code.co_freevars
    if name in varnames:
        return varnames.index(name)
    cells_only = [c for c in cellvars if c not in varnames]
    if name in cells_only:
        return len(varnames) + cells_only.index(name)
    if name in freevars:
        return len(varnames) + len(cells_only) + freevars.index(name)
    return None


def _read_word(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


# How to find the locals array: ``(indirect, offset)``: the array starts ``offset`` bytes into
# the frame object (3.10), or into the interpreter frame the object points to from its
# ``f_frame`` field at ``indirect`` (3.11, 3.12). None: unknown layout.
_LAYOUT: tuple[int | None, int] | None = None


def _base(frame: Any, layout: tuple[int | None, int]) -> int:
    indirect, offset = layout
    start = id(frame) if indirect is None else _read_word(id(frame) + indirect)
    return start + offset if start else 0


def _calibrate() -> tuple[int | None, int] | None:
    if _VIEW or sys.implementation.name != "cpython" or sys.version_info < (3, 10):
        return None
    found = [layout for layout in _candidates() if _probe_running(layout)]
    return found[0] if len(found) == 1 else None


def _candidates():
    if sys.version_info < (3, 11):  # 3.10: the array ends the frame object itself
        for offset in range(2 * _PTR, 64 * _PTR, _PTR):
            yield (None, offset)
        return
    # 3.11, 3.12: ``PyFrameObject`` is (refcount, type, f_back, f_frame, ...): only f_frame is
    # followed (a word that is not a pointer is never used as an address).
    for offset in range(2 * _PTR, 24 * _PTR, _PTR):
        yield (3 * _PTR, offset)


def _probe_running(layout: tuple[int | None, int]) -> bool:
    """Whether ``layout`` finds a running frame's locals (an argument, a plain local and a
    cell), compared by address only."""
    result: list[bool] = []

    def probe(first, second):
        local = [second]

        def inner():  # makes ``local`` a cell of ``probe``
            return local

        frame = sys._getframe()
        try:
            cell = inner.__closure__[0]  # pyright: ignore[reportOptionalSubscript]
            want = {"first": id(first), "second": id(second), "local": id(cell)}
            base = _base(frame, layout)
            code = frame.f_code
            ok = bool(base)
            for name, address in want.items():
                index = slot_index(code, name)
                if not ok or index is None or _read_word(base + index * _PTR) != address:
                    ok = False
            result.append(ok)
        finally:
            del frame

    try:
        probe(object(), object())
    except Exception:  # noqa: BLE001 - an unreadable address: not this layout
        return False
    return bool(result and result[0])


_LAYOUT = _calibrate()


_WORD_AT = ctypes.c_void_p.from_address
_CELL = types.CellType


def locals_view(code: types.CodeType, names: tuple[str, ...]) -> tuple[Any, tuple] | None:
    """``(view, places)`` for reading ``names`` (locals, cells or free variables of ``code``) in
    a running frame of ``code``, or None when one is not a variable of ``code`` or nothing can be
    read on this interpreter. ``view(frame)`` is the frame's locals array (None if it has none),
    indexed by each name's ``(index, is a cell)`` in ``places``: an index holds NULL (indexing
    raises ValueError) while the name is unbound, and a cell's slot holds the cell. One read of
    the frame and one view for all the names: a call site's check reads the callee and every
    donated name on each call. ``view`` must only be given frames running ``code`` (the call
    site cache is keyed by its identity)."""
    if _VIEW or _LAYOUT is None:
        return None
    places = []
    for name in names:
        index = slot_index(code, name)
        if index is None:
            return None
        places.append((index, name in code.co_cellvars or name in code.co_freevars))
    indirect, offset = _LAYOUT
    at = (ctypes.py_object * (max((i for i, _ in places), default=0) + 1)).from_address
    word_at = _WORD_AT

    def view(frame) -> Any:
        start = id(frame) if indirect is None else word_at(id(frame) + indirect).value
        return at(start + offset) if start else None

    return view, tuple(places)


def read_local(frame: Any, name: str) -> Any:
    """The value of the local or cell variable ``name`` in the running ``frame``, or ``MISSING``
    (unbound, not a variable of the frame's code, or no side-effect-free way to read it)."""
    if _VIEW:
        try:
            return frame.f_locals.get(name, MISSING)
        except Exception:  # noqa: BLE001
            return MISSING
    layout = _LAYOUT
    if layout is None:
        return MISSING
    code = frame.f_code
    index = slot_index(code, name)
    if index is None:
        return MISSING
    base = _base(frame, layout)
    if not base:
        return MISSING
    address = _read_word(base + index * _PTR)
    if not address:
        return MISSING
    value = ctypes.cast(address, ctypes.py_object).value
    if type(value) is types.CellType and (name in code.co_cellvars or name in code.co_freevars):
        try:
            return value.cell_contents
        except ValueError:  # an empty cell: the name is unbound
            return MISSING
    return value


def available() -> bool:
    """Locals can be read without side effects on this interpreter."""
    return _VIEW or _LAYOUT is not None
