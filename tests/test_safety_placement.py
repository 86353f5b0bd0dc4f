"""What placement keeps by default must never serve stale or shared memory (issue 14).

Each test is the pattern a user hits, with ``jax.jit`` of the same function, called in the same
order, as the oracle: a placement cache serves a device copy only when the host bytes are
provably those it copied, and a prefetched batch never shares memory with a host buffer that can
still change.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoopt


def _aligned(n: int, dtype=np.float32) -> np.ndarray:
    """A fresh 1-D array whose data is 64-byte aligned: XLA:CPU aliases such a buffer."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 64, np.uint8)
    off = (-raw.ctypes.data) % 64
    return raw[off : off + n * itemsize].view(dtype)


def _both(fn, **options):
    return jax.jit(fn), autoopt.optimize(fn, fallback="raise", **options)


# --- 1. read-only NumPy arguments are not an implicit cache ---------------------------------------


@pytest.mark.parametrize("placement", ["auto", "pack"])
def test_read_only_buffer_refilled_between_calls_gives_jax_jits_numbers(placement):
    def total(a):
        return a.sum()

    ref, opt = _both(total, placement=placement)
    buf = np.zeros(1000, np.float32)
    for value in (1.0, 2.0, 3.0, 4.0):  # the refill pattern: unlock, write, lock, call
        buf.flags.writeable = True
        buf[:] = value
        buf.flags.writeable = False
        assert float(opt(buf)) == float(ref(buf)) == 1000 * value


def test_read_only_view_whose_base_is_written_gives_jax_jits_numbers():
    ref, opt = _both(lambda a, x: a @ x)
    view = np.zeros(64 * 16, np.float32).reshape(64, 16)  # only the view holds its base
    view.flags.writeable = False
    x = jnp.ones(16)
    for value in (1.0, 2.0, 3.0):
        base = view.base
        base[:] = value  # written through the base, not through the read-only view
        del base
        np.testing.assert_array_equal(opt(view, x), ref(view, x))
        np.testing.assert_array_equal(opt(view, x), np.full(64, 16 * value, np.float32))


def test_read_only_memmap_whose_file_changes_gives_jax_jits_numbers(tmp_path):
    path = tmp_path / "table.bin"
    np.zeros(4096, np.float32).tofile(path)
    table = np.memmap(path, np.float32, mode="r", shape=(4096,))
    ref, opt = _both(lambda t: t.sum())
    for value in (1.0, 2.0, 3.0):
        writer = np.memmap(path, np.float32, mode="r+", shape=(4096,))
        writer[:] = value
        writer.flush()
        del writer
        assert float(opt(table)) == float(ref(table)) == 4096 * value


def test_read_only_argument_is_reported_with_autoopt_constant_as_the_way_to_place_it_once():
    table = np.ones((512, 1024), np.float32)
    table.flags.writeable = False
    report = autoopt.optimize(lambda t: t.sum()).explain(table)
    (finding,) = [f for f in report.by_kind("placement") if f.details.get("strategy") == "constant"]
    assert not finding.applied
    assert "autoopt.constant" in finding.message and "cannot prove" in finding.message


def test_autoopt_constant_stays_the_explicit_way_to_place_a_table_once():
    table = np.ones((256, 16), np.float32)
    c = autoopt.constant(table)
    ref, opt = _both(lambda t, x: t @ x)
    x = jnp.ones(16)
    expected = ref(table, x)
    np.testing.assert_array_equal(opt(c, x), expected)
    with jax.transfer_guard_host_to_device("disallow"):  # placed once: no transfer a call
        got = [opt(c, x) for _ in range(3)]
    for y in got:
        np.testing.assert_array_equal(y, expected)


# --- 2. large closed-over constants -----------------------------------------------------------


def _closed_over_sequence(big: np.ndarray):
    """Calls over two signatures with the closed-over array changed in between, as a user
    editing a global table between steps; returns (jax.jit results, autoopt results)."""

    def score(x):
        return (big * x).sum()

    ref, opt = _both(score)
    got_ref, got_opt = [], []
    for value, shape in ((1.0, ()), (2.0, ()), (2.0, (1,)), (3.0, ()), (3.0, (1,)), (3.0, (1, 1))):
        big[...] = value
        x = jnp.ones(shape)
        got_ref.append(float(ref(x).sum()))
        got_opt.append(float(opt(x).sum()))
    return got_ref, got_opt


@pytest.mark.parametrize("aligned", [False, True])
def test_closed_over_array_changed_between_signatures_gives_jax_jits_numbers(aligned):
    n = 512 * 1024  # 2 MiB of float32: above the size passed as a device argument
    big = _aligned(n) if aligned else np.empty(n, np.float32)
    got_ref, got_opt = _closed_over_sequence(big)
    assert got_opt == got_ref
    assert len(set(got_ref)) > 1  # the sequence does see new bytes in new signatures


def test_closed_over_array_keeps_its_first_bytes_when_a_new_constant_retraces_old_signatures():
    a = np.ones(512 * 1024, np.float32)
    b = np.full(512 * 1024, 10.0, np.float32)

    def score(x):
        if x.ndim == 0:
            return (a * x).sum()
        return (a * x[0]).sum() + (b * x[0]).sum()  # a second large constant: a new argument

    ref, opt = _both(score)
    calls = [(1.0, ()), (5.0, (1,)), (7.0, ()), (7.0, (1,))]
    for value, shape in calls:
        a[:] = value
        x = jnp.ones(shape)
        assert float(opt(x)) == float(ref(x))


def test_closed_over_array_unchanged_is_still_passed_as_a_device_argument():
    big = np.arange(512 * 1024, dtype=np.float32)

    def score(x):
        return (big * x).sum()

    opt = autoopt.optimize(score, fallback="raise")
    x = jnp.ones(())
    assert float(opt(x)) == float(jax.jit(score)(x))
    assert opt.inspect(x).placement.hoisted is not None


@pytest.mark.parametrize(
    "splat",
    [
        np.ones(512 * 1024, np.float32),
        jnp.zeros((512, 1024)),
        np.full(300_000, -0.0, np.float32),
        np.full(300_000, np.nan, np.float32),
    ],
    ids=["numpy ones", "jax zeros", "negative zeros", "nans"],
)
def test_a_large_constant_of_one_repeated_value_stays_embedded_as_jax_jit_embeds_it(splat):
    """A splat costs nothing embedded (XLA knows its value; passed as an argument the program
    ran slower on XLA:CPU), so it is not hoisted, and no finding asks to pass it."""

    def score(x):
        return (splat * x).sum()

    opt = autoopt.optimize(score, fallback="raise")
    x = jnp.float32(2.0)
    got, want = opt(x), jax.jit(score)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert opt.inspect(x).placement.hoisted is None
    assert not [
        f
        for f in opt.explain(x).by_kind("placement")
        if f.details.get("strategy") == "closed_constant"
    ]


def test_a_constant_differing_in_one_bit_is_not_a_splat():
    """Bytes, not values: -0.0 beside 0.0, or one NaN payload beside another, is two values."""
    zeros = np.zeros(300_000, np.float32)
    zeros[-1] = -0.0
    nans = np.full(300_000, np.nan, np.float32)
    nans.view(np.uint32)[123_456] ^= 1  # another NaN payload
    for big in (zeros, nans):

        def score(x, big=big):
            return (big * x).sum()

        opt = autoopt.optimize(score, fallback="raise")
        x = jnp.float32(2.0)
        np.testing.assert_array_equal(np.asarray(opt(x)), np.asarray(jax.jit(score)(x)))
        assert opt.inspect(x).placement.hoisted is not None


# --- 3. shared device copies are never donated -----------------------------------------------


@pytest.mark.parametrize("writeable", [False, True])
def test_explicit_donation_of_the_host_array_leaves_its_constant_intact(writeable):
    table = np.arange(16, dtype=np.float32).reshape(4, 4).copy()  # owns its data
    table.flags.writeable = writeable
    c = autoopt.constant(table)
    double = autoopt.optimize(lambda t: t * 2, donate_argnums=0, fallback="raise")
    for _ in range(3):
        np.testing.assert_array_equal(double(table), table * 2)
    assert not c.device_array.is_deleted()
    np.testing.assert_array_equal(jax.jit(lambda t: t + 1)(c), table + 1)


@pytest.mark.parametrize(
    "options, call",
    [
        ({"donate_argnums": 0}, lambda f, c, x: f(c, x)),
        ({"donate_argnames": "t"}, lambda f, c, x: f(c, x)),
        ({"donate_argnames": "t"}, lambda f, c, x: f(t=c, x=x)),
        ({"donate_argnums": 0, "placement": "off"}, lambda f, c, x: f(c, x)),
    ],
)
def test_explicit_donation_of_an_autoopt_constant_gets_a_fresh_copy(options, call):
    table = np.arange(16, dtype=np.float32).reshape(4, 4)
    c = autoopt.constant(table)
    other = autoopt.constant(table)  # shares the device copy with c

    def step(t, x):
        return t * x

    opt = autoopt.optimize(step, fallback="raise", **options)
    x = jnp.full((4, 4), 2.0)
    for _ in range(3):
        np.testing.assert_array_equal(call(opt, c, x), table * 2)
    assert not c.device_array.is_deleted() and not other.device_array.is_deleted()
    np.testing.assert_array_equal(np.asarray(other.device_array), table)


# --- 4. prefetch never hands out memory the loader can still write --------------------------------


def _refilling_loader(buf: np.ndarray, n: int):
    for i in range(n):
        buf[...] = i  # one host buffer, refilled for every batch
        yield buf


@pytest.mark.parametrize("n", [1024, 1 << 18])
@pytest.mark.parametrize("where", ["default", "device"])
def test_prefetch_of_a_refilled_buffer_hands_out_each_batchs_own_data(n, where):
    sharding = jax.devices()[0] if where == "device" else None
    batches = autoopt.prefetch(_refilling_loader(_aligned(n), 24), size=4, sharding=sharding)
    got = [np.asarray(b) for b in list(batches)]  # all held at once: nothing may alias
    for i, b in enumerate(got):
        np.testing.assert_array_equal(b, np.full(n, i, np.float32))


def test_prefetch_of_refilled_pytree_batches_hands_out_each_batchs_own_data():
    bufs = {"image": _aligned(4096).reshape(64, 64), "label": _aligned(16)}

    def loader():
        for i in range(12):
            for v in bufs.values():
                v[...] = i
            yield bufs

    got = list(autoopt.prefetch(loader(), size=3))
    for i, b in enumerate(got):
        assert float(b["image"].min()) == float(b["image"].max()) == i
        assert float(b["label"].min()) == float(b["label"].max()) == i


def test_prefetch_keeps_a_bounded_number_of_compiled_unpackers():
    def loader():
        for k in range(40):  # a new packed layout a batch: 16 small leaves of a new shape
            yield [np.full((k + 1,), k, np.float32) for _ in range(16)]

    it = autoopt.prefetch(loader(), size=2)
    for k, batch in enumerate(it):
        assert float(batch[-1][0]) == k
        sizes = it.cache_sizes()
        assert sizes["unpackers"] <= sizes["unpackers_max"] <= 32
        assert sizes["pools"] <= sizes["pools_max"] <= 64
    assert it.cache_sizes()["unpackers"] == it.cache_sizes()["unpackers_max"]
