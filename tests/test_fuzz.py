"""Differential fuzzing: random JAX programs compute the same numbers under autoopt as jax.jit.

The programs come from ``autoopt.testing.fuzz_cases`` (see ``autoopt/_fuzz.py``): random
statements over random pytrees of f32/bf16/i32/bool arrays, with in- and out-of-bounds
``.at[...]`` updates, dynamic slices, cond/switch/scan/fori/while loops, and grad/vmap of nested
blocks. Every pass is on and ``fallback="raise"``, so a pass that breaks a program fails here
instead of falling back quietly.

CI runs the ``ci`` hypothesis profile's number of examples per test (derandomized: the same
programs every run). ``AUTOOPT_FUZZ_EXAMPLES=N`` runs N per test with fresh random programs; a
failure prints the shrunk program as source, ready for ``tests/regressions/``. A failure that
aborts the process (an XLA CHECK) cannot shrink: ``AUTOOPT_FUZZ_LOG=/tmp/case.py`` keeps the
program being run in that file.
"""

from __future__ import annotations

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import autoopt
from autoopt.testing import _fuzz, check_program, fuzz_cases, program_args, programs

_EXAMPLES = os.environ.get("AUTOOPT_FUZZ_EXAMPLES")
if _EXAMPLES:
    fuzz_settings = settings(max_examples=int(_EXAMPLES), derandomize=False)
else:
    fuzz_settings = settings()  # the loaded profile (tests/conftest.py: "ci")


@pytest.fixture(scope="module", autouse=True)
def _report_count(request):
    def programs_run():
        return sum(v for k, v in _fuzz.RUNS.items() if not k.startswith("rewritten"))

    before = programs_run()
    yield
    run = programs_run() - before
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(
                f"\ntests/test_fuzz.py: {run} random programs checked against jax.jit "
                f"({dict(_fuzz.RUNS)})"
            )


# Options that make each pass act on small programs: remat="auto" leaves programs with under
# 1 MiB of residuals alone unless a memory budget asks, so the fuzzer forces policies and budgets.
OPTION_SETS = [
    {},
    {"remat": "nothing_saveable"},
    {"remat": "dots_saveable"},
    {"memory_budget": 1},
]


@fuzz_settings
@given(fuzz_cases(), st.sampled_from(OPTION_SETS))
def test_random_programs_compute_what_jax_jit_computes(case, options):
    note(repr(case))  # the failing program, as source
    check_program(case, **options)


def _float_params(program) -> tuple[int, ...]:
    def is_float(a):
        return a.dtype in ("float32", "bfloat16")

    return tuple(
        i
        for i, spec in enumerate(program.in_avals)
        if all(
            is_float(a)
            for a in jax.tree_util.tree_leaves(spec, is_leaf=lambda x: isinstance(x, _fuzz.Aval))
        )
    )


def _loss(f):
    """Sum of the float outputs, as float32: a scalar jax.grad can differentiate."""

    def loss(*args):
        leaves = [
            x for x in jax.tree_util.tree_leaves(f(*args)) if jnp.issubdtype(x.dtype, jnp.floating)
        ]
        return sum((jnp.sum(x.astype(jnp.float32)) for x in leaves), jnp.float32(0))

    return loss


def _second_batch_row(x):
    """A second, different value of the same aval (for a batch of two under vmap)."""
    flat = jnp.roll(x.ravel(), 1).reshape(x.shape)
    return ~flat if x.dtype == jnp.bool_ else flat + jnp.ones((), x.dtype)


@fuzz_settings
@given(
    fuzz_cases(max_ops=4), st.sampled_from(["jit", "vmap", "grad"]), st.sampled_from(OPTION_SETS)
)
def test_random_programs_compose_with_outer_transformations_like_jax_jit(case, outer, options):
    note(repr(case))  # the failing program, as source
    if outer == "jit":

        def through(f, args):
            return jax.jit(f)(*args)
    elif outer == "vmap":

        def through(f, args):
            batched = jax.tree_util.tree_map(lambda x: jnp.stack([x, _second_batch_row(x)]), args)
            return jax.vmap(f)(*batched)
    else:
        argnums = _float_params(case.program)
        if not argnums:
            argnums = None

        def through(f, args):
            if argnums is None:  # nothing to differentiate: the value of the loss then
                return _loss(f)(*args)
            return jax.grad(_loss(f), argnums=argnums)(*args)

    check_program(case, through=through, **options)


@fuzz_settings
@given(
    fuzz_cases(max_ops=4), st.sampled_from(["jit", "vmap", "grad"]), st.sampled_from(OPTION_SETS)
)
def test_random_programs_closing_over_outer_tracers_match_jax_jit(case, outer, options):
    """The optimized function is built inside an outer transformation and closes over its first
    argument, a tracer of that transformation (as a model's forward closing over parameters)."""
    note(repr(case))  # the failing program, as source
    fn = case.program.function()

    def run(compile_, args):
        def inner(first, *rest):
            return compile_(lambda *r: fn(first, *r))(*rest)

        if outer == "jit":
            return jax.jit(inner)(*args)
        if outer == "vmap":
            first = jax.tree_util.tree_map(lambda x: jnp.stack([x, _second_batch_row(x)]), args[0])
            return jax.vmap(inner, in_axes=(0,) + (None,) * (len(args) - 1))(first, *args[1:])
        if 0 not in _float_params(case.program):
            return jax.jit(inner)(*args)
        return jax.grad(_loss(inner))(*args)

    try:
        expected = run(jax.jit, case.args)
    except Exception as e:  # noqa: BLE001 - e.g. reverse-mode of a while loop: autoopt must agree
        if isinstance(e, NotImplementedError):  # a missing JAX rule a rewrite may not need
            return
        with pytest.raises(type(e)):
            run(lambda f: autoopt.optimize(f, fallback="raise", donate="off", **options), case.args)
        _fuzz.RUNS["rejected by both"] += 1
        return
    got = run(lambda f: autoopt.optimize(f, fallback="raise", donate="off", **options), case.args)
    autoopt.testing.assert_trees_equivalent(expected, got, what="optimize(program) in a closure")
    _fuzz.RUNS["equal"] += 1


def _copied(args):
    return jax.tree_util.tree_map(jnp.copy, args)


@fuzz_settings
@given(fuzz_cases(max_ops=4))
def test_random_programs_with_every_aliasable_input_donated_compute_the_same(case):
    note(repr(case))  # the failing program, as source
    # Each call gets fresh copies: donate="auto" deletes what it donates.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        check_program(case, donate="auto", through=lambda f, args: f(*_copied(args)))


@settings(fuzz_settings, max_examples=max(1, fuzz_settings.max_examples // 3))
@given(fuzz_cases(max_ops=4))
def test_explain_reports_on_random_programs_without_error(case):
    note(repr(case))  # the failing program, as source
    fn = case.program.function()
    report = autoopt.optimize(fn, fallback="raise", donate="off").explain(*case.args)
    assert str(report).strip()  # renders
    for f in report.findings:
        # Finding already refuses an unknown kind; what it does not check is the contract
        # the report relies on: a reason in words, a "path:LINE" location or None.
        assert isinstance(f.applied, bool)
        assert isinstance(f.message, str) and f.message.strip(), f
        assert f.location is None or re.fullmatch(r".+:\d+", f.location), f.location
        assert f.bytes_saved is None or f.bytes_saved >= 0
    _fuzz.RUNS["explained"] += 1


@settings(fuzz_settings, max_examples=max(1, fuzz_settings.max_examples // 3))
@given(fuzz_cases(max_ops=3))
def test_a_fuzz_case_prints_as_runnable_source(case):
    """What a failure prints (the case's repr) is code that rebuilds the same program."""
    note(repr(case))  # the failing program, as source
    ns = {"jax": jax, "jnp": jnp, "lax": jax.lax, "np": np, "fit": _fuzz.fit}
    exec(repr(case), ns)  # noqa: S102 - our own generated source
    expected = jax.jit(case.program.function())(*case.args)
    got = jax.jit(ns["program"])(*ns["args"])
    autoopt.testing.assert_trees_equivalent(expected, got, exact=True, what="re-run from repr")


@settings(fuzz_settings, max_examples=max(1, fuzz_settings.max_examples // 3))
@given(programs(max_ops=3).flatmap(lambda p: st.tuples(st.just(p), program_args(p))))
def test_generated_programs_type_check_as_declared(pa):
    """The builder's avals are the program's: each parameter gets arrays of its declared aval."""
    program, args = pa
    shapes = jax.tree_util.tree_map(lambda x: (x.shape, jnp.dtype(x.dtype).name), args)
    declared = jax.tree_util.tree_map(
        lambda a: (a.shape, a.dtype), program.in_avals, is_leaf=lambda x: isinstance(x, _fuzz.Aval)
    )
    assert shapes == declared
    jax.eval_shape(program.function(), *args)


@fuzz_settings
@given(fuzz_cases(max_ops=3, first="window_chain"), st.sampled_from(["call", "grad"]))
def test_arithmetic_around_a_window_keeps_jax_jits_bits(case, route):
    # Arithmetic -> a window at a traced start -> arithmetic: where a rewrite moves a fusion
    # boundary, XLA contracts (or stops contracting) a multiply-add and the last bit changes.
    # remat="off": every route is compared bit for bit (check_program).
    note(repr(case))
    if route == "call":
        check_program(case, remat="off")
        return
    argnums = _float_params(case.program) or None

    def through(f, args):
        if argnums is None:
            return _loss(f)(*args)
        return jax.grad(_loss(f), argnums=argnums)(*args)

    check_program(case, through=through, remat="off")
