"""The report of an ``eqx.filter_jit`` function routed through autoopt (``_jit._equinox``) names
the user's arguments and says what the call site did: it named equinox's inner ``dynamic_args``
and said "applied no" for ``params, loss = step(params, batch)``, whose calls donate
``params`` (the call site's positions, the caller's, were compared with the inner program's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autoopt

eqx = pytest.importorskip("equinox")


def _step(params, batch):
    return jax.tree_util.tree_map(lambda p: p * 0.9 + batch.sum(), params), batch.sum()


def _start():
    return {"w": jnp.ones((32, 32)), "b": jnp.ones(32)}, jnp.ones(8)


def _donations(report) -> list:
    return [f for f in report.findings if f.kind == "donate"]


def test_the_report_names_the_users_arguments_and_the_donation_the_calls_made():
    step = autoopt.optimize(eqx.filter_jit(_step))
    params, batch = _start()
    in_place = []
    for _ in range(3):
        before = params["w"].unsafe_buffer_pointer()
        params, loss = step(params, batch)
        in_place.append(params["w"].unsafe_buffer_pointer() == before)
    assert all(in_place)  # the premise: the calls donate `params` (its buffers are reused)
    report = step.explain(params, batch)
    names = {f.details.get("name") for f in _donations(report) if "name" in f.details}
    assert names == {"params", "batch"}
    (site,) = [f for f in _donations(report) if "site" in f.details]
    assert site.applied and site.bytes_saved == 4224
    assert site.message == (
        "argument 0 (`params`) donated at this call site: `params, loss = step(params, batch)` "
        "rebinds it, so its buffers are dead after the call (when an output can reuse them and "
        "nothing else refers to them)."
    )
    assert "dynamic_args" not in report.render(color=False, verbose=True)


def test_a_site_whose_calls_were_refused_says_so():
    step = autoopt.optimize(eqx.filter_jit(_step))
    params, batch = _start()
    held = []
    for _ in range(3):
        keep = params
        held.append(keep)
        params, loss = step(params, batch)
    assert not any(x.is_deleted() for p in held for x in jax.tree_util.tree_leaves(p))
    (calls,) = step.inspect(params, batch).site_calls.values()
    assert (dict(calls.refused), dict(calls.donated)) == ({0: 3}, {})
    (site,) = [f for f in _donations(step.explain(params, batch)) if "site" in f.details]
    assert not site.applied
    assert site.message == (
        "argument 0 (`params`) donated at this call site only where the run-time check passed: "
        "`params, loss = step(params, batch)` rebinds it, but the check refused it at 3 calls: "
        "another reference to the same object exists (each passed a device copy of it); the "
        "calls in between are not counted (counting them would cost every call)."
    )
