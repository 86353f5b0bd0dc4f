"""remat="fit", the default (issue 29): a call compiles the original only and is bit-identical to
jax.jit, unless the original does not fit (memory_budget, the device's free memory, or an
out-of-memory error); then it plans, once, and says why. The device is simulated here
(``autoopt.testing.simulated_device_memory``)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt
from autoopt.testing import assert_trees_equivalent, simulated_device_memory


class _Compiles:
    """Every backend compile while active (as tests/test_prefetch.py counts them)."""

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


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def block_loss(ps, x):
    for w1, w2 in ps:
        x = x + jax.nn.gelu(_ln(x) @ w1) @ w2
    return jnp.mean(x**2)


def train_step(ps, x):
    """A transformer-like residual MLP step, which remat="auto" plans (tests/test_remat.py)."""
    value, g = jax.value_and_grad(block_loss)(ps, x)
    return [(w1 - 0.1 * g1, w2 - 0.1 * g2) for (w1, w2), (g1, g2) in zip(ps, g)], value


def _args(layers=3, d=64, batch=1024):
    k = jax.random.split(jax.random.key(1), 2 * layers + 1)
    ps = [
        (
            jax.random.normal(k[2 * i], (d, 4 * d)) / 8,
            jax.random.normal(k[2 * i + 1], (4 * d, d)) / 16,
        )
        for i in range(layers)
    ]
    return jax.block_until_ready((ps, jax.random.normal(k[-1], (batch, d))))


def _peak(jitted, *args) -> int:
    m = jitted.lower(*args).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _remat(fast, *args):
    return [f for f in fast.inspect(*args).findings if f.kind == "remat"]


def test_the_default_is_bit_identical_to_jax_jit_and_compiles_only_the_original():
    ws, x = _args()
    # the premise: remat="auto" plans this step
    auto = autoopt.optimize(train_step, remat="auto", fallback="raise")
    assert any(f.applied for f in _remat(auto, ws, x))

    jax.clear_caches()
    with _Compiles() as plain:
        expected = jax.block_until_ready(jax.jit(train_step)(ws, x))
    jax.clear_caches()
    fast = autoopt.optimize(train_step, fallback="raise")
    with _Compiles() as ours:
        got = jax.block_until_ready(fast(ws, x))
    assert ours.names == plain.names == ["jit(train_step)"]
    assert_trees_equivalent(expected, got, exact=True)
    assert not _remat(fast, ws, x)
    with _Compiles() as again:
        jax.block_until_ready(fast(ws, x))
    assert again.names == []


def test_the_default_plans_when_the_original_is_above_memory_budget():
    ws, x = _args()
    original = _peak(jax.jit(train_step), ws, x)
    budget = int(0.75 * original)
    fast = autoopt.optimize(train_step, memory_budget=budget, fallback="raise")
    got = fast(ws, x)
    (finding,) = _remat(fast, ws, x)
    assert finding.applied and "memory_budget" in finding.message, finding.message
    assert finding.details["live_at_peak"], finding.details
    assert _peak(fast, ws, x) <= budget
    assert_trees_equivalent(jax.jit(train_step)(ws, x), got)


def test_a_budget_the_original_meets_changes_nothing():
    ws, x = _args(layers=2)
    fast = autoopt.optimize(train_step, memory_budget="1GiB", fallback="raise")
    assert_trees_equivalent(jax.jit(train_step)(ws, x), fast(ws, x), exact=True)
    assert not _remat(fast, ws, x)


def test_a_device_too_small_for_the_original_makes_the_default_plan():
    ws, x = _args()
    original = _peak(jax.jit(train_step), ws, x)
    fast = autoopt.optimize(train_step, fallback="raise")
    with simulated_device_memory(int(0.75 * original)):
        got = fast(ws, x)
    (finding,) = _remat(fast, ws, x)
    assert finding.applied and "simulated device memory" in finding.message, finding.message
    assert _peak(fast, ws, x) <= int(0.75 * original)
    assert_trees_equivalent(jax.jit(train_step)(ws, x), got)


def test_an_out_of_memory_error_is_rescued_once_with_one_log_record(caplog):
    ws, x = _args()
    original = _peak(jax.jit(train_step), ws, x)
    fast = autoopt.optimize(train_step, fallback="raise")
    # a device that does not report its memory: only the error tells
    with caplog.at_level(logging.INFO, logger="autoopt"):
        with simulated_device_memory(int(0.75 * original), reported=False):
            got = fast(ws, x)
    records = [r for r in caplog.records if r.name == "autoopt"]
    assert len(records) == 1 and "out of memory" in records[0].getMessage(), records
    (finding,) = _remat(fast, ws, x)
    assert finding.applied and "RESOURCE_EXHAUSTED" in finding.message, finding.message
    live = finding.details["live_at_peak"]
    assert live and any(b["location"] and "test_remat_fit.py" in b["location"] for b in live)
    assert {b["plan"] for b in live} <= {"recomputed in the backward", "kept", "an input"}
    assert_trees_equivalent(jax.jit(train_step)(ws, x), got)


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "unreported"])
def test_where_no_plan_fits_jaxs_own_error_names_the_largest_live_values(reported):
    ws, x = _args(layers=2)
    fast = autoopt.optimize(train_step, fallback="raise")
    with simulated_device_memory(1024, reported=reported):
        with pytest.raises(jax.errors.JaxRuntimeError) as info:
            fast(ws, x)
    message = str(info.value)
    assert "RESOURCE_EXHAUSTED" in message and "Largest values live" in message, message
    assert "test_remat_fit.py" in message


def test_a_callbacks_error_that_mentions_resource_exhausted_is_raised_as_jax_jit_raises_it():
    # A quota error of some service, raised in a host callback, reads "RESOURCE_EXHAUSTED ...
    # (limit: N bytes)" inside jax's INTERNAL status. It was taken for an out-of-memory error:
    # the program was re-planned with N as the budget and the whole step (its callback too)
    # ran again, returning where jax.jit raises.
    ws, x = _args(layers=2)
    calls = []

    def host(v):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("RESOURCE_EXHAUSTED: quota exceeded (limit: 100000 bytes)")
        return v

    def step(ps, x):
        x = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return train_step(ps, x)

    for fn in (jax.jit(step), autoopt.optimize(step, fallback="raise")):
        calls.clear()
        with pytest.raises(jax.errors.JaxRuntimeError, match="quota exceeded") as info:
            fn(ws, x)
        assert len(calls) == 1, fn
        assert "Largest values live" not in str(info.value)
    # (and the next call runs as jax.jit's does)
    assert_trees_equivalent(jax.jit(step)(ws, x), autoopt.optimize(step)(ws, x))


def test_explain_shows_what_remat_auto_would_apply_without_applying_it():
    ws, x = _args()
    fast = autoopt.optimize(train_step, fallback="raise")
    report = fast.explain(ws, x)
    would = [f for f in report.findings if f.kind == "remat"]
    assert would and not any(f.applied for f in would)
    assert "remat='auto'" in would[0].message and would[0].details["would_save"] > 0
    # and the call itself still runs the original
    assert_trees_equivalent(jax.jit(train_step)(ws, x), fast(ws, x), exact=True)


def test_remat_auto_is_opt_in_and_fit_is_the_default():
    assert autoopt.optimize(train_step)._policy.options.remat == "fit"
    with pytest.raises(ValueError, match="'fit'"):
        autoopt.optimize(train_step, remat="fits")


_HOST_CONSTANT = np.random.default_rng(0).random((512, 1024)).astype(np.float32)


def train_step_with_a_large_constant(ps, x):
    """``train_step`` closing over a 2 MiB NumPy constant: the placer passes it as a device
    argument (``passes.placement._hoist``), so the first call's trace stops twice (the fit
    check, then the constants to hoist)."""
    return train_step(ps, x + jnp.asarray(_HOST_CONSTANT)[0, : x.shape[-1]])


@pytest.mark.parametrize("how", ["budget", "device", "out of memory"])
def test_a_program_with_hoisted_constants_is_checked_too(how):
    ws, x = _args()
    original = _peak(jax.jit(train_step_with_a_large_constant), ws, x)
    # (the executable that runs takes the constant as an argument: its bytes count there)
    short = int(0.75 * original) + _HOST_CONSTANT.nbytes
    options = {"memory_budget": short} if how == "budget" else {}
    fast = autoopt.optimize(train_step_with_a_large_constant, fallback="raise", **options)
    if how == "budget":
        got = fast(ws, x)
    else:
        with simulated_device_memory(short, reported=how == "device"):
            got = fast(ws, x)
    assert fast.inspect(ws, x).placement.hoisted is not None  # the premise
    (finding,) = _remat(fast, ws, x)
    assert finding.applied, finding.message
    assert_trees_equivalent(jax.jit(train_step_with_a_large_constant)(ws, x), got)


@pytest.mark.parametrize("how", ["budget", "out of memory"])
def test_planning_for_a_short_memory_compiles_the_original_once(how):
    """The call's own check compiled the original and read its peak: planning takes the
    original's figures from it instead of compiling the original a second time (issue 29).
    The call site rebinds what it donates, so the check's executable donates what the plan's
    measurements assume. Compiled: the check, the candidates the planner tried, the plan."""
    ws, x = _args()
    original = _peak(jax.jit(train_step, donate_argnums=0), ws, x)
    short = int(0.75 * original)
    kept = jax.tree_util.tree_map(jnp.copy, ws)
    expected = jax.jit(train_step)(kept, x)
    jax.clear_caches()
    options = {"memory_budget": short} if how == "budget" else {}
    fast = autoopt.optimize(train_step, fallback="raise", **options)
    with _Compiles() as ours:
        if how == "budget":
            ws, value = fast(ws, x)  # rebinds: the check's executable donates ws
        else:  # a device that does not report its memory: running the original raises
            with simulated_device_memory(short, reported=False):
                ws, value = fast(ws, x)
    (finding,) = _remat(fast, ws, x)
    assert finding.applied, finding.message
    tried = finding.details["tried"]
    measuring = [n for n in ours.names if n != "jit(train_step)"]
    assert len(measuring) == len(tried), (ours.names, tried)  # no second compile of the original
    assert ours.names.count("jit(train_step)") == 2, ours.names  # the original, then the plan
    assert finding.details["before"]["peak_bytes"] == original
    assert_trees_equivalent(expected, (ws, value))


@pytest.mark.parametrize("how", ["budget", "out of memory"])
def test_planning_for_a_short_memory_at_a_call_keeping_its_arguments_compiles_the_original_once(
    how,
):
    """``out = step(ws, x)`` runs an executable that donates nothing: the plans are measured
    so, and the check's executable stands for the original's measuring compile (before, the
    original was compiled a second time, donating, and reported 4 MiB below the check's own
    figure). Compiled: the check, the candidates the planner tried, the plan."""
    ws, x = _args()
    original = _peak(jax.jit(train_step), ws, x)
    short = int(0.75 * original)
    expected = jax.jit(train_step)(ws, x)
    jax.clear_caches()
    options = {"memory_budget": short} if how == "budget" else {}
    fast = autoopt.optimize(train_step, fallback="raise", **options)
    with _Compiles() as ours:
        if how == "budget":
            out = fast(ws, x)
        else:
            with simulated_device_memory(short, reported=False):
                out = fast(ws, x)
    (finding,) = _remat(fast, ws, x)
    assert finding.applied, finding.message
    tried = finding.details["tried"]
    measuring = [n for n in ours.names if n != "jit(train_step)"]
    assert len(measuring) == len(tried), (ours.names, tried)  # no second compile of the original
    assert ours.names.count("jit(train_step)") == 2, ours.names  # the original, then the plan
    assert finding.details["before"]["peak_bytes"] == original
    assert finding.details["measured_donating"] == []
    assert_trees_equivalent(expected, out)


def test_a_lower_before_the_first_call_does_not_skip_the_budget_check():
    """``lower()`` builds the signature's program without the check (ahead of time), and the
    call that follows may be answered from jax's trace of that ``lower()``, which never runs
    the wrapper: the call checks the program itself (it ignored the budget before)."""
    ws, x = _args()
    budget = int(0.75 * _peak(jax.jit(train_step), ws, x))
    fast = autoopt.optimize(train_step, memory_budget=budget, fallback="raise")
    fast.lower(ws, x).compile()  # ahead of time, as benchmarks/remat.py and AOT users do
    got = fast(ws, x)
    assert_trees_equivalent(jax.jit(train_step)(ws, x), got)
    found = _remat(fast, ws, x)
    assert len(found) == 1 and found[0].applied, found
    assert "memory_budget" in found[0].message, found[0].message
    assert _peak(fast, ws, x) <= budget
