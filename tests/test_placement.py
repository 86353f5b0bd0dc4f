"""Host inputs, host constants, scalar canonicalization and the transfer guard
(autoopt.passes.placement: _placer, _packing, _host_constants, _hoist).

Reference is always the original function under ``jax.jit``. Transfer counts are read from JAX's
own transfer-guard log (``jax.transfer_guard_host_to_device("log")`` writes one line a transfer
to the process's stderr), so they are not autoopt's word for it.
"""

from __future__ import annotations

import gc
import inspect
import logging
import time
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import autoopt
from autoopt.passes.placement import _host_arrays, _host_constants, _packing
from autoopt.passes.placement import _placer as _placement
from autoopt.testing import assert_trees_equivalent
from benchmarks._harness import Compiles


def _feats(n=12, shape=(8, 8), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {f"f{i:02d}": rng.standard_normal(shape).astype(dtype) for i in range(n)}


def _step(w, feats):
    return sum(jnp.tanh(v @ w).sum() for v in feats.values())


def _count_transfers(capfd, call) -> int:
    """Host-to-device transfers JAX performs implicitly during ``call()`` (from its guard log)."""
    capfd.readouterr()
    with jax.transfer_guard_host_to_device("log"):
        jax.block_until_ready(call())
    return capfd.readouterr().err.count("host-to-device transfer")


def _line_of(marker: str) -> int:
    src, _ = inspect.getsourcelines(inspect.getmodule(_line_of))
    return next(i for i, line in enumerate(src, 1) if marker in line and "_line_of" not in line)


# --- host inputs ----------------------------------------------------------------------------------


def test_numpy_leaves_give_the_same_values_as_jax_jit():
    w = jnp.eye(8) * 0.5
    feats = _feats()
    opt = autoopt.optimize(_step, fallback="raise")
    for _ in range(3):
        assert_trees_equivalent(jax.jit(_step)(w, feats), opt(w, feats))


def test_many_numpy_leaves_cost_one_implicit_transfer_instead_of_one_each(capfd):
    w = jnp.eye(8)
    feats = _feats(n=24)
    opt = autoopt.optimize(_step, placement="pack", fallback="raise")
    naive = jax.jit(_step)
    naive(w, feats), opt(w, feats)  # compile outside the counted calls
    assert _count_transfers(capfd, lambda: naive(w, feats)) == 24
    assert _count_transfers(capfd, lambda: opt(w, feats)) == 1
    last = opt.inspect(w, feats).placement.stats.last
    assert (last.before, last.implicit, last.packed_leaves) == (24, 1, 24)


def test_one_packed_buffer_per_dtype(capfd):
    feats = {
        "a": np.ones((4, 4), np.float32),
        "b": np.arange(16, dtype=np.float32).reshape(4, 4),
        "i": np.arange(6, dtype=np.int32),
        "j": np.full(3, 7, np.int32),
        "m": np.array([True, False, True]),
        "n": np.zeros(2, bool),
    }

    def f(feats):
        return (
            (feats["a"] + feats["b"]).sum(),
            feats["i"].sum() * feats["j"].sum(),
            feats["m"] & feats["n"][0],
        )

    opt = autoopt.optimize(f, placement="pack", fallback="raise")
    assert_trees_equivalent(jax.jit(f)(feats), opt(feats))
    assert _count_transfers(capfd, lambda: opt(feats)) == 3


def test_pooled_host_buffers_are_never_overwritten_under_a_running_step():
    def slow(feats):
        return sum(jnp.sort(jnp.sin(v.ravel())).sum() for v in feats.values())

    opt = autoopt.optimize(slow, placement="pack", fallback="raise")
    batches = [{k: v + i for k, v in _feats(n=4, shape=(128, 256)).items()} for i in range(16)]
    outs = [opt(b) for b in batches]  # no blocking: steps queue up while the next is packed
    for b, out in zip(batches, outs):
        assert_trees_equivalent(jax.jit(slow)(b), out)
    (layout,) = opt.inspect(batches[0]).placement.packed_layouts
    assert 1 <= len(layout.pools[0]) <= _packing._POOL_SIZE  # reused, not one a call


def test_strided_zero_dim_and_scalar_numpy_leaves_keep_their_values():
    base = np.arange(64, dtype=np.float32).reshape(8, 8)
    args = {
        "t": base.T,
        "s": base[::2, 1::3],
        "z": np.array(3.5, np.float32),
        "g": np.float32(2.0),
        "k": np.int32(4),
        "py": 1.5,
        "u": np.frombuffer(
            b"\x00" + np.arange(8, dtype=np.float32).tobytes(), np.float32, offset=0, count=2
        ),
    }

    def f(a):
        return a["t"] @ a["t"], a["s"] * a["z"] + a["g"], a["k"] * 2, a["py"] * a["s"], a["u"]

    assert_trees_equivalent(jax.jit(f)(args), autoopt.optimize(f, fallback="raise")(args))


def test_large_aligned_array_is_left_to_jits_zero_copy_path():
    big = _host_arrays.aligned_empty(1 << 18, np.float32).reshape(512, 512)
    big[...] = 1.0
    small = [np.ones(3, np.float32), np.ones(3, np.float32)]

    def f(big, small):
        return big.sum() + small[0].sum() + small[1].sum()

    opt = autoopt.optimize(f, placement="pack", fallback="raise")
    assert float(opt(big, small)) == float(jax.jit(f)(big, small))
    last = opt.inspect(big, small).placement.stats.last
    assert last.packed_leaves == 2 and last.implicit == 2  # the packed buffer and `big`


def test_numpy_batch_does_not_stop_the_state_from_being_donated():
    def step(state, batch):
        return state + batch["x"].sum() * batch["y"]

    batch = {"x": np.ones((4, 4), np.float32), "y": np.full((4, 4), 2.0, np.float32)}
    state = jnp.zeros((4, 4))
    opt = autoopt.optimize(step, placement="pack", fallback="raise")
    state = opt(state, batch)
    pointer = state.unsafe_buffer_pointer()  # an int: holds no reference to `state`
    state = opt(state, batch)
    assert state.unsafe_buffer_pointer() == pointer  # the output reused the donated buffer
    inspection = opt.inspect(state, batch)
    assert ((0,), ()) in inspection.donation_variants
    np.testing.assert_allclose(np.asarray(state), np.full((4, 4), 64.0))
    assert inspection.placement.stats.last.packed_leaves == 2


def test_static_arguments_and_numpy_keyword_arguments():
    def f(x, n, *, scale, table):
        return (x * scale + table[:n].sum(),)

    x = np.arange(6, dtype=np.float32)
    kw = dict(scale=np.float32(3), table=np.linspace(0, 1, 10, dtype=np.float32))
    ref = jax.jit(f, static_argnums=1)(x, 4, **kw)
    opt = autoopt.optimize(f, static_argnums=1, fallback="raise")
    assert_trees_equivalent(ref, opt(x, 4, **kw))
    assert_trees_equivalent(jax.jit(f, static_argnums=1)(x, 2, **kw), opt(x, 2, **kw))


@pytest.mark.parametrize("placement", ["auto", "pack"])
def test_packed_inputs_compose_with_grad_vmap_and_disable_jit(placement):
    feats = _feats(n=6, shape=(4, 4))
    w = jnp.eye(4)
    opt = autoopt.optimize(_step, placement=placement, fallback="raise")
    assert_trees_equivalent(jax.grad(jax.jit(_step))(w, feats), jax.grad(opt)(w, feats))
    ws = jnp.stack([w, 2 * w])
    assert_trees_equivalent(
        jax.vmap(jax.jit(_step), (0, None))(ws, feats), jax.vmap(opt, (0, None))(ws, feats)
    )
    with jax.disable_jit():
        got = opt(w, feats)
    assert_trees_equivalent(jax.jit(_step)(w, feats), got)


def test_in_shardings_turns_packing_off_but_not_correctness():
    s = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def f(a, b):
        return a * b

    a, b = np.ones(3, np.float32), np.arange(3, dtype=np.float32)
    opt = autoopt.optimize(f, in_shardings=(s, s), fallback="raise")
    assert_trees_equivalent(jax.jit(f, in_shardings=(s, s))(a, b), opt(a, b))
    assert opt.inspect(a, b).placement.stats.last.packed_leaves == 0


def test_placement_off_leaves_numpy_to_jit(capfd):
    feats = _feats(n=5)
    opt = autoopt.optimize(_step, placement="off", fallback="raise")
    w = jnp.eye(8)
    opt(w, feats)
    assert opt.inspect(w, feats).placement is None
    assert _count_transfers(capfd, lambda: opt(w, feats)) == 5


def test_device_only_calls_are_scanned_only_while_watching_then_sampled():
    # donate="off": a donating call of device arrays only skips the placer altogether (_api).
    f = autoopt.optimize(lambda xs: [v + 1 for v in xs], donate="off", placement="pack")
    xs = [jnp.zeros(3), jnp.zeros(3)]
    for _ in range(200):
        xs = f(xs)
    scanned = f.inspect(xs).placement.stats.calls_scanned
    assert scanned < 20  # 8 watched calls, then one in 32
    assert not f.inspect(xs).placement.active
    for _ in range(33):
        xs = f([np.asarray(v) for v in xs])
    assert f.inspect(xs).placement.active  # a sampled call saw the host arrays (packed)
    assert float(xs[0][0]) == 233.0
    for _ in range(_placement._IDLE_CALLS):
        xs = f(xs)
    assert not f.inspect(xs).placement.active  # host arrays stopped coming: lean again


def _tune_with(monkeypatch, opt, args, jit_s, pack_s):
    """Run ``opt`` through its tuning calls with fake timings (seconds a call a strategy),
    checking every call's values against jax.jit."""
    monkeypatch.setattr(_packing, "_TUNE_AFTER_FIRST_CALLS", 0)  # tuned from the first call

    def fake(trial, out, t0):
        layout, strategy, pos = trial
        if pos == _packing._TUNE_RUN - 1:  # the end of a run
            layout.record(strategy, jit_s if strategy == "jit" else pack_s)

    monkeypatch.setattr(_placement, "time_trial", fake)
    ref = jax.jit(_step)(*args)
    for _ in range(2 * (_packing._TUNE_SAMPLES + 1) * _packing._TUNE_RUN):
        assert_trees_equivalent(ref, opt(*args))
    (layout,) = opt.inspect(*args).placement.packed_layouts
    return layout


def test_auto_packs_a_feed_whose_first_calls_measured_packing_faster(capfd, monkeypatch):
    w, feats = jnp.eye(8), _feats(n=16)
    opt = autoopt.optimize(_step, donate="off", fallback="raise")
    layout = _tune_with(monkeypatch, opt, (w, feats), jit_s=1.0, pack_s=0.5)
    assert layout.mode == "pack"
    assert _count_transfers(capfd, lambda: opt(w, feats)) == 1
    assert opt.inspect(w, feats).placement.active


def test_auto_leaves_a_feed_to_jit_when_packing_measured_slower_and_goes_lean(capfd, monkeypatch):
    w, feats = jnp.eye(8), _feats(n=16)
    opt = autoopt.optimize(_step, donate="off", fallback="raise")
    layout = _tune_with(monkeypatch, opt, (w, feats), jit_s=1.0, pack_s=0.95)  # within the margin
    assert layout.mode == "jit"
    assert _count_transfers(capfd, lambda: opt(w, feats)) == 16
    assert not opt.inspect(w, feats).placement.active  # nothing left to place: the lean path


def test_a_pack_decision_is_timed_again_and_dropped_when_the_loop_measures_it_slower(monkeypatch):
    # The decision is the loop's own: after _RETUNE_AFTER packed calls both ways are timed
    # again, and packing that now loses goes back to jit's own transfers (issue 30).
    monkeypatch.setattr(_packing, "_RETUNE_AFTER", 8)
    monkeypatch.setattr(_packing, "_TUNE_AFTER_FIRST_CALLS", 0)
    w, feats = jnp.eye(8), _feats(n=16)
    opt = autoopt.optimize(_step, donate="off", fallback="raise")
    timings = {"jit": 1.0, "pack": 0.5}

    def fake(trial, out, t0):
        layout, strategy, pos = trial
        if pos == _packing._TUNE_RUN - 1:
            layout.record(strategy, timings[strategy])

    monkeypatch.setattr(_placement, "time_trial", fake)
    ref = jax.jit(_step)(w, feats)
    tuning = 2 * (_packing._TUNE_SAMPLES + 1) * _packing._TUNE_RUN
    for _ in range(tuning):
        assert_trees_equivalent(ref, opt(w, feats))
    (layout,) = opt.inspect(w, feats).placement.packed_layouts
    assert layout.decisions == ["pack"]
    timings["pack"] = 2.0  # packing became the slower way
    for _ in range(8 + tuning):
        assert_trees_equivalent(ref, opt(w, feats))
    assert layout.decisions == ["pack", "jit"]
    assert layout.mode == "jit"


def test_auto_tuning_on_real_timings_settles_and_keeps_every_value(monkeypatch):
    monkeypatch.setattr(_packing, "_TUNE_AFTER_FIRST_CALLS", 0)
    w, feats = jnp.eye(8), _feats(n=8)
    opt = autoopt.optimize(_step, donate="off", fallback="raise")
    ref = jax.jit(_step)(w, feats)
    for _ in range(2 * (_packing._TUNE_SAMPLES + 1) * _packing._TUNE_RUN):
        assert_trees_equivalent(ref, opt(w, feats))
    (layout,) = opt.inspect(w, feats).placement.packed_layouts
    assert layout.mode in ("jit", "pack")
    assert all(len(t) == _packing._TUNE_SAMPLES + 1 for t in layout.timings.values())


def test_auto_tunes_only_once_the_loop_ran_ten_times_its_first_call(monkeypatch):
    """The packed program's compile is paid back over many calls: a loop shorter than ten of
    its first calls runs as under jax.jit, compiling once (found by a new user's try: a
    200-step loop of 9 NumPy columns took twice jax.jit's time, half of it that compile)."""
    clock = [100.0]
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(_packing, "time", fake_time)
    monkeypatch.setattr(_placement, "time", fake_time)

    def step(w, feats):
        clock[0] += 2.0  # the first call (its trace and compile) takes 2 s
        return _step(w, feats)

    w, feats = jnp.eye(8), _feats(n=16)
    opt = autoopt.optimize(step, donate="off", fallback="raise")
    ref = jax.jit(_step)(w, feats)
    with Compiles("step") as compiles:
        assert_trees_equivalent(ref, opt(w, feats))
        for _ in range(50):
            assert_trees_equivalent(ref, opt(w, feats))
            clock[0] += 0.3  # 15 s of calls: less than 10 first calls
    (layout,) = opt.inspect(w, feats).placement.packed_layouts
    assert (layout.trials, compiles.own) == (0, 1)
    clock[0] += 10.0  # 25 s: the tuning starts at a call the lean path samples
    with Compiles("step") as compiles:
        for _ in range(2 * (_packing._TUNE_SAMPLES + 1) * _packing._TUNE_RUN + 64):
            assert_trees_equivalent(ref, opt(w, feats))
    assert layout.decisions and compiles.own == 1  # the packed program


def test_auto_never_packs_a_few_leaves_and_never_tunes_them():
    w, feats = jnp.eye(8), _feats(n=_placement._AUTO_PACK_MIN_LEAVES - 1)
    opt = autoopt.optimize(_step, donate="off", fallback="raise")
    for _ in range(3):
        assert_trees_equivalent(jax.jit(_step)(w, feats), opt(w, feats))
    assert opt.inspect(w, feats).placement.packed_layouts == ()


def test_fast_path_rechecks_shapes_and_dtypes_of_a_remembered_feed():
    def f(feats):
        return [v * 2 for v in feats]

    opt = autoopt.optimize(f, placement="pack", fallback="raise")
    rng = np.random.default_rng(0)
    calls = [
        [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(6)],
        [rng.standard_normal((2, 8)).astype(np.float32) for _ in range(6)],  # same sizes
        [rng.standard_normal((4, 4)).astype(np.float64) for _ in range(6)],
        [jnp.ones((4, 4))] + [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(5)],
    ]
    ro = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(6)]
    ro[0].flags.writeable = False
    calls.append(ro)
    for feats in calls + calls:
        assert_trees_equivalent(jax.jit(f)(feats), opt(feats), exact=True)
    ro[0].flags.writeable = True
    ro[0][:] = 5.0  # a read-only leaf is transferred like any other: the change is seen
    ro[0].flags.writeable = False
    assert_trees_equivalent(jax.jit(f)(ro), opt(ro), exact=True)


def test_constant_whose_copy_plain_jit_donated_is_placed_again_by_the_next_constant_call():
    t = _table(seed=4)
    c = autoopt.constant(t)
    jax.jit(lambda a: a * 2, donate_argnums=0)(c)  # plain jax.jit: the user's own donation
    assert c.device_array.is_deleted()
    again = autoopt.constant(t)
    x = jnp.ones(16)
    assert_trees_equivalent(
        jax.jit(lambda t, x: t @ x)(t, x), autoopt.optimize(jnp.matmul)(again, x)
    )


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "int32", "bool", "float16", "uint8"]),
            st.lists(st.integers(1, 4), min_size=0, max_size=3),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_packing_preserves_every_leaf_of_any_numpy_pytree(specs):
    rng = np.random.default_rng(len(specs))
    leaves = [(rng.standard_normal(shape) * 10).astype(dtype) for dtype, shape in specs]
    tree = {"xs": leaves[: len(leaves) // 2], "ys": tuple(leaves[len(leaves) // 2 :])}

    def f(tree):
        return jax.tree_util.tree_map(lambda v: v, tree)

    assert_trees_equivalent(
        jax.jit(f)(tree), autoopt.optimize(f, fallback="raise")(tree), exact=True
    )


# --- host constants -------------------------------------------------------------------------------


def _table(n=256, seed=1):
    t = np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)
    t.flags.writeable = False
    return t


def test_read_only_array_is_transferred_every_call_and_a_constant_once(capfd):
    table = _table()
    x = jnp.ones(16)

    def f(table, x):
        return table @ x

    opt = autoopt.optimize(f, fallback="raise")
    for _ in range(3):
        assert_trees_equivalent(jax.jit(f)(table, x), opt(table, x))
    # A read-only flag proves nothing (it can be switched back on): transferred as jit does.
    assert _count_transfers(capfd, lambda: opt(table, x)) == 1
    assert _count_transfers(capfd, lambda: jax.jit(f)(table, x)) == 1
    c = autoopt.constant(table)  # the caller's promise
    assert_trees_equivalent(jax.jit(f)(table, x), opt(c, x))
    assert _count_transfers(capfd, lambda: opt(c, x)) == 0


def test_a_cached_constant_the_caller_still_holds_survives_a_sweep():
    table = _table(seed=3)
    c = autoopt.constant(table)
    _host_constants.sweep_constants()
    assert (id(table), None) in _host_constants.CONSTANTS
    assert not c.device_array.is_deleted()


def test_cached_copy_is_dropped_when_the_host_array_is_freed():
    table = _table(seed=2)
    autoopt.constant(table)
    entry = _host_constants.CONSTANTS[(id(table), None)]
    device_copy = weakref.ref(entry.device)
    jax.block_until_ready(entry.device)  # a pending host-to-device copy still holds the host array
    del entry, table
    gc.collect()
    swept = 0
    for _ in range(50):  # the transfer's own reference to the host array goes when it completes
        swept += _host_constants.sweep_constants()
        if swept:
            break
        time.sleep(0.01)
        gc.collect()
    assert swept >= 1
    gc.collect()
    assert device_copy() is None


def test_writeable_arrays_are_never_cached_and_changes_are_seen():
    before = _host_constants.constant_cache_size()
    a = np.ones((64, 4), np.float32)
    opt = autoopt.optimize(lambda a: a.sum(), fallback="raise")
    assert float(opt(a)) == 256.0
    a[:] = 2.0
    assert float(opt(a)) == 512.0
    assert _host_constants.constant_cache_size() == before


def test_read_only_view_of_a_writeable_array_is_not_cached():
    base = np.ones((8, 8), np.float32)
    view = base[:4]
    view.flags.writeable = False
    opt = autoopt.optimize(lambda v: v.sum(), fallback="raise")
    assert float(opt(view)) == 32.0
    base[:] = 3.0
    assert float(opt(view)) == 96.0


def test_read_only_reshape_of_a_private_temporary_counts_as_read_only():
    t = np.arange(12, dtype=np.float32).reshape(3, 4)  # the base is referenced only by `t`
    t.flags.writeable = False
    assert _host_arrays.is_read_only(t)
    base = np.arange(12, dtype=np.float32)
    shared = base.reshape(3, 4)
    shared.flags.writeable = False
    assert not _host_arrays.is_read_only(shared)


def test_array_made_writeable_again_loses_its_cached_copy():
    t = np.ones((16, 16), np.float32)
    t.flags.writeable = False
    opt = autoopt.optimize(lambda t: t.sum(), fallback="raise")
    assert float(opt(t)) == 256.0
    t.flags.writeable = True
    t[:] = 2.0
    assert float(opt(t)) == 512.0
    t.flags.writeable = False
    assert float(opt(t)) == 512.0  # placed again, not the stale copy


def test_constant_wrapper_is_placed_once_and_works_with_jax_jit_too():
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    c = autoopt.constant(host)
    assert isinstance(c.device_array, jax.Array)
    assert np.asarray(c) is host or np.shares_memory(np.asarray(c), host)
    assert (c.shape, c.dtype) == ((3, 4), np.float32)

    def f(t, x):
        return t @ x

    x = jnp.ones(4)
    expected = host @ np.ones(4, np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(c, x)), expected)
    np.testing.assert_allclose(np.asarray(autoopt.optimize(f)(c, x)), expected)
    assert autoopt.constant(host).device_array is c.device_array  # one device copy per host array


def test_read_only_arguments_and_constants_under_grad_and_an_outer_jit_never_cache_a_tracer():
    table = _table(n=8, seed=5)

    def f(w, table):
        return (table @ w).sum()

    opt = autoopt.optimize(f, fallback="raise")
    w = jnp.ones(16)
    assert_trees_equivalent(jax.grad(jax.jit(f))(w, table), jax.grad(opt)(w, table))
    assert_trees_equivalent(jax.jit(f)(w, table), jax.jit(lambda w: opt(w, table))(w))
    assert_trees_equivalent(jax.jit(f)(w, table), opt(w, table))
    c = autoopt.constant(table)
    assert_trees_equivalent(jax.jit(f)(w, table), jax.jit(lambda w: opt(w, c))(w))
    assert (id(table), None) in _host_constants.CONSTANTS
    assert not any(
        isinstance(e.device, jax.core.Tracer) for e in _host_constants.CONSTANTS.values()
    )


def test_a_cached_copy_donated_through_explicit_donate_argnums_is_placed_again():
    table = _table(n=16, seed=6)
    opt = autoopt.optimize(lambda t: t * 2, donate_argnums=0, fallback="raise")
    for _ in range(3):
        np.testing.assert_allclose(np.asarray(opt(table)), table * 2)


def test_constant_is_never_donated_even_under_donate_auto():
    c = autoopt.constant(np.ones((4, 4), np.float32))
    opt = autoopt.optimize(lambda t, x: t + x, donate="auto", fallback="raise")
    x = jnp.ones((4, 4))
    opt(c, x)
    assert not c.device_array.is_deleted()
    np.testing.assert_allclose(np.asarray(opt(c, jnp.ones((4, 4)))), 2.0)


# --- scalars and recompile triggers ---------------------------------------------------------------


def _scaled(traces):
    def f(x, s):
        traces.append(1)
        return x * s

    return f


def test_canonicalize_scalars_merges_only_scalars_jax_gives_one_abstract_value():
    # 2.0, 2, np.float32(2) and True each give jax.jit's result its own dtype (int32 for an
    # int x): merging them would change it. np.float64 without x64 is np.float32's float32.
    traces: list = []
    f = _scaled(traces)
    opt = autoopt.optimize(f, canonicalize_scalars=True, fallback="raise")
    x = jnp.arange(3.0)
    for s in (2.0, 2, np.float32(2), True, 3, np.float64(2)):
        assert_trees_equivalent(jax.jit(f)(x, s), opt(x, s))
    assert len(opt.inspect(x, 2.0).programs) == 4
    plain = autoopt.optimize(_scaled([]), fallback="raise")
    for s in (2.0, 2, np.float32(2), True):
        plain(x, s)
    assert len(plain.inspect(x, 2.0).programs) == 4


def test_inexact_scalar_conversions_are_never_made():
    opt = autoopt.optimize(lambda x, s: x * s, canonicalize_scalars=True, fallback="raise")
    x = jnp.arange(3, dtype=jnp.int32)
    assert opt(x, 2).dtype == jnp.int32
    got = opt(x, 2.5)  # 2.5 is no int: a new signature, the right numbers
    assert_trees_equivalent(jax.jit(lambda x, s: x * s)(x, 2.5), got)


def test_explain_names_numpy_and_scalar_arguments_and_recompile_triggers():
    def f(w, feats, lr):
        return _step(w, feats) * lr

    opt = autoopt.optimize(f)
    w, feats = jnp.eye(8), _feats(n=4)
    opt(w, feats, 2.0)  # call-site marker
    opt(w, feats, 2)
    report = opt.explain(w, feats, 2.0)
    placement = report.by_kind("placement")
    text = " ".join(f.message for f in placement)
    assert "feats['f00']" in text and "`lr`" in text
    recompile = [f for f in placement if f.details.get("strategy") == "recompile"]
    assert recompile and recompile[0].details["leaves"] == ["lr"]
    site = next(f for f in placement if f.details.get("strategy") == "pack").location
    assert site == f"{__file__}:{_line_of('# call-site marker')}"


def test_explain_with_another_scalar_type_than_the_calls_reports_no_recompile_trigger():
    # issue 16: the loop passes a Python int every call; explain() was given a jnp.int32, and
    # its own trace (never compiled) was counted as a second compiled program
    def write(buf, i, row):
        return buf.at[i].set(row)

    opt = autoopt.optimize(write)
    buf = jnp.zeros((8, 2))
    for i in range(3):
        buf = opt(buf, i, jnp.ones(2))
    report = opt.explain(buf, jnp.int32(3), jnp.ones(2))
    assert not [f for f in report.findings if f.details.get("strategy") == "recompile"]
    buf = opt(buf, jnp.int32(4), jnp.ones(2))  # now a call does pass it: two programs run
    report = opt.explain(buf, 1, jnp.ones(2))
    [trigger] = [f for f in report.findings if f.details.get("strategy") == "recompile"]
    assert trigger.details["leaves"] == ["i"] and trigger.details["programs"] == 2


def test_large_closed_over_constant_is_reported_at_its_line():
    big = np.arange(1024 * 300, dtype=np.float32).reshape(1024, 300)  # (not a splat)

    def f(x):
        return x @ big  # closed-over use

    report = autoopt.explain(f, jnp.ones((2, 1024)))
    found = [
        f for f in report.by_kind("placement") if f.details.get("strategy") == "closed_constant"
    ]
    assert found and found[0].location.endswith(f":{_line_of('# closed-over use')}")


def _hlo_chars(opt, *args, **kwargs) -> int:
    return len(opt.inspect(*args).jit.lower(*args, **kwargs).as_text())


def test_large_closed_over_constant_is_passed_as_a_device_argument_not_embedded(caplog):
    big = np.random.default_rng(5).standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB

    def f(x):
        return jnp.tanh(x @ big).sum(0) + big[0]

    x = jnp.ones((2, 1024))
    opt = autoopt.optimize(f, fallback="raise")
    ref = jax.jit(f)(x)
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        for _ in range(3):
            assert_trees_equivalent(ref, opt(x))
    compiles = [r for r in caplog.records if "Finished XLA compilation of jit(f)" in r.getMessage()]
    assert len(compiles) == 1  # the cut-short trace compiled nothing
    hoisted = opt.inspect(x).placement.hoisted
    assert hoisted is not None and len(hoisted.devs) == 1
    assert _hlo_chars(opt, x, _autoopt_hoisted=hoisted) < 100_000  # the program, not the data
    assert _hlo_chars(autoopt.optimize(f, placement="off"), x) > 4_000_000  # embedded as before
    found = [
        f
        for f in autoopt.explain(f, x).by_kind("placement")
        if f.details.get("strategy") == "closed_constant"
    ]
    assert found and found[0].applied


def test_hoisted_constants_compose_with_grad_vmap_disable_jit_and_donation(caplog):
    big = np.random.default_rng(6).standard_normal((512, 512)).astype(np.float32) * 0.01
    big = np.concatenate([big, big])  # 2 MiB

    def loss(w):
        return jnp.tanh(w @ big.T).sum()

    w = jnp.ones((3, 512))
    opt = autoopt.optimize(loss, fallback="raise")
    assert_trees_equivalent(jax.grad(jax.jit(loss))(w), jax.grad(opt)(w))
    ws = jnp.stack([w, 2 * w])
    assert_trees_equivalent(jax.vmap(jax.jit(loss))(ws), jax.vmap(opt)(ws))
    with jax.disable_jit():
        assert_trees_equivalent(jax.jit(loss)(w), opt(w))
    assert_trees_equivalent(jax.jit(loss)(w), jax.jit(opt)(w))  # inside an outer trace

    def step(w):
        return w - 0.1 * (w @ big.T @ big)

    opt_step = autoopt.optimize(step, donate="auto", fallback="raise")
    ref, got = w, w + 0
    for _ in range(4):
        ref = jax.jit(step)(ref)
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        for _ in range(4):  # the donating fast path keeps passing the constants: one compile
            got = opt_step(got)
    assert_trees_equivalent(ref, got)
    assert opt_step.inspect(got).placement.hoisted is not None
    assert (
        sum("Finished XLA compilation of jit(step)" in r.getMessage() for r in caplog.records) == 1
    )


# --- the transfer guard ---------------------------------------------------------------------------


def test_guard_disallow_raises_naming_the_argument_and_the_callers_line():
    opt = autoopt.optimize(lambda x, lr: x * lr, transfer_guard="disallow")
    x = jnp.ones(3)
    with pytest.raises(_placement.HostTransferError) as e:
        opt(x, 0.5)  # guarded call
    msg = str(e.value)
    assert "`lr`" in msg and f"{__file__}:{_line_of('# guarded call')}" in msg


def test_guard_disallow_accepts_numpy_that_autoopt_placed_itself():
    opt = autoopt.optimize(_step, transfer_guard="disallow", placement="pack", fallback="raise")
    w, feats = jnp.eye(8), _feats(n=6)
    assert_trees_equivalent(jax.jit(_step)(w, feats), opt(w, feats))
    last = opt.inspect(w, feats).placement.stats.last
    assert last.explicit == 1 and last.implicit == 0


def test_guard_with_placement_off_raises_for_numpy():
    opt = autoopt.optimize(lambda a: a.sum(), transfer_guard="disallow", placement="off")
    with pytest.raises(_placement.HostTransferError, match="`a`"):
        opt(np.ones(3, np.float32))


def test_guard_log_reports_implicit_transfers_once_per_call_site(caplog):
    opt = autoopt.optimize(lambda x, lr: x * lr, transfer_guard="log")
    x = jnp.ones(3)
    with caplog.at_level(logging.WARNING, logger="autoopt"):
        for _ in range(3):
            opt(x, 0.5)
    lines = [r for r in caplog.records if "implicit host-to-device" in r.getMessage()]
    assert len(lines) == 1 and "lr" in lines[0].getMessage()


def test_cached_copy_of_an_aligned_host_array_neither_aliases_it_nor_keeps_it_alive():
    table = _host_arrays.aligned_empty(64 * 16, np.float32).reshape(64, 16)  # XLA:CPU would alias
    table[...] = 1.0
    table.flags.writeable = False
    opt = autoopt.optimize(lambda t: t.sum(), fallback="raise")
    assert float(opt(autoopt.constant(table))) == 1024.0
    entry = _host_constants.CONSTANTS[(id(table), None)]
    jax.block_until_ready(entry.device)
    table.flags.writeable = True
    table[...] = 2.0  # the promise broken behind the cache's back: the copy must not change
    assert float(entry.device.sum()) == 1024.0
    table.flags.writeable = False
    host = weakref.ref(table.base)
    del entry, table
    gc.collect()
    _host_constants.sweep_constants()
    gc.collect()
    assert host() is None
