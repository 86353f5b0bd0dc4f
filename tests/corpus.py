"""A shared corpus of small JAX functions that every pass's tests run over.

Each entry is ``Case(name, fn, make_args, options)``: ``make_args(rng)`` returns ``(args, kwargs)``
built from a numpy Generator, so hypothesis can vary the seed. ``options`` are extra keywords for
``optimize`` (static arguments). Add a case here whenever a pass learns a new trick, so every
other pass is run over it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    make_args: Callable[[np.random.Generator], tuple[tuple, dict]]
    options: dict = dataclasses.field(default_factory=dict)


def _f32(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def elementwise(x, y):
    return jnp.tanh(x) * y + jnp.exp(-jnp.abs(x))


def reductions(x):
    return x.sum(axis=0), x.max(), jnp.mean(x, axis=-1), jnp.argmax(x, axis=1)


def matmul(w, x):
    return jnp.dot(x, w) + 1.0


def scan_cumulative(xs):
    def body(c, x):
        c = c * 0.9 + x
        return c, c.sum()

    return lax.scan(body, jnp.zeros(xs.shape[1:], xs.dtype), xs)


def while_loop(x):
    return lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 1.5), (0, x))


def cond_branches(p, x):
    return lax.cond(p > 0, lambda v: v * 2.0, lambda v: v - 1.0, x)


def grad_inside(w, x, y):
    def loss(w):
        return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

    value, g = jax.value_and_grad(loss)(w)
    return value, w - 0.1 * g


def pytree_state(state, batch):
    new_w = state["params"]["w"] - 0.01 * (batch.T @ batch)
    return {"params": {"w": new_w, "b": state["params"]["b"] + 1.0}, "step": state["step"] + 1}


def with_kwargs(x, *, scale=2.0, shift=None):
    out = x * scale
    return out if shift is None else out + shift


def static_arg(x, n, mode):
    for _ in range(n):
        x = jnp.sin(x) if mode == "sin" else jnp.cos(x)
    return x


def row_update(buf, i, row):
    return buf.at[i].set(row)


def row_add_in_fori(buf):
    def body(i, b):
        return b.at[i].add(jnp.full(b.shape[1:], i, b.dtype))

    return lax.fori_loop(0, buf.shape[0], body, buf)


def int_and_bool(x, m):
    return jnp.where(m, x * 3, x // 2), (x % 7 == 0)


def custom_jvp_relu(x):
    return jax.nn.relu(x) + jax.nn.gelu(x)


def nested_jit(x):
    inner = jax.jit(lambda v: v * v + 1)
    return inner(x) + inner(2 * x)


def checkpointed(x):
    f = jax.checkpoint(lambda v: jnp.sin(jnp.sin(v)))
    return jax.grad(lambda v: f(v).sum())(x)


CASES: tuple[Case, ...] = (
    Case("elementwise", elementwise, lambda r: ((_f32(r, 4, 3), _f32(r, 4, 3)), {})),
    Case("reductions", reductions, lambda r: ((_f32(r, 5, 4),), {})),
    Case("matmul", matmul, lambda r: ((_f32(r, 8, 4), _f32(r, 3, 8)), {})),
    Case("scan", scan_cumulative, lambda r: ((_f32(r, 6, 3),), {})),
    Case("while", while_loop, lambda r: ((_f32(r, 3),), {})),
    Case("cond", cond_branches, lambda r: ((jnp.float32(r.standard_normal()), _f32(r, 3)), {})),
    Case("grad_inside", grad_inside, lambda r: ((_f32(r, 4, 2), _f32(r, 8, 4), _f32(r, 8, 2)), {})),
    Case(
        "pytree_state",
        pytree_state,
        lambda r: (
            (
                {"params": {"w": _f32(r, 3, 3), "b": _f32(r, 3)}, "step": jnp.int32(0)},
                _f32(r, 5, 3),
            ),
            {},
        ),
    ),
    Case(
        "kwargs",
        with_kwargs,
        lambda r: ((_f32(r, 3),), {"scale": jnp.float32(3.0), "shift": _f32(r, 3)}),
    ),
    Case(
        "static_args",
        static_arg,
        lambda r: ((_f32(r, 3), 3, "sin"), {}),
        {"static_argnums": (1, 2)},
    ),
    Case(
        "row_update",
        row_update,
        lambda r: ((_f32(r, 6, 3), jnp.int32(r.integers(-8, 8)), _f32(r, 3)), {}),
    ),
    Case("row_add_in_fori", row_add_in_fori, lambda r: ((_f32(r, 5, 2),), {})),
    Case(
        "int_and_bool",
        int_and_bool,
        lambda r: (
            (
                jnp.asarray(r.integers(-50, 50, (4, 3)), jnp.int32),
                jnp.asarray(r.integers(0, 2, (4, 3)), bool),
            ),
            {},
        ),
    ),
    Case("custom_jvp", custom_jvp_relu, lambda r: ((_f32(r, 7),), {})),
    Case("nested_jit", nested_jit, lambda r: ((_f32(r, 3),), {})),
    Case("checkpointed", checkpointed, lambda r: ((_f32(r, 4),), {})),
)


def case_ids() -> list[str]:
    return [c.name for c in CASES]


def args_for(case: Case, seed: int = 0) -> tuple[tuple, dict]:
    return case.make_args(np.random.default_rng(seed))
