"""A new user's programs under ``jax.jit`` (or the framework's own jit) and ``autoopt.optimize``.

Each program is the kind users write: an optax loop, an equinox model, a flax nnx model with its
optimizer, a ``lax.scan`` simulation, a sampler on typed PRNG keys, rows written into a buffer.
The oracle is the same program under plain ``jax.jit`` (``eqx.filter_jit``, ``nnx.jit``): the
same bits, no array the caller still holds deleted, no warning the oracle does not give.

Tests named ``test_bug_...`` fail today (reported; not xfailed): they time a loop of small steps
interleaved with the oracle, with a wide margin over what a fixed call path would need.
"""

import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoopt


def _bits(tree) -> list:
    out = []
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.asarray(leaf)
        out.append((a.dtype.str, a.shape, a.tobytes()))
    return out


def _run(program, wrap):
    """``program(wrap)`` -> (outputs, held): outputs, the arrays the caller still holds deleted,
    and the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs, held = program(wrap)
        jax.block_until_ready(jax.tree.leaves(outs))
    deleted = [
        i
        for i, x in enumerate(jax.tree.leaves(held))
        if isinstance(x, jax.Array) and x.is_deleted()
    ]
    return outs, deleted, [f"{w.category.__name__}: {w.message}" for w in caught]


def _assert_like_the_oracle(program, oracle, optimized=autoopt.optimize):
    want, want_deleted, want_warnings = _run(program, oracle)
    got, got_deleted, got_warnings = _run(program, optimized)
    assert _bits(got) == _bits(want)
    assert got_deleted == want_deleted == []
    assert got_warnings == want_warnings


# --- the programs ---------------------------------------------------------------------------------


def _optax_adamw(wrap, steps=20):
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(k1, (32, 64)) * 0.1,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(k2, (64, 1)) * 0.1,
        "b2": jnp.zeros(1),
    }
    tx = optax.adamw(1e-3, weight_decay=1e-4)
    opt_state = tx.init(params)
    x_all = np.random.RandomState(0).randn(256, 32).astype(np.float32)
    y_all = (x_all.sum(1, keepdims=True) > 0).astype(np.float32)

    def loss_fn(p, x, y):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    def train_step(params, opt_state, step, x, y):
        loss, g = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss + 0.0 * step

    train_step = wrap(train_step)
    initial = params
    losses = []
    for step in range(steps):  # a Python int step counter, NumPy batches
        i = (step * 32) % 256
        params, opt_state, loss = train_step(
            params, opt_state, step, x_all[i : i + 32], y_all[i : i + 32]
        )
        losses.append(loss)
    return [params, opt_state, losses], [initial, losses]


def _equinox_mlp(wrap, steps=20):
    model = eqx.nn.MLP(8, 1, 32, 2, key=jax.random.key(1))
    tx = optax.adam(1e-2)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(2), (64, 8))
    y = jnp.sin(x.sum(1, keepdims=True))

    @eqx.filter_value_and_grad
    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    def make_step(model, opt_state, x, y):
        value, grads = loss(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    make_step = wrap(make_step)
    initial = model
    losses = []
    for _ in range(steps):
        model, opt_state, value = make_step(model, opt_state, x, y)
        losses.append(value)
    arrays = eqx.filter(model, eqx.is_array)
    return [arrays, opt_state, losses], [eqx.filter(initial, eqx.is_array), losses]


class _NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def _nnx_with_optimizer(wrap, epochs=3):
    model = _NnxModel(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(3), (64, 8))
    y = jnp.cos(x.sum(1, keepdims=True))

    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def eval_step(model, x):
        return model(x)

    train_step, eval_step = wrap(nnx.jit(train_step)), wrap(nnx.jit(eval_step))
    kept = model.l1.kernel[...]  # a caller's copy of a weight: never donated
    out = []
    for _ in range(epochs):
        model.train()
        for _ in range(4):
            loss = train_step(model, optimizer, x, y)
            out.append(loss)
        model.eval()
        out.append(eval_step(model, x))
    return [out, nnx.state((model, optimizer))], [kept, out, x, y]


def _scan_simulation(wrap, steps=20):
    def simulate(state, params):
        def body(s, _):
            pos, vel = s
            acc = -params["k"] * pos - params["c"] * vel
            vel = vel + 0.01 * acc
            return (pos + 0.01 * vel, vel), pos.sum()

        return jax.lax.scan(body, state, None, length=50)

    simulate = wrap(simulate)
    params = {"k": jnp.float32(2.0), "c": jnp.float32(0.1)}
    state = (jnp.linspace(-1, 1, 1000), jnp.zeros(1000))
    initial = state
    traces = []
    for _ in range(steps):
        state, trace = simulate(state, params)
        traces.append(trace)
    return [state, traces], [initial, params, traces]


def _typed_key_sampler(wrap, steps=20):
    def sample(key, mu):
        k1, k2 = jax.random.split(key)
        return mu + jax.random.normal(k1, mu.shape) * (jax.random.uniform(k2, mu.shape) > 0.5)

    def walk(key, x):
        key, sub = jax.random.split(key)
        return key, x + 0.1 * jax.random.normal(sub, x.shape)

    sample, walk = wrap(sample), wrap(walk)
    key = first_key = jax.random.key(42)
    mu = jnp.arange(16, dtype=jnp.float32)
    x = jnp.zeros(16)
    out = []
    for _ in range(steps):
        key, sub = jax.random.split(key)
        out.append(sample(sub, mu))
        key, x = walk(key, x)
    return [key, x, out], [first_key, mu, out]


def _row_writes(wrap, steps=20):
    def write(buf, i, row):
        return buf.at[i].set(row * 2.0)

    write = wrap(write)
    buf = jnp.zeros((64, 128))
    history = []
    rows = [jnp.full(128, float(i)) for i in range(steps)]
    # in range, negative, past the end (dropped), NumPy and jax integers
    indices = [0, 5, -1, -64, 64, -65, np.int32(7), jnp.int32(-3)] * (steps // 8 + 1)
    for i, row in zip(indices, rows):
        if len(history) < 4:
            history.append(buf)  # the caller keeps the first buffers: never donated
        buf = write(buf, i, row)
    return [buf, history], [history, rows]


PROGRAMS = {
    "optax adamw, Python int step, NumPy batches": (_optax_adamw, jax.jit),
    "equinox MLP, optimize in place of filter_jit": (_equinox_mlp, eqx.filter_jit),
    "nnx model + Optimizer, dropout, batchnorm, train/eval": (_nnx_with_optimizer, None),
    "lax.scan simulation": (_scan_simulation, jax.jit),
    "typed PRNG key sampler": (_typed_key_sampler, jax.jit),
    "rows written with .at[i].set": (_row_writes, jax.jit),
}


@pytest.mark.parametrize("program,oracle", PROGRAMS.values(), ids=PROGRAMS.keys())
def test_new_users_program_gives_the_oracles_bits_and_deletes_nothing_held(program, oracle):
    _assert_like_the_oracle(program, oracle if oracle is not None else (lambda f: f))


def test_equinox_mlp_through_optimize_of_filter_jit_gives_filter_jits_bits():
    _assert_like_the_oracle(
        _equinox_mlp, eqx.filter_jit, lambda f: autoopt.optimize(eqx.filter_jit(f))
    )


def test_equinox_dropout_flag_is_traced_by_optimize_as_by_jax_jit():
    """``eqx.nn.Dropout.inference`` is a Python bool leaf: static under ``filter_jit``, traced
    under ``jax.jit``, and so under ``optimize`` (a jax.jit drop-in) it raises as jax.jit does.
    ``autoopt.optimize(eqx.filter_jit(f))`` keeps equinox's semantics."""
    drop = eqx.nn.Dropout(0.3)

    def f(d, x, key):
        return d(x, key=key)

    args = (drop, jnp.ones(8), jax.random.key(0))
    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(f)(*args)
    with pytest.raises(jax.errors.TracerBoolConversionError):
        autoopt.optimize(f)(*args)
    got = autoopt.optimize(eqx.filter_jit(f))(*args)  # pyright: ignore[reportCallIssue]
    assert _bits(got) == _bits(eqx.filter_jit(f)(*args))


def test_the_public_api_imports_without_the_test_extra():
    """A plain `pip install autoopt` has no hypothesis: `from autoopt import *` and
    `autoopt.testing.simulated_device_memory` (which the README tells users to call in their
    tests) must work; only the strategies need it, and say what to install."""
    code = textwrap.dedent("""\
        import sys
        sys.modules["hypothesis"] = None  # as if not installed
        from autoopt import *
        import autoopt
        assert {"prefetch", "constant", "testing"} <= set(dir(autoopt))
        with autoopt.testing.simulated_device_memory(1 << 30):
            pass
        try:
            autoopt.testing.caller_programs()
        except ImportError as e:
            assert "pip install 'autoopt[test]'" in str(e), e
        else:
            raise AssertionError("no ImportError without hypothesis")
        print("ok")
        """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
