"""Review of 68d4348: a large closed-over constant of one repeated value stays embedded.

Each test runs the same function under ``jax.jit`` and ``autoopt.optimize``, in the same order of
calls, with ``jax.jit`` as the oracle: bit-identical numbers, no array of the caller deleted,
nothing jax.jit would not raise. ``jax.jit`` bakes a closed-over NumPy array's bytes into a
signature's executable when that signature is first traced; a later signature retraces and reads
the bytes of that moment.

Tests named ``test_bug_...`` fail on the commit under review (reported to the lead; not xfailed).
"""

import threading
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import autoopt
from tests.test_native_call_path import _run

MIB = 1 << 20


def _both(fn, **options) -> tuple[Any, Any]:
    return jax.jit(fn), autoopt.optimize(fn, fallback="raise", **options)


def _assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def _full(nbytes: int, value, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    return np.full(max(2, nbytes // dtype.itemsize), value, dtype)


def _nan_with_payload(dtype, payload: int):
    bits = {np.dtype(np.float32): np.uint32, np.dtype(np.float16): np.uint16}[np.dtype(dtype)]
    quiet = {np.uint32: 0x7FC00000, np.uint16: 0x7E00}[bits]
    return np.array(quiet | payload, bits).view(dtype)[()]


# --- 1. which constants are splats: dtypes and byte patterns -------------------------------------

SPLATS = {
    "bool": (True, np.bool_),
    "int8": (-3, np.int8),
    "uint8": (255, np.uint8),
    "bfloat16": (1.5, ml_dtypes.bfloat16),
    "float16 -0.0": (-0.0, np.float16),
    "float32 nan payload": (_nan_with_payload(np.float32, 0x123), np.float32),
    "float16 nan payload": (_nan_with_payload(np.float16, 0x5), np.float16),
    "complex64": (1 - 2j, np.complex64),
    "complex64 -0.0 imag": (complex(0.0, -0.0), np.complex64),
    "float64 (x64 off)": (0.1, np.float64),
    "int32 min": (np.iinfo(np.int32).min, np.int32),
    "int4": (-7, ml_dtypes.int4),
    "float8_e4m3fn nan": (float("nan"), ml_dtypes.float8_e4m3fn),
}


def _bytes_of(big, x):
    """An output that carries every byte of ``big`` (through ``x`` so nothing constant-folds
    away the call)."""
    if big.dtype == jnp.bool_:
        return big & (x > 0)
    return big * x.astype(jax.dtypes.canonicalize_dtype(big.dtype))


@pytest.mark.parametrize("value,dtype", SPLATS.values(), ids=SPLATS.keys())
def test_splat_of_each_dtype_gives_jax_jits_bits(value, dtype):
    big = _full(2 * MIB, value, dtype)

    def f(x):
        return _bytes_of(big, x)

    ref, opt = _both(f)
    x = jnp.float32(1.0)
    _assert_same_bits(opt(x), ref(x))
    _assert_same_bits(opt(x), ref(x))  # the cached call too


def _one_differs(value, dtype, other):
    big = _full(2 * MIB, value, dtype)
    big[-1] = other
    return big


NEAR_SPLATS = {
    "float16 0.0 then -0.0": (0.0, np.float16, -0.0),
    "bfloat16 0.0 then -0.0": (0.0, ml_dtypes.bfloat16, -0.0),
    "float32 nan payloads": (
        _nan_with_payload(np.float32, 1),
        np.float32,
        _nan_with_payload(np.float32, 2),
    ),
    "complex -0.0 imag": (complex(1.0, 0.0), np.complex64, complex(1.0, -0.0)),
    "bool": (False, np.bool_, True),
    "float64 equal as float32": (1.0, np.float64, 1.0 + 2.0**-40),
}


@pytest.mark.parametrize("value,dtype,other", NEAR_SPLATS.values(), ids=NEAR_SPLATS.keys())
def test_constant_differing_in_its_last_element_only_gives_jax_jits_bits(value, dtype, other):
    big = _one_differs(value, dtype, other)

    def f(x):
        return _bytes_of(big, x)

    ref, opt = _both(f)
    x = jnp.float32(1.0)
    _assert_same_bits(opt(x), ref(x))
    big[:] = value  # now a splat: the signature's executable keeps its first bytes
    _assert_same_bits(opt(x), ref(x))


# --- 2. layouts: views that are not contiguous ---------------------------------------------

VIEWS = {
    "strided splat": lambda: np.ones(2 * 512 * 1024, np.float32)[::2],
    "transposed splat": lambda: np.full((1024, 512), 7.0, np.float32).T,
    "negative strides splat": lambda: np.full((512, 1024), -2.0, np.float32)[::-1, ::-1],
    "broadcast_to scalar (0 strides)": lambda: np.broadcast_to(np.float32(3.0), (512, 1024)),
    "broadcast_to a row (0 strides)": lambda: np.broadcast_to(
        np.arange(1024, dtype=np.float32), (512, 1024)
    ),
    "transposed non-splat": lambda: np.arange(512 * 1024, dtype=np.float32).reshape(1024, 512).T,
    "negative strides non-splat": lambda: np.arange(512 * 1024, dtype=np.float32)[::-1],
}


@pytest.mark.parametrize("make", VIEWS.values(), ids=VIEWS.keys())
def test_non_contiguous_constant_gives_jax_jits_bits(make):
    big = make()

    def f(x):
        return big * x, (big * x).sum(axis=0)

    ref, opt = _both(f)
    x = jnp.float32(1.5)
    for g, w in zip(opt(x), ref(x)):
        _assert_same_bits(g, w)


def test_small_zero_d_size_one_and_empty_constants_give_jax_jits_bits():
    zero_d = np.float32(np.nan)
    one = np.full((1,), -0.0, np.float32)
    empty = np.zeros((0, MIB), np.float32)

    def f(x):
        return zero_d * x, one * x, empty * x

    ref, opt = _both(f)
    x = jnp.float32(2.0)
    for g, w in zip(opt(x), ref(x)):
        _assert_same_bits(g, w)


# --- 3. typed PRNG keys, jax arrays, sharded arrays --------------------------------------------


@pytest.mark.parametrize("splat", [True, False], ids=["one key repeated", "split keys"])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_large_typed_key_array_constant_gives_jax_jits_bits(splat, impl):
    n = MIB // 8  # threefry: 8 bytes a key; rbg: 16
    key = jax.random.key(0, impl=impl)
    keys = jnp.broadcast_to(key, (n,)) if splat else jax.random.split(key, n)
    keys = jnp.array(keys)  # a materialized (not broadcast) array

    def f(x):
        return jax.vmap(lambda k: jax.random.uniform(k))(keys)[:1024] * x

    ref, opt = _both(f)
    x = jnp.float32(2.0)
    _assert_same_bits(opt(x), ref(x))
    assert not keys.is_deleted()


@pytest.mark.parametrize("splat", [True, False], ids=["jnp.zeros", "jnp.arange"])
def test_large_jax_array_constant_is_never_deleted_by_donation(splat):
    big = jnp.zeros(512 * 1024) if splat else jnp.arange(512 * 1024, dtype=jnp.float32)
    kept = big

    def step(x):
        return x + big

    ref, opt = _both(step, donate="auto")
    x = jnp.ones(512 * 1024)
    want = ref(x)
    for _ in range(3):
        x = opt(x)
    _assert_same_bits(x, want + 2 * big)
    assert not big.is_deleted() and not kept.is_deleted()


_SHARDED = """
    import jax, jax.numpy as jnp, numpy as np
    import autoopt
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("d",))
    sh = NamedSharding(mesh, P("d"))
    splat = jax.device_put(jnp.zeros((1024, 512)), sh)
    rand = jax.device_put(jnp.arange(1024 * 512, dtype=jnp.float32).reshape(1024, 512), sh)
    def f(x):
        return {BODY}
    ref, opt = jax.jit(f), autoopt.optimize(f, fallback="raise")
    x = jnp.float32(3.0)
    for _ in range(2):
        for g, w in zip(opt(x), ref(x)):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
            if {SHARDINGS}:
                assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
    assert not splat.is_deleted() and not rand.is_deleted()
    print("ok")
"""
_FOUR_CPUS = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


@pytest.mark.parametrize("splat", [True, False], ids=["jnp.zeros", "jnp.arange"])
def test_closed_over_jax_array_donated_elsewhere_raises_where_jax_jit_does_not(splat):
    """PRE-EXISTING for a hoisted constant (the jnp.arange case; 68d4348 fixed the splat
    case). jax.jit embeds a copy of a closed-over jax array; autoopt passes the array itself
    as the hoisted argument (``device_put`` to its own device copies nothing), so once
    another jit donates that array the same signature raises ``RuntimeError: Array has been
    deleted`` where jax.jit returns 6.0."""
    table = jnp.zeros(512 * 1024) if splat else jnp.arange(512 * 1024, dtype=jnp.float32)

    def lookup(i):
        return table[i] * 2

    ref, opt = _both(lookup)
    assert float(opt(3)) == float(ref(3))
    bump = jax.jit(lambda t: t + 1, donate_argnums=0)
    bumped = bump(table)  # donates the buffer the closure still holds
    assert table.is_deleted() and not bumped.is_deleted()
    assert float(opt(3)) == float(ref(3))


def test_sharded_constants_over_four_cpu_devices_give_jax_jits_bits():
    body = "splat + x, rand * x, (splat * rand).sum() + x, splat.sum() + x"
    code = _SHARDED.replace("{BODY}", body).replace("{SHARDINGS}", "False")
    assert _run(code, True, _FOUR_CPUS).strip().endswith("ok")


def test_sharded_splat_constant_gives_jax_jits_output_sharding():
    code = _SHARDED.replace("{BODY}", "splat + x, splat.sum() + x").replace("{SHARDINGS}", "True")
    assert _run(code, True, _FOUR_CPUS).strip().endswith("ok")


def test_sharded_hoisted_constant_changes_the_output_sharding():
    """PRE-EXISTING (68d4348 fixed it for splats only). jax.jit embeds a closed-over array
    sharded over 4 CPU devices and returns single-device outputs (SingleDeviceSharding on
    CpuDevice 0); autoopt passes it as an argument and its outputs come back sharded over the
    4 devices (NamedSharding P('d') / P()). Same numbers, other devices: code that mixes the
    result with arrays committed to device 0 may meet errors jax.jit would not raise."""
    code = _SHARDED.replace("{BODY}", "rand * x, rand.sum() + x").replace("{SHARDINGS}", "True")
    assert _run(code, True, _FOUR_CPUS).strip().endswith("ok")


_COMMITTED_ELSEWHERE = """
    import jax, jax.numpy as jnp, numpy as np
    import autoopt
    d0, d2 = jax.devices()[0], jax.devices()[2]
    c = jax.device_put({MAKE}, d2)  # a closed-over array committed to device 2
    def f(x):
        return c * x
    bias = jax.device_put(jnp.ones(512 * 1024), d0)
    want = jax.jit(f)(jnp.float32(2.0))
    got = autoopt.optimize(f, fallback="raise")(jnp.float32(2.0))
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    assert got.devices() == want.devices(), (got.devices(), want.devices())
    (want + bias).block_until_ready()
    (got + bias).block_until_ready()  # jax.jit's output combines with device 0's arrays
    print("ok")
"""


def test_splat_committed_to_another_device_gives_jax_jits_device():
    code = _COMMITTED_ELSEWHERE.replace("{MAKE}", "jnp.zeros(512 * 1024)")
    assert _run(code, True, _FOUR_CPUS).strip().endswith("ok")


def test_hoisted_constant_committed_to_another_device_moves_the_output_there():
    """PRE-EXISTING (68d4348 fixed it for splats only). jax.jit embeds a closed-over array
    committed to CpuDevice 2 and computes on the default device 0; autoopt passes it as an
    argument and the output lands on device 2, so ``out + bias_on_device_0`` raises
    ``ValueError: Received incompatible devices for jitted computation`` where jax.jit's
    does not."""
    code = _COMMITTED_ELSEWHERE.replace("{MAKE}", "jnp.arange(512 * 1024, dtype=jnp.float32)")
    assert _run(code, True, _FOUR_CPUS).strip().endswith("ok")


def test_float64_splat_with_x64_gives_jax_jits_bits():
    out = _run(
        """
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp, numpy as np
        import autoopt
        big = np.full(256 * 1024, 0.1, np.float64)  # 2 MiB
        near = big.copy(); near[-1] = np.nextafter(0.1, 1.0)
        for c in (big, near):
            def f(x, c=c):
                return c * x
            ref, opt = jax.jit(f), autoopt.optimize(f, fallback="raise")
            x = jnp.float64(3.0)
            g, w = opt(x), ref(x)
            assert g.dtype == w.dtype == np.float64
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes()
        print("ok")
        """,
        True,
    )
    assert out.strip().endswith("ok")


# --- 4. constants refilled between calls ---------------------------------------------------------


def _same_results(make_big, body, script):
    """``script(fn, big)`` under jax.jit and under optimize, each on a fresh constant from
    ``make_big`` closed over by ``body(big, x)``: the same outputs, bit for bit. A script
    calls from distinct lines on purpose: each line is a call site of its own under
    ``donate="safe"``, as in a user's program (a loop's single site hides some retraces)."""
    results = []
    for wrap in (jax.jit, lambda fn: autoopt.optimize(fn, fallback="raise")):
        big = make_big()
        fn = wrap(lambda x, big=big: body(big, x))
        results.append([np.asarray(o) for o in script(fn, big)])
    for i, (w, g) in enumerate(zip(*results)):
        assert g.tobytes() == w.tobytes(), f"output {i}: autoopt {g}, jax.jit {w}"


def _splat(n=512 * 1024):
    return lambda: np.ones(n, np.float32)


def _arange(n=512 * 1024):
    return lambda: np.arange(n, dtype=np.float32)


def _sum_times(big, x):
    return (big * x.astype(jnp.float32)).sum()


F32, BF16 = jnp.float32(2.0), jnp.ones((), ml_dtypes.bfloat16)


@pytest.mark.parametrize(
    "make_big,then",
    [(_splat(), np.arange(512 * 1024)), (_arange(), 1.0), (_splat(), 5.0)],
    ids=["splat then non-splat", "non-splat then splat", "splat then another splat"],
)
def test_refilled_constant_same_signature_keeps_its_first_bytes(make_big, then):
    def script(fn, big):
        a = fn(F32)
        big[:] = then
        b = fn(F32)
        c = fn(F32)
        return a, b, c

    _same_results(make_big, _sum_times, script)


@pytest.mark.parametrize(
    "make_big,then",
    [(_splat(), np.arange(512 * 1024)), (_arange(), 1.0), (_splat(), 5.0)],
    ids=["splat then non-splat", "non-splat then splat", "splat then another splat"],
)
def test_refilled_constant_then_a_new_signature_from_one_call_site(make_big, then):
    def script(fn, big):
        out = []
        for i, x in enumerate((F32, BF16, F32, BF16)):
            if i == 1:
                big[:] = then
            out.append(fn(x))
        return out

    _same_results(make_big, _sum_times, script)


@pytest.mark.parametrize(
    "make_big,then",
    [(_arange(), 1.0), (_splat(), 5.0)],
    ids=["non-splat then splat", "splat then another splat"],
)
def test_refilled_constant_then_a_new_signature_from_other_call_sites(make_big, then):
    def script(fn, big):
        a = fn(F32)
        big[:] = then
        b = fn(BF16)
        c = fn(F32)
        d = fn(BF16)
        return a, b, c, d

    _same_results(make_big, _sum_times, script)


def _refill_then_bf16(fn, big):
    a = fn(F32)
    big[:] = np.arange(big.size)
    b = fn(BF16)
    c = fn(F32)
    return a, b, c


def _refill_then_keyword(fn, big):
    a = fn(F32)
    big[:] = np.arange(big.size)
    b = fn(x=F32)  # jax.jit: a keyword is a new signature, traced again
    c = fn(F32)
    return a, b, c


@pytest.mark.parametrize(
    "script", [_refill_then_bf16, _refill_then_keyword], ids=["new dtype", "keyword"]
)
def test_splat_refilled_non_splat_then_new_signature_changes_the_first_signatures_numbers(
    script,
):
    """REGRESSION of 68d4348 (passes on 68d4348^). The new signature hoists the refilled
    constant; calls then pass it, so a new call site of the first signature traces its
    wrapper again, which embeds the constant's *current* bytes: autoopt returns 2.7487738e+11
    where jax.jit (and autoopt before the commit) keep the first trace's 1048576.0."""
    _same_results(_splat(), _sum_times, script)


_OTHER = np.arange(512 * 1024, dtype=np.float32)


def _splat_and_hoisted_in_bf16(big, x):
    r = (big * x.astype(jnp.float32)).sum()
    if x.dtype == ml_dtypes.bfloat16:  # only this signature closes over a non-splat
        r = r + (_OTHER * x.astype(jnp.float32)).sum()
    return r


def _refill_then_hoist_elsewhere(fn, big):
    a = fn(F32)
    big[:] = 5.0
    b = fn(BF16)
    c = fn(F32)
    return a, b, c


def test_splat_refilled_then_another_signature_hoists_a_constant_changes_numbers():
    """REGRESSION of 68d4348 (passes on 68d4348^). The splat is refilled with another splat;
    a second signature hoists an unrelated constant, so the first signature's wrapper is
    traced again (a new hoisted kwarg) and embeds the splat's current bytes: autoopt
    5242880.0, jax.jit 1048576.0."""
    _same_results(_splat(), _splat_and_hoisted_in_bf16, _refill_then_hoist_elsewhere)


def test_small_constant_refilled_then_another_signature_hoists_a_constant_changes_numbers():
    """PRE-EXISTING (fails on 68d4348^ too): the same retrace with a constant under 1 MiB,
    which was always embedded: autoopt 10000.0, jax.jit 2000.0."""
    _same_results(
        lambda: np.ones(1000, np.float32), _splat_and_hoisted_in_bf16, _refill_then_hoist_elsewhere
    )


def _many_leaves_and_a_constant(big, xs):
    return sum(x.sum() for x in xs) + (big * xs[1][0]).sum()


_LEAVES = [np.full(8, i, np.float32) for i in range(64)]


@pytest.mark.parametrize(
    "make_big",
    [
        pytest.param(_splat(300_000), id="large splat (REGRESSION of 68d4348)"),
        pytest.param(lambda: np.ones(1000, np.float32), id="small constant (PRE-EXISTING)"),
    ],
)
def test_refilled_constant_with_packing_trials_changes_numbers_between_calls(make_big):
    """Many small NumPy leaves: the placer times packing against plain jit over the first
    calls, and each strategy's first call traces the wrapper again, embedding the constant's
    bytes of that moment. One signature, one call site, no new argument: autoopt's results
    switch between the old and the refilled bytes from call to call (916128.0 among
    316128.0), jax.jit's never change."""

    def script(fn, big):
        out = [fn(_LEAVES)]
        big[:] = 3.0
        for _ in range(40):
            out.append(fn(_LEAVES))
        return out

    _same_results(make_big, _many_leaves_and_a_constant, script)


def test_refilled_constant_under_grad_vmap_and_lower_gives_jax_jits_numbers():
    """jax.jit retraces under grad and vmap (new bytes) and reuses its lowering for
    ``.lower`` and the plain call (first bytes)."""

    def script(fn, big):
        a = fn(F32)
        big[:] = np.arange(big.size)
        b = fn(F32)
        c = jax.grad(fn)(F32)
        d = jax.vmap(fn)(jnp.ones(2, jnp.float32))
        e = fn.lower(F32).compile()(F32)
        f = fn(F32)
        return a, b, c, d, e, f

    _same_results(_splat(), _sum_times, script)


def test_constant_shared_by_two_optimized_functions_refilled_between_their_first_calls():
    big = np.ones(512 * 1024, np.float32)

    def f(x):
        return (big * x).sum()

    def g(x):
        return (big + x).sum()

    results = []
    for wrap in (jax.jit, lambda fn: autoopt.optimize(fn, fallback="raise")):
        big[:] = 1.0
        jf, jg = wrap(f), wrap(g)
        out = [jf(F32)]
        big[:] = np.arange(big.size)
        out += [jg(F32), jf(F32)]
        big[:] = 2.0
        out += [jg(F32), jf(F32), jf(BF16), jg(BF16)]
        results.append([np.asarray(o).tobytes() for o in out])
    assert results[0] == results[1]


def test_explain_says_passed_as_argument_for_a_splat_refilled_after_its_first_call():
    """REGRESSION of 68d4348 (report only): the finding reads ``is_splat`` of the constant's
    current bytes, the program the cached decision of its first look. After a splat is
    refilled, explain says the constant "is passed to the compiled program as a device
    argument" (applied) while ``inspect`` shows nothing hoisted: it is embedded."""
    big = np.ones(512 * 1024, np.float32)

    def f(x):
        return (big * x).sum()

    opt = autoopt.optimize(f, fallback="raise")
    x = jnp.float32(2.0)
    opt(x)
    big[:] = np.arange(big.size)
    claimed = [
        f
        for f in opt.explain(x).by_kind("placement")
        if f.details.get("strategy") == "closed_constant" and f.applied
    ]
    hoisted = opt.inspect(x).placement.hoisted is not None
    assert bool(claimed) == hoisted, (claimed, hoisted)


# --- 5. threads -----------------------------------------------------------------------------------


def test_threads_tracing_signatures_at_once_give_jax_jits_numbers():
    big = np.ones((256, 1024), np.float32)
    rand = np.arange(256 * 1024, dtype=np.float32).reshape(256, 1024)

    def f(x):
        return (big * x[:1]).sum() + (rand * x[:1]).sum() + x.sum()

    opt, ref = autoopt.optimize(f, fallback="raise"), jax.jit(f)
    shapes = [(n,) for n in range(1, 13)]
    want = {s: np.asarray(ref(jnp.ones(s, jnp.float32))) for s in shapes}
    errors: list = []
    got: dict = {}
    barrier = threading.Barrier(len(shapes))

    def call(s):
        try:
            barrier.wait()
            got[s] = np.asarray(opt(jnp.ones(s, jnp.float32)))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(s,)) for s in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for s in shapes:
        assert got[s].tobytes() == want[s].tobytes(), s


# --- 6. grad / vmap / outer jit of the optimized function -----------------------------------------


@pytest.mark.parametrize("value", [1.0, -0.0, float("nan")], ids=["ones", "-0.0", "nan"])
def test_grad_vmap_and_outer_jit_with_a_splat_constant_give_jax_jits_bits(value):
    big = np.full((512, 1024), value, np.float32)

    def loss(w):
        return jnp.sum(jnp.tanh(big @ w))

    ref, opt = _both(loss)
    w = jnp.linspace(-1, 1, 1024 * 4, dtype=jnp.float32).reshape(1024, 4)
    w2 = jnp.stack([w, -w], axis=2)
    for t, arg in (
        (lambda f: f, w),
        (jax.grad, w),
        (lambda f: jax.vmap(f, in_axes=2), w2),
        (lambda f: jax.jit(jax.grad(f)), w),
    ):
        _assert_same_bits(t(opt)(arg), t(ref)(arg))
