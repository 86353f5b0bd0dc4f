"""Many devices: optimized functions over a Mesh of 8 forced host devices.

The checks run in a subprocess started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
(the flag must be set before JAX initializes, and the main test process keeps its one device).
The subprocess runs every check, prints one JSON line of results, and each test below asserts
its own entry, so a failure names the property and carries the subprocess's traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import pytest

_MARK = "MULTIDEVICE-RESULTS "


# --- the checks (run in the subprocess) -----------------------------------------------------------


def _checks() -> dict[str, str | None]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import autoopt
    from autoopt.testing import assert_trees_equivalent

    assert len(jax.devices()) == 8, jax.devices()
    mesh = jax.make_mesh((8,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    def check_sharded_arguments_give_jits_values_and_output_shardings():
        x = jax.device_put(np.arange(64 * 4, dtype=np.float32).reshape(64, 4), rows)
        w = jax.device_put(np.ones((3, 4), np.float32), replicated)

        def f(x, w):
            return jnp.tanh(x @ w.T) + 1.0, (x * 2).sum(axis=1)

        ref = jax.jit(f)(x, w)
        got = autoopt.optimize(f, fallback="raise")(x, w)
        assert_trees_equivalent(ref, got)
        for r, g in zip(ref, got):
            assert g.sharding.is_equivalent_to(r.sharding, g.ndim), (g.sharding, r.sharding)
        assert got[0].sharding.is_equivalent_to(rows, 2), got[0].sharding

    def check_out_shardings_pass_through():
        x = jax.device_put(np.ones((16, 4), np.float32), rows)
        f = autoopt.optimize(lambda x: x * 3, out_shardings=replicated, fallback="raise")
        out = f(x)
        assert out.sharding.is_equivalent_to(replicated, 2), out.sharding
        np.testing.assert_allclose(np.asarray(out), 3.0)

    def check_sharded_argument_is_donated_when_rebound():
        f = autoopt.optimize(lambda x: x * 2 + 1, fallback="raise")
        x = jax.device_put(np.zeros((64, 4), np.float32), rows)
        x = f(x)
        pointers = [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
        x = f(x)
        assert [s.data.unsafe_buffer_pointer() for s in x.addressable_shards] == pointers
        assert ((0,), ()) in f.inspect(x).donation_variants
        assert x.sharding.is_equivalent_to(rows, 2), x.sharding
        np.testing.assert_allclose(np.asarray(x), 3.0)

    def check_shard_map_bodies_are_left_untouched():
        # A mesh of automatic axes (jax.make_mesh makes explicit ones), as most shard_map code uses.
        auto_mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))

        def f(x):
            def body(block):
                return jax.lax.psum(block.sum(), "data") + block * 0

            y = jax.shard_map(body, mesh=auto_mesh, in_specs=P("data"), out_specs=P("data"))(x)
            return y.at[0].set(-1.0)

        x = jax.device_put(np.arange(32, dtype=np.float32), NamedSharding(auto_mesh, P("data")))
        opt = autoopt.optimize(f, fallback="raise")
        assert_trees_equivalent(jax.jit(f)(x), opt(x))
        inspection = opt.inspect(x)

        def bodies(closed):
            from autoopt._jaxpr import iter_eqns

            return [
                str(s.eqn.params["jaxpr"])
                for s in iter_eqns(closed)
                if s.eqn.primitive.name == "shard_map"
            ]

        assert bodies(inspection.optimized) == bodies(inspection.traced) != []

    def check_prefetch_splits_each_batch_across_the_mesh():
        batches = [
            {"x": np.full((64, 4), i, np.float32), "y": np.arange(64, dtype=np.int32)}
            for i in range(3)
        ]
        got = list(autoopt.prefetch(iter(batches), sharding=rows))
        for i, b in enumerate(got):
            for leaf in (b["x"], b["y"]):
                assert leaf.sharding == rows, leaf.sharding
                assert len(leaf.addressable_shards) == 8
                assert leaf.addressable_shards[0].data.shape[0] == 8
            np.testing.assert_array_equal(np.asarray(b["x"]), batches[i]["x"])

    def check_data_parallel_training_loop_matches_jax_jit():
        def loss(w, batch):
            return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

        def step(w, batch):
            return w - 0.1 * jax.grad(loss)(w, batch)

        rng = np.random.default_rng(0)
        batches = [
            {
                "x": rng.standard_normal((64, 4)).astype(np.float32),
                "y": rng.standard_normal(64).astype(np.float32),
            }
            for _ in range(4)
        ]
        w_ref = jax.device_put(np.zeros(4, np.float32), replicated)
        for b in batches:
            w_ref = jax.jit(step)(w_ref, jax.device_put(b, rows))
        opt = autoopt.optimize(step, fallback="raise")
        w = jax.device_put(np.zeros(4, np.float32), replicated)
        for b in autoopt.prefetch(iter(batches), sharding=rows):
            w = opt(w, b)
        assert_trees_equivalent(w_ref, w)
        assert w.sharding.is_equivalent_to(w_ref.sharding, 1)

    def check_numpy_batches_and_read_only_tables_with_sharded_state():
        table = autoopt.constant(np.linspace(0, 1, 4 * 8, dtype=np.float32).reshape(8, 4))

        def f(state, batch, table):
            return state + (batch["a"] @ table.T).sum(axis=1) + batch["b"]

        state = jax.device_put(np.zeros(16, np.float32), rows)
        batch = {"a": np.ones((16, 4), np.float32), "b": np.arange(16, dtype=np.float32)}
        ref = jax.jit(f)(state, batch, table)
        opt = autoopt.optimize(f, placement="pack", fallback="raise")
        assert_trees_equivalent(ref, opt(state, batch, table))
        last = opt.inspect(state, batch, table).placement.stats.last
        assert last.packed_leaves == 2

    results: dict[str, str | None] = {}
    for name, check in sorted(locals().items()):
        if name.startswith("check_"):
            try:
                check()
                results[name[len("check_") :]] = None
            except Exception:  # noqa: BLE001 - reported to the parent test
                results[name[len("check_") :]] = traceback.format_exc()
    return results


# --- the tests (run in pytest's process) ----------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    assert lines, f"the 8-device subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len(_MARK) :])


@pytest.mark.parametrize(
    "name",
    [
        "sharded_arguments_give_jits_values_and_output_shardings",
        "out_shardings_pass_through",
        "sharded_argument_is_donated_when_rebound",
        "shard_map_bodies_are_left_untouched",
        "prefetch_splits_each_batch_across_the_mesh",
        "data_parallel_training_loop_matches_jax_jit",
        "numpy_batches_and_read_only_tables_with_sharded_state",
    ],
)
def test_on_eight_devices(results, name):
    assert name in results, f"check {name} did not run; ran {sorted(results)}"
    assert results[name] is None, results[name]


if __name__ == "__main__":
    print(_MARK + json.dumps(_checks()), flush=True)
