"""The call path (``autoopt._jit._dispatch``): one route for functions, methods, ``trace``,
``lower``, ``explain`` and ``inspect``; non-array leaves found before jax.jit is called."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt import _compare
from autoopt.testing import assert_trees_equivalent

POLICIES = ("safe", "auto", "off")


@pytest.mark.parametrize("disable_jit", [False, True])
@pytest.mark.parametrize("donate", POLICIES)
def test_a_users_type_error_with_a_non_array_leaf_runs_the_body_once(donate, disable_jit):
    # Under disable_jit, jax.jit runs the body without checking the leaves first: a route that
    # retried on TypeError as "static leaves" ran the body a second time.
    runs = []

    def f(x, config):
        runs.append(config["name"])
        raise TypeError("the user's own TypeError")

    fast = autoopt.optimize(f, donate=donate, fallback="raise")
    x = jnp.ones(3) + 0
    config = {"act": jnp.tanh, "name": "mlp"}  # a function and a string: static leaves
    with jax.disable_jit(disable_jit), pytest.raises(TypeError, match="the user's own TypeError"):
        x = fast(x, config)  # a rebinding statement: the donating route under "safe"
    assert runs == ["mlp"]
    assert not x.is_deleted()


@pytest.mark.parametrize("donate", POLICIES)
def test_a_users_type_error_with_array_leaves_only_runs_the_body_once(donate):
    runs = []

    def f(x):
        runs.append(1)
        raise TypeError("the user's own TypeError")

    fast = autoopt.optimize(f, donate=donate, fallback="raise")
    x = jnp.ones(3) + 0
    with pytest.raises(TypeError, match="the user's own TypeError"):
        x = fast(x)
    assert runs == [1]


@pytest.mark.parametrize("donate", POLICIES)
def test_static_leaves_are_found_before_jit_and_the_output_keeps_its_own(donate):
    runs = []

    def f(x, config):
        runs.append(1)
        return {"y": config["act"](x), "name": config["name"]}

    fast = autoopt.optimize(f, donate=donate, fallback="raise")
    config = {"act": jnp.tanh, "name": "mlp"}
    for _ in range(3):
        out = fast(jnp.arange(3.0), config)  # fresh: "auto" may donate it
        assert out["name"] == "mlp"
        np.testing.assert_allclose(out["y"], np.tanh(np.arange(3.0)), rtol=1e-6)
    out = fast(2.0, config)  # a Python scalar leaf: the output's static leaves come back too
    assert out["name"] == "mlp"
    assert len(runs) == 2  # one trace per signature


def _decorated(donate):
    class Model:  # a plain object: its instance is passed as a static argument
        scale = 2.0

        @autoopt.optimize(static_argnums=0, verify=True, donate=donate, fallback="raise")
        def step(self, x):
            return x * self.scale

    return Model()


@pytest.mark.parametrize("donate", POLICIES)
def test_verify_runs_for_a_decorated_method_under_every_policy(donate, monkeypatch):
    checked = []
    original = _compare.assert_trees_equivalent

    def counting(expected, got, **kw):
        checked.append(kw.get("what"))
        return original(expected, got, **kw)

    monkeypatch.setattr(_compare, "assert_trees_equivalent", counting)
    model = _decorated(donate)
    x = jnp.arange(3.0) + 0
    for _ in range(3):
        x = model.step(x)  # rebinding: donated under "safe" and "auto"
    np.testing.assert_allclose(x, 8 * np.arange(3.0))
    assert checked == ["optimize(verify=True) of step"]  # the signature's first call only
    assert model.step.inspect(x).program.verified


def test_verify_runs_for_a_method_whose_instance_is_a_non_array_leaf(monkeypatch):
    checked = []
    original = _compare.assert_trees_equivalent
    monkeypatch.setattr(
        _compare,
        "assert_trees_equivalent",
        lambda e, g, **kw: (checked.append(1), original(e, g, **kw))[1],
    )

    @dataclasses.dataclass(frozen=True)  # a value that cannot change: a static leaf
    class Plain:
        scale: float = 3.0

        @autoopt.optimize(verify=True, donate="off", fallback="raise")
        def step(self, x):
            return x * self.scale

    p = Plain()
    np.testing.assert_allclose(p.step(jnp.ones(2)), 3.0)
    np.testing.assert_allclose(p.step(jnp.ones(2)), 3.0)
    assert checked == [1]


def test_trace_lower_explain_and_inspect_take_static_leaves_as_a_call_does():
    def f(x, config):
        return config["act"](x) * 2

    fast = autoopt.optimize(f, donate="auto", fallback="raise")
    config = {"act": jnp.tanh}
    x = jnp.arange(3.0)
    want = jax.jit(lambda x: jnp.tanh(x) * 2)(x)
    assert_trees_equivalent(want, fast(x, config))
    assert "tanh" in fast.lower(x, config).as_text()
    assert fast.trace(x, config).jaxpr is not None
    assert fast.explain(x, config).after is not None
    inspection = fast.inspect(x, config)
    assert len(inspection.programs) == 1
    assert inspection.donated == ((0,), ())


def test_inspect_says_what_each_policy_donates_and_which_jit_runs():
    def f(x, y):
        return x + 1, y.sum()

    x, y = jnp.ones(4), jnp.ones(3)
    auto = autoopt.optimize(f, donate="auto")
    auto(jnp.ones(4), jnp.ones(3))
    got = auto.inspect(x, y)
    assert got.donated == ((0,), ())  # y: no output of its shape
    assert got.donated in got.donation_variants  # the jit object the call used
    safe = autoopt.optimize(f)
    got = safe.inspect(x, y)
    assert got.donated == ((0,), ())  # what `x, y = f(x, y)` would donate
    assert got.donation_variants == {((), ())}  # no call made a donating jit object
    off = autoopt.optimize(f, donate="off").inspect(x, y)
    assert off.donated == ((), ()) and off.donation_variants == {((), ())}
    explicit = autoopt.optimize(f, donate_argnums=1).inspect(x, y)
    assert explicit.donated == ((1,), ())
    assert off.traced is not None and off.optimized is not None
    assert off.fallback is None and off.placement is not None


def test_a_bound_method_inspects_with_its_instance():
    class Model:
        @autoopt.optimize(static_argnums=0, donate="auto")
        def step(self, x):
            return x * 2

    m = Model()
    x = m.step(jnp.ones(3))
    inspection = m.step.inspect(x)
    assert inspection.donated == ((1,), ())  # the position past the instance


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Scale:
    """An instance that is itself a pytree of arrays, with an output it could alias."""

    w: jax.Array

    @autoopt.optimize
    def apply(self, x):
        return x * self.w, self.w + 1


def test_inspect_of_a_method_under_safe_never_counts_the_instance_as_donated():
    s = _Scale(jnp.ones(3))
    x = jnp.ones(3) + 0
    inspection = s.apply.inspect(x)
    assert inspection.donated == ((1,), ())  # x; never the instance (position 0)


# --- leaves jax.jit traces that are not arrays ----------------------------------------------------


def test_a_jax_ref_argument_is_traced_and_mutated_as_under_jax_jit():
    """A ``jax.Ref`` is a leaf jax.jit traces. Taken for a static leaf, it was baked into the
    program as a constant and the in-place pass looped reading it (no return, memory growing):
    run in a subprocess with a time limit, so a regression fails instead of hanging."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, autoopt

        def inc(r):
            r[...] += 1

        traces = []
        def counted(r):
            traces.append(1)
            inc(r)

        f = autoopt.optimize(counted, fallback="raise")
        refs = [jax.new_ref(jnp.zeros(3)) for _ in range(3)]
        for r in refs:
            f(r)
            f(r)
        expected = jax.new_ref(jnp.zeros(3))
        jax.jit(inc)(expected)
        jax.jit(inc)(expected)
        assert all((r[...] == expected[...]).all() for r in refs), [r[...] for r in refs]
        assert len(traces) == 1, len(traces)  # one signature: traced once, as by jax.jit
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_fresh_token_each_call_is_one_signature():
    traces = []

    def body(t, x):
        traces.append(1)
        return t, x + 1

    f = autoopt.optimize(body, fallback="raise")
    x = jnp.ones(2)
    for _ in range(4):
        t, x = f(jax.lax.create_token(), x)
    assert len(traces) == 1  # jax.jit traces once; a token taken as static compiled each call
    assert (x == 5).all()


def test_a_second_eager_grad_finds_the_first_ones_backward():
    # equinox's test_ad::test_grad_jit_new: under jax.jit a custom_vjp's backward is traced
    # once for two jax.grad calls (JAX caches the transposed program of the jit's trace); the
    # second call must go to the same jit object as the first.
    traces = 0

    @jax.custom_vjp
    def f(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        nonlocal traces
        traces += 1
        return (g + 2,)

    f.defvjp(fwd, bwd)
    x = jnp.array(1.0)
    with autoopt.patch(fallback="raise"):  # how the equinox suite runs it (autoopt run)
        fast = jax.jit(f)
        assert jax.grad(fast)(x) == 3
        assert jax.grad(fast)(x) == 3
    assert traces == 1
