"""Every claim of a report matches a measurement taken here (issue 16), on six kinds of program
a user brings: a small GPT with optax, a KV-cache decoder, a DQN replay buffer, a flax CNN fed
from NumPy, an equinox MLP, a deep MLP under a memory budget.

Each program runs its loop (``state = step(state, ...)``) three times under
``autoopt.optimize``; then its report is checked against:

- donation: every applied donation row's argument really was donated at the loop's call (the
  output reuses an input buffer: the same device pointer), and the bytes the rows claim are
  the bytes the calls' executable aliases (``memory_analysis()``);
- memory: the report's "before" peak is plain ``jax.jit``'s compiled peak, its "after" peak is
  the calls' executable's;
- remat: an applied plan's "after" peak is what its program compiles to, and the candidates it
  says it compiled are the compiles the first call made beyond the program itself;
- compiles: the loop compiles no more executables than ``jax.jit`` does, plus the measuring
  compiles the remat row lists (the original and each candidate it says it tried).

Found by this test: an equinox module's step was donated at ``model = step(model, x)`` but its
report showed only "can be donated", no row for the call (the call sites were recorded on the
function, the report read the one made for the module's static leaves).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


def _gpt():
    import optax

    layers, d, t, vocab = 2, 64, 32, 128
    k = jax.random.split(jax.random.key(0), 4 * layers + 2)
    params = {
        "emb": jax.random.normal(k[0], (vocab, d)) * 0.02,
        "blocks": [
            {
                n: jax.random.normal(k[1 + 4 * i + j], (d, d)) / math.sqrt(d)
                for j, n in enumerate(("q", "k", "v", "mlp"))
            }
            for i in range(layers)
        ],
    }
    tokens = jax.random.randint(k[-1], (4, t), 0, vocab)
    tx = optax.adamw(1e-3)

    def loss(params, tokens):
        h = params["emb"][tokens]
        for p in params["blocks"]:
            att = jax.nn.softmax((h @ p["q"]) @ (h @ p["k"]).swapaxes(-1, -2) / math.sqrt(d))
            h = h + att @ (h @ p["v"])
            h = h + jax.nn.gelu(h @ p["mlp"])
        logits = h @ params["emb"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def loop(f, n):
        p, s = jax.tree_util.tree_map(jnp.copy, params), tx.init(params)
        for _ in range(n):
            p, s, _ = f(p, s, tokens)
        return p, s

    return step, loop, lambda: (params, tx.init(params), tokens)


def _decoder():
    d, cache_len = 64, 32

    def step(cache, x, t):
        cache = jax.lax.dynamic_update_slice_in_dim(cache, jnp.tanh(x)[None], t, 0)
        return cache, jnp.tanh(cache.T @ jax.nn.softmax(cache @ x))

    def loop(f, n):
        cache, x = jnp.zeros((cache_len, d)), jnp.ones(d)
        for t in range(n):
            cache, x = f(cache, x, t)
        return cache, x

    return step, loop, lambda: (jnp.zeros((cache_len, d)), jnp.ones(d), 0)


def _replay_buffer():
    size, obs = 4096, 16

    def step(buf, i, transition):
        return buf.at[i % size].set(transition)

    def loop(f, n):
        buf = jnp.zeros((size, obs))
        for i in range(n):
            buf = f(buf, i, jnp.full((obs,), float(i)))
        return buf

    return step, loop, lambda: (jnp.zeros((size, obs)), 3, jnp.ones(obs))


def _flax_cnn():
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(8, (3, 3))(x))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    model = CNN()
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((8, 8, 8, 1), dtype=np.float32)
    params = model.init(jax.random.key(0), x0)

    def step(params, x, y):
        def loss(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        value, g = jax.value_and_grad(loss)(params)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, g), value

    def batch(i):
        r = np.random.default_rng(i)
        return (
            r.standard_normal((8, 8, 8, 1), dtype=np.float32),
            r.standard_normal((8, 10), dtype=np.float32),
        )

    def loop(f, n):
        p = jax.tree_util.tree_map(jnp.copy, params)
        for i in range(n):
            x, y = batch(i)
            p, _ = f(p, x, y)
        return p

    return step, loop, lambda: (params, *batch(0))


def _equinox_mlp():
    import equinox as eqx

    model = eqx.nn.MLP(16, 16, 64, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 16))

    def step(model, x):
        def loss(m):
            return jnp.mean(jax.vmap(m)(x) ** 2)

        value, g = eqx.filter_value_and_grad(loss)(model)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, g)), value

    def loop(f, n):
        m = jax.tree_util.tree_map(lambda a: jnp.copy(a) if eqx.is_array(a) else a, model)
        for _ in range(n):
            m, _ = f(m, x)
        return m

    return step, loop, lambda: (model, x), eqx.filter_jit


def _deep_mlp():
    layers, n, d = 12, 1024, 128
    ws = [jax.random.normal(jax.random.key(i), (d, d)) / math.sqrt(d) for i in range(layers)]
    x = jax.random.normal(jax.random.key(99), (n, d))

    def step(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(jnp.sin(h @ w))
            return jnp.mean(h**2)

        value, g = jax.value_and_grad(loss)(ws)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], value

    def loop(f, n_steps):
        w = [jnp.copy(a) for a in ws]
        for _ in range(n_steps):
            w, _ = f(w, x)
        return w

    return step, loop, lambda: (ws, x)


PROGRAMS = {
    "GPT + optax": (_gpt, {}),
    "KV-cache decoder": (_decoder, {}),
    "DQN replay buffer": (_replay_buffer, {}),
    "flax CNN fed from NumPy": (_flax_cnn, {}),
    "equinox MLP": (_equinox_mlp, {}),
    "deep MLP under a budget": (_deep_mlp, {"memory_budget": "8MiB"}),
}


class _Compiles:
    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def _peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _pointers(tree) -> set[int]:
    return {
        a.unsafe_buffer_pointer()
        for a in jax.tree_util.tree_leaves(tree)
        if isinstance(a, jax.Array) and not a.is_deleted()
    }


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_claim_of_the_report_matches_a_measurement(name):
    build, options = PROGRAMS[name]
    step, loop, make_args, *jit = build()
    # (equinox's modules hold functions: its own filter_jit is how a user jits them plainly)
    plain, fast = (jit[0] if jit else jax.jit)(step), autoopt.optimize(step, **options)

    # compiles: the loop under autoopt against jax.jit's (remat's measuring compiles apart)
    jax.clear_caches()
    make_args()  # its own compiles are not the loop's
    with _Compiles() as plain_compiles:
        loop(plain, 3)
    with _Compiles() as fast_compiles:
        loop(fast, 3)
    args = make_args()
    report = fast.explain(*args)
    remat = [f for f in report.findings if f.kind == "remat" and "tried" in f.details]
    measuring = sum(1 + len(f.details["tried"]) for f in remat)  # the original + candidates
    assert fast_compiles.count <= plain_compiles.count + measuring, (
        fast_compiles.count,
        plain_compiles.count,
        measuring,
    )

    donated_rows = [f for f in report.findings if f.kind == "donate" and f.applied]
    if not jit:  # (a module with functions in it is jitted through a function of its own)
        # memory: before is jax.jit's compiled peak, after the calls' executable's
        calls = fast.inspect(*args).jit.lower(*args).compile()
        assert report.memory["before"]["peak_bytes"] == _peak(plain.lower(*args).compile())
        assert report.memory["after"]["peak_bytes"] == _peak(calls)
        # donation: the bytes the rows claim are the bytes the calls' executable aliases
        claimed = sum(f.bytes_saved or 0 for f in donated_rows)
        assert claimed == calls.memory_analysis().alias_size_in_bytes, (claimed, donated_rows)
    # ... and a rebinding call really donates: an output reuses an input buffer
    assert donated_rows, report.render(color=False)
    assert _donating_call(fast, make_args), "no input buffer was reused: not donated"

    # remat: an applied plan compiles to the peak its row claims
    for f in report.findings:
        if f.kind == "remat" and f.applied and "after" in f.details:
            compiled = fast.lower(*args).compile()  # the optimized program, nothing donated
            assert _peak(compiled) == f.details["after"]["peak_bytes"], f.message


def _donating_call(fast, make_args) -> set[int]:
    """The input buffers an output reuses at ``state = fast(state, ...)``, written out as a
    rebinding call with plain arguments (the form "safe" donates; a ``*rest`` call never is),
    on a fresh state nothing else holds."""
    state = jax.tree_util.tree_map(
        lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a, make_args()[0]
    )
    rest = make_args()[1:]
    before = _pointers(state)
    if len(rest) == 1:
        (a,) = rest
        del rest
        state = fast(state, a)
    elif len(rest) == 2:
        a, b = rest
        del rest
        state = fast(state, a, b)
    else:
        raise AssertionError(f"write the call with {len(rest)} more arguments")
    return before & _pointers(state)
