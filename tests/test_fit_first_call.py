"""The default (remat="fit") compiles what jax.jit compiles (issue 29): a signature's first call
under ``autoopt.optimize`` makes exactly as many XLA backend compiles and MLIR lowerings as the
same calls under ``jax.jit`` (one per signature), later calls none, and the results are
bit-identical. The memory check reads the executable the call then runs: it is never a second
compile.

Counted with jax's own monitoring events (``/jax/core/compile/backend_compile_duration``, one
per XLA compile; ``/jax/core/compile/jaxpr_to_mlir_module_duration``, one per lowering), for
every function name (not only the program's own): a compile autoopt made under another name
would count too. Traces (``jaxpr_trace_duration``) are not compiles and are not compared:
autoopt traces the function to a jaxpr and jit traces the wrapper that evaluates it.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent

COMPILE = "/jax/core/compile/backend_compile_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class _Events:
    """Backend compiles and lowerings while active, per call (``mark`` starts the next)."""

    def __init__(self):
        self.calls: list[collections.Counter] = [collections.Counter()]

    def __call__(self, event, duration, fun_name=None, **kw):
        if event in (COMPILE, LOWER):
            self.calls[-1][event] += 1

    def mark(self):
        self.calls.append(collections.Counter())

    def per_call(self, event: str) -> list[int]:
        return [c[event] for c in self.calls[:-1]]

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


# --- the programs: each ``run(wrap, events)`` calls ``wrap(fn)`` as a user's loop does, with a
# rebinding statement where the state would be donated, and returns what it computed ----------


def tiny_step(v):
    return v * 0.9 + 1.0


def run_tiny(wrap, events):
    f = wrap(tiny_step, donate_argnums=0)
    x = jnp.arange(8.0) + 0
    events.calls[-1].clear()  # (the argument's own compiles)
    for _ in range(3):
        x = f(x)
        events.mark()
    return x


_BIG = np.random.default_rng(0).random((512, 1024)).astype(np.float32)  # 2 MiB: hoisted


def hoisted_step(v):
    return v + jnp.asarray(_BIG)[0, :3]


def run_hoisted(wrap, events):
    f = wrap(hoisted_step, donate_argnums=0)
    x = jnp.ones(3) + 0
    events.calls[-1].clear()
    for _ in range(3):
        x = f(x)
        events.mark()
    return x


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch @ params["w"]) - 1.0) ** 2)


def readme_step(state, batch):
    """The README's first example."""
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    params = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, state["params"], grads)
    return {"params": params}, loss


def run_readme(wrap, events):
    step = wrap(readme_step, donate_argnums=0)
    k = jax.random.split(jax.random.key(0), 2)
    state = {"params": {"w": jax.random.normal(k[0], (32, 16))}}
    batches = [jax.random.normal(k[1], (8, 32)) + i for i in range(3)]
    events.calls[-1].clear()  # (the batches' own compiles)
    losses = []
    for batch in batches:
        state, loss = step(state, batch)
        losses.append(loss)
        events.mark()
    return state, losses


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def block_loss(ps, x):
    for w1, w2 in ps:
        x = x + jax.nn.gelu(_ln(x) @ w1) @ w2
    return jnp.mean(x**2)


def remat_step(ps, x):
    """A residual MLP step remat="auto" plans (tests/test_remat_fit.py): it fits, so the
    default leaves it as it is."""
    value, g = jax.value_and_grad(block_loss)(ps, x)
    return [(w1 - 0.1 * g1, w2 - 0.1 * g2) for (w1, w2), (g1, g2) in zip(ps, g)], value


def run_remat(wrap, events):
    step = wrap(remat_step, donate_argnums=0)
    layers, d = 3, 64
    k = jax.random.split(jax.random.key(1), 2 * layers + 1)
    ps = [
        (
            jax.random.normal(k[2 * i], (d, 4 * d)) / 8,
            jax.random.normal(k[2 * i + 1], (4 * d, d)) / 16,
        )
        for i in range(layers)
    ]
    x = jax.random.normal(k[-1], (1024, d))
    events.calls[-1].clear()
    values = []
    for _ in range(3):
        ps, value = step(ps, x)
        values.append(value)
        events.mark()
    return ps, values


def decode(x, kcache, vcache):
    """A forward-only scan (benchmarks/first_call.py's decode loop, smaller)."""
    d = x.shape[-1]

    def one(carry, t):
        x, kc, vc = carry
        kc = jax.lax.dynamic_update_slice_in_dim(kc, x[None], t, 0)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, jnp.sin(x)[None], t, 0)
        att = jax.nn.softmax((kc @ x) / math.sqrt(d))
        return (jnp.tanh(att @ vc + x), kc, vc), None

    (x, kc, vc), _ = jax.lax.scan(one, (x, kcache, vcache), jnp.arange(kcache.shape[0]))
    return x, kc, vc


def run_decode(wrap, events):
    f = wrap(decode, donate_argnums=(1, 2))
    x, kc, vc = jnp.ones(32) + 0, jnp.zeros((16, 32)), jnp.zeros((16, 32))
    events.calls[-1].clear()
    for _ in range(3):
        x, kc, vc = f(x, kc, vc)
        events.mark()
    return x, kc, vc


def scaled(x, *, scale, power):
    return x**power * scale


def run_keywords_and_static(wrap, events):
    f = wrap(scaled, static_argnames=("power",), donate_argnums=0)
    x = jnp.arange(6.0) + 1
    s = jnp.float32(0.5)
    events.calls[-1].clear()
    for _ in range(3):
        x = f(x, scale=s, power=2)
        events.mark()
    return x


def host_step(w, batch):
    return w - 0.01 * (batch.T @ (batch @ w))


def run_host_inputs(wrap, events):
    f = wrap(host_step, donate_argnums=0)
    w = jnp.ones((16, 4)) * 0.1
    batches = [np.full((8, 16), i, np.float32) for i in range(3)]  # numpy: the placer's
    events.calls[-1].clear()
    for batch in batches:
        w = f(w, batch)
        events.mark()
    return w


PROGRAMS = {
    "tiny donating step": run_tiny,
    "hoisted constant": run_hoisted,
    "README step": run_readme,
    "remat-able backward that fits": run_remat,
    "decode scan": run_decode,
    "keywords and a static argument": run_keywords_and_static,
    "numpy batches": run_host_inputs,
}


def _jit(fn, **kw):
    return jax.jit(fn, **kw)


def _default(fn, donate_argnums=None, **kw):
    # autoopt proves the donation itself at the rebinding statement
    return autoopt.optimize(fn, fallback="raise", **kw)


def _measure(run, wrap):
    jax.clear_caches()
    with _Events() as events:
        out = jax.block_until_ready(run(wrap, events))
    return out, events


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_defaults_first_call_compiles_what_jax_jit_compiles(name):
    run = PROGRAMS[name]
    expected, plain = _measure(run, _jit)
    got, ours = _measure(run, _default)
    assert plain.per_call(COMPILE) == [1, 0, 0], plain.calls  # the premise
    assert ours.per_call(COMPILE) == plain.per_call(COMPILE), (name, ours.calls)
    assert ours.per_call(LOWER) == plain.per_call(LOWER), (name, ours.calls)
    assert_trees_equivalent(expected, got, exact=True)


def test_the_default_donates_where_it_proves_it_and_still_compiles_once():
    """The premise of the donating rows: the default's one executable is the donating one."""
    f = autoopt.optimize(tiny_step, fallback="raise")
    x = jnp.arange(8.0) + 0
    with _Events() as events:
        x = f(x)
        events.mark()
        x = f(x)
        events.mark()
    assert events.per_call(COMPILE) == [1, 0]
    assert f.inspect(x).donated == ((0,), ())
