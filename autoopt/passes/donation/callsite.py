"""Which arguments a call site proves dead: the statement rebinds the very names it passed.

``state = step(state, batch)`` proves ``state`` dead after the call (the name is rebound before
any other statement runs); ``new = step(state, batch)`` proves nothing. The proof is syntactic
and per call site, so it is computed once per ``(code object, instruction offset)`` (keyed by
the code object's identity: code objects compare equal by value, and two modules may hold equal
ones) and the cached call path pays one dict lookup plus ``CallSiteProof.check``. Object-level
aliasing (``old = state`` earlier, or the same array inside two arguments) is not visible in the
syntax; ``donation_checks`` rules it out at run time with reference counts and identities.

The proof is an allow-list: it accepts only the call shapes whose reference counts are
calibrated below (positional arguments and named keywords, no ``*``/``**``), a callee written
as a name or a chain of attributes of one (re-read on every call: ``check``), and targets that
are plain names (nothing evaluated after the call can read a donated argument). Everything else
is refused with a reason. What the syntax cannot see is refused at run time: a donated name that
other code can reach (a module global, a closure cell) while another thread runs, and (in the
jit wrapper) a program that calls back into Python (``host_callbacks``).

NB: ``executing`` (the package behind ``icecream`` and ``stack_data``) maps a frame's current
instruction to the AST node being evaluated.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import dis
import importlib
import inspect
import operator
import signal
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import executing
import jax
import numpy as np

from autoopt._compat import (
    ARRAY_IMPL,
    KEY_ARRAY,
    flatten_one_level,
    is_plain_namedtuple,
    is_tracer,
    jit_accepts_leaf,
    key_base_array,
    key_entry,
)
from autoopt.passes.donation import _frames


@dataclasses.dataclass(frozen=True)
class CallSiteProof:
    """What one call site proves. ``positions``/``names``: arguments passed as a plain name that
    the statement rebinds. ``reasons``: for each other argument, why it is not proven dead."""

    positions: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    reasons: tuple[tuple[Any, str], ...] = ()
    location: str | None = None
    statement: str | None = None
    # The call's shape as written, which every call must match for the positions to mean the
    # arguments the function receives (a ``functools.partial`` in between shifts them): the
    # number of positional arguments, the keyword names.
    n_positional: int | None = None
    keywords: frozenset[str] | None = None
    # ``a, b = f(x)``, ``(a, b), c = f(a, b, c)``: the shape of each unpacking target (see
    # ``target_pattern``), so the result's tree can be checked at every level before donating
    # (an unpacking that fails after the call leaves the names bound to the donated arrays).
    unpack: tuple | None = None
    # The code object the proof is about: the site cache keys on its identity, and this
    # reference keeps that identity from being reused by another code object.
    code: Any = dataclasses.field(default=None, repr=False, compare=False)
    # ``check(frame, callee, args, kwargs) -> bool``, run on every call of a site that
    # donates, before anything is donated: this call is the call the proof is about. The
    # statement's callee expression still evaluates to ``callee`` (a name rebound to
    # ``functools.partial(sorted, key=f)``, or to a builtin calling back, reaches ``f`` from the
    # same instruction), each donated name still holds the argument received, and no donated
    # name is reachable by another running thread. Never raises.
    check: Callable[[Any, Any, tuple, dict], bool] = dataclasses.field(
        default=lambda frame, callee, args, kwargs: False, repr=False, compare=False
    )
    # ``check`` without its question whether other code may run: this call is the statement's
    # call of the function with the names' objects (``binding`` is then the statement's).
    same_call: Callable[[Any, Any, tuple, dict], bool] = dataclasses.field(
        default=lambda frame, callee, args, kwargs: False, repr=False, compare=False
    )
    # ``check`` as data, for the C call path (``autoopt/_jit/_native.c``), which runs exactly
    # this check and nothing less: ``(the callee's global name, or None when the callee is a
    # frame slot; whether a donated name is shared (``other_code_may_run``); ((slot index, is a
    # cell, the argument's position or keyword, None for the callee), ...); ((position or
    # keyword, global name), ...))``. None where ``check`` is not ``_slot_check``'s (a callee
    # with attributes, module level, or no readable frame): that path then runs ``check``.
    slot_spec: tuple | None = dataclasses.field(default=None, repr=False, compare=False)
    # The statement's targets in the order its instructions store them, for the C call path to
    # bind before the call returns (``autoopt/_jit/_native.c``: a signal's exception at the end
    # of the call must not find a donated name still bound to its deleted arrays): ``(0, slot
    # index, is a cell)`` a function's local or cell, ``(1, name)`` a global the function
    # declares, ``(3, name)`` a module-level name, ``(2, (target, ...))`` unpacking. None where
    # a slot cannot be placed on this interpreter.
    binding: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def any(self) -> bool:
        return bool(self.positions or self.names)

    def matches(self, args: tuple, kwargs: dict, shift: int = 0) -> bool:
        """This call passes what the statement wrote; ``shift``: arguments in front of what the
        statement wrote (1 for a decorated method's instance)."""
        if self.n_positional is not None and len(args) - shift != self.n_positional:
            return False
        return self.keywords is None or self.keywords == kwargs.keys()


def _plain_targets(target: ast.AST) -> set[str] | None:
    """The names a target binds when it is plain names (``x``, ``a, (b, c)``), else None: an
    attribute, a subscript or a starred target runs code after the call, which could read a
    donated argument (``d[key(x)], x = g(x)`` calls ``key(x)`` once ``x`` is donated)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Tuple | ast.List):
        out: set[str] = set()
        for elt in target.elts:
            names = _plain_targets(elt)
            if names is None:
                return None
            out |= names
        return out
    return None


def target_pattern(target: ast.AST) -> tuple | None:
    """The shape an assignment target unpacks its value into: None for a name (any value), a
    tuple of the elements' patterns for a tuple or list target (``(a, b), c`` -> ``((None,
    None), None)``). Only for targets ``_plain_targets`` accepts."""
    if isinstance(target, ast.Tuple | ast.List):
        return tuple(target_pattern(e) for e in target.elts)
    return None


def _binding(targets: Sequence[ast.AST], code) -> tuple | None:
    """``CallSiteProof.binding`` of an assignment's targets (plain names, as
    ``_plain_targets`` accepts), or None where a name's slot is not known."""

    def one(t: ast.AST) -> tuple | None:
        if isinstance(t, ast.Tuple | ast.List):
            subs = tuple(one(e) for e in t.elts)
            return None if any(s is None for s in subs) else (2, subs)
        assert isinstance(t, ast.Name)
        scope = _name_scope(t.id, code)
        if scope == "global":
            return (1 if code.co_flags & inspect.CO_OPTIMIZED else 3, t.id)
        index = _frames.slot_index(code, t.id)
        return None if index is None else (0, index, scope == "cell")

    out = tuple(one(t) for t in targets)
    return None if not out or any(t is None for t in out) else out


def _later_uses(stmt: ast.stmt, name: str) -> list[int]:
    """Lines after ``stmt`` in its enclosing scope where ``name`` is read (for the report)."""
    scope: ast.AST = stmt
    while (parent := getattr(scope, "parent", None)) is not None and not isinstance(
        scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.Module | ast.Lambda
    ):
        scope = parent
    end = getattr(stmt, "end_lineno", stmt.lineno)
    lines = sorted(
        {
            n.lineno
            for n in ast.walk(scope)
            if isinstance(n, ast.Name)
            and n.id == name
            and isinstance(n.ctx, ast.Load)
            and n.lineno > end
        }
    )
    return lines


def _refuse(loc: str, why: str, code: Any = None) -> CallSiteProof:
    return CallSiteProof(location=loc, reasons=(("*", why),), code=code)


_MISSING = object()


def _name_scope(name: str, code) -> str:
    """Where ``name`` lives in a frame running ``code``: ``"local"`` (a function's own variable,
    reachable from no other frame), ``"cell"`` (shared with nested functions) or ``"global"``."""
    if not code.co_flags & inspect.CO_OPTIMIZED:
        return "global"  # module level (class bodies and exec with separate locals are refused)
    if name in code.co_cellvars or name in code.co_freevars:
        return "cell"
    if name in code.co_varnames:
        return "local"
    return "global"


def _read_local(frame, name: str) -> Any:
    """A function's local or cell variable, read without touching the frame's dicts (a
    ``snap = locals()`` of the caller stays as it was; see ``_frames``), or ``_MISSING``."""
    value = _frames.read_local(frame, name)
    return _MISSING if value is _frames.MISSING else value


def _static_attr(value: Any, attr: str) -> Any:
    """``value.attr`` without running code (no property, no ``__getattr__``), or ``_MISSING``."""
    if type(value) is types.ModuleType:
        return value.__dict__.get(attr, _MISSING)
    try:
        return inspect.getattr_static(value, attr)
    except AttributeError:
        return _MISSING


def _callee_path(expr: ast.AST) -> tuple[str, tuple[str, ...]] | None:
    """``(root name, attributes)`` of a callee written ``name`` or ``name.a.b``, else None."""
    chain: list[str] = []
    while isinstance(expr, ast.Attribute):
        chain.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    return expr.id, tuple(reversed(chain))


def _make_check(
    root: str,
    scope: str,
    chain: tuple[str, ...],
    shared: bool,
    module_level: bool,
    bound: tuple[tuple[Any, str, str], ...],
    code: Any,
) -> Callable:
    """The per-call half of the proof (``CallSiteProof.check``): re-read the callee expression
    and every donated name (a global costs one dict lookup; a local or cell, one read of the
    frame's own slot: ``_frames``), and require that each name still holds the very object the
    call received (``x = step(x, take())`` where ``take()`` moves the old ``x`` into another name
    and rebinds ``x``: the reference counts are unchanged, the identity is not). ``bound``:
    ``(position or keyword, name, scope)`` of each donated argument. With ``shared`` (a donated
    name is a global or a cell) no other thread may run and no Python signal handler be set,
    since either could read the name while the call runs, after its array is donated
    (``other_code_may_run``). ``module_level``: the same code object
    may run again with separate locals (``exec(code, globals, {})``), where the name it reads is
    not the one it binds: checked on each call."""
    if not chain:
        fast = _slot_check(root, scope, shared, bound, code, module_level)
        if fast is not None:
            return fast

    def check(frame, callee, args, kwargs) -> bool:
        if shared and other_code_may_run():
            return False
        if type(frame.f_globals) is not dict:  # (``exec`` with a dict subclass: see below)
            return False
        return same_call(frame, callee, args, kwargs)

    def same_call(frame, callee, args, kwargs) -> bool:
        if module_level and frame.f_locals is not frame.f_globals:
            return False
        try:
            if _resolve(frame, root, scope, chain) is not callee:
                return False
            for key, name, where in bound:
                value = (
                    frame.f_globals.get(name, _MISSING)
                    if where == "global"
                    else _read_local(frame, name)
                )
                if value is not (args[key] if type(key) is int else kwargs.get(key, _MISSING)):
                    return False
            return True
        except Exception:  # noqa: BLE001 - an unreadable callee proves nothing
            return False

    check.same_call = same_call  # pyright: ignore[reportFunctionMemberAccess]
    return check


def _slot_check(
    root: str,
    scope: str,
    shared: bool,
    bound: tuple[tuple[Any, str, str], ...],
    code: Any,
    module_level: bool,
) -> Callable | None:
    """``_make_check``'s check for a callee written as a plain name, with the place of every
    name found once: a global costs one dict lookup; the locals and cells are read together,
    from one view of the frame's own array (``_frames.locals_view``). None where that array
    cannot be read on this interpreter (the general check then reads each name by name). At
    module level every name is a global, and the frame's locals must be its globals (the C
    path's ``run_spec`` asks the same of any code that is not a function's)."""
    in_frame = [(None, root)] if scope != "global" else []
    in_frame += [(key, name) for key, name, where in bound if where != "global"]
    found = _frames.locals_view(code, tuple(name for _, name in in_frame))
    if found is None:
        return None
    view, places = found
    # (slot index, is a cell, the argument it must hold: None for the callee)
    slots_t = tuple((i, cell, key) for (i, cell), (key, _) in zip(places, in_frame))
    globals_t = tuple((key, name) for key, name, where in bound if where == "global")
    callee_global = scope == "global"
    may_run, missing, cell_type = other_code_may_run, _MISSING, types.CellType

    def check(frame, callee, args, kwargs) -> bool:
        if shared and may_run():
            return False
        if type(frame.f_globals) is not dict:
            # ``exec`` with a dict subclass: the C call path could not bind the statement's
            # names before returning (``CallSiteProof.binding``), so nothing is donated
            return False
        return same_call(frame, callee, args, kwargs)

    def same_call(frame, callee, args, kwargs) -> bool:
        if module_level and frame.f_locals is not frame.f_globals:
            return False
        if callee_global:
            value = frame.f_globals.get(root, missing)
            if value is missing:
                value = frame.f_builtins.get(root, missing)
            if value is not callee:
                return False
        slots = view(frame)
        if slots is None:
            return False
        for index, is_cell, key in slots_t:
            try:
                value = slots[index]  # ValueError: NULL, the name is unbound
                if is_cell and type(value) is cell_type:
                    value = value.cell_contents  # ValueError: an empty cell
            except ValueError:
                return False
            if key is None:
                if value is not callee:
                    return False
            elif value is not (args[key] if type(key) is int else kwargs.get(key, missing)):
                return False
        for key, name in globals_t:
            value = frame.f_globals.get(name, missing)
            if value is not (args[key] if type(key) is int else kwargs.get(key, missing)):
                return False
        return True

    check.slot_spec = (root if callee_global else None, shared, slots_t, globals_t)  # pyright: ignore[reportFunctionMemberAccess]
    check.same_call = same_call  # pyright: ignore[reportFunctionMemberAccess]
    return check


_SIGNALS = tuple(int(s) for s in signal.valid_signals())
# ``_signal``'s own getsignal: ``signal.getsignal`` wraps each answer in an enum, ten times slower
_signal: Any = importlib.import_module("_signal")
_getsignal, _default_int_handler = _signal.getsignal, _signal.default_int_handler


def other_code_may_run() -> bool:
    """Whether code other than the caller's statement may run while a call is in flight, and so
    read a global or a cell after its array is donated and before the statement rebinds it:
    another thread with a Python frame (``sys._current_frames``, which also sees threads
    started with ``_thread``, unlike ``threading.active_count``), or a Python signal handler
    (a checkpoint hook on SIGTERM or a timer: it runs on this thread between two bytecodes,
    such as right after the executable is dispatched). Python's own SIGINT handler raises
    KeyboardInterrupt and reads nothing. Also a trace or profile function on this thread (a
    debugger's watch expression runs on the return events of autoopt's own frames). Not seen:
    code the garbage collector runs (``__del__``, ``weakref.finalize``, ``gc.callbacks``, which
    hypothesis and jax register for their own timing), the README's limit. Reads every
    signal's handler (about 5 us): only calls that donate a shared name pay it."""
    if len(sys._current_frames()) > 1:
        return True
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return True
    return sum(map(callable, map(_getsignal, _SIGNALS))) > (
        _getsignal(signal.SIGINT) is _default_int_handler
    )


def _resolve(frame, root: str, scope: str, chain: tuple[str, ...]) -> Any:
    if scope == "global":
        value = frame.f_globals.get(root, _MISSING)
        if value is _MISSING:
            value = frame.f_builtins.get(root, _MISSING)
    else:
        value = _read_local(frame, root)
    for attr in chain:
        if value is _MISSING:
            break
        value = _static_attr(value, attr)
    return value


# Instructions between a call and the stores of its result: unpacking, copies for chained
# targets, and the interpreter's own filler.
_BETWEEN_STORES = frozenset(
    {"CACHE", "EXTENDED_ARG", "NOP", "UNPACK_SEQUENCE", "UNPACK_EX", "COPY", "SWAP", "DUP_TOP"}
)


def _stored_after_call(code, lasti: int) -> set[str] | None:
    """The names the instructions right after the call at ``lasti`` store its result in (an
    empty set: the result is not assigned to names), or None when the call is not found."""
    instructions = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
    at = None
    for n, ins in enumerate(instructions):
        if ins.offset > lasti:
            break
        at = n
    if at is None or not instructions[at].opname.startswith("CALL"):
        return None
    stored: set[str] = set()
    for ins in instructions[at + 1 :]:
        if ins.opname in _BETWEEN_STORES:
            continue
        if ins.opname.startswith("STORE_") and ins.opname not in ("STORE_ATTR", "STORE_SUBSCR"):
            names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            stored.update(str(name) for name in names)
            continue
        break
    return stored


def called_directly(frame, callee: Any, n_positional: int, keywords) -> bool:
    """Whether the statement running in ``frame`` calls ``callee`` itself, with plain arguments:
    a call expression (no ``*``/``**`` unpacking) whose callee, written as a name or attributes
    of one, evaluates to ``callee``, or is itself a call (``jax.jit(f)(x, nnx.Rngs(0))``) and
    the statement writes the arguments ``callee`` received (``n_positional``, ``keywords``: a
    ``functools.partial`` made there adds its own). Then the caller's stack holds each argument
    while the call runs, as in the calibrated probes; through a ``functools.partial``, ``map``,
    a thread's ``target(*args)`` or an unpacked tuple, a container the caller may still hold
    takes the stack's place. Never raises."""
    try:
        node = executing.Source.executing(frame).node
    except Exception:  # noqa: BLE001 - no source (REPL, exec), or executing cannot tell
        return False
    if not isinstance(node, ast.Call):
        return False
    if any(isinstance(a, ast.Starred) for a in node.args) or any(
        kw.arg is None for kw in node.keywords
    ):
        return False
    if isinstance(node.func, ast.Attribute) and node.func.attr == "__call__":
        return False
    if isinstance(node.func, ast.Call):
        return len(node.args) == n_positional and {kw.arg for kw in node.keywords} == set(keywords)
    path = _callee_path(node.func)
    if path is None:
        return False
    root, chain = path
    try:
        return _resolve(frame, root, _name_scope(root, frame.f_code), chain) is callee
    except Exception:  # noqa: BLE001
        return False


def prove_call_site(frame, callee: Any = None) -> CallSiteProof:
    """Analyse the statement that is calling ``callee`` from ``frame``. Never raises.

    Besides the names the statement rebinds, the proof must be about the function being called
    with the arguments as written: a ``functools.partial`` or a builtin calling back (``sorted(
    xs, key=f)``) in between would shift or replace them. So the callee must be written as a
    name or attributes of one that evaluate to ``callee`` (now, and on every later call:
    ``CallSiteProof.check``), and every call must have the written shape
    (``CallSiteProof.matches``). Each accepted form is positively checked; anything else is
    refused with its reason."""
    code = frame.f_code
    try:
        ex = executing.Source.executing(frame)
        node = ex.node
    except Exception:  # noqa: BLE001 - no source (REPL, exec), or executing cannot tell
        node = None
    loc = f"{code.co_filename}:{frame.f_lineno}"
    if not isinstance(node, ast.Call):
        return _refuse(
            loc,
            "the call site could not be read (no source, or the call is not a "
            "plain call expression)",
            code,
        )
    if not code.co_flags & inspect.CO_OPTIMIZED and frame.f_locals is not frame.f_globals:
        # A class body (or exec with separate locals) reads names from one namespace and binds
        # them in another: ``x = f(x)`` there leaves the module's ``x`` bound to the argument.
        return _refuse(
            loc, "a class body or exec namespace: the name it rebinds is not the one it reads", code
        )
    if isinstance(node.func, ast.Attribute) and node.func.attr == "__call__":
        return _refuse(
            loc,
            "the function is called through `__call__`, a call shape whose "
            "references autoopt does not measure",
            code,
        )
    if any(isinstance(a, ast.Starred) for a in node.args) or any(
        kw.arg is None for kw in node.keywords
    ):
        # ``x = f(x, *rest)``: the arguments travel in a tuple built for the call, one more
        # reference than the calibrated shapes hold, so an alias (``alias = x``) is not seen.
        return _refuse(
            loc,
            "arguments from `*` or `**` unpacking: autoopt measures the references of plain "
            "positional and keyword arguments only (write them out to donate)",
            code,
        )
    path = _callee_path(node.func)
    if path is None:
        return _refuse(
            loc,
            f"the called expression `{ast.unparse(node.func)}` is not a name or an attribute "
            "of one, so autoopt cannot check on each call that it is this function",
            code,
        )
    root, chain = path
    scope = _name_scope(root, code)
    try:
        value = _resolve(frame, root, scope, chain)
    except Exception:  # noqa: BLE001
        value = _MISSING
    if value is not callee:
        return _refuse(
            loc,
            f"the statement calls `{ast.unparse(node.func)}`, which is not this function "
            "itself (a functools.partial, a builtin calling back, or another wrapper)",
            code,
        )
    parent = getattr(node, "parent", None)
    targets: set[str] = set()
    unpack = None
    binding = None
    if isinstance(parent, ast.Assign) and parent.value is node:
        for t in parent.targets:
            names = _plain_targets(t)
            if names is None:
                return _refuse(
                    loc,
                    f"the statement assigns to `{ast.unparse(t)}`, which is evaluated after "
                    "the call and could read a donated argument",
                    code,
                )
            targets |= names
            if isinstance(t, ast.Tuple | ast.List):  # ``a = (b, c) = f(x)``: every one
                unpack = (*(unpack or ()), target_pattern(t))
        binding = _binding(parent.targets, code)
    elif isinstance(parent, ast.AnnAssign) and parent.value is node:
        if not isinstance(parent.target, ast.Name):
            return _refuse(
                loc,
                f"the statement assigns to `{ast.unparse(parent.target)}`, which is evaluated "
                "after the call and could read a donated argument",
                code,
            )
        targets = {parent.target.id}
        binding = _binding([parent.target], code)
    if _stored_after_call(code, frame.f_lasti) != targets:
        # The source was read from the file as it is now (linecache), which may not be the text
        # the running code was compiled from (a script edited while it runs): the names the
        # instructions store after the call must be the statement's targets.
        return _refuse(
            loc,
            "the running code does not store what its source line says (the file was edited "
            "since it was compiled?), so autoopt cannot tell which names the statement rebinds",
            code,
        )
    stmt = parent if isinstance(parent, ast.stmt) else None
    try:
        text = ast.unparse(stmt if stmt is not None else node)
    except Exception:  # noqa: BLE001
        text = None

    positions, names, reasons = [], [], []

    def judge(expr: ast.AST):
        if not isinstance(expr, ast.Name):
            return f"it is passed as an expression (`{ast.unparse(expr)}`), not a plain name"
        if expr.id in targets:
            return None
        if not targets:
            if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                what = "assigned to something other than plain names"
            elif stmt is None:  # (`float(step(x))`, `step(x) + 1`)
                what = "used inside a larger expression, not assigned back to it"
            else:
                what = "not assigned"
            msg = f"the call's result is {what}, so `{expr.id}` may be used later"
        else:
            msg = f"the statement rebinds {', '.join(sorted(targets))}, not `{expr.id}`"
        if stmt is not None:
            uses = _later_uses(stmt, expr.id)
            if uses:
                msg = f"`{expr.id}` is used again on line {uses[0]} ({msg})"
        return msg

    donated: list[str] = []
    for i, a in enumerate(node.args):
        why = judge(a)
        if why is None and isinstance(a, ast.Name):  # judge accepts plain names only
            positions.append(i)
            donated.append(a.id)
        else:
            reasons.append((i, why))
    for kw in node.keywords:
        why = judge(kw.value)
        if why is None and isinstance(kw.value, ast.Name):
            names.append(kw.arg)
            donated.append(kw.value.id)
        else:
            reasons.append((kw.arg, why))
    shared = any(_name_scope(n, code) != "local" for n in donated)
    bound = tuple(
        (key, name, _name_scope(name, code)) for key, name in zip([*positions, *names], donated)
    )
    check = _make_check(
        root,
        scope,
        chain,
        shared,
        module_level=not code.co_flags & inspect.CO_OPTIMIZED,
        bound=bound,
        code=code,
    )
    return CallSiteProof(
        tuple(positions),
        tuple(names),
        tuple(reasons),
        loc,
        text,
        n_positional=len(node.args),
        keywords=frozenset(kw.arg for kw in node.keywords if kw.arg is not None),
        unpack=unpack,
        code=code,
        check=check,
        slot_spec=getattr(check, "slot_spec", None),
        same_call=check.same_call,  # pyright: ignore[reportFunctionMemberAccess]
        binding=binding,
    )


# --- run-time checks -------------------------------------------------------------------------
# Reference-count baselines are measured, not assumed: CPython versions differ in how many
# references a call holds (the caller's stack, the *args tuple, the **kwargs dict). We measure
# them once through the same call shape the real path uses.


class _Probe:
    def __call__(self, *args, **kwargs):
        return _measure(args, kwargs)


class _BoundProbe:
    """The call shape of a decorated method: ``_BoundOptimized`` prepends the instance."""

    def __call__(self, *args, **kwargs):
        full = (None, *args)  # as _BoundOptimized.__call__ builds it (both tuples stay alive)
        return _measure(full, kwargs, 1)


def _measure(args, kwargs, i=0):
    return sys.getrefcount(args[i]), (sys.getrefcount(kwargs["k"]) if "k" in kwargs else None)


def _calibrate(probe) -> tuple[int, int, int]:
    """Baselines for (positional arg, no keywords), (positional arg, with keywords), (keyword arg).

    A call with keywords holds one more transient reference per argument in CPython 3.11, so the
    two shapes get their own baseline. A call shape we did not calibrate (``functools.partial``
    around the function) holds more references, which only makes the check refuse: safe.
    """

    def positional_only():
        x = object()
        return probe(x)

    def with_keywords():
        x = object()
        y = object()
        return probe(x, k=y)

    pos_only = min(positional_only()[0] for _ in range(3))
    with_kw = [with_keywords() for _ in range(3)]
    return pos_only, min(c[0] for c in with_kw), min(c[1] for c in with_kw)


_BASE_POS, _BASE_POS_KW, _BASE_KW = _calibrate(_Probe())
# The reference count of a positional argument nothing but the call holds, read as
# ``sys.getrefcount(args[i])`` on the ``args`` tuple the call's ``*args`` built.
CALL_REFS = _BASE_POS
# The same for a call that also passes keyword arguments (one more transient reference).
CALL_REFS_KW = _BASE_POS_KW
# A decorated method's call (``obj.step(state, batch)``): the arguments tuple is rebuilt with
# the instance in front, one more reference to each positional argument while the call runs.
BOUND_BASES = _calibrate(_BoundProbe())


_BUILTIN_NODES = (dict, list, tuple)
_EMPTY_TUPLE = ()


def kid_refcounts(obj) -> tuple[list, list[int], int]:
    """``(children, their reference counts, the count of a child nothing else refers to)``.

    Plain dicts, lists and tuples (jax flattens them to their values) are read directly, ~4x
    cheaper than ``flatten_one_level``; every other node goes through jax's registry."""
    t = type(obj)
    if t in _BUILTIN_NODES:
        kids = list(obj.values()) if t is dict else list(obj)
        return kids, list(map(sys.getrefcount, kids)), _BASE_KID_BUILTIN
    if t in _NAMEDTUPLE_NODES or _is_namedtuple_node(t):
        # An optax state's NamedTuple: its items are its children, held by the tuple itself,
        # read as a tuple's (~6x cheaper than the registry's path, which looks for a container
        # of its own behind them: a tuple has none). Read as jax reads them, past any
        # ``__iter__`` the class defines (one hiding a field would hide it from this count).
        kids = list(tuple.__iter__(obj))
        return kids, list(map(sys.getrefcount, kids)), _BASE_KID_BUILTIN
    return _registry_kid_refcounts(obj)


# NamedTuple types jax flattens by its default rule (``_compat.is_plain_namedtuple``), kept per
# type: registration is fixed for a type's lifetime.
_NAMEDTUPLE_NODES: set[type] = set()


def _is_namedtuple_node(t: type) -> bool:
    if is_plain_namedtuple(t) and not keeps_itself(t):
        _NAMEDTUPLE_NODES.add(t)
        return True
    return False


def holds_node_keeping_itself(x: Any, depth: int = 0) -> bool:
    """Whether the pytree ``x`` has a node of a type that ``keeps_itself``: never donated, so a
    signature's executable is decided without it (else every call would pass copies, in
    containers of that type built for the call, which its ``__del__`` could keep)."""
    t = type(x)
    if t is _ARRAY_IMPL or depth > 64:
        return False
    try:
        kids, _ = flatten_one_level(x)
    except ValueError:  # a leaf
        return False
    if t not in _BUILTIN_NODES and keeps_itself(t):
        return True
    return any(holds_node_keeping_itself(k, depth + 1) for k in kids)


def keeps_itself(t: type) -> bool:
    """Whether instances of the node type ``t`` run a ``__del__`` of their own: one that
    stores ``self`` somewhere keeps the node, and the arrays it held, after the call dropped it,
    so a donated node's arrays would be read deleted. Such nodes are never donated."""
    return getattr(t, "__del__", None) is not None


def _registry_counts(obj) -> tuple[list, list[int], int, bool, Any]:
    """``(children, their counts, the count of the children's container, container is obj,
    the container)``."""
    kids, _ = flatten_one_level(obj)
    count = sys.getrefcount(kids)
    return list(kids), [sys.getrefcount(c) for c in kids], count, kids is obj, kids


def _registry_kid_refcounts(obj) -> tuple[list, list[int], int]:
    kids, counts, container, same, stored = _registry_counts(obj)
    if same:  # a list node: jax returns the node itself as its children
        return kids, counts, _BASE_KID_SAME
    if container == _FRESH_CONTAINER:  # a new container: built from what the node holds
        if _inner_container_shared(obj, kids):
            return kids, counts, -1
        return kids, counts, _BASE_KID_NEW
    if container == _FRESH_CONTAINER + 1 and any(v is stored for v in _attribute_values(obj)):
        return kids, counts, _BASE_KID_STORED  # the node's own stored container
    # The container the node flattens to is reachable from elsewhere, and the leaves with it.
    return kids, counts, -1


def _attribute_values(obj) -> list:
    """The values of ``obj``'s attributes (its ``__dict__`` and its slots), read without
    running its code (no ``__getattr__``, no property)."""
    try:
        values = list(object.__getattribute__(obj, "__dict__").values())
    except (AttributeError, TypeError):
        values = []
    for name in _slot_names(type(obj)):
        try:
            values.append(object.__getattribute__(obj, name))
        except (AttributeError, TypeError):
            continue
    return values


_SLOT_NAMES: dict[type, tuple[str, ...]] = {}


def _slot_names(t: type) -> tuple[str, ...]:
    """The value slots ``t`` and its bases declare (a class's slots are fixed once made)."""
    got = _SLOT_NAMES.get(t)
    if got is None:
        names = []
        for klass in t.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__"):
                    names.append(name)
        got = _SLOT_NAMES[t] = tuple(names)
    return got


def _holds_array(container, depth: int = 0) -> bool:
    """A plain dict, list or tuple holding a jax array, at any depth of plain containers."""
    if depth > 8:
        return True  # deeper than any state is written: assume it does
    kids = container.values() if type(container) is dict else container
    return any(
        type(k) is _ARRAY_IMPL or (type(k) in _BUILTIN_NODES and _holds_array(k, depth + 1))
        for k in kids
    )


def _inner_container_shared(obj, kids: list) -> bool:
    """Whether the node ``obj``, whose flatten built a fresh container of its children, may
    hold them where something else can reach them. Refused unless every child that can hold an
    array is found among ``obj``'s own attributes, directly or inside plain dicts, lists and
    tuples of its own that nothing else holds: a node storing ``self.layers = [...]`` and
    flattening to ``tuple(self.layers)`` is donated unless the caller holds
    ``layers = model.layers`` (that container's count shows it; the children's own counts
    cannot, the container holds each once as the node itself would). A child reached through
    any other holder (an object of the user's, a deque, an OrderedDict, a closure, a bound
    method) is not followed: who else holds that holder is not read here
    (``pool = state.pool``)."""
    wanted = {id(k) for k in kids if type(k) not in _SCALAR_TYPES}
    values = _attribute_values(obj) + _items_of(obj)
    counts = [sys.getrefcount(v) for v in values]
    missing = wanted.difference(map(id, values))
    for value, count in zip(values, counts):
        if type(value) not in _BUILTIN_NODES or id(value) in wanted:
            continue
        inside = _plain_contents(value) & missing if missing else missing
        if _holds_array(value):
            if count > _BASE_ATTRIBUTE or _container_shared(value):
                return True
        # (A container holding only other nodes is not counted, as before: an nnx State's
        # mapping has one reference more than its object's, from nnx itself.)
        missing -= inside
    return bool(missing)


def _items_of(obj) -> list:
    """What a node that is a tuple, list or dict (a NamedTuple with its own registration) holds
    as one, read without running its code."""
    if isinstance(obj, tuple):
        return list(tuple.__iter__(obj))
    if isinstance(obj, list):
        return list(list.__iter__(obj))
    if isinstance(obj, dict):
        return list(dict.values(obj))
    return []


def _plain_contents(container, depth: int = 0) -> set[int]:
    """The ids of what ``container`` holds, and what the plain dicts, lists and tuples inside
    it hold, down to the depth any state is written at."""
    out: set[int] = set()
    if depth > 8:
        return out
    for k in container.values() if type(container) is dict else container:
        out.add(id(k))
        if type(k) in _BUILTIN_NODES:
            out |= _plain_contents(k, depth + 1)
    return out


def _container_shared(container, depth: int = 0) -> bool:
    """A plain container (held once) that holds, at any depth, a plain container holding an
    array that something else also holds."""
    if depth > 8:
        return True
    inner, counts, base = kid_refcounts(container)
    for value, count in zip(inner, counts):
        if type(value) in _BUILTIN_NODES and _holds_array(value):
            if count > base or _container_shared(value, depth + 1):
                return True
    return False


def _calibrate_attribute() -> int:
    """``_inner_container_shared``'s count of an attribute value that only its object holds."""

    class Probe:
        def __init__(self):
            self.held = [object()]

    values = _attribute_values(Probe())
    return [sys.getrefcount(v) for v in values][0]


_BASE_ATTRIBUTE = 0
_BASE_KID_SAME = _BASE_KID_NEW = _BASE_KID_BUILTIN = _BASE_KID_STORED = _FRESH_CONTAINER = 0


def _calibrate_kids() -> tuple[int, int, int, int, int]:
    """Each path of ``kid_refcounts`` on a fresh child: its count when only the node holds it,
    and the count of a container the flatten function built afresh."""

    class Fresh:  # flattens to a new list; holds its child itself
        def __init__(self, kid):
            self.kid = kid

    class Stored:  # flattens to the list it stores (``lambda b: (b.parts, None)``)
        def __init__(self, kid):
            self.parts = [kid]

    jax.tree_util.register_pytree_node(
        Fresh, lambda n: ([n.kid], None), lambda _, kids: Fresh(*kids)
    )
    jax.tree_util.register_pytree_node(
        Stored, lambda n: (n.parts, None), lambda _, kids: Stored(*kids)
    )
    _, same_counts, _, same, _ = _registry_counts([object()])
    assert same  # flatten_one_level returns a list node itself as its children
    _, new_counts, fresh, _, _ = _registry_counts(Fresh(object()))
    node = Stored(object())
    _, stored_counts, stored, _, container = _registry_counts(node)
    assert stored == fresh + 1 and container is node.parts  # jax hands back the stored list
    builtin = kid_refcounts({"a": object()})[1][0]
    named = collections.namedtuple("named", "a")(object())
    assert kid_refcounts(named)[1][0] == builtin == kid_refcounts((object(),))[1][0]
    return same_counts[0], new_counts[0], builtin, stored_counts[0], fresh


(_BASE_KID_SAME, _BASE_KID_NEW, _BASE_KID_BUILTIN, _BASE_KID_STORED, _FRESH_CONTAINER) = (
    _calibrate_kids()
)
_BASE_ATTRIBUTE = _calibrate_attribute()


# The concrete array type jax returns from every computation: checked with ``type(x) is`` first,
# because ``isinstance(x, jax.Array)`` goes through an ABC check (~0.5 us a leaf).
_ARRAY_IMPL = ARRAY_IMPL
_HOST_SCALARS = (np.ndarray, np.generic, int, float, complex, bool)
_NO_ARRAYS = (int, float, complex, bool, str, type(None))
_SCALAR_TYPES = frozenset(_NO_ARRAYS)


_ONLY_ARRAYS = {_ARRAY_IMPL}
_IS_DELETED = operator.methodcaller("is_deleted")
_AVAL = operator.attrgetter("aval")


# A weak reference to a donated array, or to a node holding one, counts no reference but reads
# the object: another thread, a signal handler or a finalizer holding one would find the
# donated arrays deleted. Under "safe" such an argument is not donated.
weakly_held = weakref.getweakrefcount
WEAKLY_HELD = "a weak reference to it (weakref) exists, which other code could read it through"


def _array_problem(obj, seen: set[int], check_refs: bool = True) -> str | None:
    if obj.is_deleted():
        return "it was already deleted (donated earlier)"
    if check_refs and weakly_held(obj):
        return WEAKLY_HELD
    if id(obj) in seen:
        return "the same array appears twice in the arguments"
    seen.add(id(obj))
    return None


def _key_data_refs(key) -> int:
    """The reference count of a typed PRNG key's data array (``_compat.key_base_array``), read
    as ``_calibrate_key_data`` reads it."""
    return sys.getrefcount(key_base_array(key))


def _calibrate_key_data() -> int:
    """``_key_data_refs`` of a key whose data array nothing but the key holds. Measured on a
    stand-in holding its data as a key does (one attribute), as the other baselines are measured
    on ``object()``s: a real key would start jax's backend at import. A real key's data array
    held by jax besides the key (a cache) counts more, and its key is never donated: the
    tests donate real keys, so they fail if that ever happens."""

    class Probe:
        def __init__(self):
            self._base_array = object()

    return min(_key_data_refs(Probe()) for _ in range(3))


_BASE_KEY_DATA = _calibrate_key_data()


def _key_problem(key, seen: set[int], check_refs: bool) -> str | None:
    """``_array_problem`` of a typed PRNG key: a key is a leaf of its own, and its data array
    (what ``jax.random.key_data`` returns, what ``jax.random.wrap_key_data`` wraps) a jax array
    of its own sharing its buffer. Donating the key deletes that buffer, so the data array is
    checked as the key is: held by nothing but the key (``check_refs``), passed nowhere else,
    no constant of the program (``seen``)."""
    if key.is_deleted():
        return "it was already deleted (donated earlier)"
    if check_refs and (weakly_held(key) or weakly_held(key_base_array(key))):
        return WEAKLY_HELD
    data = id(key_base_array(key))
    if id(key) in seen or data in seen:
        return "the same array appears twice in the arguments"
    if check_refs and _key_data_refs(key) > _BASE_KEY_DATA:
        return (
            "the data array of a typed PRNG key in it (jax.random.key_data of it) is also "
            "referenced from elsewhere"
        )
    seen.add(id(key))
    seen.add(data)
    return None


def leaf_problem(obj, seen: set[int], check_refs: bool = True) -> str | None:
    """Why the pytree ``obj`` (whose own refcount was checked) cannot be donated, or None.

    ``check_refs=False`` (``donate="auto"``: the caller promised not to reuse the argument)
    skips the reference counts of the parts but keeps every other check."""
    t = type(obj)
    if t is _ARRAY_IMPL:
        return _array_problem(obj, seen, check_refs)
    if t is KEY_ARRAY:
        return _key_problem(obj, seen, check_refs)
    if t not in _BUILTIN_NODES:
        if getattr(t, "_autoopt_never_donate", False):
            return "it holds an autoopt.constant, whose device copy every call shares"
        if check_refs and weakly_held(obj):
            return WEAKLY_HELD
    if t not in _BUILTIN_NODES and t not in _NODE_TYPES:
        # (plain containers and known node types skip these checks: ~1 us of ABC lookups)
        if isinstance(obj, jax.Array):
            if is_tracer(obj):
                return "it is traced by an enclosing transformation"
            return _array_problem(obj, seen, check_refs)
        if isinstance(obj, _HOST_SCALARS):
            return (
                "it holds a NumPy array or Python scalar; jax copies those to the device "
                "on every call, so donating saves nothing"
            )
    try:
        kids, counts, base = kid_refcounts(obj)
    except ValueError:
        return f"it holds a leaf of type {type(obj).__name__} that is not a jax.Array"
    if t not in _BUILTIN_NODES and keeps_itself(t):
        return (
            f"it holds a {t.__name__}, whose __del__ can keep it (and the arrays it holds) "
            "after the call drops it"
        )
    if kids and set(map(type, kids)) == _ONLY_ARRAYS:
        # A node of arrays only (an optimizer state's dict, a list of layers' weights): the
        # per-kid checks below, each as one C-level pass over the kids (a state of 512 leaves
        # would otherwise pay ~1 us a leaf in Python on every call).
        if check_refs and max(counts) > base:
            return "a part of it is also referenced from elsewhere"
        if check_refs and any(map(weakly_held, kids)):
            return WEAKLY_HELD
        if any(map(_IS_DELETED, kids)):
            return "it was already deleted (donated earlier)"
        ids = set(map(id, kids))
        if len(ids) < len(kids) or not seen.isdisjoint(ids):
            return "the same array appears twice in the arguments"
        seen.update(ids)
        return None
    for kid, count in zip(kids, counts):
        if kid is None or kid is _EMPTY_TUPLE:
            # an empty node (a None field, an empty state's ``()``): no buffer, and None and
            # the empty tuple are single objects every holder shares
            continue
        if type(kid) is not _ARRAY_IMPL and _static_leaf(kid):
            continue  # passed as a constant of the program, never donated
        if check_refs and count > base:
            return "a part of it is also referenced from elsewhere"
        why = leaf_problem(kid, seen, check_refs)
        if why is not None:
            return why
    return None


def shared_parts(obj) -> bool:
    """Whether a part of the pytree ``obj`` (whose own count was checked) is also referenced from
    elsewhere, read from the reference counts alone: a cached plan's check (``_jit._plans``),
    whose signature already fixed everything else ``leaf_problem`` looks at (no tracer, no
    static leaf, where the NumPy leaves are). A deleted array or one passed twice needs no
    look: jax's call raises for the first before it donates anything, and the second counts
    one reference more."""
    t = type(obj)
    if weakly_held(obj):
        return True
    if t is _ARRAY_IMPL:
        return False
    if t is KEY_ARRAY:  # (its own count is its holder's to check; its data array's is here)
        return _key_data_refs(obj) > _BASE_KEY_DATA or weakly_held(key_base_array(obj)) > 0
    if t not in _BUILTIN_NODES and getattr(t, "_autoopt_never_donate", False):
        return True  # an autoopt.constant: its device copy is every call's
    try:
        kids, counts, base = kid_refcounts(obj)
    except ValueError:  # a leaf that is not a jax array (a scalar, a NumPy array): no buffer
        return False
    if t not in _BUILTIN_NODES and keeps_itself(t):
        return True  # a node whose __del__ can keep it (and its arrays) after the call
    for kid, count in zip(kids, counts):
        if kid is None or kid is _EMPTY_TUPLE:
            # an empty node (a None field, an empty state's ``()``): no buffer, and None and
            # the empty tuple are single objects every holder shares
            continue
        if count > base:
            return True
        if type(kid) is _ARRAY_IMPL:
            if weakly_held(kid):
                return True
        elif shared_parts(kid):
            return True
    return False


def _static_leaf(x) -> bool:
    """A leaf jax.jit cannot trace (an equinox module's activation function, a string): the
    call path makes it static (``_jit._static_leaves``), so it holds no buffer to donate and
    other references to it do not matter."""
    t = type(x)
    if t in _STATIC_LEAF_TYPES:
        return True
    if t in _BUILTIN_NODES or t in _NODE_TYPES:
        return False
    if isinstance(x, _HOST_SCALARS) or isinstance(x, jax.Array):
        return False
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x)):
        # A pytree node with children (an optax state's NamedTuple, an equinox module): being
        # a node is a fact about its type (jax's registry, or a NamedTuple's fields), kept
        # per type so a training step's state is not asked again on every call (never an
        # autoopt.constant's type: ``leaf_problem`` refuses it by its type).
        if not getattr(t, "_autoopt_never_donate", False):
            _NODE_TYPES.add(t)
        return False
    static = not hasattr(x, "__jax_array__") and not jit_accepts_leaf(x)
    if static and (t is types.FunctionType or (t.__module__ or "").startswith("jax._src.")):
        # Functions and jax's own function objects (``jax.nn.relu`` is a ``custom_jvp``): their
        # type decides (no pytree registration, no abstract value), so the answer is kept per
        # type. A model's activation functions are checked on every call of a training step,
        # ~10 us each through jax's registry and abstractification.
        _STATIC_LEAF_TYPES.add(t)
    return static


_STATIC_LEAF_TYPES: set[type] = set()
_NODE_TYPES: set[type] = set()  # types seen as pytree nodes with children (``_static_leaf``)


def _add_leaf_ids(value, seen: set[int]) -> None:
    """Record the identity of every array in ``value`` (fast paths for the common leaves), and of
    every typed PRNG key's data array (``_key_data_ids``)."""
    if type(value) is _ARRAY_IMPL:
        seen.add(id(value))
    elif not isinstance(value, _NO_ARRAYS):
        leaves = jax.tree_util.tree_leaves(value)
        seen.update(map(id, leaves))
        seen.update(_key_data_ids(leaves))


def _key_data_ids(values) -> list[int]:
    """Identities of the data arrays of the typed PRNG keys in ``values``: a key is a leaf of its
    own (jax flattens it to its data only inside a trace), but the uint32 array holding its data
    is a jax array of its own, the very object ``jax.random.key_data``
    returns and ``jax.random.wrap_key_data`` wraps (``_compat.key_base_array``). Donating that
    array beside the key would delete a buffer the call reads (XLA refuses the call); donating
    it where a program holds the key as a constant deletes the constant."""
    return [id(key_base_array(a)) for a in values if type(a) is KEY_ARRAY]


def _repeated_array_ids(args: tuple, kwargs: dict) -> set[int]:
    """Identities of the arrays that occur more than once anywhere in the arguments."""
    once: set[int] = set()
    twice: set[int] = set()
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.Array):
            (twice if id(leaf) in once else once).add(id(leaf))
    return twice


def donation_checks(
    args: tuple,
    kwargs: dict,
    positions,
    names,
    *,
    check_refs: bool,
    bases: tuple[int, int, int] | None = None,
    exclude: frozenset[int] = frozenset(),
):
    """Filter the candidate arguments down to those safe to donate now.

    Returns ``(positions, names, reasons)``. ``check_refs`` is the ``"safe"`` policy's proof that
    no other reference exists; ``"auto"`` skips it (the caller promised). ``bases``: the
    reference-count baselines of the call shape (``BOUND_BASES`` for a decorated method).
    ``exclude``: identities of arrays never to donate (the program's own constants). Never
    raises.
    """
    ok_pos, ok_names, reasons = [], [], []
    base_only, base_with_kw, base_kw = bases or (_BASE_POS, _BASE_POS_KW, _BASE_KW)
    base_pos = base_with_kw if kwargs else base_only
    # Identities of every array in the non-candidate arguments, and of every array passed twice
    # among the candidates: donating a buffer that is also passed elsewhere would delete an input
    # the program still reads (XLA refuses the call). Under "safe" the reference counts already
    # rule out the second case; "auto" has only this.
    candidates = set(positions) | set(names)
    seen: set[int] = set(exclude) if check_refs else _repeated_array_ids(args, kwargs) | exclude
    if len(candidates) < len(args) + len(kwargs):
        # Indexing, not ``for a in args``: a loop variable left bound to the last argument is
        # one more reference to it, and the check below would refuse it.
        for i in range(len(args)):
            if i not in candidates:
                _add_leaf_ids(args[i], seen)
        for k in kwargs:
            if k not in candidates:
                _add_leaf_ids(kwargs[k], seen)
    for key in positions:
        if key >= len(args):
            continue
        # Measured before binding a local name, exactly as ``_measure`` does.
        if check_refs and sys.getrefcount(args[key]) > base_pos:
            reasons.append((key, "another reference to the same object exists"))
            continue
        why = leaf_problem(args[key], seen, check_refs)
        if why is None:
            ok_pos.append(key)
        else:
            reasons.append((key, why))
    for key in names:
        if key not in kwargs:
            continue
        if check_refs and sys.getrefcount(kwargs[key]) > base_kw:
            reasons.append((key, "another reference to the same object exists"))
            continue
        why = leaf_problem(kwargs[key], seen, check_refs)
        if why is None:
            ok_names.append(key)
        else:
            reasons.append((key, why))
    return tuple(ok_pos), tuple(ok_names), tuple(reasons)


def hidden_holders(frame: Any, obj: Any) -> int:
    """How many locals of ``frame`` no Python code can name hold ``obj``: pytest's assertion
    rewriting keeps each call's arguments in locals named ``@py_assert<N>`` (to explain a
    failure) and clears them after the statement, so ``assert f(x, nnx.Rngs(0))`` passes an
    object only pytest's failure message could ever read (``_jit._mutations``)."""
    if frame is None:
        return 0
    return sum(
        1
        for name in frame.f_code.co_varnames
        if not name.isidentifier() and _frames.read_local(frame, name) is obj
    )


def nodes_held_elsewhere(
    args: tuple,
    kwargs: dict,
    key: int | str,
    bases: tuple[int, int, int] | None = None,
    hidden: int = 0,
) -> bool:
    """Whether something besides the call can reach the argument ``key`` (a position or a
    keyword) or a pytree node inside it once the call returns: the argument has any holder but
    the call (a name of the caller's included), or a node inside it any but its parent
    (``kid_refcounts``). ``hidden``: references to the argument itself known not to count
    (``hidden_holders``). Leaves are not looked at: an array or a number is a
    value, and a holder of one cannot see what happens to the node that held it. What the
    question is for: an assignment to an nnx object the trace made on jax's copy
    (``_jit._mutations``) is visible to nobody when the call holds the only way to the object.
    Never raises: an argument it cannot walk counts as held."""
    base_only, base_with_kw, base_kw = bases or (_BASE_POS, _BASE_POS_KW, _BASE_KW)
    # The baselines count the caller's name for the argument (``_calibrate``'s probes pass a
    # local); an object made for the call alone has no name: one reference fewer.
    base_only, base_with_kw, base_kw = (b + hidden for b in (base_only, base_with_kw, base_kw))
    try:
        # Measured before binding a local name, exactly as ``_measure`` does.
        if isinstance(key, int):
            if (
                key >= len(args)
                or sys.getrefcount(args[key]) > (base_with_kw if kwargs else base_only) - 1
            ):
                return True
            return _nodes_shared(args[key])
        if key not in kwargs or sys.getrefcount(kwargs[key]) > base_kw - 1:
            return True
        return _nodes_shared(kwargs[key])
    except Exception:  # noqa: BLE001 - a node whose flatten fails: assume it is reachable
        return True


def _nodes_shared(root) -> bool:
    """Whether a pytree node inside ``root`` has a holder outside it. A node may appear under
    several parents inside the argument itself (an ``Rngs`` every sub-module of a fresh model
    keeps, tied weights): each appearance is one reference its count shows, and only what is
    beyond them is a holder outside."""
    nodes, appearances = [root], {}
    known = {id(root)}
    i = 0
    while i < len(nodes):  # every node once, and how many times it appears under a parent
        kids, _, base = kid_refcounts(nodes[i])
        i += 1
        if base < 0:  # the node flattens to a container something else holds
            return True
        for kid in kids:
            if _is_value(kid):
                continue
            appearances[id(kid)] = appearances.get(id(kid), 0) + 1
            if id(kid) not in known:
                known.add(id(kid))
                nodes.append(kid)
        if len(nodes) > 100_000:
            return True  # larger than any model is written: assume shared
    for parent in nodes:
        # while the counts are read, this walk holds each node once: in ``nodes`` (the last
        # parent's children and the loop's name let go first)
        kids = kid = None
        kids, counts, base = kid_refcounts(parent)
        for kid, count in zip(kids, counts):
            n = appearances.get(id(kid))
            if n is not None and count > base + n:  # n - 1 other parents here, and ``nodes``
                return True
    return False


def _is_value(kid) -> bool:
    """A leaf (or an empty node) that holds nothing a call could update: an array, a number,
    None, the empty tuple, or another leaf type."""
    if kid is None or kid is _EMPTY_TUPLE or type(kid) in _NO_ARRAYS:
        return True
    if isinstance(kid, jax.Array | np.ndarray):
        return True
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(kid))


# --- signatures and checks of the cached plans (``_jit._plans``) --------------------------------
# A call site that rebinds its arguments calls with the same signature again and again.
# ``OptimizedFunction`` caches the static half of the donation decision per site and signature
# (the program's aliasing, the site's proof) as a plan, which re-checks only the run-time half.

_FLAT_SCALARS = (int, float, bool, complex)
# Leaves a signature reads by their ``aval``: jax arrays, and typed PRNG keys (by
# ``_compat.key_entry``). A plan may donate either (``is_array``, ``all_array_leaves``).
_AVAL_TYPES = frozenset({_ARRAY_IMPL, KEY_ARRAY})


def flat_signature(args: tuple) -> tuple:
    """The signature of flat positional arguments, as ``_jit._plans.lookup`` computes it.

    ``aval`` is a stored attribute of a jax array, and the same object across the outputs of one
    executable, so building and hashing this tuple costs ~0.3 us. Only signatures of flat
    arguments are stored under it, so a pytree argument (its type here) never finds an entry.
    """
    return tuple([a.aval if type(a) is _ARRAY_IMPL else non_array_entry(a) for a in args])


def non_array_entry(a) -> Any:
    """A flat signature's entry for an argument that is not a jax array: a typed key's
    ``_compat.key_entry``, anything else's type."""
    return key_entry(a) if type(a) is KEY_ARRAY else type(a)


_HOST_LEAVES = (np.ndarray, np.float32, np.float64, np.int32, np.int64, np.bool_, np.float16)


def tree_signature(args: tuple) -> tuple[tuple, list] | None:
    """``(signature, leaves)`` of pytree positional arguments, or None when a leaf is not a jax
    array, a Python scalar, or a NumPy array or scalar (tracers, anything else: the general path
    decides). NumPy leaves are never donated; they are in the signature by shape and dtype, as
    jax.jit sees them (a batch fed from the host to a step that rebinds its state)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    if set(map(type, leaves)) <= _ONLY_ARRAYS:  # one C-level pass for a state of arrays
        return (treedef, tuple(map(_AVAL, leaves))), leaves
    sig = []
    for x in leaves:
        t = type(x)
        if t is _ARRAY_IMPL:
            sig.append(x.aval)
        elif t is KEY_ARRAY:
            sig.append(key_entry(x))
        elif t in _FLAT_SCALARS:
            sig.append(t)
        elif t in _HOST_LEAVES:
            sig.append((t, x.shape, x.dtype))
        else:
            return None
    return (treedef, tuple(sig)), leaves


def nested_signature(args: tuple) -> tuple[tuple, bool] | None:
    """``(signature, whether a leaf is a NumPy array or scalar)`` of positional arguments made of
    jax arrays, Python scalars, NumPy arrays and scalars, None, and plain dicts, lists, tuples
    and NamedTuples (jax's default rule) of them at any depth: a model's parameters, an optax
    state, a simulation's state, a batch of NumPy columns. None for anything else (a registered
    node, a tracer: ``tree_signature`` decides then).

    Read off the containers directly, without jax's treedef. The C call path (``_native.c``,
    ``nested_key``) builds the equal key, entry for entry, and both must change together. An
    argument's entry: a jax array's ``aval``, a scalar's type, None, a NumPy leaf's ``(type,
    shape, dtype)``, a container's ``(type, keys or length, entries)``. A dict's keys are in
    insertion order (a dict built in another order is another signature: one more plan, never
    a wrong one). No flat signature holds a tuple or None, and no tree signature starts with
    anything but a treedef, so the three kinds never meet in one plans dict."""
    host = [False]
    sig = []
    for a in args:
        entry = _nested_entry(a, host, 0)
        if entry is _NOT_NESTED:
            return None
        sig.append(entry)
    return tuple(sig), host[0]


def nested_tables() -> tuple[set, frozenset, frozenset]:
    """What ``nested_signature`` reads types by, for the C call path's copy of it: the NamedTuple
    types met so far that jax flattens by its default rule (the set itself, which grows), the
    NumPy leaf types, the Python scalar types."""
    return _NAMEDTUPLE_NODES, frozenset(_HOST_LEAVES), frozenset(_FLAT_SCALARS)


_NOT_NESTED: Any = object()
_ONLY_STR = {str}
# Deeper than any state is written: the tree signature decides (it has no recursion limit of
# its own to reach).
_NESTED_DEPTH = 48


def _nested_entry(a: Any, host: list, depth: int) -> Any:
    t = type(a)
    if t is _ARRAY_IMPL:
        return a.aval
    if t is KEY_ARRAY:  # (the C path reads no key: it leaves them here)
        return key_entry(a)
    if t in _FLAT_SCALARS:
        return t
    if a is None:
        return None
    if depth >= _NESTED_DEPTH:
        return _NOT_NESTED
    if t is dict:
        kids = list(a.values())
        keys = tuple(a)
        if not set(map(type, keys)) <= _ONLY_STR:
            return _NOT_NESTED  # (what jax sorts them by is the tree signature's to read)
    elif t in _HOST_LEAVES:
        host[0] = True
        return (t, a.shape, a.dtype)
    elif t is list or t is tuple:
        kids = a
        keys = len(a)
    elif t in _NAMEDTUPLE_NODES or _is_namedtuple_node(t):
        kids = tuple(tuple.__iter__(a))  # its items as jax reads them, past its own __iter__
        keys = len(kids)
    else:
        return _NOT_NESTED
    if set(map(type, kids)) <= _ONLY_ARRAYS:  # one C-level pass for a node of arrays
        return (t, keys, tuple(map(_AVAL, kids)))
    entries = []
    for kid in kids:
        entry = _nested_entry(kid, host, depth + 1)
        if entry is _NOT_NESTED:
            return _NOT_NESTED
        entries.append(entry)
    return (t, keys, tuple(entries))


def has_host_leaves(leaves: list) -> bool:
    return any(type(x) in _HOST_LEAVES for x in leaves)


def is_array(x) -> bool:
    """A concrete jax array or typed PRNG key: what a flat signature's plan may donate."""
    return type(x) in _AVAL_TYPES


def key_data_shared(x) -> bool:
    """Whether ``x`` is a typed PRNG key whose data array something besides the key holds
    (``jax.random.key_data`` of it kept by the caller, or a weak reference to it): a flat
    plan's check of a donated key, whose own count the plan read."""
    return type(x) is KEY_ARRAY and (
        _key_data_refs(x) > _BASE_KEY_DATA or weakly_held(key_base_array(x)) > 0
    )


def is_flat(args: tuple) -> bool:
    """Every argument is a concrete jax array, a typed PRNG key or a Python scalar (no pytree,
    tracer, NumPy)."""
    return all(type(a) in _AVAL_TYPES or type(a) in _FLAT_SCALARS for a in args)


def all_array_leaves(x) -> bool:
    """``x`` is a pytree with at least one leaf, and every leaf a concrete jax array or typed
    PRNG key (whose plans' checks read its data array: ``shared_parts``, ``leaf_problem``,
    ``distinct_arrays``)."""
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(type(v) in _AVAL_TYPES for v in leaves)


def distinct_arrays(values: Sequence, exclude: frozenset[int], keys: bool = False) -> bool:
    """No array occurs twice in ``values``, none is in ``exclude`` (a program's constants, with
    its keys' data arrays: ``_jaxpr.const_ids``), and none is the data array of a typed PRNG
    key in ``values`` (``_key_data_ids``: ``f(k, jax.random.key_data(k))``). ``keys``: the
    call may donate a typed key, so no key occurs twice either, no two keys share a data
    array, and neither a key nor its data array is in ``exclude``; otherwise a key passed twice
    is no problem.

    Identities see every sharing of a buffer that ``key_data``, ``wrap_key_data`` and
    ``jnp.asarray`` make (each returns or wraps the very object); ``jax.device_put(x, device)``
    aliases ``x``'s buffer under another object, which no identity shows."""
    ids = [id(a) for a in values if type(a) is _ARRAY_IMPL]
    unique = set(ids)
    if len(unique) < len(ids) or not unique.isdisjoint(exclude):
        return False
    if len(ids) == len(values):
        return True  # every value an array: no key to read, and no second pass over them
    data = _key_data_ids(values)
    if not keys:
        return unique.isdisjoint(data)
    key_ids = [id(a) for a in values if type(a) is KEY_ARRAY]
    every = ids + key_ids + data
    return len(set(every)) == len(every) and exclude.isdisjoint(every)
