"""The first call's cost (issue 15 item 5): a program without a backward compiles nothing but
itself, as under jax.jit; one with a backward still gets its plan; candidates are measured
with options that leave the memory figures exactly as the final program's."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import autoopt
from autoopt.passes.remat import measuring_options
from autoopt.testing import assert_trees_equivalent

D = 64


class _Compiles:
    """Every backend compile while active."""

    def __init__(self):
        self.names: list[str] = []

    def __call__(self, event, duration, fun_name=None, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.names.append(fun_name)

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def decode(x, cache):
    """A forward-only loop: a KV-cache style scan writing one row per step."""

    def step(carry, t):
        x, cache = carry
        cache = jax.lax.dynamic_update_slice_in_dim(cache, jnp.tanh(x)[None], t, 0)
        return (jnp.tanh(cache.T @ jax.nn.softmax(cache @ x)) + x, cache), None

    (x, cache), _ = jax.lax.scan(step, (x, cache), jnp.arange(cache.shape[0]))
    return x, cache


def train_step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    value, g = jax.value_and_grad(loss)(ws)
    return [w - 0.1 * gw for w, gw in zip(ws, g)], value


def _compiles_of_first_call(fn, *args) -> list[str]:
    jax.clear_caches()
    args = jax.block_until_ready(args)  # their own compiles are not the call's
    with _Compiles() as c:
        jax.block_until_ready(fn(*args))
    return c.names


def test_a_forward_only_loop_compiles_only_itself_as_under_jax_jit():
    # residuals of a differentiated scan over 64 steps: 64 caches of 64 KiB, above the 1 MiB
    # the static gate of the forward plan lets through to compiling
    x, cache = jnp.ones(256), jnp.zeros((64, 256))
    plain = _compiles_of_first_call(jax.jit(decode), x, cache)
    fast = autoopt.optimize(decode, fallback="raise")
    assert _compiles_of_first_call(fast, x, cache) == plain == ["jit(decode)"]
    assert not [f for f in fast.inspect(x, cache).findings if f.kind == "remat"]
    assert_trees_equivalent(jax.jit(decode)(x, cache), fast(x, cache), exact=True)


def test_remat_auto_calls_a_program_it_has_nothing_to_measure_for_as_remat_off_does():
    """A forward-only loop under remat="auto": no first-call check (its aborted trace and its
    own lower() cost a warm first call a few percent): the same traces as remat="off"."""
    x, cache = jnp.ones(256), jnp.zeros((64, 256))

    def traces(remat):
        fast = autoopt.optimize(decode, fallback="raise", remat=remat)
        jax.clear_caches()
        names = []

        def on(event, duration, fun_name=None, **kw):
            if event == "/jax/core/compile/jaxpr_trace_duration":
                names.append(fun_name)

        jax.monitoring.register_event_duration_secs_listener(on)
        try:
            jax.block_until_ready(fast(x, cache))
        finally:
            jax.monitoring.unregister_event_duration_listener(on)
        return names

    off = traces("off")
    assert traces("auto") == off, off
    assert len(traces("fit")) > len(off)  # (the default's check: the test can fail)


def test_a_forward_differentiated_eagerly_or_under_a_budget_is_still_planned():
    ws = [jnp.eye(D) * 0.5 for _ in range(6)]
    x = jnp.ones((512, D))

    def loss(ws, x):
        h = x
        for w in ws:
            h = jnp.tanh(jnp.sin(h @ w))
        return jnp.mean(h**2)

    fast = autoopt.optimize(loss, fallback="raise", memory_budget=1)
    assert [f for f in fast.explain(ws, x).findings if f.kind == "remat"]
    assert_trees_equivalent(jax.grad(jax.jit(loss))(ws, x), jax.grad(fast)(ws, x))


def test_a_training_step_is_still_planned_on_its_first_call_under_auto():
    ws = [jax.random.normal(jax.random.key(i), (256, 256)) / math.sqrt(256) for i in range(12)]
    x = jnp.ones((2048, 256))
    fast = autoopt.optimize(train_step, fallback="raise", remat="auto")
    findings = [f for f in fast.inspect(ws, x).findings if f.kind == "remat"]
    assert findings and findings[0].details.get("tried"), findings  # candidates were compiled


def test_after_a_failed_candidate_only_those_the_calibrated_estimate_lets_pass_are_compiled():
    # The benchmarks' 16-layer MLP step: no plan cuts its compiled peak by 20%. The estimate
    # ranks three candidates, and the first one's compile shows the estimate 8 MiB low, which
    # puts the other two above the rule: the first call compiles the original (the call's own
    # executable, which donates nothing here: the statement keeps its arguments, and the
    # candidates are measured so) and that one candidate, at once, and runs the original's
    # executable (before: the original a second time, then all three candidates too).
    ws = [jax.random.normal(jax.random.key(i), (256, 256)) / math.sqrt(256) for i in range(16)]
    x = jnp.ones((1024, 256))
    fast = autoopt.optimize(train_step, fallback="raise", remat="auto")
    compiles = _compiles_of_first_call(fast, ws, x)
    (finding,) = [f for f in fast.inspect(ws, x).findings if f.kind == "remat"]
    assert not finding.applied and len(finding.details["tried"]) == 1, finding
    assert sorted(compiles) == ["jit(remat_measured)", "jit(train_step)"], compiles
    assert_trees_equivalent(jax.jit(train_step)(ws, x), fast(ws, x), exact=True)


@pytest.mark.parametrize("fn", [train_step, decode], ids=["train step", "decode"])
def test_measuring_options_leave_the_memory_figures_as_the_final_program_has_them(fn):
    args = (
        ([jnp.eye(D) for _ in range(4)], jnp.ones((256, D)))
        if fn is train_step
        else (jnp.ones(D), jnp.zeros((16, D)))
    )
    backend = jax.default_backend()

    def figures(options):
        m = jax.jit(fn, compiler_options=options).lower(*args).compile().memory_analysis()
        sizes = ("argument", "output", "temp", "alias")
        return tuple(getattr(m, f"{s}_size_in_bytes") for s in sizes)

    assert figures(measuring_options(None, backend)) == figures(None)


# --- remat="auto" at a call that rebinds its state: the call's own executable is measured -------


def _deep(layers=16, n=1024, d=256):
    ws = [jax.random.normal(jax.random.key(i), (d, d)) / math.sqrt(d) for i in range(layers)]
    return ws, jnp.ones((n, d))


def _fresh(tree):
    return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, tree))


def _remat_finding(fast, *args):
    (finding,) = [f for f in fast.inspect(*args).findings if f.kind == "remat"]
    return finding


def _decision(finding) -> tuple:
    d = finding.details
    return (
        finding.applied,
        d.get("plan"),
        d["before"]["peak_bytes"],
        d["before"]["flops"],
        d.get("after", {}).get("peak_bytes"),
        d["tried"],
    )


def test_a_rebinding_first_call_that_keeps_the_original_runs_the_executable_it_measured():
    """The 16-layer step keeps its original (no plan cuts 20%). Its first call compiles the
    original once, through the jit object the call runs, and the one candidate measured (before:
    the original a second time, to measure it); the decision and its figures are those remat
    makes measuring the original itself (``inspect`` before any call)."""
    ws, x = _deep()
    expected = jax.jit(train_step)(_fresh(ws), x)
    reported = _decision(_remat_finding(autoopt.optimize(train_step, remat="auto"), ws, x))
    fast = autoopt.optimize(train_step, fallback="raise", remat="auto")
    jax.clear_caches()
    ws = _fresh(ws)
    with _Compiles() as c:
        ws, value = fast(ws, x)  # rebinds: the call donates ws, as remat's measurements assume
    assert sorted(c.names) == ["jit(remat_measured)", "jit(train_step)"], c.names  # (at once)
    assert_trees_equivalent(expected, (ws, value), exact=True)
    assert _decision(_remat_finding(fast, ws, x)) == reported
    assert not reported[0]
    with _Compiles() as c:
        fast(ws, x)
    assert c.names == []


def test_a_plan_applied_on_a_rebinding_first_call_is_the_one_remat_chooses_alone():
    """A plan applied (for a memory budget): the same plan and figures as remat measuring the
    original itself; the call runs the plan (the original's executable, compiled meanwhile,
    is dropped: compiles are the original, the candidates measured, the plan)."""
    ws, x = _deep(layers=12)
    expected = jax.jit(train_step)(_fresh(ws), x)
    peak = jax.jit(train_step, donate_argnums=0).lower(ws, x).compile().memory_analysis()
    original = (
        sum(getattr(peak, f"{s}_size_in_bytes") for s in ("argument", "output", "temp"))
        - peak.alias_size_in_bytes
    )
    options = {"remat": "auto", "memory_budget": int(0.8 * original)}
    reported = _decision(_remat_finding(autoopt.optimize(train_step, **options), ws, x))
    assert reported[0], reported  # the premise: a plan is applied
    fast = autoopt.optimize(train_step, fallback="raise", **options)
    jax.clear_caches()
    ws = _fresh(ws)
    with _Compiles() as c:
        ws, value = fast(ws, x)
    assert c.names[-1] == "jit(train_step)", c.names  # the plan, last
    assert sorted(c.names[:-1]) == ["jit(remat_measured)"] * len(reported[5]) + [
        "jit(train_step)"
    ], (
        c.names,
        reported,
    )
    assert _decision(_remat_finding(fast, ws, x)) == reported
    assert_trees_equivalent(expected, (ws, value))


def test_a_new_signature_of_a_function_already_compiled_is_decided_before_it_compiles():
    """A plan would clear the jit object's caches (jax keeps one trace per signature), which
    would cost the signatures compiled before one compile each: a new signature of a function
    that already compiled one is measured as before, and nothing compiled earlier is lost."""
    ws, x = _deep(layers=12, d=128)
    fast = autoopt.optimize(train_step, fallback="raise", remat="auto")
    ws, value = fast(ws, x)
    x2 = jnp.ones((2048, 128))
    ws, value = fast(ws, x2)
    with _Compiles() as c:
        ws, value = fast(ws, x)
        ws, value = fast(ws, x2)
    assert c.names == []


# --- remat="auto" at a call that keeps its arguments: measured as its executable runs -----------


def test_a_first_call_keeping_its_arguments_measures_what_its_executable_donates():
    """``out = step(ws, x)`` runs an executable that donates nothing: remat measures the
    original and its candidates so (the decision remat makes alone with ``donate="off"``),
    and the original it measured is that executable: two compiles (the original, through the
    call's jit object, and the one candidate), and nothing more on the next call."""
    ws, x = _deep()
    expected = jax.jit(train_step)(ws, x)
    alone = autoopt.optimize(train_step, remat="auto", donate="off")
    reported = _decision(_remat_finding(alone, ws, x))
    fast = autoopt.optimize(train_step, fallback="raise", remat="auto")
    jax.clear_caches()
    with _Compiles() as c:
        out = fast(ws, x)
    assert sorted(c.names) == ["jit(remat_measured)", "jit(train_step)"], c.names  # (at once)
    assert_trees_equivalent(expected, out, exact=True)
    finding = _remat_finding(fast, ws, x)
    assert _decision(finding) == reported
    assert finding.details["measured_donating"] == []
    with _Compiles() as c:
        fast(ws, x)
    assert c.names == []


def test_a_plan_applied_on_a_first_call_keeping_its_arguments_is_measured_without_donation():
    """With a budget a plan is applied: the same plan and figures as remat measuring alone
    with ``donate="off"``; compiles are the original (the call's), the candidates, the plan."""
    ws, x = _deep(layers=12)
    expected = jax.jit(train_step)(ws, x)
    peak = jax.jit(train_step).lower(ws, x).compile().memory_analysis()
    original = sum(getattr(peak, f"{s}_size_in_bytes") for s in ("argument", "output", "temp"))
    options = {"remat": "auto", "memory_budget": int(0.8 * original)}
    alone = autoopt.optimize(train_step, donate="off", **options)
    reported = _decision(_remat_finding(alone, ws, x))
    assert reported[0], reported  # the premise: a plan is applied
    fast = autoopt.optimize(train_step, fallback="raise", **options)
    jax.clear_caches()
    with _Compiles() as c:
        out = fast(ws, x)
    assert c.names[-1] == "jit(train_step)", c.names  # the plan, last
    assert sorted(c.names[:-1]) == ["jit(remat_measured)"] * len(reported[5]) + [
        "jit(train_step)"
    ], (
        c.names,
        reported,
    )
    assert _decision(_remat_finding(fast, ws, x)) == reported
    assert_trees_equivalent(expected, out)
    with _Compiles() as c:
        fast(ws, x)
    assert c.names == []
