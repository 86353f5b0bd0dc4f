"""Plan once (issue 29, item 3): a remat decision measured in one process is kept beside JAX's
persistent compilation cache, and a second process planning the same program compiles none of
the candidates: only the chosen program, which JAX's cache answers too. Each process is a fresh
interpreter (``subprocess``) with its own empty in-memory caches and the same cache folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import cProfile, hashlib, json, pstats, sys
    import jax, jax.numpy as jnp, numpy as np

    if sys.argv[1] != "-":
        jax.config.update("jax_compilation_cache_dir", sys.argv[1])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import autoopt

    names, cache, traced = [], [], []
    program = sys.argv[3] if len(sys.argv) > 3 else "residual"
    rebind = len(sys.argv) > 4 and sys.argv[4] == "rebind"

    def on_event(event, duration, fun_name=None, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(fun_name)  # (recorded for a program JAX's cache answers too)

    def on_cache(event, **kw):
        if event.startswith("/jax/compilation_cache/cache_"):
            cache.append(event.rsplit("_", 1)[-1])

    def block_loss(ps, x):
        for w1, w2 in ps:
            m = x.mean(-1, keepdims=True)
            h = (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)
            x = x + jax.nn.gelu(h @ w1) @ w2
        return jnp.mean(x**2)

    def train_step(ps, x):
        traced.append("train_step")  # (runs when the function is traced)
        value, g = jax.value_and_grad(block_loss)(ps, x)
        return [(w1 - 0.1 * g1, w2 - 0.1 * g2) for (w1, w2), (g1, g2) in zip(ps, g)], value

    def deep_loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    def deep_step(ws, x):  # no plan cuts its peak by 20% (tests/test_remat_first_call.py)
        traced.append("deep_step")
        value, g = jax.value_and_grad(deep_loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], value

    if program == "residual":
        layers, d = 3, 64
        k = jax.random.split(jax.random.key(1), 2 * layers + 1)
        ps = [
            (
                jax.random.normal(k[2 * i], (d, 4 * d)) / 8,
                jax.random.normal(k[2 * i + 1], (4 * d, d)) / 16,
            )
            for i in range(layers)
        ]
        x = jax.block_until_ready(jax.random.normal(k[-1], (1024, d)))
        step = train_step
    elif program == "small":  # residuals far below remat's gate (1 MiB): never planned
        ps = [(jnp.ones((16, 64)) / 8, jnp.ones((64, 16)) / 8)]
        x = jax.block_until_ready(jnp.ones((32, 16)))
        step = train_step
    else:
        ps = [jax.random.normal(jax.random.key(i), (256, 256)) / 16 for i in range(16)]
        x = jax.block_until_ready(jnp.ones((1024, 256)))
        step = deep_step
    options = json.loads(sys.argv[2])
    fast = autoopt.optimize(step, fallback="raise", **options)
    # (the rebinding call's own state: copies made before compiles are counted)
    held = [(jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, ps)), x)] if rebind else []
    jax.monitoring.register_event_duration_secs_listener(on_event)
    jax.monitoring.register_event_listener(on_cache)
    profile = cProfile.Profile()

    def rebinding_call(held):
        ps, x = held.pop()  # the statement's names hold the state's only references
        ps, value = fast(ps, x)  # donate="safe" donates ps
        return jax.block_until_ready((ps, value))

    if rebind:
        profile.enable()
        out = rebinding_call(held)
    else:
        profile.enable()
        out = jax.block_until_ready(fast(ps, x))
    profile.disable()
    traced_by_call = len(traced)
    jax.monitoring.unregister_event_duration_listener(on_event)
    jax.monitoring.unregister_event_listener(on_cache)
    # how many times planning's analyses ran (counted by the profiler, by function name)
    calls = {}
    for (_, _, name), row in pstats.Stats(profile).stats.items():
        if name in ("joint_graph", "jaxpr_flops", "_joint_candidates", "pp_jaxpr", "fingerprint"):
            calls[name] = calls.get(name, 0) + row[0]  # (calls, not counting recursion)
    remat = [f for f in fast.inspect(ps, x).findings if f.kind == "remat"]
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(out):
        digest.update(np.asarray(leaf).tobytes())
    print(json.dumps({
        "compiles": names,
        "cache": cache,
        "applied": [f.applied for f in remat],
        "messages": [f.message for f in remat],
        "out": digest.hexdigest(),
        "calls": calls,
        "donating": [f.details.get("measured_donating") for f in remat],
        "tried": [len(f.details.get("tried", ())) for f in remat],
        "traced": traced_by_call,
    }))
    """
)


def _process(
    tmp_path, cache: str, options: dict, program: str = "residual", call: str = "keep"
) -> dict:
    """``call``: "keep" (``out = fast(ps, x)``) or "rebind" (``ps, value = fast(ps, x)``)."""
    script = tmp_path / "plan_once.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOOPT_SIMULATED")}
    result = subprocess.run(
        [sys.executable, str(script), cache, json.dumps(options), program, call],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("options", "programs"),
    [({"remat": "auto"}, 1), ({"memory_budget": "10MiB"}, 2)],
    ids=["remat='auto'", "default, budget short"],
)
def test_a_second_process_compiles_only_the_chosen_program(tmp_path, options, programs):
    """``programs``: the executables a call runs or checks: under the default, the original
    (whose peak says it does not fit) and the plan; under remat="auto", the plan."""
    cache = tmp_path / "jax-cache"
    first = _process(tmp_path, str(cache), options)
    assert first["applied"] == [True], first["messages"]  # the premise: a plan was measured
    measuring = [n for n in first["compiles"] if n != "jit(train_step)"]
    assert measuring, first["compiles"]  # candidates compiled under their own names
    assert "hits" not in first["cache"], first["cache"]
    assert os.listdir(cache / "autoopt-plans")

    second = _process(tmp_path, str(cache), options)
    # no candidate compiled: only the call's own programs, which JAX's own cache answers
    assert second["compiles"] == ["jit(train_step)"] * programs, second["compiles"]
    assert second["cache"] == ["hits"] * programs, second["cache"]
    assert second["applied"] == [True] and second["messages"] == first["messages"]
    assert second["out"] == first["out"]


def test_without_a_compilation_cache_nothing_is_kept(tmp_path):
    first = _process(tmp_path, "-", {"remat": "auto"})
    second = _process(tmp_path, "-", {"remat": "auto"})
    assert first["applied"] == [True]
    assert first["compiles"] == second["compiles"]  # measured again
    assert not any(p.name == "autoopt-plans" for p in tmp_path.rglob("*"))
    # and the key is never computed (the program's text: tens of ms on a GPT step)
    assert "pp_jaxpr" not in first["calls"], first["calls"]


def _unproposed(stored: dict) -> str:
    if "recompute" in stored:  # the joint plan, kept whole: equations it does not have
        stored["recompute"] = [10**9]
    else:  # the candidates' decision: a plan this process does not propose
        stored["chosen"] = "a plan nobody proposed"
    return json.dumps(stored)


def _malformed(stored: dict) -> str:
    # (fields of other types: these raised TypeError, AttributeError or RecursionError out of
    # the pass, so a process skipped remat, and every later one, the entry never replaced)
    stored.update(chosen=None, base=None, tried=[], reason=None, floor="abc")
    return json.dumps(stored)


@pytest.mark.parametrize(
    "spoil",
    [_unproposed, _malformed, lambda stored: "[" * 100000 + "]" * 100000],
    ids=["a plan it does not propose", "fields of other types", "nested too deep"],
)
def test_an_entry_this_process_cannot_use_is_measured_again(tmp_path, spoil):
    cache = tmp_path / "jax-cache"
    first = _process(tmp_path, str(cache), {"remat": "auto"})
    folder = cache / "autoopt-plans"
    for entry in folder.iterdir():
        entry.write_text(spoil(json.loads(entry.read_text())))
    second = _process(tmp_path, str(cache), {"remat": "auto"})
    assert second["messages"] == first["messages"] and second["out"] == first["out"]
    assert [n for n in second["compiles"] if n != "jit(train_step)"]  # measured again


@pytest.mark.parametrize(
    ("program", "planned"), [("residual", True), ("deep", False)], ids=["planned", "not planned"]
)
def test_a_stored_decision_skips_the_analyses_it_holds(tmp_path, program, planned):
    """A second process reads the decision before analysing the program for it: the
    candidates are never enumerated nor their FLOPs counted, and where the decision is that no
    plan applies, the forward/backward graph is not built either (where one applies, the graph
    is what the stored plan is rebuilt on). Counted by the profiler."""
    cache = tmp_path / "jax-cache"
    first = _process(tmp_path, str(cache), {"remat": "auto"}, program)
    assert first["applied"] == [planned], first["messages"]  # the premise
    assert first["calls"].get("_joint_candidates") == 1, first["calls"]
    second = _process(tmp_path, str(cache), {"remat": "auto"}, program)
    assert second["messages"] == first["messages"] and second["out"] == first["out"]
    assert "_joint_candidates" not in second["calls"], second["calls"]
    assert "jaxpr_flops" not in second["calls"], second["calls"]
    assert second["calls"].get("joint_graph", 0) == (1 if planned else 0), second["calls"]


def test_a_step_with_small_residuals_costs_no_key_even_with_a_cache(tmp_path):
    """Remat leaves a step whose residuals are below its gate alone, and stores nothing for
    it: the decision's key (the program's text) is not computed to look one up, nor the
    forward/backward graph (the gate counts the residuals without it)."""
    cache = tmp_path / "jax-cache"
    for _ in range(2):
        got = _process(tmp_path, str(cache), {"remat": "auto"}, "small")
        assert got["applied"] == [], got["messages"]
        assert "pp_jaxpr" not in got["calls"], got["calls"]
        assert "joint_graph" not in got["calls"], got["calls"]


@pytest.mark.parametrize("program", ["residual", "deep"], ids=["planned", "not planned"])
@pytest.mark.parametrize("call", ["keep", "rebind"])
def test_a_first_call_compiles_each_program_once_cold_and_only_the_chosen_one_warm(
    tmp_path, program, call
):
    """remat="auto", cold: the original once (the call's own executable, measured donating
    what it donates: nothing where the call keeps its arguments), each candidate tried once,
    and the plan once when one is applied. Warm (a second process, both caches): the chosen
    program only, from JAX's cache, with the same decision."""
    cache = tmp_path / "jax-cache"
    first = _process(tmp_path, str(cache), {"remat": "auto"}, program, call)
    planned = program == "residual"
    assert first["applied"] == [planned], first["messages"]  # the premise
    (donating,) = first["donating"]
    assert (donating == []) == (call == "keep"), donating  # the state's leaves when rebinding
    name = "jit(train_step)" if planned else "jit(deep_step)"
    own = first["compiles"].count(name)
    measuring = [n for n in first["compiles"] if n == "jit(remat_measured)"]
    assert own == (2 if planned else 1), first["compiles"]  # (the original; the plan)
    assert len(measuring) + own == len(first["compiles"]), first["compiles"]
    assert len(measuring) == first["tried"][0] >= 1, first  # each candidate once
    second = _process(tmp_path, str(cache), {"remat": "auto"}, program, call)
    assert second["compiles"] == [name], second["compiles"]
    assert second["cache"] == ["hits"], second["cache"]
    assert second["messages"] == first["messages"] and second["out"] == first["out"]


@pytest.mark.parametrize("program", ["residual", "deep"], ids=["planned", "not planned"])
@pytest.mark.parametrize("call", ["keep", "rebind"])
def test_a_warm_first_call_traces_the_function_once_and_compiles_one_program(
    tmp_path, program, call
):
    """A second process finding the decision on disk does what jax.jit's first call does: it
    traces the user's function once (counted by the function itself), compiles one program
    (jax.monitoring's backend compile events; JAX's cache answers it), and prints the
    program's fingerprint once for the decision's keys (the donation a rebinding call would
    measure and the one a keeping call measured: one fingerprint for both), never its text
    (jax's printer costs about half a trace)."""
    cache = tmp_path / "jax-cache"
    first = _process(tmp_path, str(cache), {"remat": "auto"}, program, call)
    assert first["applied"] == [program == "residual"], first["messages"]  # the premise
    assert first["traced"] == 1, first  # a cold first call traces once too
    second = _process(tmp_path, str(cache), {"remat": "auto"}, program, call)
    assert second["traced"] == 1, second
    assert len(second["compiles"]) == 1 and second["cache"] == ["hits"], second
    assert second["calls"].get("fingerprint") == 1, second["calls"]
    assert "pp_jaxpr" not in second["calls"], second["calls"]
    assert second["messages"] == first["messages"] and second["out"] == first["out"]


def test_a_decision_kept_for_another_donation_is_made_again_for_the_call_s_own(tmp_path):
    """A process rebinding its state keeps a decision measured donating it; a later process
    whose call keeps its arguments (its executable donates nothing) does not take it: the
    check measures again without donation, as a cold process keeping its arguments does, and
    keeps that decision too (a third such process compiles only the chosen program)."""
    cache = tmp_path / "jax-cache"
    rebinding = _process(tmp_path, str(cache), {"remat": "auto"}, "residual", "rebind")
    assert rebinding["donating"] != [[]], rebinding["donating"]  # the premise
    keeping = _process(tmp_path, str(cache), {"remat": "auto"}, "residual", "keep")
    cold = _process(tmp_path, "-", {"remat": "auto"}, "residual", "keep")
    assert keeping["donating"] == [[]] == cold["donating"]
    assert keeping["messages"] == cold["messages"] and keeping["out"] == cold["out"]
    assert [n for n in keeping["compiles"] if n == "jit(remat_measured)"], keeping  # measured
    again = _process(tmp_path, str(cache), {"remat": "auto"}, "residual", "keep")
    assert again["compiles"] == ["jit(train_step)"], again["compiles"]
    assert again["messages"] == cold["messages"]
