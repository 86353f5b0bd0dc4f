"""The remat pass: gradients equal jax.jit's, budgets hold on the compiled program, programs with
nothing to gain are left alone, and loops, branches, custom_vjp and stop_gradient work."""

import re

import jax
import jax.numpy as jnp
import pytest

import autoopt
import autoopt.testing
from autoopt.passes import PassContext, make_options
from autoopt.passes.remat import CPU_FLAGS, fence_for, jit_options, remat
from autoopt.passes.remat import _plan as _remat_plan
from autoopt.testing import assert_trees_equivalent

L, N, D = 6, 2048, 64  # 512 KiB per activation, ~6 MiB of residuals


def _params(layers=L, d=D, seed=0):
    k = jax.random.split(jax.random.key(seed), layers + 1)
    return [
        jax.random.normal(k[i], (d, d)) / jnp.sqrt(d) for i in range(layers)
    ], jax.random.normal(k[-1], (N, d))


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
    ps = [
        (
            jax.random.normal(k[2 * i], (d, 4 * d)) / 8,
            jax.random.normal(k[2 * i + 1], (4 * d, d)) / 16,
        )
        for i in range(layers)
    ]
    return ps, jax.random.normal(k[-1], (1024, d))


def _auto(fn, **opts):
    """``optimize`` with remat="auto", which these tests are about (the default, "fit", plans
    only when the program does not fit: tests/test_remat_fit.py)."""
    return autoopt.optimize(fn, **{"remat": "auto", **opts})


def _remat_findings(fn, *args, **opts):
    opts.setdefault("remat", "auto")
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
        *jax.tree_util.tree_leaves(args)
    )
    expected = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert_trees_equivalent(expected, list(got), exact=exact, what=f"remat of {fn.__name__}")
    return list(result.findings)


def _peak(fn, *args):
    m = fn.lower(*args).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


# On XLA:CPU, remat plans built on optimization barriers only survive with this compile option,
# which autoopt does not force (it aborts XLA:CPU on barriers inside scan bodies); the user opts
# in with compiler_options. Tests of the planning logic opt in; the default is tested separately.
OPT_IN = {"compiler_options": CPU_FLAGS} if jax.default_backend() == "cpu" else {}


def _ctx(default=False, **opts):
    opts.setdefault("remat", "auto")
    return PassContext(
        options=make_options(**({} if default else OPT_IN), **opts), backend=jax.default_backend()
    )


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

    opt = _auto(step, fallback="raise", donate="off")
    report = opt.explain(ps, x)
    (f,) = report.by_kind("remat")
    assert f.applied and "conditionals" in f.details["mechanism"], f.message
    # Matmuls may be recomputed without a budget, within the rule's FLOPs cap only.
    assert f.details["after"]["flops"] <= 1.1 * f.details["before"]["flops"]
    # The report names every recomputed operation by source line with the FLOPs it adds: a
    # recomputed matmul shows (the codemod reads these primitives to choose its policy).
    rows = f.details["recomputed"]
    assert all(r["flops"] > 0 and "test_remat.py" in r["location"] for r in rows)
    assert any("dot_general" in r["primitives"] for r in rows) == (
        f.details["recomputed_matmuls"] > 0
    )
    text = report.render(color=False)
    assert "what the backward recomputes and keeps" in text and "added FLOPs" in text
    # The figure the pass measured is the figure of the program that runs.
    assert _peak(opt, ps, x) <= 0.8 * _peak(jax.jit(step), ps, x)
    assert " conditional(" in opt.lower(ps, x).compile().as_text()
    assert_trees_equivalent(jax.jit(step)(ps, x), opt(ps, x))
    assert_trees_equivalent(
        jax.jit(jax.grad(lambda ps: step(ps, x)[0]))(ps),
        jax.jit(jax.grad(lambda ps: opt(ps, x)[0]))(ps),
    )


def test_cpu_default_budget_recomputes_matmuls_with_bit_identical_weights():
    _cpu_only()
    ws, x = _params()
    opt = _auto(train_step, fallback="raise", memory_budget=1, donate="off")
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
    opt = _auto(train_step, fallback="raise", memory_budget=1, donate="off")
    outer = jax.jit(jax.grad(lambda ws: opt(ws, x)[0]))
    assert_trees_equivalent(jax.jit(jax.grad(lambda ws: train_step(ws, x)[0]))(ws), outer(ws))
    assert_trees_equivalent(
        jax.vmap(lambda x: train_step(ws, x)[0])(xs[:, :64]),
        jax.vmap(lambda x: opt(ws, x)[0])(xs[:, :64]),
    )


# --- a training step that differentiates inside ---------------------------------------------------


def test_budgeted_training_step_gives_bit_identical_gradients():
    ws, x = _params()
    opt = _auto(train_step, **OPT_IN, fallback="raise", memory_budget=1)
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
    opt = _auto(train_step, **OPT_IN, fallback="raise", memory_budget=budget, donate="off")
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


def test_default_rule_applies_a_plan_within_the_flops_cap_and_keeps_gradients():
    ps, x = _blocks()

    def step(ps, x):
        return jax.value_and_grad(block_loss)(ps, x)

    (f,) = _planned(step, ps, x)
    assert f.applied, f.message
    before, after = f.details["before"], f.details["after"]
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
    lines = {
        _remat_plan._jaxpr.user_location(s.eqn) for s in _remat_plan._jaxpr.iter_eqns(result.jaxpr)
    }
    assert any(loc and "test_remat.py" in loc for loc in lines)


# --- nothing to gain ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,args",
    [
        (lambda x: jnp.sin(x) * 2, (jnp.ones((8, 8)),)),  # no backward
        (
            lambda x: jax.grad(lambda y: jnp.sum(jnp.tanh(y)))(x),
            (jnp.ones((8, 8)),),
        ),  # tiny residuals
        (lambda i: i * 3 + 1, (jnp.arange(4),)),  # integers only
    ],
)
def test_program_with_nothing_to_gain_is_left_identical(fn, args):
    closed = jax.make_jaxpr(fn)(*args)
    result = remat(closed, _ctx())
    assert result.jaxpr is closed and not result.changed and not result.findings


def test_a_large_backward_with_no_plan_within_the_rule_says_so_without_compiling():
    # A scan over layers: its stacked residuals are large, but without a budget no plan is
    # estimated to pass the rule (checkpointing the scan body recomputes every layer).
    def loss(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)
        return jnp.sum(h**2)

    def step(w, x):
        return jax.value_and_grad(loss)(w, x)

    w, x = jnp.full((8, 64, 64), 0.01), jnp.ones((1024, 64))
    closed = jax.make_jaxpr(step)(w, x)
    result = remat(closed, _ctx(default=True))
    (f,) = result.findings
    assert result.jaxpr is closed and not f.applied
    assert "not applied" in f.message and "memory_budget=" in f.message, f.message
    assert "before" not in f.details  # nothing was compiled for it
    # With a budget the scan body is checkpointed (the message's promise holds).
    (g,) = _planned(step, w, x, default=True, memory_budget=1)
    assert g.applied, g.message


def test_remat_off_leaves_the_program_alone():
    ws, x = _params()
    assert _remat_findings(train_step, ws, x, remat="off") == []


# --- a forward the user differentiates ------------------------------------------------------------


def test_grad_of_optimized_forward_matches_and_forward_is_unchanged():
    ws, x = _params()
    opt = _auto(mlp_loss, **OPT_IN, fallback="raise", memory_budget=1)
    (f,) = opt.explain(ws, x).by_kind("remat")
    assert f.applied and "checkpoint" in f.message
    assert_trees_equivalent(jax.jit(mlp_loss)(ws, x), opt(ws, x), exact=True)
    assert_trees_equivalent(jax.grad(jax.jit(mlp_loss))(ws, x), jax.grad(opt)(ws, x), exact=True)


def test_optimized_forward_composes_under_outer_jit_and_vmap():
    ws, x = _params(layers=3)
    opt = _auto(mlp_loss, **OPT_IN, fallback="raise", memory_budget=1)
    assert_trees_equivalent(jax.jit(jax.grad(mlp_loss))(ws, x), jax.jit(jax.grad(opt))(ws, x))
    xs = jnp.stack([x[:8], x[8:16]])
    assert_trees_equivalent(
        jax.vmap(lambda x: mlp_loss(ws, x))(xs), jax.vmap(lambda x: opt(ws, x))(xs)
    )


def test_scan_bodies_are_checkpointed_for_a_differentiated_scan():
    w = jax.random.normal(jax.random.key(2), (16, D, D)) / jnp.sqrt(D)
    x = jax.random.normal(jax.random.key(3), (N, D))

    def scan_loss(w, x):
        h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(jnp.sin(h @ wi)), None), x, w)
        return jnp.mean(h**2)

    opt = _auto(scan_loss, **OPT_IN, fallback="raise", memory_budget=1)
    (f,) = opt.explain(w, x).by_kind("remat")
    assert f.applied and "scan" in f.message
    assert_trees_equivalent(jax.grad(jax.jit(scan_loss))(w, x), jax.grad(opt)(w, x))
    assert_trees_equivalent(jax.jit(scan_loss)(w, x), opt(w, x), exact=True)


def _residual_bytes(f, *args):
    """Bytes an eager ``jax.vjp`` of ``f`` keeps alive between the forward and the backward."""
    _, pullback = jax.vjp(f, *args)
    mine = {id(a) for a in jax.tree_util.tree_leaves(args)}
    return sum(
        r.nbytes
        for r in jax.tree_util.tree_leaves(pullback)
        if hasattr(r, "nbytes") and id(r) not in mine
    )


def test_eager_grad_of_an_optimized_forward_keeps_fewer_residuals_and_equal_gradients():
    # Applied eagerly, jax.grad runs the forward and the backward as two programs and keeps the
    # forward's residuals alive in between; XLA:CPU cannot merge a checkpoint across programs,
    # so the plan is measured, and pays off, there (no compiler flag).
    _cpu_only()
    ws, x = _params()
    opt = _auto(mlp_loss, fallback="raise", memory_budget=1)
    got = jax.grad(opt)(ws, x)
    assert opt.inspect(ws, x).eager_autodiff_jit is not None  # the eager call took its own program
    assert_trees_equivalent(jax.grad(jax.jit(mlp_loss))(ws, x), got)
    assert _residual_bytes(opt, ws, x) <= 0.5 * _residual_bytes(jax.jit(mlp_loss), ws, x)
    # Under an outer jit the two halves are one program again: the eager path is not taken.
    autoopt.testing.forget_wrappers()  # else optimize returns ``opt`` itself, with its programs
    fresh = _auto(mlp_loss, fallback="raise", memory_budget=1)
    assert_trees_equivalent(jax.jit(jax.grad(mlp_loss))(ws, x), jax.jit(jax.grad(fresh))(ws, x))
    assert fresh.inspect(ws, x).eager_autodiff_jit is None


def test_eager_grad_with_a_function_leaf_in_the_arguments_takes_the_static_leaf_path():
    # equinox-style: a model holding its activation function. jax.jit refuses the leaf; the
    # static-leaf path must still catch that under eager autodiff.
    ws, x = _params(layers=3)

    def loss(model, x):
        ws, act = model
        for w in ws:
            x = act(x @ w)
        return jnp.mean(x**2)

    opt = _auto(loss, fallback="raise")
    got = jax.grad(lambda ws: opt((ws, jnp.tanh), x))(ws)
    want = jax.grad(lambda ws: loss((ws, jnp.tanh), x))(ws)
    assert_trees_equivalent(want, got)


def test_a_training_step_stops_watching_for_eager_autodiff_after_its_first_call():
    # The check costs ~0.2 us a call; a function with its own backward never needs it.
    ws, x = _params(layers=2)
    step = _auto(train_step)
    step(ws, x)
    assert not step.inspect(ws, x).eager_autodiff_watched
    loss = _auto(mlp_loss)
    loss(ws, x)
    assert loss.inspect(ws, x).eager_autodiff_watched


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
    assert_trees_equivalent(
        jax.jit(branch)(ws, x, False),
        _auto(branch, **OPT_IN, memory_budget=1)(ws, x, False),
    )


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
    opt = _auto(loss, **OPT_IN, fallback="raise", memory_budget=1)
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


# --- choosing among candidates (no compiles: a table of measured figures) ---------------------


def _cand(name, est_peak, est_flops=0.0, heavy=False):
    from autoopt.passes.remat._pass import Candidate

    return Candidate(name, lambda: name, est_peak, est_flops, heavy=heavy)


def _measure_from(table):
    """A stand-in for compiling: the figures of each candidate's 'program' (its name)."""
    from autoopt._memory import CompiledMemory
    from autoopt.passes.remat._pass import Measured

    def measure(program):
        peak, flops = table[program]
        return Measured(
            CompiledMemory(argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=peak),
            flops,
            0.0,
        )

    return measure


def test_auto_order_falls_back_to_a_plan_without_matmul_recompute():
    from autoopt.passes.remat._pass import _auto_order

    cands = [
        _cand("heavy1", 40, heavy=True),
        _cand("heavy2", 50, heavy=True),
        _cand("heavy3", 55, heavy=True),
        _cand("light", 70),
        _cand("light2", 75),
        _cand("too costly", 10, est_flops=50.0),
        _cand("too little", 95),
    ]
    assert [c.name for c in _auto_order(cands, est_base=100, total_flops=100)] == [
        "heavy1",
        "heavy2",
        "light",
    ]
    # A light plan among the two best: nothing more is compiled.
    cands[1] = _cand("light0", 50)
    assert [c.name for c in _auto_order(cands, est_base=100, total_flops=100)] == [
        "heavy1",
        "light0",
    ]


def test_rule_takes_the_fallback_when_the_heavy_plans_cost_more_flops_than_estimated():
    from autoopt.passes.remat._pass import _auto_order, _choose

    cands = [_cand("heavy1", 40, heavy=True), _cand("heavy2", 50, heavy=True), _cand("light", 70)]
    table = {
        "base": (100, 100.0),
        "heavy1": (45, 120.0),
        "heavy2": (50, 111.0),
        "light": (75, 101.0),
    }
    dec = _choose(_auto_order(cands, 100, 100.0), cands, _measure_from(table), "base", None)
    assert dec.chosen.name == "light" and dec.reason == "rule"
    assert [n for n, _ in dec.tried] == ["heavy1", "heavy2", "light"]


def test_budget_floor_compiles_more_than_the_lowest_estimate():
    from autoopt.passes.remat._pass import _choose, _lowest_estimates, _pareto

    cands = [
        _cand("a", 90, 1.0),
        _cand("b", 70, 2.0),
        _cand("c", 60, 3.0),
        _cand("seg", 65, 5.0),
        _cand("d", 61, 4.0),
        _cand("far", 80, 6.0),
    ]
    front = _pareto(cands)
    assert [c.name for c in front] == ["a", "b", "c"]
    lowest = _lowest_estimates(cands)
    assert [c.name for c in lowest][:3] == ["c", "d", "seg"]
    table = {
        "base": (100, 10.0),
        "a": (95, 11.0),
        "b": (80, 12.0),
        "c": (70, 13.0),
        "d": (70, 14.0),
        "seg": (62, 15.0),
        "far": (50, 16.0),
    }
    # The budget cannot be met: the floor is the lowest compiled peak, found off the front.
    dec = _choose([], front, _measure_from(table), "base", 50, floor_extra=lowest)
    assert dec.reason == "floor" and dec.chosen.name == "seg" and dec.floor == 62
    assert [n for n, _ in dec.tried] == ["c", "d", "seg"]  # "far" is estimated too high
    # A budget only an off-front plan meets is met.
    dec = _choose([], front, _measure_from(table), "base", 65, floor_extra=lowest)
    assert dec.reason == "budget" and dec.chosen.name == "seg"


def test_decreasing_segments_shrink_by_one_fine_segment_and_cover_the_forward():
    sizes = _remat_plan.segment_sizes(16, 4, decreasing=True)
    assert sizes == [5.5, 4.5, 3.5, 2.5] and sum(sizes) == 16
    assert _remat_plan.segment_sizes(16, 4) == [4.0] * 4
    assert _remat_plan.segment_sizes(16, 6, decreasing=True) is None  # the last would be < 1
    # Cuts at equal crossing bytes: the chosen cut indices follow the sizes.
    cuts = [(10 * (i + 1), 100) for i in range(15)]
    assert _remat_plan.choose_cuts(cuts, 4, decreasing=True) == [50, 100, 130]  # 5, 5, 3, 3
    assert _remat_plan.choose_cuts(cuts, 4) == [40, 80, 120]
    assert _remat_plan.choose_cuts(cuts, 6, decreasing=True) == []


def test_a_generous_budget_keeps_the_plan_the_rule_would_apply():
    from autoopt.passes.remat._pass import _choose

    rule_plan, cheap = _cand("rule plan", 45, 0.5, heavy=True), _cand("cheap", 75, 0.0)
    table = {"base": (100, 10.0), "rule plan": (45, 10.5), "cheap": (75, 9.9)}
    measure = _measure_from(table)
    # The budget alone would take the fewest FLOPs below it (cheap: 75); the rule's plan holds
    # less and meets the budget too.
    dec = _choose([rule_plan], [cheap, rule_plan], measure, "base", 80)
    assert dec.chosen.name == "rule plan" and dec.reason == "budget"
    # When the rule's plan fails the rule (here its FLOPs), the budget takes the fewest FLOPs.
    table["rule plan"] = (45, 12.0)
    dec = _choose([rule_plan], [cheap, rule_plan], measure, "base", 80)
    assert dec.chosen.name == "cheap" and dec.reason == "budget"
