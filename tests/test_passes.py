"""The pass manager: a pass declared once (``Pass(...)``) and registered is ordered by its
constraints, gets its options validated, its findings' kind accepted and its report section
rendered, without any other module knowing about it; unregistering takes all of that away."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import autoopt
from autoopt import passes
from autoopt.passes import (
    Option,
    Pass,
    PassResult,
    make_options,
    option_names,
    registered_pass_names,
)
from autoopt.report import KINDS, Finding

BUILTIN_ORDER = ("scatter_to_dus", "remat", "donation", "transfers")


def _check_toy_level(level):
    if not isinstance(level, int) or isinstance(level, bool) or not 0 <= level <= 3:
        raise ValueError(f"toy_level={level!r}: use 0 (off), 1, 2 or 3.")
    return level


def toy(closed, ctx):
    n = len(closed.jaxpr.eqns)
    return PassResult.unchanged(
        closed,
        [
            Finding(
                "toy",
                applied=False,
                location=ctx.fn_location,
                message=f"toy counted {n} equations at level {ctx.options.toy_level}",
            )
        ],
    )


def toy_section(report, console):
    if report.by_kind("toy"):
        console.print(f"toy section: {len(report.by_kind('toy'))} toy finding(s)")


TOY = Pass(
    name="toy",
    run=toy,
    kinds=("toy",),
    after=("scatter_to_dus",),
    options=(Option("toy_level", 1, _check_toy_level, "how hard the toy pass looks"),),
    enabled=lambda o: o.toy_level > 0,
    report_section=toy_section,
)


def f(x):
    return jnp.sin(x).at[0].set(1.0) * 2.0


@pytest.fixture
def registered_toy():
    with passes.register(TOY) as p:
        yield p
    assert "toy" not in registered_pass_names()


def test_the_builtin_passes_are_ordered_rewrites_first_analyses_last():
    assert registered_pass_names() == BUILTIN_ORDER


def test_a_registered_pass_is_ordered_by_its_constraint(registered_toy):
    names = registered_pass_names()
    assert names.index("toy") > names.index("scatter_to_dus")
    # The built-ins keep their order relative to each other.
    assert tuple(n for n in names if n != "toy") == BUILTIN_ORDER
    assert [p.name for p in passes.enabled_passes(make_options())] == list(names)
    assert "toy" not in [p.name for p in passes.enabled_passes(make_options(toy_level=0))]


def test_a_registered_passs_findings_show_in_explain_and_the_printed_report(registered_toy):
    report = autoopt.explain(f, jnp.ones(3), toy_level=2)
    [found] = report.by_kind("toy")
    assert found.pass_name == "toy"
    assert found.message.startswith("toy counted") and "at level 2" in found.message
    text = report.render(color=False)
    assert any(line.split()[:1] == ["toy"] and "toy counted" in line for line in text.splitlines())
    assert "toy section: 1 toy finding(s)" in text
    # The pipeline ran it after the rewrite it is ordered after.
    kinds = [x.kind for x in report.findings]
    assert kinds.index("scatter_to_dus") < kinds.index("toy")


def test_a_registered_passs_option_is_accepted_and_validated_by_its_check(registered_toy):
    fast = autoopt.optimize(f, toy_level=2)
    assert fast(jnp.ones(3)).shape == (3,)
    assert make_options(toy_level=3).toy_level == 3
    assert make_options().toy_level == 1  # the declared default
    assert "toy_level" in option_names()
    with pytest.raises(ValueError, match=r"toy_level=7: use 0 \(off\), 1, 2 or 3\."):
        autoopt.optimize(f, toy_level=7)
    with pytest.raises(TypeError, match="Did you mean 'toy_level'"):
        autoopt.optimize(f, toy_levl=2)


def test_unregistering_takes_away_the_pass_its_kind_and_its_option():
    undo = passes.register(TOY)
    assert "toy" in KINDS and "toy" in registered_pass_names()
    Finding("toy", applied=False, message="ok")
    undo()
    assert "toy" not in KINDS and registered_pass_names() == BUILTIN_ORDER
    with pytest.raises(ValueError, match="Finding kind 'toy' is not one of"):
        Finding("toy", applied=False, message="no longer a kind")
    with pytest.raises(TypeError, match="unknown option 'toy_level'"):
        autoopt.optimize(f, toy_level=2)
    assert "toy_level" not in option_names()
    assert not any(x.kind == "toy" for x in autoopt.explain(f, jnp.ones(3)).findings)


def test_constraints_that_make_a_cycle_are_refused_naming_the_passes():
    a = Pass(name="toy_a", run=toy, kinds=("toy",), after=("donation",), before=("remat",))
    with pytest.raises(ValueError, match="cycle: donation -> toy_a -> remat -> donation"):
        passes.register(a)
    assert registered_pass_names() == BUILTIN_ORDER  # nothing half-registered
    assert "toy" not in KINDS
    with passes.register(Pass(name="toy_b", run=toy)):
        with pytest.raises(ValueError, match="cycle: toy_b -> toy_c -> toy_b"):
            passes.register(Pass(name="toy_c", run=toy, after=("toy_b",), before=("toy_b",)))
        assert "toy_c" not in registered_pass_names()


def test_a_constraint_on_an_unknown_pass_is_refused_naming_both():
    with pytest.raises(
        ValueError,
        match="pass 'toy' is ordered relative to 'scater_to_dus', which is not a registered pass",
    ):
        passes.register(Pass(name="toy", run=toy, after=("scater_to_dus",)))
    assert "toy" not in registered_pass_names()


def test_a_pass_cannot_take_a_name_or_an_option_another_already_has():
    with pytest.raises(ValueError, match="a pass named 'remat' is already registered"):
        passes.register(Pass(name="remat", run=toy))
    with pytest.raises(
        ValueError, match="option 'memory_budget', which pass 'remat' already declares"
    ):
        passes.register(Pass(name="toy", run=toy, options=(Option("memory_budget"),)))
    with pytest.raises(
        ValueError, match="option 'fallback', which is optimize\\(\\)'s own keyword"
    ):
        passes.register(Pass(name="toy", run=toy, options=(Option("fallback"),)))
    assert registered_pass_names() == BUILTIN_ORDER


def test_a_pass_that_others_are_ordered_after_cannot_be_unregistered_first(registered_toy):
    with pytest.raises(ValueError, match="cannot unregister pass 'scatter_to_dus'.*'remat', 'toy'"):
        passes._remove("scatter_to_dus")
    assert registered_pass_names()[0] == "scatter_to_dus"
