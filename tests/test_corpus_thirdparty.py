"""Real third-party code under autoopt: optax, flax (linen and nnx), equinox, diffrax.

Each test optimizes a function written the way those libraries' own examples write it, with
small random inputs, and checks three things: it runs, it computes what ``jax.jit`` computes, and
the findings make sense (a training step's parameters and optimizer state are donatable, and are
really donated when the caller rebinds them). Each library is optional (the ``corpus`` extra);
its tests skip when it is not installed.

Versions these were run with: optax 0.2.8, flax 0.12.8, equinox 0.13.8, diffrax 0.7.2 (jax 0.10.2).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent


def _rng(seed=0):
    return np.random.default_rng(seed)


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _copy(tree):
    return jax.tree_util.tree_map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _buffers(tree) -> set[int]:
    """Device addresses of the leaves (plain ints: holding them keeps no array alive, so the
    ``"safe"`` policy's reference check is not disturbed)."""
    return {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree)}


def _donate_finding(report, arg):
    found = [f for f in report.by_kind("donate") if f.details.get("arg") == arg]
    assert found, f"no donation finding for argument {arg!r}: {report.findings}"
    return found[0]


def _assert_donatable(report, arg, tree):
    f = _donate_finding(report, arg)
    assert f.details.get("aliasable"), f.message
    assert f.bytes_saved == _tree_bytes(tree), (f.bytes_saved, _tree_bytes(tree))
    assert "can be donated" in f.message


# --- optax --------------------------------------------------------------------------------------


def _mlp_params(rng, sizes=(8, 16, 4)):
    return {
        f"layer{i}": {"w": _normal(rng, a, b) * 0.3, "b": jnp.zeros((b,), jnp.float32)}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
    }


def _mlp(params, x):
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jnp.tanh(x)
    return x


def _mse(params, x, y):
    return jnp.mean((_mlp(params, x) - y) ** 2)


def _make_update(tx):
    def update(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_mse)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax_apply(params, updates), opt_state, loss

    return update


def optax_apply(params, updates):
    import optax

    return optax.apply_updates(params, updates)


def _batch(rng, n=5):
    return _normal(rng, n, 8), _normal(rng, n, 4)


def test_optax_adam_step_matches_jax_jit_and_reports_params_and_state_donatable():
    optax = pytest.importorskip("optax")
    rng = _rng()
    tx = optax.adam(1e-2)
    params = _mlp_params(rng)
    opt_state = tx.init(params)
    x, y = _batch(rng)
    update = _make_update(tx)
    fast = autoopt.optimize(update, fallback="raise", donate="off")
    assert_trees_equivalent(jax.jit(update)(params, opt_state, x, y), fast(params, opt_state, x, y))
    report = fast.explain(params, opt_state, x, y)
    _assert_donatable(report, 0, params)
    _assert_donatable(report, 1, opt_state)
    assert not _donate_finding(report, 2).details.get("aliasable")  # the batch has no twin output


def test_optax_training_loop_donates_rebound_state_and_matches_jax_jit_every_step():
    optax = pytest.importorskip("optax")
    rng = _rng(1)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))
    params = _mlp_params(rng)
    opt_state = tx.init(params)
    ref_params, ref_state = _copy(params), _copy(opt_state)
    update = _make_update(tx)
    ref = jax.jit(update)
    fast = autoopt.optimize(update, fallback="raise")  # donate="safe": proven at the call site
    for step in range(4):
        x, y = _batch(rng)
        before = _buffers((params, opt_state))
        ref_params, ref_state, ref_loss = ref(ref_params, ref_state, x, y)
        params, opt_state, loss = fast(params, opt_state, x, y)
        assert_trees_equivalent(
            (ref_params, ref_state, ref_loss), (params, opt_state, loss), what=f"step {step}"
        )
        # Donated: the new state lives in the old state's buffers.
        assert _buffers((params, opt_state)) == before, f"step {step}: state was not donated"


def test_optax_chained_transforms_with_schedule_match_jax_jit():
    optax = pytest.importorskip("optax")
    rng = _rng(2)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=10)
    tx = optax.chain(
        optax.clip(0.5),
        optax.scale_by_adam(),
        optax.add_decayed_weights(1e-4),
        optax.scale_by_schedule(schedule),
        optax.scale(-1.0),
    )
    params = _mlp_params(rng)
    opt_state = tx.init(params)
    x, y = _batch(rng)
    update = _make_update(tx)
    fast = autoopt.optimize(update, fallback="raise", donate="off")
    expected = jax.jit(update)(params, opt_state, x, y)
    assert_trees_equivalent(expected, fast(params, opt_state, x, y))
    report = fast.explain(params, opt_state, x, y)
    _assert_donatable(report, 0, params)
    _assert_donatable(report, 1, opt_state)


def test_optax_multisteps_gradient_accumulation_matches_jax_jit_over_steps():
    optax = pytest.importorskip("optax")
    rng = _rng(3)
    tx = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=3)
    params = _mlp_params(rng)
    opt_state = tx.init(params)
    update = _make_update(tx)
    ref, fast = jax.jit(update), autoopt.optimize(update, fallback="raise", donate="off")
    ref_carry = fast_carry = (params, opt_state)
    for step in range(5):
        x, y = _batch(rng)
        r = ref(*ref_carry, x, y)
        f = fast(*fast_carry, x, y)
        assert_trees_equivalent(r, f, what=f"MultiSteps step {step}")
        ref_carry, fast_carry = r[:2], f[:2]


def test_optax_training_loop_inside_scan_matches_jax_jit():
    optax = pytest.importorskip("optax")
    rng = _rng(4)
    tx = optax.adam(1e-2)
    params = _mlp_params(rng)
    xs, ys = _normal(rng, 6, 5, 8), _normal(rng, 6, 5, 4)
    update = _make_update(tx)

    def train(params, xs, ys):
        def body(carry, batch):
            p, s = carry
            p, s, loss = update(p, s, *batch)
            return (p, s), loss

        (params, _), losses = jax.lax.scan(body, (params, tx.init(params)), (xs, ys))
        return params, losses

    assert_trees_equivalent(
        jax.jit(train)(params, xs, ys),
        autoopt.optimize(train, fallback="raise", donate="off")(params, xs, ys),
    )


# --- flax linen ---------------------------------------------------------------------------------


def test_flax_linen_train_step_matches_jax_jit_and_donates_params_and_opt_state():
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax")
    from flax import linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(16)(x))
            x = nn.LayerNorm()(x)
            return nn.Dense(4)(x)

    rng = _rng(5)
    model = MLP()
    x, y = _batch(rng)
    params = model.init(jax.random.key(0), x)["params"]
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ref_params, ref_state = _copy(params), _copy(opt_state)
    fast = autoopt.optimize(train_step, fallback="raise")
    report = fast.explain(params, opt_state, x, y)
    _assert_donatable(report, 0, params)
    _assert_donatable(report, 1, opt_state)
    for step in range(3):
        before = _buffers((params, opt_state))
        ref_params, ref_state, ref_loss = jax.jit(train_step)(ref_params, ref_state, x, y)
        params, opt_state, loss = fast(params, opt_state, x, y)
        assert_trees_equivalent(
            (ref_params, ref_state, ref_loss), (params, opt_state, loss), what=f"linen step {step}"
        )
        assert _buffers((params, opt_state)) == before, f"step {step}: state was not donated"


# --- flax nnx -----------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _Affine:
    """A model that is a pytree of arrays (what nnx.split advises passing)."""

    w: jax.Array

    def __call__(self, x):
        return x @ self.w


def test_flax_nnx_modules_rngs_and_lists_pass_as_under_jax_jit():
    # Since flax 0.12 every nnx object is a pytree jax.jit accepts (FINDINGS.md: refusing them
    # lost 34 of flax's tests).
    pytest.importorskip("flax")
    from flax import nnx

    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(1)), nnx.Linear(4, 2, rngs=nnx.Rngs(2))])
    x = jnp.ones((2, 3))

    def forward(model, layers, x):
        h = model(x)
        for layer in layers:
            h = layer(h)
        return h

    fast = autoopt.optimize(forward, fallback="raise")
    assert_trees_equivalent(jax.jit(forward)(model, layers, x), fast(model, layers, x))
    assert_trees_equivalent(forward(model, layers, x), fast(model, layers, x))
    # The split/merge form works with the same machinery.
    graphdef, state = nnx.split(model)

    def forward_state(state, x):
        return nnx.merge(graphdef, state)(x)

    got = autoopt.optimize(forward_state, fallback="raise")(state, x)
    assert_trees_equivalent(model(x), got)


@pytest.mark.filterwarnings("error")
def test_flax_nnx_ref_and_hijax_variables_reach_jit_untouched():
    # FINDINGS.md: a closed-over jax.Ref (flax's ref Variables) made scatter_to_dus fail and
    # fall back with a warning; a hijax Variable argument could not be traced apart from jit.
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax")
    from flax import nnx

    with nnx.var_defaults(hijax=True):
        model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = jnp.ones((4, 2)), jnp.zeros((4, 3))

    def train_step(x, y):  # updates the closed-over model's Refs in place
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):
            return ((nnx.merge(graphdef, params, rest)(x) - y) ** 2).mean()

        loss, grads = jax.value_and_grad(loss_fn)(nnx.with_vars(params, hijax=False))
        optimizer.update(model, grads)
        return loss

    fast = autoopt.optimize(train_step, fallback="raise")
    first, second = fast(x, y), fast(x, y)
    assert float(second) < float(first)  # the in-place update took effect between the calls
    assert fast.inspect(x, y).program.untouched is not None

    @autoopt.optimize(fallback="raise")
    def scaled(model, x):  # a hijax Variable as an argument
        return model(x) * 2

    with nnx.var_defaults(hijax=True):
        m2 = nnx.Linear(2, 3, rngs=nnx.Rngs(3))
    assert_trees_equivalent(jax.jit(lambda m, x: m(x) * 2)(m2, x), scaled(m2, x))


def test_flax_nnx_split_merge_train_step_with_optimizer_matches_jax_jit():
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax")
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(8, 16, rngs=rngs)
            self.l2 = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.l2(jax.nn.gelu(self.l1(x)))

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    rng = _rng(6)

    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    ref_state = _copy(state)
    fast = autoopt.optimize(train_step, fallback="raise", donate="off")
    report = fast.explain(state, *_batch(rng))
    _assert_donatable(report, 0, state)
    for step in range(3):
        x, y = _batch(rng)
        ref_state, ref_loss = jax.jit(train_step)(ref_state, x, y)
        state, loss = fast(state, x, y)
        assert_trees_equivalent((ref_state, ref_loss), (state, loss), what=f"nnx step {step}")


# --- equinox ------------------------------------------------------------------------------------


def test_equinox_module_with_function_leaves_runs_as_filter_jit_does():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(8, 4, 16, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    x = _normal(_rng(7), 8)
    traces = []

    def forward(model, x):
        traces.append(1)
        return model(x)

    with pytest.raises(TypeError, match="static"):
        jax.jit(forward)(mlp, x)  # what plain jax.jit does with the activation function leaf
    fast = autoopt.optimize(forward, fallback="raise")
    expected = eqx.filter_jit(forward)(mlp, x)
    traces.clear()
    for _ in range(3):
        assert_trees_equivalent(expected, fast(mlp, x))
    assert len(traces) == 1, "the function leaves are static: one trace for one model"
    # A model with another activation is another static signature.
    other = eqx.tree_at(lambda m: m.activation, mlp, jax.nn.relu)
    assert_trees_equivalent(eqx.filter_jit(forward)(other, x), fast(other, x))


def test_equinox_train_step_matches_filter_jit_and_reports_model_donatable():
    eqx = pytest.importorskip("equinox")
    optax = pytest.importorskip("optax")
    rng = _rng(8)
    model = eqx.nn.MLP(8, 4, 16, 2, key=jax.random.key(1))
    tx = optax.adam(1e-2)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))

    def train_step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(x) - y) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    fast = autoopt.optimize(train_step, fallback="raise", donate="off")
    ref = eqx.filter_jit(train_step)
    ref_model, ref_state = model, opt_state
    for step in range(3):
        x, y = _batch(rng)
        ref_model, ref_state, ref_loss = ref(ref_model, ref_state, x, y)
        model, opt_state, loss = fast(model, opt_state, x, y)
        assert_trees_equivalent(
            eqx.filter((ref_model, ref_state, ref_loss), eqx.is_array),
            eqx.filter((model, opt_state, loss), eqx.is_array),
            what=f"equinox step {step}",
        )
        assert model.activation is ref_model.activation  # static leaves come back as they were
    report = fast.explain(model, opt_state, x, y)
    _assert_donatable(report, 0, eqx.filter(model, eqx.is_array))
    _assert_donatable(report, 1, opt_state)


def test_equinox_module_with_function_leaves_under_donate_auto_computes_the_same():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(2))

    def scale(model):
        return jax.tree_util.tree_map(lambda w: w * 0.5 if eqx.is_array(w) else w, model)

    expected = eqx.filter_jit(scale)(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, no unusable-donation warning
        got = autoopt.optimize(scale, donate="auto", fallback="raise")(_copy(model))
    assert_trees_equivalent(eqx.filter(expected, eqx.is_array), eqx.filter(got, eqx.is_array))
    assert got.activation is model.activation


def test_equinox_module_with_function_leaves_is_donated_under_donate_auto():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(2))

    def scale(model):
        return jax.tree_util.tree_map(lambda w: w * 0.5 if eqx.is_array(w) else w, model)

    fresh = _copy(model)
    before = _buffers(eqx.filter(fresh, eqx.is_array))
    got = autoopt.optimize(scale, donate="auto", fallback="raise")(fresh)
    assert _buffers(eqx.filter(got, eqx.is_array)) == before


# --- diffrax ------------------------------------------------------------------------------------


def _ode_solve(y0, theta, adaptive=True):
    import diffrax

    def vector_field(t, y, args):
        a, b = args
        return jnp.stack([a * y[0] - b * y[0] * y[1], -y[1] + b * y[0] * y[1]])

    controller = (
        diffrax.PIDController(rtol=1e-5, atol=1e-5) if adaptive else diffrax.ConstantStepSize()
    )
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=y0,
        args=theta,
        stepsize_controller=controller,
        max_steps=16,
        saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)),
    )
    return sol.ys


def test_diffrax_adaptive_ode_solve_matches_jax_jit():
    pytest.importorskip("diffrax")
    y0, theta = jnp.array([1.0, 0.5]), (jnp.float32(1.1), jnp.float32(0.4))
    fast = autoopt.optimize(_ode_solve, fallback="raise", donate="off")
    assert_trees_equivalent(jax.jit(_ode_solve)(y0, theta), fast(y0, theta))


def test_diffrax_gradient_of_ode_solve_matches_jax_jit():
    pytest.importorskip("diffrax")
    y0, theta = jnp.array([1.0, 0.5]), (jnp.float32(1.1), jnp.float32(0.4))

    # Fixed steps and the default adjoint (checkpointed while loop). Differentiated inside the
    # optimized function, as a training step does; each compile of it takes seconds on CPU.
    def grad_of_solve(theta, y0):
        return jax.grad(lambda th: jnp.sum(_ode_solve(y0, th, adaptive=False)[-1] ** 2))(theta)

    assert_trees_equivalent(
        jax.jit(grad_of_solve)(theta, y0),
        autoopt.optimize(grad_of_solve, fallback="raise", donate="off")(theta, y0),
    )
