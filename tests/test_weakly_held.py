"""An argument another piece of code reaches through a weak reference is not donated.

A ``weakref.ref`` to an array (or to a node holding one) counts no reference, so the reference
counts that prove an argument dead do not see it; but another thread, a signal handler or a
finalizer can read the array through it while the call runs, and would find it deleted. Under
``"safe"`` such an argument is not donated; without one it is. Checked by buffer pointers: a
donated ``x * 2`` reuses its input's buffer, an undonated one cannot (the input is alive while
the executable writes the output).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

import autoopt


def _donations(step, make, leaf, weak_of=None, calls: int = 4, weak_at: int = 3) -> list[bool]:
    """Whether each call ``s = step(s)`` reused ``leaf(s)``'s buffer; on call ``weak_at`` a weak
    reference to ``weak_of(s)`` (default: the leaf) exists."""
    out, refs = [], []
    s = make()
    for i in range(calls):
        before = leaf(s).unsafe_buffer_pointer()
        if i == weak_at:
            refs.append(weakref.ref((weak_of or leaf)(s)))
        s = step(s)
        out.append(leaf(s).unsafe_buffer_pointer() == before)
        refs.clear()
    return out


class _Opt(NamedTuple):
    mu: jax.Array


def _shapes():
    flax_struct = pytest.importorskip("flax.struct")
    eqx = pytest.importorskip("equinox")

    @flax_struct.dataclass
    class State:
        w: jax.Array

    class Model(eqx.Module):
        w: jax.Array

    yield "flat", autoopt.optimize(lambda x: x * 2.0), lambda: jnp.ones(8), lambda s: s, None
    yield (
        "dict",
        autoopt.optimize(lambda d: {"a": d["a"] * 2.0, "b": [d["b"][0] + 1.0]}),
        lambda: {"a": jnp.ones(8), "b": [jnp.ones(2)]},
        lambda s: s["a"],
        None,
    )
    yield (
        "namedtuple",
        autoopt.optimize(lambda o: _Opt(o.mu * 2.0)),
        lambda: _Opt(jnp.ones(8)),
        lambda s: s.mu,
        None,
    )
    struct = autoopt.optimize(lambda s: s.replace(w=s.w * 2.0))
    yield "struct leaf", struct, lambda: State(jnp.ones(8)), lambda s: s.w, None
    yield "struct node", struct, lambda: State(jnp.ones(8)), lambda s: s.w, lambda s: s
    module = autoopt.optimize(lambda m: eqx.tree_at(lambda m: m.w, m, m.w * 2.0))
    yield "equinox leaf", module, lambda: Model(jnp.ones(8)), lambda s: s.w, None
    yield "equinox node", module, lambda: Model(jnp.ones(8)), lambda s: s.w, lambda s: s


def test_a_weakly_referenced_argument_is_not_donated_on_any_call_path():
    for name, step, make, leaf, weak_of in _shapes():
        got = _donations(step, make, leaf, weak_of)
        assert got == [True, True, True, False], name


def test_a_typed_key_whose_data_array_is_weakly_referenced_is_not_donated():
    # (the flat plan of a cached call reads the key's own count and its data array's)
    from autoopt._compat import key_base_array

    step = autoopt.optimize(lambda k: jax.random.fold_in(k, 1))
    key = jax.random.key(0)
    got, refs = [], []
    for i in range(5):
        before = key_base_array(key).unsafe_buffer_pointer()
        if i in (2, 4):
            refs.append(weakref.ref(key_base_array(key)))
        key = step(key)
        got.append(key_base_array(key).unsafe_buffer_pointer() == before)
        refs.clear()
    assert got == [True, True, False, True, False]


def test_a_weakly_referenced_nnx_value_is_not_donated():
    nnx = pytest.importorskip("flax.nnx")

    class Lin(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(8))

    def double(model):
        model.w[...] = model.w[...] * 2.0

    with autoopt.patch():
        step = nnx.jit(double)
        # (a Variable itself takes no weak reference in this flax; its array does)
        for weak_of in (lambda m: m.w.get_raw_value(),):
            model, got, refs = Lin(), [], []
            for i in range(4):
                before = model.w.get_raw_value().unsafe_buffer_pointer()
                if i == 3:
                    refs.append(weakref.ref(weak_of(model)))
                step(model)
                got.append(model.w.get_raw_value().unsafe_buffer_pointer() == before)
                refs.clear()
            assert got == [True, True, True, False]
            assert float(model.w.get_raw_value()[0]) == 16.0
