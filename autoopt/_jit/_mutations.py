"""A function that assigns to an nnx Variable of its argument is refused, not silently undone.

jax.jit passes a flax nnx Module as a pytree: the function receives new Variable objects built
from the flattened leaves, so ``model.count[...] += 1`` inside changes those copies, and the
caller's Variable keeps its old value (``nnx.jit`` carries the change back; jax.jit drops it
without a word). autoopt sees the Variables, so it checks: after the trace, every Variable of
the arguments either holds the leaves it was given, or its new leaves are outputs of the
function (as in ``nnx.jit``'s own inner function, which returns the updated state); and every
nnx object (Module, Optimizer) of the arguments keeps its attributes (a new Variable in place of
the old, a Python counter, an ``nnx.data`` array, an added attribute) unless the object is
returned. Anything else raises, saying what to do.

NB: the analogous machinery in flax is ``nnx.transforms.compilation.JitFn`` (``extract.to_tree``
of the arguments after the call, returned as outputs and merged back by ``nnx.update``).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from jax import tree_util


def _variable_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")  # never imported here: only if the program uses it
    return getattr(nnx, "Variable", None) if nnx is not None else None


def _variables(tree: Any, variable: type) -> list[tuple[str, Any, list]]:
    """``(path, Variable, its leaves)`` of every nnx Variable in ``tree``."""
    found = []
    nodes = tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, variable))[0]
    for path, node in nodes:
        if isinstance(node, variable):
            found.append((tree_util.keystr(path), node, tree_util.tree_leaves(node)))
    return found


def _pytree_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return None
    return getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)


def _attributes(tree: Any, pytree: type) -> dict[int, tuple[str, Any, dict[str, int]]]:
    """``id -> (path, object, {attribute: id of its value})`` of every nnx object (a Module,
    an Optimizer) reachable from ``tree``: what an assignment to an attribute changes (a new
    Variable in place of the old, a Python counter, an ``nnx.data`` array, a new attribute)."""
    import flax.nnx as nnx

    iter_graph = getattr(nnx, "iter_graph", None) or nnx.graph.iter_graph
    found: dict[int, tuple[str, Any, dict[str, int]]] = {}
    roots = tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, pytree))[0]
    for root_path, root in roots:
        if not isinstance(root, pytree):
            continue
        for path, node in iter_graph(root):
            if isinstance(node, pytree) and id(node) not in found:
                where = tree_util.keystr(root_path) + "".join(f".{p}" for p in path)
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


def refusing_lost_updates(fn: Callable) -> Callable:
    """``fn``, raising after a call that assigned to a Variable of its arguments a value that
    it does not return (the assignment would be lost when the call returns)."""
    variable = _variable_type()
    if variable is None:
        return fn

    pytree = _pytree_type()

    @functools.wraps(fn)
    def refusing_lost_updates(*args, **kwargs):
        before = _variables((args, kwargs), variable)
        objects = _attributes((args, kwargs), pytree) if pytree is not None else {}
        out = fn(*args, **kwargs)
        returned = {id(x) for x in tree_util.tree_leaves(out)}
        if objects and pytree is not None:
            kind: type = pytree
            returned_objects = {
                id(x) for x in tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, kind))
            }
            for where, node, attrs in objects.values():
                now = {k: id(v) for k, v in vars(node).items() if not k.startswith("_pytree__")}
                if now != attrs and id(node) not in returned_objects:
                    changed = sorted(
                        set(now) ^ set(attrs)
                        | {k for k in now if k in attrs and now[k] != attrs[k]}
                    )
                    name = getattr(fn, "__name__", "the function")
                    raise TypeError(
                        f"{name} assigns to {', '.join(repr(k) for k in changed)} of the nnx "
                        f"object at {_where(where)} of its arguments. Under jax.jit (and "
                        "autoopt.optimize) the function gets a copy of the object, so the "
                        "change would be lost when the call returns. Use nnx.jit, which "
                        "carries it back, or return the object and rebind it after the call."
                    )
        for path, var, leaves in before:
            now = tree_util.tree_leaves(var)
            changed = len(now) != len(leaves) or any(a is not b for a, b in zip(now, leaves))
            if changed and not all(id(x) in returned for x in now):
                name = getattr(fn, "__name__", "the function")
                raise TypeError(
                    f"{name} assigns to the nnx Variable at {_where(path)} of its arguments. "
                    "Under jax.jit (and autoopt.optimize) the function gets a copy of each "
                    "Variable, so the new value would be lost when the call returns and the "
                    "caller's Variable would keep its old value. Use nnx.jit, which carries the "
                    "update back, or return the new state (nnx.state(model)) and apply it with "
                    "nnx.update(model, state) after the call."
                )
        return out

    return refusing_lost_updates


def _where(path: str) -> str:
    """``[0].count`` -> ``args[0].count``, as the user spells it."""
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path or "the argument"
