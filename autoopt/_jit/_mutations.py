"""A function that assigns to an nnx Variable of its argument is refused, not silently undone,
unless nobody could see the difference.

jax.jit passes a flax nnx Module as a pytree: the function receives new Variable objects built
from the flattened leaves, so ``model.count[...] += 1`` inside changes those copies, and the
caller's Variable keeps its old value (``nnx.jit`` carries the change back; jax.jit drops it
without a word). autoopt sees the Variables, so it checks: after the trace, every Variable of
the arguments either holds the leaves it was given, or its new leaves are outputs of the
function (as in ``nnx.jit``'s own inner function, which returns the updated state); and every
nnx object (Module, Optimizer) of the arguments keeps its attributes (a new Variable in place of
the old, a Python counter, an ``nnx.data`` array, an added attribute) unless the object is
returned. What else the trace did is recorded on the program (``LostUpdate``), and every call
checks the caller's own objects (``held_lost_update``): an object made for the call alone
(``f(x, nnx.Rngs(0))``) is reachable by nobody afterwards, so its lost update is invisible, as
under jax.jit; one the caller can still reach raises, saying what to do.

NB: the analogous machinery in flax is ``nnx.transforms.compilation.JitFn`` (``extract.to_tree``
of the arguments after the call, returned as outputs and merged back by ``nnx.update``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

from jax import tree_util

from autoopt.passes.donation import callsite


def _variable_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")  # never imported here: only if the program uses it
    return getattr(nnx, "Variable", None) if nnx is not None else None


def _variables(tree: Any, variable: type) -> list[tuple[tuple, Any, list]]:
    """``(key path, Variable, its leaves)`` of every nnx Variable in ``tree``."""
    found = []
    nodes = tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, variable))[0]
    for path, node in nodes:
        if isinstance(node, variable):
            found.append((tuple(path), node, tree_util.tree_leaves(node)))
    return found


def _pytree_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    return getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)


def _attributes(tree: Any, pytree: type) -> dict[int, tuple[tuple, Any, dict[str, int]]]:
    """``id -> (key path, object, {attribute: id of its value})`` of every nnx object (a Module,
    an Optimizer) reachable from ``tree``: what an assignment to an attribute changes (a new
    Variable in place of the old, a Python counter, an ``nnx.data`` array, a new attribute)."""
    import flax.nnx as nnx

    iter_graph = getattr(nnx, "iter_graph", None) or nnx.graph.iter_graph
    found: dict[int, tuple[tuple, Any, dict[str, int]]] = {}
    roots = tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, pytree))[0]
    for root_path, root in roots:
        if not isinstance(root, pytree):
            continue
        for path, node in iter_graph(root):
            if isinstance(node, pytree) and id(node) not in found:
                where = (*root_path, *(tree_util.GetAttrKey(str(p)) for p in path))
                attrs = {k: id(v) for k, v in vars(node).items() if not k.startswith("_pytree__")}
                found[id(node)] = (where, node, attrs)
    return found


def holds_variables(args: tuple, kwargs: dict, fn: Any = None) -> bool:
    """The arguments hold an nnx Variable (checked once per signature, when it is traced), and
    ``fn`` is not flax's own: flax jits functions that change Variables on purpose, relying on
    jax.jit to drop the change (``nnx.tabulate`` counts calls on copies), and under
    ``autoopt.patch()`` they must keep jax.jit's semantics."""
    module = getattr(fn, "__module__", None) or ""
    if module == "flax" or module.startswith("flax."):
        return False
    variable = _variable_type()
    if variable is None:
        return False
    leaves = tree_util.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, variable))
    return any(isinstance(x, variable) for x in leaves)


class LostUpdate(NamedTuple):
    """An assignment the trace made to an nnx object of the arguments and did not return: lost
    when the call returns, as under jax.jit."""

    root: int | str  # the argument holding the object: its position, or its keyword's name
    message: str  # the error raised when the caller can still reach the object


def recording_lost_updates(fn: Callable, found: list[LostUpdate]) -> Callable:
    """``fn``, appending to ``found`` every assignment a call made to a Variable or another nnx
    object of its arguments that it does not return (the assignment is lost when the call
    returns). Whether that surprises anyone depends on the caller's objects, which the trace
    never sees (it gets jax's copies): the call path checks them (``held_lost_update``)."""
    variable = _variable_type()
    if variable is None:
        return fn

    pytree = _pytree_type()
    name = getattr(fn, "__name__", "the function")

    @functools.wraps(fn)
    def recording_lost_updates(*args, **kwargs):
        before = _variables((args, kwargs), variable)
        objects = _attributes((args, kwargs), pytree) if pytree is not None else {}
        out = fn(*args, **kwargs)
        returned = {id(x) for x in tree_util.tree_leaves(out)}
        if objects and pytree is not None:
            kind: type = pytree
            returned_objects = {
                id(x) for x in tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, kind))
            }
            for path, node, attrs in objects.values():
                now = {k: id(v) for k, v in vars(node).items() if not k.startswith("_pytree__")}
                if now != attrs and id(node) not in returned_objects:
                    changed = sorted(
                        set(now) ^ set(attrs)
                        | {k for k in now if k in attrs and now[k] != attrs[k]}
                    )
                    where = _where(path)
                    found.append(
                        LostUpdate(
                            _root(path),
                            f"{name} assigns to {', '.join(repr(k) for k in changed)} of the nnx "
                            f"object at {where} of its arguments. Under jax.jit (and "
                            "autoopt.optimize) the function gets a copy of the object, so the "
                            "change would be lost when the call returns. Use nnx.jit, which "
                            "carries it back, or return the object and rebind it after the call.",
                        )
                    )
        for path, var, leaves in before:
            now = tree_util.tree_leaves(var)
            changed = len(now) != len(leaves) or any(a is not b for a, b in zip(now, leaves))
            if changed and not all(id(x) in returned for x in now):
                found.append(
                    LostUpdate(
                        _root(path),
                        f"{name} assigns to the nnx Variable at {_where(path)} of its arguments. "
                        "Under jax.jit (and autoopt.optimize) the function gets a copy of each "
                        "Variable, so the new value would be lost when the call returns and the "
                        "caller's Variable would keep its old value. Use nnx.jit, which carries "
                        "the update back, or return the new state (nnx.state(model)) and apply "
                        "it with nnx.update(model, state) after the call.",
                    )
                )
        return out

    return recording_lost_updates


def held_lost_update(
    lost: tuple[LostUpdate, ...],
    args: tuple,
    kwargs: dict,
    bases: tuple | None = None,
    caller: Any = None,
    callee: Any = None,
) -> LostUpdate | None:
    """The first of ``lost`` whose object the caller can still reach after this call, or None.

    An object made for the call alone (``f(x, nnx.Rngs(0))``: flax's own tests do this) is
    reachable by nobody once the call returns, so its lost update is invisible, as under
    jax.jit; one the caller holds (``rngs = nnx.Rngs(0); f(x, rngs)``) would keep its old value
    and surprise. Reachable means: the call does not hold the only reference to the argument,
    or to some pytree node inside it (a Variable, a stream of an ``Rngs``, a sub-module).
    ``args`` must be the tuple the call's ``*args`` built (``callsite.nodes_held_elsewhere``);
    ``bases``: a decorated method's baselines, whose ``args`` start with the instance, which is
    the caller's (``model(x)``), so held. ``caller``: the calling frame, whose statement must
    call ``callee`` itself with plain arguments (``callsite.called_directly``: the reference
    counts' baselines assume the caller's stack holds each argument) and whose hidden locals
    (``callsite.hidden_holders``) do not count as holders; otherwise every object is held."""
    written = len(args) - (1 if bases is not None else 0)  # a method's instance is not written
    if lost and (caller is None or not callsite.called_directly(caller, callee, written, kwargs)):
        return lost[0]
    for update in lost:
        root = update.root
        if bases is not None and root == 0:
            return update
        if isinstance(root, int):
            hidden = callsite.hidden_holders(caller, args[root]) if root < len(args) else 0
        else:
            hidden = callsite.hidden_holders(caller, kwargs[root]) if root in kwargs else 0
        if callsite.nodes_held_elsewhere(args, kwargs, root, bases, hidden):
            return update
    return None


def _root(path: tuple) -> int | str:
    """The argument a path into ``(args, kwargs)`` starts at: a position or a keyword."""
    kind, key = path[0], path[1]
    if getattr(kind, "idx", 0) == 0:
        return int(key.idx)
    return key.key


def _where(keys: tuple) -> str:
    """``[0][0].count`` -> ``args[0].count``, as the user spells it."""
    path = tree_util.keystr(keys)
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path or "the argument"
