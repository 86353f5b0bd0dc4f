"""A hostile review of fa0568d and 80e3757: the optimized program is staged into jax.jit's
trace by copying its equations (``_compat.stage_jaxpr``) instead of binding each primitive
again; decisions on disk are keyed by a structural fingerprint (``_jaxpr.fingerprint``) instead
of the printed jaxpr; ``dtype_interval`` is cached per dtype; a call with a jax.Ref argument
traces once.

What must hold: autoopt's numbers, dtypes, effects, locations and errors are jax.jit's, and two
programs the printed jaxpr tells apart never share a fingerprint (a decision measured for one
would be applied to the other). The failing tests are the bugs found; the others guard what
was checked and held."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import io_callback

import autoopt
from autoopt import _jaxpr
from autoopt.passes.in_place import _ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code: str, **env: str) -> str:
    """``code`` in a fresh interpreter of this tree; its last line of output."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _leaves(tree) -> list[tuple[str, bytes]]:
    return [(str(jax.typeof(v)), np.asarray(v).tobytes()) for v in jax.tree_util.tree_leaves(tree)]


# --- bugs ---------------------------------------------------------------------------------------


def test_a_rewrite_whose_result_type_is_stale_still_gives_jax_jits_numbers():
    """Binding each equation again recomputed its result type, so a rewrite that left an
    equation's declared type stale failed while the program was staged, and ``_evaluate`` fell
    back to the original (a warning, jax.jit's numbers). Copying the equations trusts the
    declared types: the mistake reaches the compiler, which converts to the stale type, and
    the call returns other numbers, silently. Shown with a pass registered through the public
    ``autoopt.passes.register``, in a process with the production setting (AUTOOPT_CHECK
    unset: no type check of rewritten programs)."""
    got = _run_python(
        """
        import json, warnings
        import jax, jax.numpy as jnp, numpy as np
        from jax import lax
        import autoopt
        from autoopt.passes import Pass, PassResult, register

        def stale(closed, ctx):  # sin -> convert to bf16, the result's type left f32
            eqns = [
                e.replace(
                    primitive=lax.convert_element_type_p,
                    params=dict(new_dtype=jnp.dtype(jnp.bfloat16), weak_type=False,
                                sharding=None),
                )
                if e.primitive is lax.sin_p else e
                for e in closed.jaxpr.eqns
            ]
            return PassResult(closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns)), True)

        register(Pass(name="review_stale_type", run=stale))
        f = lambda x: jnp.sin(x) * 3.0
        x = jnp.linspace(0.0, 1.0, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = autoopt.optimize(f)(x)
        print(json.dumps([np.asarray(got).tolist(), np.asarray(jax.jit(f)(x)).tolist()]))
        """,
        AUTOOPT_CHECK="0",
    )
    got, want = json.loads(got)
    assert got == want


def test_the_fingerprint_tells_a_constant_from_an_argument():
    """``{ lambda a; b. mul b a }`` (a closed-over constant) and ``{ lambda ; a b. mul b a }``
    (two arguments) print differently, but the fingerprint lists constvars and invars as one
    sequence. The decision on disk is keyed by the fingerprint, the budget, the candidates and
    the donated input positions, not the input types: one function's measured decision is
    read for the other."""
    c = jnp.arange(3.0)
    closing = jax.make_jaxpr(lambda x: x * c)(jnp.ones(3))
    passing = jax.make_jaxpr(lambda c, x: x * c)(c, jnp.ones(3))
    assert str(closing) != str(passing)  # the premise: the text tells them apart
    assert _jaxpr.fingerprint(closing) != _jaxpr.fingerprint(passing)


_REF_PROGRAMS = {
    "new_ref": """
        def f(x):
            r = jax.new_ref(x)
            r[...] = r[...] * 2
            return r[...] + 1
        """,
    "pallas_call": """
        from jax.experimental import pallas as pl

        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2 + 1

        def f(x):
            block = pl.BlockSpec((4,), lambda i: (i,))
            out = jax.ShapeDtypeStruct(x.shape, x.dtype)
            call = pl.pallas_call(
                kernel, out_shape=out, grid=(2,), in_specs=[block], out_specs=block,
                interpret=True,
            )
            return call(x)
        """,
}


@pytest.mark.parametrize("program", list(_REF_PROGRAMS))
def test_the_fingerprint_of_a_program_with_refs_is_the_same_in_another_process(program):
    """The fingerprint keys decisions kept on disk, so it must be the same in every process.
    Effects are written as ``str(effect)``: a ref's ``ReadEffect(Var(id=...))`` and
    ``InternalMutableArrayEffect object at 0x...`` carry addresses (the printed jaxpr shows
    no effects, so the key it replaced was stable): a program using ``jax.new_ref``, or any
    Pallas kernel (its body reads and writes refs), never finds its decision again."""
    code = (
        "import jax, jax.numpy as jnp\nfrom autoopt import _jaxpr\n"
        + textwrap.dedent(_REF_PROGRAMS[program])
        + "\nprint(_jaxpr.fingerprint(jax.make_jaxpr(f)(jnp.arange(8.0))))\n"
    )
    assert _run_python(code) == _run_python(code)


def _nan_step(x):
    y = jnp.sin(x)
    return jnp.log(y - 2) * 2


@pytest.mark.parametrize("nested", [False, True], ids=["top", "inside-jit"])
def test_debug_nans_points_at_the_users_line_as_jax_jit_does(nested):
    """Under jax_debug_nans, jax.jit calls the de-optimized function again on a NaN, so the
    FloatingPointError's traceback ends in the user's function, at the line that made it.
    autoopt's wrapper, called again eagerly, evaluates the traced program instead: the
    traceback never reaches ``_nan_step`` (the message is the same). Not from these commits
    (80e3757 behaves alike)."""
    x = jnp.arange(4.0)

    def frames(g):
        h = jax.jit(lambda a: g(a)) if nested else g
        with jax.debug_nans(True), pytest.raises(FloatingPointError) as info:
            h(x)
        return [f.name for f in traceback.extract_tb(info.value.__traceback__)]

    want = frames(jax.jit(_nan_step))
    assert "_nan_step" in want  # the premise
    assert "_nan_step" in frames(autoopt.optimize(_nan_step))


def test_inspect_of_a_call_with_a_ref_says_what_it_cannot_do():
    """A jax.Ref argument runs the function as plain jax.jit (no program). ``inspect`` with
    concrete arguments, one a Ref, says they are "traced by an enclosing transformation" and
    asks for "concrete arrays": they are concrete already. Not from these commits."""

    def f(r, x):
        r[...] = r[...] + x
        return r[...] * 2

    fast = autoopt.optimize(f)
    r, x = jax.new_ref(jnp.zeros(3)), jnp.ones(3)
    fast(r, x)
    try:
        fast.inspect(r, x)
    except Exception as e:  # noqa: BLE001 - refusing is fine; the reason must be true
        assert "traced by an enclosing transformation" not in str(e), str(e)


# --- held: effects, callbacks, locations, autodiff, constants -----------------------------------

_LOG: list = []


def _record(tag):
    def callback(v):
        _LOG.append((tag, np.asarray(v).tolist()))
        return np.asarray(v)

    return callback


def _effects(x):
    jax.debug.callback(_record("a"), x, ordered=True)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
    y = io_callback(_record("b"), spec, x * 2, ordered=True)
    jax.debug.callback(_record("c"), y + 1, ordered=True)
    z = io_callback(_record("d"), spec, y, ordered=False)
    jax.debug.callback(_record("e"), z)
    return z


_WRAPS = {
    "top": lambda g: g,
    "jit": lambda g: jax.jit(lambda a: g(a)),
    "scan": lambda g: jax.jit(lambda a: jax.lax.scan(lambda c, _: (g(c), None), a, None, 2)[0]),
    "cond": lambda g: jax.jit(lambda a: jax.lax.cond(a[0] < 1, g, lambda b: b, a)),
}


@pytest.mark.parametrize("where", list(_WRAPS))
def test_ordered_callbacks_run_in_jax_jits_order(where):
    x = jnp.arange(3.0)
    seen = {}
    for name, g in [("jit", jax.jit(_effects)), ("ao", autoopt.optimize(_effects))]:
        _LOG.clear()
        out = _WRAPS[where](g)(x)
        out = _WRAPS[where](g)(x)  # a second call: the staged program, from the cache
        jax.effects_barrier()
        seen[name] = (list(_LOG), np.asarray(out).tolist())
    assert seen["ao"] == seen["jit"]


def _refs(x):
    r = jax.new_ref(x)
    r[...] = r[...] * 2

    def body(i, c):
        r[...] = r[...] + i
        return c + r[0]

    c = jax.lax.fori_loop(0, 3, body, 0.0)
    return r[...] + c


@jax.custom_jvp
def _cj(x):
    return jnp.sin(x)


_cj.defjvp(lambda p, t: (_cj(p[0]), 3.0 * t[0]))


@jax.custom_vjp
def _cv(x):
    return jnp.cos(x)


_cv.defvjp(lambda x: (_cv(x), x), lambda r, g: (g * 7.0 * r,))

_KEY = jax.random.key(3)
_PROGRAMS = {
    "refs": _refs,
    "custom_jvp": lambda x: _cj(x) * x,
    "custom_vjp": lambda x: _cv(x) * x,
    "checkpoint": lambda x: jax.checkpoint(
        lambda y: jnp.sin(jnp.cos(y)), policy=jax.checkpoint_policies.nothing_saveable
    )(x),
    "while": lambda x: jax.lax.while_loop(lambda c: c.sum() < 10, lambda c: c * 1.5, x),
    "key_constant": lambda x: x + jax.random.normal(_KEY, x.shape),
    "odd_literals": lambda x: (
        (x.astype(jnp.bfloat16) * jnp.bfloat16(1.5)).astype(jnp.float32)
        + (x.astype(jnp.int4) + jnp.int4(3)).astype(jnp.float32)
        + (x.astype(jnp.uint32) * np.uint32(4000000000)).astype(jnp.float32)
        + jnp.real(x * np.complex64(3 - 1j))
        + jnp.where(x > 1, True, False)
        + x * -0.0
    ),
    "literal_outputs": lambda x: (x, 1.0, jnp.int32(3), True),
}


def _first(out):
    return jax.tree_util.tree_leaves(out)[0]


_MODES = {
    "top": lambda g, x: g(x),
    "jit": lambda g, x: jax.jit(lambda a: g(a))(x),
    "vmap": lambda g, x: jax.vmap(g)(jnp.stack([x, x + 1])),
    "grad": lambda g, x: jax.grad(lambda a: _first(g(a)).sum())(x),
    "jit_grad": lambda g, x: jax.jit(jax.grad(lambda a: _first(g(a)).sum()))(x),
}


@pytest.mark.parametrize("mode", list(_MODES))
@pytest.mark.parametrize("name", list(_PROGRAMS))
def test_programs_staged_by_copying_compute_what_jax_jit_computes(name, mode):
    f, x = _PROGRAMS[name], jnp.linspace(0.25, 2.0, 4)
    fast = autoopt.optimize(f, fallback="raise")

    def outcome(g):  # the numbers, or the error jax raises (a while_loop's reverse mode)
        try:
            return _leaves(_MODES[mode](g, x))
        except Exception as e:  # noqa: BLE001
            return (type(e).__name__, str(e).splitlines()[0])

    want = outcome(jax.jit(f))
    assert outcome(fast) == want
    assert outcome(fast) == want  # the cached program, again


def test_named_scopes_and_lines_in_the_compiled_program_are_jax_jits():
    def g(x):
        with jax.named_scope("blk"):
            return jnp.sin(x) * 2

    x = jnp.arange(4.0)

    body = range(g.__code__.co_firstlineno, g.__code__.co_firstlineno + 3)

    def names(h):  # the scoped op names, and the lines of g the program names
        text = jax.jit(lambda a: h(a)).lower(x).as_text(debug_info=True)
        scoped = re.findall(r'loc\("([^"]*blk[^"]*)"', text)
        lines = [int(n) for n in re.findall(r'test_review_stage\.py":(\d+)', text)]
        return sorted(scoped), sorted(n for n in lines if n in body)

    want = names(jax.jit(g))
    assert any("blk/sin" in n for n in want[0]) and want[1]  # the premise
    assert names(autoopt.optimize(g, fallback="raise")) == want


def test_a_refilled_numpy_constant_reads_as_jax_jit_reads_it():
    x = jnp.ones(3)

    def scenario(wrap):
        c, c64 = np.ones(3, np.float32), np.ones(3, np.float64)
        g = wrap(lambda a: a * c + c64)
        outs = [g(x)]
        c[:], c64[:] = 5, 7
        outs += [g(x), jax.jit(lambda a: g(a))(x), jax.vmap(g)(jnp.stack([x, x]))]
        outs.append(jax.grad(lambda a: g(a).sum())(x))
        c[:], c64[:] = 9, 11
        outs += [g(x), jax.jit(lambda a: g(a) * 1)(x), g(x * 2)]
        return _leaves(outs)

    assert scenario(lambda f: autoopt.optimize(f, fallback="raise")) == scenario(jax.jit)


def test_x64_toggled_between_calls_gives_jax_jits_dtypes():
    c64 = np.arange(3, dtype=np.int64) + 2**33

    def f(x):
        return x + jnp.arange(3), c64 * 2, x * 1.5

    x = jnp.arange(3, dtype=jnp.int32)

    def calls(g):
        outs = []
        for flag in (False, True, False):
            with jax.enable_x64(flag):
                outs += [_leaves(g(x)), _leaves(jax.jit(lambda a: g(a))(x))]
        return outs

    assert calls(autoopt.optimize(f, fallback="raise")) == calls(jax.jit(f))


# --- held: the fingerprint and the dtype ranges -------------------------------------------------


def _fp(f, *args) -> str:
    return _jaxpr.fingerprint(jax.make_jaxpr(f)(*args))


def _apart(f, g, *args) -> bool:
    """Whether the fingerprint tells ``f``'s program from ``g``'s (the text does: asserted)."""
    a, b = jax.make_jaxpr(f)(*args), jax.make_jaxpr(g)(*args)
    assert str(a) != str(b)  # the premise
    return _jaxpr.fingerprint(a) != _jaxpr.fingerprint(b)


def test_the_fingerprint_tells_literals_apart_where_the_text_does():
    x, b = jnp.ones(3), jnp.ones(3, bool)
    assert _apart(lambda a: a * -0.0, lambda a: a * 0.0, x)
    assert _apart(lambda a: a.astype(int) + 1, lambda a: a.astype(float) + 1.0, b)
    assert _apart(lambda a: a | True, lambda a: a.astype(int) + 1, b)
    assert _apart(lambda a: a * jnp.bfloat16(1.5), lambda a: a * jnp.bfloat16(1.5078125), x)
    u = jnp.ones(3, jnp.uint32)
    assert _apart(lambda a: a + np.uint32(2**32 - 1), lambda a: a + np.uint32(2**32 - 2), u)
    assert _apart(lambda a: a * np.complex64(1 + 2j), lambda a: a * np.complex64(2 + 1j), x)


def test_the_fingerprint_tells_apart_sub_programs_and_callbacks_of_other_structure():
    x = jnp.ones(3)

    def branches(t, f):
        return lambda a: jax.lax.cond(a[0] > 0, t, f, a)

    assert _apart(branches(jnp.sin, jnp.cos), branches(jnp.cos, jnp.sin), x)
    assert _fp(branches(jnp.sin, jnp.cos), x) == _fp(branches(jnp.sin, jnp.cos), x)
    # (ordered or not: a parameter of the callback, whatever the effects it makes)
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    assert _apart(
        lambda a: io_callback(np.asarray, spec, a, ordered=True),
        lambda a: io_callback(np.asarray, spec, a, ordered=False),
        x,
    )
    assert _apart(
        lambda a: (jax.debug.callback(np.asarray, a, ordered=True), a)[1],
        lambda a: (jax.debug.callback(np.asarray, a, ordered=False), a)[1],
        x,
    )
    nothing = jax.checkpoint_policies.nothing_saveable
    dots = jax.checkpoint_policies.dots_saveable
    assert _apart(
        lambda a: jax.checkpoint(jnp.sin, policy=nothing)(a),
        lambda a: jax.checkpoint(jnp.sin, policy=dots)(a),
        x,
    )


def test_dtype_ranges_of_dtypes_with_equal_hashes_stay_apart():
    # NumPy gives ml_dtypes' int2/uint2/int4/uint4 equal hashes (they compare unequal)
    got = {
        name: _ranges.dtype_interval(np.dtype(getattr(ml_dtypes, name)))
        for name in ("int2", "uint2", "int4", "uint4", "float8_e4m3fn")
    }
    assert got["int2"] == _ranges.Interval(-2, 1)
    assert got["uint2"] == _ranges.Interval(0, 3)
    assert got["int4"] == _ranges.Interval(-8, 7)
    assert got["uint4"] == _ranges.Interval(0, 15)
    assert got["float8_e4m3fn"] is None
    assert _ranges.dtype_interval(jax.random.key(0).dtype) is None


def test_a_call_with_a_ref_traces_once_as_jax_jit_does():
    traced = []

    def f(r, x):
        traced.append(1)
        r[...] = r[...] + x
        return r[...] * 2

    fast = autoopt.optimize(f)
    r, x = jax.new_ref(jnp.zeros(3)), jnp.ones(3)
    outs = [np.asarray(fast(r, x)).tolist() for _ in range(3)]
    assert outs == [[2.0] * 3, [4.0] * 3, [6.0] * 3]
    assert np.asarray(r[...]).tolist() == [3.0] * 3
    assert len(traced) == 1


def test_the_fingerprint_tells_tuple_parameters_apart_as_the_text_does():
    """A tuple parameter's elements were written with ``str``, where the printed jaxpr writes
    the tuple (its elements' ``repr``): ``('a,b',)`` and ``('a', 'b')`` shared a fingerprint."""
    from jax.extend.core import Primitive

    prim = Primitive("review_tuple_param")
    prim.def_abstract_eval(lambda x, *, names: x)

    def closed(names):
        return jax.make_jaxpr(lambda x: prim.bind(x, names=names))(jnp.ones(3))

    one, two = closed(("a,b",)), closed(("a", "b"))
    assert str(one) != str(two)  # the premise: the text tells them apart
    assert _jaxpr.fingerprint(one) != _jaxpr.fingerprint(two)
