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

    def check_prefetch_replicates_a_batchs_scalars():
        # jax.device_put(np.float32(0.1), rows) fails an assertion: a leaf of fewer dimensions
        # than the spec is split over those it has and replicated over the rest
        grid = jax.sharding.NamedSharding(
            jax.make_mesh((4, 2), ("data", "model")), jax.sharding.PartitionSpec("data", "model")
        )
        for sharding in (rows, grid):
            batches = [
                {"x": np.full((64, 4), i, np.float32), "lr": np.float32(0.1), "n": np.array(i)}
                for i in range(2)
            ]
            got = list(autoopt.prefetch(iter(batches), sharding=sharding))
            for i, b in enumerate(got):
                assert b["x"].sharding == sharding, b["x"].sharding
                for k in ("lr", "n"):
                    assert b[k].sharding.is_fully_replicated, (k, b[k].sharding)
                    assert b[k].sharding.mesh == sharding.mesh
                    np.testing.assert_array_equal(np.asarray(b[k]), batches[i][k])
            labels = np.arange(64, dtype=np.int32)
            (placed,) = autoopt.prefetch([labels], sharding=grid)
            assert placed.sharding.spec == jax.sharding.PartitionSpec("data"), placed.sharding
            np.testing.assert_array_equal(np.asarray(placed), labels)

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
        got = opt(state, batch, table)
        assert_trees_equivalent(ref, got)
        assert got.sharding == ref.sharding
        # never packed on a backend of several devices (``Placer._settle``)
        last = opt.inspect(state, batch, table).placement.stats.last
        assert last.packed_leaves == 0

    def same(got, ref):
        """Bit for bit, and sharded as jax.jit's."""
        for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key):
                g, r = jax.random.key_data(g), jax.random.key_data(r)
            np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
            assert g.sharding == r.sharding, (g.sharding, r.sharding)
            assert g.committed == r.committed

    def check_host_leaves_beside_a_sharded_argument_keep_jits_bits_and_shardings():
        # A packed buffer's sharding (and its slices') was XLA's choice from the sharded
        # neighbours: `d.T` came back split where jax.jit's is replicated, `x @ b + c` summed
        # otherwise, on the tuning trials under "auto" and on every call under "pack".
        grid = jax.make_mesh((4, 2), ("x", "y"))
        x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(grid, P("x", "y")))

        def g(x, a, b, c, d):
            return x + a, (x @ b) + c, d.T

        rng = np.random.default_rng(0)
        for placement in ("auto", "pack"):
            opt = autoopt.optimize(g, placement=placement, fallback="raise")
            for _ in range(12):  # past "auto"'s tuning trials
                hs = [rng.random((8, 8), np.float32) for _ in range(4)]
                same(opt(x, *hs), jax.jit(g)(x, *hs))

    def check_a_large_closed_over_constant_beside_sharded_arguments():
        # A hoisted constant was an uncommitted argument XLA sharded like `x`: `C @ x` came
        # back P('x', 'y') where jax.jit's is P(None, 'y'), 89% of it in other bits.
        grid = jax.make_mesh((4, 2), ("x", "y"))
        c = np.random.default_rng(0).random((512, 512), np.float32)  # 1 MiB: hoisted on 1 device
        tiles = NamedSharding(grid, P("x", "y"))
        x = jax.device_put(np.random.default_rng(1).random((512, 512), np.float32), tiles)

        def f(x):
            return x + c, c @ x

        same(autoopt.optimize(f, fallback="raise")(x), jax.jit(f)(x))

    def check_a_held_replicated_key_survives_a_rebinding_call():
        # The copy a call made of a held key (jax.device_put(k, may_alias=False), no target)
        # was shard 0's own buffer on one device: donating it deleted the caller's key.
        def step(k):
            return jax.random.split(k)[0]

        opt = autoopt.optimize(step, fallback="raise")
        k = jax.device_put(jax.random.key(1), replicated)
        held = k
        k = opt(k)
        assert not held.is_deleted()
        same(k, jax.jit(step)(held))

        def split_all(s):
            return {"key": jax.vmap(lambda q: jax.random.split(q)[0])(s["key"])}

        opt2 = autoopt.optimize(split_all, fallback="raise")
        s = {"key": jax.device_put(jax.random.split(jax.random.key(0), 8), rows)}
        data = jax.random.key_data(s["key"])  # the caller keeps the keys' data: a copy is passed
        ref = jax.jit(split_all)(s)
        s = opt2(s)
        assert not data.is_deleted()
        same(s, ref)

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
        "prefetch_replicates_a_batchs_scalars",
        "data_parallel_training_loop_matches_jax_jit",
        "numpy_batches_and_read_only_tables_with_sharded_state",
        "host_leaves_beside_a_sharded_argument_keep_jits_bits_and_shardings",
        "a_large_closed_over_constant_beside_sharded_arguments",
        "a_held_replicated_key_survives_a_rebinding_call",
    ],
)
def test_on_eight_devices(results, name):
    assert name in results, f"check {name} did not run; ran {sorted(results)}"
    assert results[name] is None, results[name]


if __name__ == "__main__":
    print(_MARK + json.dumps(_checks()), flush=True)
