"""The remat pass: gradients equal jax.jit's, budgets hold on the compiled program, programs with
nothing to gain are left alone, and loops, branches, custom_vjp and stop_gradient work."""

import re

import jax
import jax.numpy as jnp
import pytest

import autoopt
from autoopt import _remat_plan
from autoopt._options import make_options
from autoopt.passes import PassContext
from autoopt.passes.remat import CPU_FLAGS, fence_for, jit_options, remat
from autoopt.testing import assert_trees_equivalent

L, N, D = 6, 2048, 64  # 512 KiB per activation, ~6 MiB of residuals


def _params(layers=L, d=D, seed=0):
    k = jax.random.split(jax.random.key(seed), layers + 1)
    return [jax.random.normal(k[i], (d, d)) / jnp.sqrt(d) for i in range(layers)], \
        jax.random.normal(k[-1], (N, d))


def mlp_loss(ws, x):
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.mean(h**2)


def train_step(ws, x):
    loss, g = jax.value_and_grad(mlp_loss)(ws, x)
    return loss, [w - 0.1 * gw for w, gw in zip(ws, g)]


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def block_loss(ps, x):
    for w1, w2 in ps:
        x = x + jax.nn.gelu(_ln(x) @ w1) @ w2
    return jnp.mean(x**2)


def _blocks(layers=3, d=64):
    k = jax.random.split(jax.random.key(1), 2 * layers + 1)
    ps = [(jax.random.normal(k[2 * i], (d, 4 * d)) / 8, jax.random.normal(k[2 * i + 1], (4 * d, d)) / 16)
          for i in range(layers)]
    return ps, jax.random.normal(k[-1], (1024, d))


def _remat_findings(fn, *args, **opts):
    return autoopt.explain(fn, *args, fallback="raise", **opts).by_kind("remat")


def _planned(fn, *args, exact=False, default=False, **opts):
    """Run the pass on ``fn``'s program, check the rewrite type-checks and computes what
    ``jax.jit(fn)`` computes (compiled as autoopt compiles it), and return the findings.
    Cheaper than going through ``optimize`` + ``explain``: no report compiles. ``default``:
    without the XLA:CPU opt-in flag."""
    closed = jax.make_jaxpr(fn)(*args)
    result = remat(closed, _ctx(default=default, **opts))
    jax.extend.core.check_jaxpr(result.jaxpr.jaxpr)
    flags = CPU_FLAGS if jax.default_backend() == "cpu" and not default else None
    got = jax.jit(jax.extend.core.jaxpr_as_fun(result.jaxpr), compiler_options=flags)(
        *jax.tree_util.tree_leaves(args))
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert_trees_equivalent(expected, list(got), exact=exact, what=f"remat of {fn.__name__}")
    return list(result.findings)


def _peak(fn, *args):
    m = fn.lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


# On XLA:CPU, remat plans built on optimization barriers only survive with this compile option,
# which autoopt does not force (it aborts XLA:CPU on barriers inside scan bodies); the user opts
# in with compiler_options. Tests of the planning logic opt in; the default is tested separately.
OPT_IN = {"compiler_options": CPU_FLAGS} if jax.default_backend() == "cpu" else {}


def _ctx(default=False, **opts):
    return PassContext(options=make_options(**({} if default else OPT_IN), **opts),
                       backend=jax.default_backend())


# --- the backend flag ----------------------------------------------------------------------------

def test_cpu_flag_compiles_programs_without_barriers_to_the_same_hlo():
    if jax.default_backend() != "cpu":
        pytest.skip("the flag is XLA:CPU's")
    ws, x = _params(layers=3)

    def strip(text):
        return re.sub(r"metadata=\{[^}]*\}", "", text)

    plain = jax.jit(train_step).lower(ws, x).compile().as_text()
    flagged = jax.jit(train_step, compiler_options=CPU_FLAGS).lower(ws, x).compile().as_text()
    assert strip(plain) == strip(flagged)


def test_remat_off_asks_for_no_compiler_options():
    assert jit_options(make_options(remat="off"), "cpu") == {}
    assert jit_options(make_options(remat="auto"), "gpu") == {}
    # Not even by default on CPU: the flag aborts XLA:CPU on barriers inside scan bodies.
    assert jit_options(make_options(), "cpu") == {}


def test_fence_is_a_conditional_on_cpu_by_default_and_a_barrier_with_the_flag_or_elsewhere():
    assert fence_for("cpu", None) == "cond"
    assert fence_for("cpu", {"xla_disable_hlo_passes": "foo,cse_barrier_expander"}) == "barrier"
    assert fence_for("gpu", None) == fence_for("tpu", None) == "barrier"


# --- XLA:CPU by default: recomputation inside conditionals ----------------------------------------

def _cpu_only():
    if jax.default_backend() != "cpu":
        pytest.skip("the default XLA:CPU mechanism")


def test_cpu_default_training_step_drops_compiled_memory_with_equal_gradients():
    _cpu_only()
    ps, x = _blocks()

    def step(ps, x):
        return jax.value_and_grad(block_loss)(ps, x)

    opt = autoopt.optimize(step, fallback="raise", donate="off")
    (f,) = opt.explain(ps, x).by_kind("remat")
    assert f.applied and "conditionals" in f.details["mechanism"], f.message
    assert f.details["recomputed_matmuls"] == 0
    # The figure the pass measured is the figure of the program that runs.
    assert _peak(opt, ps, x) <= 0.8 * _peak(jax.jit(step), ps, x)
    assert " conditional(" in opt.lower(ps, x).compile().as_text()
    assert_trees_equivalent(jax.jit(step)(ps, x), opt(ps, x))
    assert_trees_equivalent(jax.jit(jax.grad(lambda ps: step(ps, x)[0]))(ps),
                            jax.jit(jax.grad(lambda ps: opt(ps, x)[0]))(ps))


def test_cpu_default_budget_recomputes_matmuls_with_bit_identical_weights():
    _cpu_only()
    ws, x = _params()
    opt = autoopt.optimize(train_step, fallback="raise", memory_budget=1, donate="off")
    assert _peak(opt, ws, x) <= 0.9 * _peak(jax.jit(train_step), ws, x)
    (loss0, ws0), (loss1, ws1) = jax.jit(train_step)(ws, x), opt(ws, x)
    assert_trees_equivalent(ws0, ws1, exact=True)
    assert_trees_equivalent(loss0, loss1)


def test_cpu_default_leaves_a_step_with_nothing_within_the_rule_alone():
    _cpu_only()
    ws, x = _params()
    closed = jax.make_jaxpr(train_step)(ws, x)
    result = remat(closed, _ctx(default=True))
    assert result.jaxpr is closed and not result.changed
    assert all(not f.applied for f in result.findings)


def test_cpu_default_conditionals_inside_loops_branches_and_custom_vjp_run_and_match():
    _cpu_only()
    ws, x = _params(layers=4)
    xs = jnp.stack([x, x * 0.5])

    def in_scan(ws, xs):
        return jax.lax.scan(lambda ws, xb: train_step(ws, xb)[::-1], ws, xs)

    def in_cond(ws, x, p):
        return jax.lax.cond(p, lambda: train_step(ws, x)[1], lambda: ws)

    def custom(ws, x):
        return jax.value_and_grad(_mixed_loss)(ws, x)

    for fn, args in [(in_scan, (ws, xs)), (in_cond, (ws, x, jnp.bool_(True))), (custom, (ws, x))]:
        # A forced policy applies without measuring: the conditionals are there to run.
        fs = _planned(fn, *args, remat="nothing_saveable", default=True)
        assert fs and fs[0].applied, (fn.__name__, fs)
        assert "conditionals" in fs[0].details["mechanism"]
    # Under an outer jit and grad: the conditionals are differentiated and batched like any.
    opt = autoopt.optimize(train_step, fallback="raise", memory_budget=1, donate="off")
    outer = jax.jit(jax.grad(lambda ws: opt(ws, x)[0]))
    assert_trees_equivalent(jax.jit(jax.grad(lambda ws: train_step(ws, x)[0]))(ws), outer(ws))
    assert_trees_equivalent(jax.vmap(lambda x: train_step(ws, x)[0])(xs[:, :64]),
                            jax.vmap(lambda x: opt(ws, x)[0])(xs[:, :64]))


# --- a training step that differentiates inside ---------------------------------------------------

def test_budgeted_training_step_gives_bit_identical_gradients():
    ws, x = _params()
    opt = autoopt.optimize(train_step, **OPT_IN, fallback="raise", memory_budget=1)
    (loss0, ws0), (loss1, ws1) = jax.jit(train_step)(ws, x), opt(ws, x)
    # The recomputation repeats the same operations on the same values: the updated weights are
    # bit-identical. The loss is a reduction that XLA fuses differently once the forward no
    # longer keeps its inputs, so it may differ in the last bit.
    assert_trees_equivalent(ws0, ws1, exact=True)
    assert_trees_equivalent(loss0, loss1)


def test_reachable_budget_holds_on_the_compiled_program():
    ws, x = _params()
    before = _peak(jax.jit(train_step, compiler_options=CPU_FLAGS), ws, x)
    budget = int(0.85 * before)
    opt = autoopt.optimize(train_step, **OPT_IN, fallback="raise", memory_budget=budget, donate="off")
    (f,) = opt.explain(ws, x).by_kind("remat")
    assert f.applied and "to meet the memory budget" in f.message
    assert _peak(opt, ws, x) <= budget < before
    assert f.bytes_saved > 0 and f.details["after"]["peak_bytes"] <= budget


def test_unreachable_budget_applies_the_lowest_memory_plan_and_reports_the_floor():
    ws, x = _params()
    (f,) = _planned(train_step, ws, x, memory_budget="1KB")
    assert f.applied and "cannot be met" in f.message
    assert f.details["floor_bytes"] == f.details["after"]["peak_bytes"] > 1000
    assert f.details["after"]["peak_bytes"] < f.details["before"]["peak_bytes"]


def test_default_rule_applies_cheap_recompute_and_keeps_gradients():
    ps, x = _blocks()

    def step(ps, x):
        return jax.value_and_grad(block_loss)(ps, x)

    (f,) = _planned(step, ps, x)
    assert f.applied, f.message
    before, after = f.details["before"], f.details["after"]
    assert f.details["recomputed_matmuls"] == 0  # no budget: elementwise work only
    assert after["peak_bytes"] <= 0.8 * before["peak_bytes"]
    assert after["flops"] <= 1.1 * before["flops"]
    assert f.location and f.location.endswith(".py:" + f.location.split(":")[-1])
    assert "test_remat.py" in f.location


def test_default_rule_rejects_plans_that_cost_more_than_ten_percent_flops():
    # Every residual of a tanh MLP is a matmul's input: dropping 20% of the peak costs >10%.
    ws, x = _params()
    closed = jax.make_jaxpr(train_step)(ws, x)
    result = remat(closed, _ctx())
    assert result.jaxpr is closed and not result.changed
    assert all(not f.applied for f in result.findings)


def test_forced_policy_recomputes_what_the_policy_does_not_save():
    ws, x = _params()
    (f,) = _planned(train_step, ws, x, remat="dots_saveable")
    assert f.applied and "forced" in f.message
    assert f.details["recomputed_matmuls"] == 0


def test_recomputation_keeps_the_users_source_line():
    ws, x = _params()
    closed = jax.make_jaxpr(train_step)(ws, x)
    result = remat(closed, _ctx(memory_budget=1))
    assert result.changed
    lines = {_remat_plan._jaxpr.user_location(s.eqn) for s in _remat_plan._jaxpr.iter_eqns(result.jaxpr)}
    assert any(loc and "test_remat.py" in loc for loc in lines)


# --- nothing to gain -------------------------------------------------------------------------------

@pytest.mark.parametrize("fn,args", [
    (lambda x: jnp.sin(x) * 2, (jnp.ones((8, 8)),)),                       # no backward
    (lambda x: jax.grad(lambda y: jnp.sum(jnp.tanh(y)))(x), (jnp.ones((8, 8)),)),  # tiny residuals
    (lambda i: i * 3 + 1, (jnp.arange(4),)),                                # integers only
])
def test_program_with_nothing_to_gain_is_left_identical(fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    result = remat(closed, _ctx())
    assert result.jaxpr is closed and not result.changed and not result.findings


def test_remat_off_leaves_the_program_alone():
    ws, x = _params()
    assert _remat_findings(train_step, ws, x, remat="off", memory_budget=1) == []


# --- a forward the user differentiates -------------------------------------------------------------

def test_grad_of_optimized_forward_matches_and_forward_is_unchanged():
    ws, x = _params()
    opt = autoopt.optimize(mlp_loss, **OPT_IN, fallback="raise", memory_budget=1)
    (f,) = opt.explain(ws, x).by_kind("remat")
    assert f.applied and "checkpoint" in f.message
    assert_trees_equivalent(jax.jit(mlp_loss)(ws, x), opt(ws, x), exact=True)
    assert_trees_equivalent(jax.grad(jax.jit(mlp_loss))(ws, x), jax.grad(opt)(ws, x), exact=True)


def test_optimized_forward_composes_under_outer_jit_and_vmap():
    ws, x = _params(layers=3)
    opt = autoopt.optimize(mlp_loss, **OPT_IN, fallback="raise", memory_budget=1)
    assert_trees_equivalent(jax.jit(jax.grad(mlp_loss))(ws, x), jax.jit(jax.grad(opt))(ws, x))
    xs = jnp.stack([x[:8], x[8:16]])
    assert_trees_equivalent(jax.vmap(lambda x: mlp_loss(ws, x))(xs),
                            jax.vmap(lambda x: opt(ws, x))(xs))


def test_scan_bodies_are_checkpointed_for_a_differentiated_scan():
    w = jax.random.normal(jax.random.key(2), (16, D, D)) / jnp.sqrt(D)
    x = jax.random.normal(jax.random.key(3), (N, D))

    def scan_loss(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(jnp.sin(h @ wi)), None), x, w)
        return jnp.mean(h**2)

    opt = autoopt.optimize(scan_loss, **OPT_IN, fallback="raise", memory_budget=1)
    (f,) = opt.explain(w, x).by_kind("remat")
    assert f.applied and "scan" in f.message
    assert_trees_equivalent(jax.grad(jax.jit(scan_loss))(w, x), jax.grad(opt)(w, x))
    assert_trees_equivalent(jax.jit(scan_loss)(w, x), opt(w, x), exact=True)


# --- loops, branches, custom_vjp, stop_gradient ---------------------------------------------------

def test_scan_inside_a_training_step_recomputes_its_body_in_the_backward_scan():
    w = jax.random.normal(jax.random.key(2), (8, D, D)) / jnp.sqrt(D)
    x = jax.random.normal(jax.random.key(3), (N, D))

    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(jnp.sin(h @ wi) * h), None), x, w)
        return jnp.mean(h**2)

    def step(w, x):
        return jax.value_and_grad(loss)(w, x)

    (f,) = _planned(step, w, x, memory_budget=1, exact=True)
    assert f.applied and "checkpoint scan bodies" in f.message
    assert f.details["after"]["peak_bytes"] < 0.5 * f.details["before"]["peak_bytes"]


def test_training_step_inside_scan_body_is_planned_there():
    ws, x = _params(layers=6)
    xs = jnp.stack([x, x * 0.5])

    def train(ws, xs):
        return jax.lax.scan(lambda ws, xb: train_step(ws, xb)[::-1], ws, xs)

    fs = _planned(train, ws, xs, memory_budget=1)
    assert fs and fs[0].applied and "scan body" in fs[0].message


def test_training_step_inside_while_and_cond_keeps_values():
    ws, x = _params(layers=6)

    def loop(ws, x, n):
        return jax.lax.fori_loop(0, n, lambda i, ws: train_step(ws, x)[1], ws)

    def branch(ws, x, p):
        return jax.lax.cond(p, lambda: train_step(ws, x)[1], lambda: ws)

    fs = _planned(loop, ws, x, jnp.int32(2), memory_budget=1)
    assert fs and fs[0].applied and "while body" in fs[0].message
    fs = _planned(branch, ws, x, jnp.bool_(True), memory_budget=1)
    assert fs and fs[0].applied and "cond body" in fs[0].message
    assert_trees_equivalent(jax.jit(branch)(ws, x, False),
                            autoopt.optimize(branch, **OPT_IN, memory_budget=1)(ws, x, False))


@jax.custom_vjp
def _clipped_tanh(x):
    return jnp.tanh(x)


def _clipped_fwd(x):
    y = jnp.tanh(x)
    return y, y


def _clipped_bwd(y, g):
    return (jnp.clip(g * (1 - y * y), -1.0, 1.0),)


_clipped_tanh.defvjp(_clipped_fwd, _clipped_bwd)


def _mixed_loss(ws, x):
    """Layers alternating a custom_vjp activation and tanh plus a stop_gradient term."""
    h = x
    for i, w in enumerate(ws):
        z = h @ w
        h = _clipped_tanh(z) if i % 2 else jnp.tanh(z) + jax.lax.stop_gradient(jnp.sin(z))
    return jnp.mean(h**2)


def test_custom_vjp_and_stop_gradient_keep_their_gradients():
    ws, x = _params()
    loss = _mixed_loss

    def step(ws, x):
        return jax.value_and_grad(loss)(ws, x)

    fs = _planned(step, ws, x, memory_budget=1)
    assert fs and fs[0].applied
    opt = autoopt.optimize(loss, **OPT_IN, fallback="raise", memory_budget=1)
    assert_trees_equivalent(jax.grad(jax.jit(loss))(ws, x), jax.grad(opt)(ws, x))


def test_rewrite_of_a_rewritten_program_still_type_checks_and_matches():
    ws, x = _params(layers=4)
    closed = jax.make_jaxpr(train_step)(ws, x)
    once = remat(closed, _ctx(memory_budget=1)).jaxpr
    twice = remat(once, _ctx(memory_budget=1)).jaxpr
    jax.extend.core.check_jaxpr(twice.jaxpr)
    ref = jax.jit(train_step)(ws, x)
    got = jax.extend.core.jaxpr_as_fun(twice)(*jax.tree_util.tree_leaves((ws, x)))
    assert_trees_equivalent(jax.tree_util.tree_leaves(ref), list(got))
