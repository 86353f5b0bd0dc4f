"""The cached plans of ``eqx.filter_jit`` under ``autoopt.patch()``: a repeating call takes its
signature's plan at its call site, which re-checks on every call what the general path checks
(every donated argument, and every node and array inside it, held only by the call; nothing
deleted; no array passed twice; ``jax_debug_nans`` off) and keeps equinox's semantics (static
leaves hashed into the signature, non-array outputs, ``eqx.error_if``).

Each test warms the statement's plan first (a loop whose first calls take the general path),
then changes one thing. That the plan ran, not the general path, is read from what only the
general path does: bind the arguments to the function's signature (``inspect.Signature.bind``,
as equinox binds them), counted.
"""

from __future__ import annotations

import contextlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt

pytestmark = pytest.mark.corpus

eqx = pytest.importorskip("equinox")
optax = pytest.importorskip("optax")


@pytest.fixture
def general_calls(monkeypatch):
    """How many calls took the general path (which binds the arguments to the signature)."""
    calls = []
    real = inspect.Signature.bind

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(inspect.Signature, "bind", counted)
    return calls


def _pointers(tree) -> list[int]:
    # scalars left out: XLA:CPU gives adam's step count a buffer of its own under any donation
    arrays = jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    return sorted(x.unsafe_buffer_pointer() for x in arrays if x.ndim)


def _same(a, b) -> None:
    la = jax.tree_util.tree_leaves(eqx.filter(a, eqx.is_array))
    lb = jax.tree_util.tree_leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True)


def _alive(tree) -> bool:
    return not any(
        x.is_deleted() for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    )


TX = optax.adam(1e-2)
X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32))
Y = jnp.asarray(np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32))


def _init():
    model = eqx.nn.MLP(4, 4, 16, 2, key=jax.random.key(0))
    return model, TX.init(eqx.filter(model, eqx.is_array))


def _step(model, opt_state, x, y):
    def loss(m):
        return jnp.mean((jax.vmap(m)(x) - y) ** 2)

    value, g = eqx.filter_value_and_grad(loss)(model)
    updates, opt_state = TX.update(g, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def _plain_steps(n: int, **kw):
    plain = eqx.filter_jit(_step)
    model, opt_state = _init()
    for _ in range(n):
        model, opt_state, loss = plain(model, opt_state, X, Y, **kw)
    return model, opt_state, loss


def test_the_cached_plan_donates_every_step_bit_identical_to_plain(general_calls):
    with autoopt.patch():
        step = eqx.filter_jit(_step)
    model, opt_state = _init()
    reused, general = [], []
    for _ in range(6):
        before, n = _pointers((model, opt_state)), len(general_calls)
        model, opt_state, loss = step(model, opt_state, X, Y)
        reused.append(_pointers((model, opt_state)) == before)
        general.append(len(general_calls) > n)
    assert reused[2:] == [True] * 4  # every step in the input's buffers
    assert general[2:] == [False] * 4  # the plan's
    _same(_plain_steps(6), (model, opt_state, loss))


def test_with_keyword_arguments_the_plan_donates_too(general_calls):
    with autoopt.patch():
        step = eqx.filter_jit(_step)
    model, opt_state = _init()
    reused, general = [], []
    for _ in range(5):
        before, n = _pointers((model, opt_state)), len(general_calls)
        model, opt_state, loss = step(model, opt_state, x=X, y=Y)
        reused.append(_pointers((model, opt_state)) == before)
        general.append(len(general_calls) > n)
    assert reused[2:] == [True] * 3
    assert general[2:] == [False] * 3
    _same(_plain_steps(5), (model, opt_state, loss))


def test_a_held_copy_of_the_old_model_is_never_donated_by_the_plan(general_calls):
    with autoopt.patch():
        step = eqx.filter_jit(_step)
    model, opt_state = _init()
    old = None
    for i in range(6):
        if i >= 3:
            old = model
            want = np.array(old.layers[0].weight, copy=True)
        model, opt_state, _ = step(model, opt_state, X, Y)
        if old is not None:
            assert _alive(old)
            np.testing.assert_array_equal(np.asarray(old.layers[0].weight), want)
    assert general_calls  # each refused plan went to the general path


@pytest.mark.parametrize(
    "hold",
    [
        lambda m, s: {"w": m.layers[1].bias},  # an array of the model
        lambda m, s: m.layers,  # the tuple of layers (a node)
        lambda m, s: [m.layers[0]],  # one layer (a Module)
        lambda m, s: s[0].mu,  # a part of the optimizer state
    ],
    ids=["array", "tuple-node", "module", "optimizer-part"],
)
def test_a_part_shared_with_another_holder_is_never_donated_by_the_plan(hold):
    with autoopt.patch():
        step = eqx.filter_jit(_step)
    model, opt_state = _init()
    kept = None
    for i in range(5):
        if i == 3:
            kept = hold(model, opt_state)
        model, opt_state, _ = step(model, opt_state, X, Y)
        if kept is not None:
            assert _alive(kept)


def test_an_array_passed_twice_is_never_donated_by_the_plan():
    def step(model, w):
        return jax.tree_util.tree_map(lambda a: a + 1, model), w * 2

    with autoopt.patch():
        f = eqx.filter_jit(step)
    model = eqx.nn.Linear(4, 4, key=jax.random.key(0))
    w = jnp.ones(3)
    for i in range(5):
        if i == 3:
            w = model.weight  # also inside the donated model
        model, w2 = f(model, w)
        if i == 3:
            assert not w.is_deleted()
            np.testing.assert_array_equal(np.asarray(w2), np.asarray(w) * 2)


def test_another_statement_that_does_not_rebind_never_takes_the_donating_plan():
    with autoopt.patch():
        step = eqx.filter_jit(_step)
    model, opt_state = _init()
    for _ in range(4):
        model, opt_state, _ = step(model, opt_state, X, Y)
    for _ in range(3):
        new_model, new_state, _ = step(model, opt_state, X, Y)
        assert _alive((model, opt_state))
    del new_model, new_state


class Scaled(eqx.Module):
    w: jax.Array
    scale: float = eqx.field(static=True)


def _scaled_step(m, x, k):
    return Scaled(m.w * m.scale + x * k, m.scale), (m.scale, k)


@pytest.mark.parametrize("vary", ["static-field", "python-scalar"])
def test_a_changed_static_leaf_retraces_and_replans_as_equinox_does(vary):
    scales = [1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 1.0, 1.0]
    traces: list = []

    def counted(m, x, k):
        traces.append(1)
        return _scaled_step(m, x, k)

    def run(f):
        m = Scaled(jnp.ones(8), 1.0)
        outs = []
        for s in scales:
            if vary == "static-field":
                m = Scaled(m.w, s)
                m, extra = f(m, jnp.ones(8), 1)
            else:
                m, extra = f(m, jnp.ones(8), s)
            outs.append((np.asarray(m.w), extra))
        return outs

    want = run(eqx.filter_jit(counted))
    plain_traces = len(traces)
    traces.clear()
    with autoopt.patch():
        got = run(eqx.filter_jit(counted))
    assert len(traces) == plain_traces == 3  # one trace per value, as equinox
    for (w1, e1), (w2, e2) in zip(want, got):
        np.testing.assert_array_equal(w1, w2, strict=True)
        assert e1 == e2 and [type(v) for v in e1] == [type(v) for v in e2]


def test_python_scalars_of_equal_value_and_other_type_keep_their_types():
    def f(x, k):
        return x + 1, k

    with autoopt.patch():
        g = eqx.filter_jit(f)
    x = jnp.ones(2)
    outs = []
    for k in (1, 1, 1, 1.0, True, 1):
        x, got = g(x, k)
        outs.append(got)
    plain = eqx.filter_jit(f)
    y = jnp.ones(2)
    want = []
    for k in (1, 1, 1, 1.0, True, 1):
        y, got = plain(y, k)
        want.append(got)
    assert [(type(v), v) for v in outs] == [(type(v), v) for v in want]
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_eqx_error_if_raises_from_a_planned_call_as_equinox_raises_it(general_calls):
    def step(m, x):
        w = eqx.error_if(m.w + x, (m.w + x) > 100.0, "grew too large")
        return Scaled(w, m.scale)

    with autoopt.patch():
        f = eqx.filter_jit(step)
    m = Scaled(jnp.zeros(4), 1.0)
    n = 0
    with pytest.raises(eqx.EquinoxRuntimeError, match="grew too large"):
        for x in [jnp.ones(4)] * 3 + [jnp.full(4, 1000.0, jnp.float32)]:
            n = len(general_calls)
            m = f(m, x)  # one statement: its fourth call takes the plan
    assert len(general_calls) == n  # raised by the plan's own call


def test_a_deleted_array_fails_as_it_does_under_equinox():
    def step(m, x):
        return Scaled(m.w + x, m.scale)

    plain = eqx.filter_jit(step)
    dead = Scaled(jnp.zeros(4), 1.0)
    dead.w.delete()
    with pytest.raises(Exception) as want:
        plain(dead, jnp.ones(4))
    with autoopt.patch():
        f = eqx.filter_jit(step)
    for i in range(4):
        m = Scaled(jnp.zeros(4), 1.0)
        fails = contextlib.nullcontext()
        if i == 3:
            m.w.delete()
            fails = pytest.raises(type(want.value))
        with fails:
            m = f(m, jnp.ones(4))  # one statement: its last call has a plan


def test_a_batch_that_is_deleted_fails_as_it_does_under_equinox():
    def step(m, x):
        return Scaled(m.w + x, m.scale)

    with autoopt.patch():
        f = eqx.filter_jit(step)
    m = Scaled(jnp.zeros(4), 1.0)
    for i in range(4):
        x = jnp.ones(4)
        fails = contextlib.nullcontext()
        if i == 3:
            x.delete()
            fails = pytest.raises(Exception, match="deleted")
        with fails:
            m = f(m, x)  # one statement: its last call has a plan
    assert not m.w.is_deleted()  # the failed call donated nothing


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]


class _CountedEq:
    compared = 0

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other) -> bool:
        _CountedEq.compared += 1
        return isinstance(other, _CountedEq)


def test_static_leaves_that_are_unhashable_or_compare_slowly_keep_equinoxs_behaviour():
    def step(m, x, tag):
        return Scaled(m.w + x, m.scale)

    plain = eqx.filter_jit(step)
    with pytest.raises(Exception) as want:
        plain(Scaled(jnp.zeros(2), 1.0), jnp.ones(2), _Unhashable())
    with autoopt.patch():
        f = eqx.filter_jit(step)
    m = Scaled(jnp.zeros(2), 1.0)
    for _ in range(2):
        with pytest.raises(type(want.value)):
            m = f(m, jnp.ones(2), _Unhashable())
    for _ in range(4):
        m = f(m, jnp.ones(2), _CountedEq())
    np.testing.assert_array_equal(np.asarray(m.w), np.full(2, 4.0, np.float32))


def test_under_debug_nans_the_plan_donates_nothing():
    with autoopt.patch():
        step = eqx.filter_jit(_step)
    model, opt_state = _init()
    before: set[int] = set()
    for i in range(5):
        before = set(_pointers((model, opt_state)))
        with jax.debug_nans(i == 4):
            model, opt_state, _ = step(model, opt_state, X, Y)  # one statement, one plan
    assert not before & set(_pointers((model, opt_state)))


class WithSize(eqx.Module):
    size: int  # a Python scalar in a non-static field: static under equinox's split
    w: jax.Array
    act: object = jax.nn.relu


def test_a_module_holding_python_scalars_and_functions_is_donated_whole():
    def step(m, x):
        return WithSize(m.size, m.act(m.w + x)), m.size

    with autoopt.patch():
        f = eqx.filter_jit(step)
    m = WithSize(3, jnp.zeros(64))
    old = None
    for i in range(5):
        before = _pointers(m)
        if i == 4:
            old = m
        m, size = f(m, jnp.ones(64))
        assert size == 3 and type(size) is int
        if i in (2, 3):
            assert _pointers(m) == before  # donated by the plan
    assert old is not None and _alive(old)  # and never while another name holds it
