"""Typed PRNG keys (``jax.random.key``) as arguments: a signature with a key finds its cached
plan like any other (review: every such call took the general path, 4-5x jax.jit's time a step
in a sampler's loop), the key is never donated, and the numbers are jax.jit's."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import autoopt


def _walk(key, x):
    key, sub = jax.random.split(key)
    return key, x + 0.1 * jax.random.normal(sub, x.shape)


def _state_step(s):
    rng, sub = jax.random.split(s["rng"])
    return {"rng": rng, "x": s["x"] + jax.random.normal(sub, s["x"].shape)}


def _dispatch_frames(run):
    """The names of ``_dispatch``'s functions that ``run()`` entered (the general path)."""
    frames: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith("_dispatch.py"):
            frames.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return frames


def test_a_walk_with_a_typed_key_takes_its_cached_plan_and_donates_the_state():
    walk = autoopt.optimize(_walk, fallback="raise")
    ref = jax.jit(_walk)

    def loop(step, n, key, x):
        reused = []
        for _ in range(n):
            before = x.unsafe_buffer_pointer()
            key, x = step(key, x)
            reused.append(x.unsafe_buffer_pointer() == before)
        return key, x, reused

    key, x, _ = loop(walk, 2, jax.random.key(0), jnp.zeros(16))
    # (``x + 0``: a state the caller does not hold, so the first call donates as well)
    assert _dispatch_frames(lambda: loop(walk, 5, key, x + 0)) == []
    got = loop(walk, 8, jax.random.key(3), jnp.zeros(16))
    want = loop(ref, 8, jax.random.key(3), jnp.zeros(16))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(jax.random.key_data(got[0]), jax.random.key_data(want[0]))
    assert all(got[2][1:])  # the state's buffer reused after the first call


def test_a_held_typed_key_and_state_are_never_deleted():
    walk = autoopt.optimize(_walk, fallback="raise")
    key, x = jax.random.key(1), jnp.zeros(16)
    kept_key, kept_x = key, x
    for _ in range(4):
        key, x = walk(key, x)
    assert not kept_key.is_deleted() and not kept_x.is_deleted()
    np.testing.assert_array_equal(np.asarray(kept_x), np.zeros(16))


def test_a_key_inside_a_dict_state_finds_its_plan():
    """(A state holding a key is not donated: ``Program.decide`` donates arguments whose leaves
    are all plain arrays.)"""
    step = autoopt.optimize(_state_step, fallback="raise")

    def loop(n, s):
        for _ in range(n):
            s = step(s)
        return s

    s = loop(2, {"rng": jax.random.key(0), "x": jnp.zeros(8)})
    assert _dispatch_frames(lambda: loop(4, s)) == []
    got = loop(5, {"rng": jax.random.key(2), "x": jnp.zeros(8)})
    want = {"rng": jax.random.key(2), "x": jnp.zeros(8)}
    ref = jax.jit(_state_step)
    for _ in range(5):
        want = ref(want)
    np.testing.assert_array_equal(np.asarray(got["x"]), np.asarray(want["x"]))


def test_keys_of_two_shapes_are_two_signatures():
    """The key's aval is in the signature: a batch of keys is not the single key's plan."""
    draw = autoopt.optimize(lambda k: jax.random.normal(k, (4,)) if k.ndim == 0 else k.shape[0])
    one = draw(jax.random.key(0))
    many = draw(jax.random.split(jax.random.key(0), 3))
    again = draw(jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(one), np.asarray(again))
    assert int(many) == 3
