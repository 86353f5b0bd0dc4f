"""A state holding a typed PRNG key (``jax.random.key``, an nnx ``Rngs``) is donated as jax.jit
donates it, under "safe" and "auto": the key's buffer is its data array's (what
``jax.random.key_data`` returns, what ``jax.random.wrap_key_data`` wraps), so every run-time
check reads that data array as it reads an array: held by nothing but the key, passed nowhere
else, no constant of the program. The numbers and the key's data are jax.jit's, and nothing the
caller holds is ever deleted. The same with the C call path on and off (``AUTOOPT_NATIVE``)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import autoopt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class State(NamedTuple):
    rng: jax.Array
    w: jax.Array
    m: jax.Array


def _named_step(s: State, x):
    rng, sub = jax.random.split(s.rng)
    w = s.w + 0.1 * jax.random.normal(sub, s.w.shape) * x
    return State(rng, w, s.m * 0.9 + w)


def _dict_step(s: dict, x):
    rng, sub = jax.random.split(s["rng"])
    return {"rng": rng, "w": s["w"] + jax.random.uniform(sub, s["w"].shape) * x}


def _fresh(kind: str, seed: int = 0):
    rng = jax.random.key(seed)
    if kind == "named":
        return State(rng, jnp.zeros(64), jnp.ones(64))
    return {"rng": rng, "w": jnp.zeros(64)}


STEPS = {"named": _named_step, "dict": _dict_step}


def _float_pointers(s) -> list[int]:
    return [
        leaf.unsafe_buffer_pointer()
        for leaf in jax.tree_util.tree_leaves(s)
        if not jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    ]


def _bits(s) -> list[bytes]:
    """Every leaf's bytes, a key's as its data."""
    return [
        np.asarray(
            jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
        ).tobytes()
        for leaf in jax.tree_util.tree_leaves(s)
    ]


def _reference(kind: str, n: int, seed: int = 0):
    step, s = jax.jit(STEPS[kind]), _fresh(kind, seed)
    for _ in range(n):
        s = step(s, 2.0)
    return _bits(s)


@pytest.mark.parametrize("donate", ["safe", "auto"])
@pytest.mark.parametrize("kind", ["named", "dict"])
def test_a_state_with_a_key_is_donated_and_matches_jax_jit(kind, donate):
    f = autoopt.optimize(STEPS[kind], donate=donate, fallback="raise")
    s = _fresh(kind)
    s = f(s, 2.0)  # (the first call: the caller's fresh state)
    reused = []
    for _ in range(5):  # the general path, then the signature's cached plan
        before = _float_pointers(s)
        s = f(s, 2.0)
        reused.append(before == _float_pointers(s))
    assert all(reused)
    assert _bits(s) == _reference(kind, 6)
    assert f.inspect(s, 2.0).donated == ((0,), ())


def test_a_bare_key_rebound_is_donated_and_matches_jax_jit():
    def split(k):
        return jax.random.split(k)[0]

    f = autoopt.optimize(split, fallback="raise")
    k, want = jax.random.key(5), jax.random.key(5)
    for _ in range(6):
        old = jax.random.key_data(k).unsafe_buffer_pointer()
        k = f(k)
        want = jax.jit(split)(want)
    assert jax.random.key_data(k).unsafe_buffer_pointer() == old
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(want))


HOLDERS = ["key", "key_data", "alias", "list"]


@pytest.mark.parametrize("holder", HOLDERS)
@pytest.mark.parametrize("kind", ["named", "dict"])
def test_nothing_the_caller_holds_is_deleted(kind, holder):
    """The old key, ``key_data`` of it, another name of the state, the old state in a list:
    whichever the caller keeps is never deleted, at any call (the first, the cached plan's)."""
    f = autoopt.optimize(STEPS[kind], fallback="raise")
    s = _fresh(kind, 3)
    kept: list = []
    for _ in range(5):
        rng = s.rng if kind == "named" else s["rng"]
        held = {
            "key": rng,
            "key_data": jax.random.key_data(rng),
            "alias": s,
            "list": s,
        }[holder]
        kept.append(held)
        del rng, held
        s = f(s, 2.0)
    for held in kept:
        assert not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(held))
    assert _bits(s) == _reference(kind, 5, 3)
    if holder in ("alias", "list"):  # each kept state is the one jax.jit computes
        assert [_bits(held) for held in kept] == [_reference(kind, n, 3) for n in range(5)]


def test_a_held_key_keeps_its_values_over_many_calls():
    """Every call of an executable that donates a state whose key the caller holds passes a
    copy of the state: over enough calls that the copies are compiled too."""
    f = autoopt.optimize(_dict_step, fallback="raise")
    s, kept = _fresh("dict", 4), []
    for _ in range(24):
        kept.append(s["rng"])
        s = f(s, 2.0)
    assert not any(k.is_deleted() for k in kept)
    assert _bits(s) == _reference("dict", 24, 4)


def test_a_bare_key_whose_data_the_caller_holds_is_not_deleted():
    f = autoopt.optimize(lambda k: jax.random.split(k)[0], fallback="raise")
    k = jax.random.key(0)
    datas = []
    for _ in range(5):
        datas.append(jax.random.key_data(k))
        k = f(k)
    assert not any(d.is_deleted() for d in datas)
    want = jax.random.key(0)
    for d in datas:
        np.testing.assert_array_equal(d, jax.random.key_data(want))
        want = jax.random.split(want)[0]


@pytest.mark.parametrize("donate", ["safe", "auto"])
def test_a_key_and_its_data_passed_together_are_never_donated(donate):
    """``f(state, key_data(state["rng"]))``: donating the state would delete the data the call
    also reads (XLA refuses the call jax.jit runs)."""

    def step(s, d):
        return _dict_step(s, 2.0), d.sum()

    f = autoopt.optimize(step, donate=donate, fallback="raise")
    ref = jax.jit(step)
    s = _fresh("dict")
    for _ in range(4):
        d = jax.random.key_data(s["rng"])
        want = ref(s, d)
        s, total = f(s, d)
        assert not d.is_deleted()
        assert int(total) == int(want[1])
        assert _bits(s) == _bits(want[0])


@pytest.mark.parametrize("donate", ["safe", "auto"])
@pytest.mark.parametrize("constant", ["key", "key_data"])
def test_a_key_sharing_a_constants_buffer_is_never_donated(donate, constant):
    """A program that closes over a key (or over its data) holds its buffer as a constant: a
    state holding that key, or a key wrapping that data, is never donated."""
    k0 = jax.random.key(7)
    d0 = jax.random.key_data(k0)
    held = k0 if constant == "key" else d0

    def step(s):
        extra = jax.random.normal(held, ()) if constant == "key" else held.sum()
        return {"rng": jax.random.split(s["rng"])[0], "w": s["w"] + extra}

    f = autoopt.optimize(step, donate=donate, fallback="raise")
    ref = jax.jit(step)
    for _ in range(3):
        rng = k0 if constant == "key" else jax.random.wrap_key_data(d0)
        s = {"rng": rng, "w": jnp.zeros(4)}
        del rng
        want = ref({"rng": k0, "w": jnp.zeros(4)})
        s = f(s)
        assert not k0.is_deleted() and not d0.is_deleted()
        assert _bits(s) == _bits(want)


class _Dropped(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(32, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.lin(x))


def test_an_nnx_dropout_model_split_and_merged_reuses_its_buffers():
    graphdef, state = nnx.split(_Dropped(nnx.Rngs(0)))
    assert any(
        jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) for leaf in jax.tree_util.tree_leaves(state)
    )

    def step(state, x):
        model = nnx.merge(graphdef, state)
        y = model(x)
        _, new = nnx.split(model)
        return new, y.sum()

    f = autoopt.optimize(step, fallback="raise")
    ref_state, x = nnx.split(_Dropped(nnx.Rngs(0)))[1], jnp.ones((4, 32))
    reused = []
    for _ in range(5):
        before = _float_pointers(state)
        state, y = f(state, x)
        reused.append(before == _float_pointers(state))
        ref_state, want = jax.jit(step)(ref_state, x)
        assert np.asarray(y).tobytes() == np.asarray(want).tobytes()
    assert all(reused[1:]), [fd.message for fd in f.inspect(state, x).findings]
    assert _bits(state) == _bits(ref_state)
    assert f.inspect(state, x).donated == ((0,), ())


@pytest.mark.skipif("AUTOOPT_KEY_DONATION_CHILD" in os.environ, reason="(the child run)")
@pytest.mark.parametrize("native", ["0", "1"])
def test_these_tests_pass_with_the_c_path_on_and_off(native):
    env = {
        **os.environ,
        "AUTOOPT_NATIVE": native,
        "AUTOOPT_KEY_DONATION_CHILD": "1",
        "PYTHONPATH": ROOT,
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-x", "-q", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
