"""The transfers pass: host callbacks (device-to-host stalls) reported with their source lines."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import autoopt
from autoopt.passes import PassContext, make_options
from autoopt.passes.placement._transfers import host_callbacks, transfers


def _line(marker: str) -> int:
    src, _ = inspect.getsourcelines(inspect.getmodule(_line))
    return next(i for i, line in enumerate(src, 1) if marker in line and "_line(" not in line)


def _double(v):
    return np.asarray(v) * 2


def every_kind(x):
    jax.debug.print("x={x}", x=x)  # marker: print
    jax.debug.callback(lambda v: None, x)  # marker: callback
    y = jax.pure_callback(_double, jax.ShapeDtypeStruct(x.shape, x.dtype), x)  # marker: pure
    return io_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), y)  # marker: io


def nested(x):
    def body(c, _):
        jax.debug.print("c={c}", c=c)  # marker: in scan
        return c + 1, None

    c, _ = jax.lax.scan(body, x.sum(), None, length=3)
    inner = jax.jit(lambda v: jax.pure_callback(_double, jax.ShapeDtypeStruct((), v.dtype), v))
    d = inner(c)  # jit body
    e = jax.lax.cond(
        d > 0,
        lambda v: jax.debug.print("pos {v}", v=v) or v,  # marker: in cond
        lambda v: v,
        d,
    )

    @jax.custom_vjp
    def g(v):
        jax.debug.callback(lambda a: None, v)  # marker: in custom_vjp
        return v * 2

    g.defvjp(lambda v: (g(v), None), lambda _, ct: (ct * 2,))
    return g(e)


def _transfer_findings(fn, *args):
    return autoopt.explain(fn, *args).by_kind("transfer")


def test_every_callback_kind_is_reported_at_its_line():
    found = {
        f.details["primitive"]: f
        for f in _transfer_findings(every_kind, jnp.ones(3))
        if "primitive" in f.details
    }
    for prim, marker in [
        ("debug_print", "print"),
        ("debug_callback", "callback"),
        ("pure_callback", "pure"),
        ("io_callback", "io"),
    ]:
        assert found[prim].location == f"{__file__}:{_line(f'# marker: {marker}')}"
        assert not found[prim].applied
    assert found["pure_callback"].details["to_host_bytes"] == 12
    assert found["pure_callback"].details["to_device_bytes"] == 12
    assert "jax.pure_callback" in found["pure_callback"].message


def test_callbacks_nested_in_scan_jit_cond_and_custom_vjp_are_found():
    found = [f for f in _transfer_findings(nested, jnp.ones(3)) if "primitive" in f.details]
    by_line = {int(f.location.rsplit(":", 1)[1]): f for f in found}
    scan_f = by_line[_line("# marker: in scan")]
    assert scan_f.details["in_loop"] and "every iteration" in scan_f.message
    assert by_line[_line("# marker: in cond")].details["path"][-1] == "cond"
    assert _line("# marker: in custom_vjp") in by_line
    assert any(
        f.details["primitive"] == "pure_callback" and "jit" in f.details["path"] for f in found
    )


def test_the_pass_never_changes_the_program():
    closed = jax.make_jaxpr(nested)(jnp.ones(3))
    result = transfers(closed, PassContext(options=make_options()))
    assert result.jaxpr is closed and not result.changed
    assert len(result.findings) == len(host_callbacks(closed)) == 4


def test_a_program_without_callbacks_has_no_transfer_findings():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) @ x)(jnp.ones((3, 3)))
    assert transfers(closed, PassContext(options=make_options())).findings == ()


def test_optimized_function_still_runs_its_callbacks(capfd):
    opt = autoopt.optimize(every_kind, fallback="raise")
    out = opt(jnp.arange(3.0))
    np.testing.assert_allclose(np.asarray(out), [0.0, 2.0, 4.0])
    jax.effects_barrier()
    assert "x=[0. 1. 2.]" in capfd.readouterr().out
