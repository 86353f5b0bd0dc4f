"""The static estimate that ranks remat plans (``_plan.schedule`` and
``_plan.simulated_peak``) gives exactly the figures of its first, direct implementation (kept
below as the reference) on every schedule the planner's searches visit and on random ones: it
was rewritten for speed (issue 29: a cold remat="auto" first call enumerates ~80 schedules of
a GPT step), and the plans it ranks, so the programs autoopt builds, must not change."""

from __future__ import annotations

import math
import random

import jax
import jax.numpy as jnp
import pytest

from autoopt.passes.remat import _plan


def _reference_schedule(g, recompute):
    rec = frozenset(i for i in recompute if i in g.eligible)
    producer, ins = g.producer, g.ins
    done: set[int] = set()
    blocks: dict[int, _plan.Block] = {}
    external_reads: set = set()
    last_bwd_val = None
    flops = 0.0
    for t in g.backward_order:
        need = [v for v in ins[t] if producer.get(v) in rec and producer[v] not in done]
        if need:
            cone: set[int] = set()
            stack = [producer[v] for v in need]
            while stack:
                p = stack.pop()
                if p in cone or p in done:
                    continue
                cone.add(p)
                stack.extend(producer[u] for u in ins[p] if producer.get(u) in rec)
            order = tuple(sorted(cone))
            ext: list = []
            seen_ext: set = set()
            for p in order:
                for u in ins[p]:
                    if producer.get(u) not in rec and u not in seen_ext:
                        seen_ext.add(u)
                        ext.append(u)
            anchor = next((v for v in ins[t] if producer.get(v) in g.backward), last_bwd_val)
            blocks[t] = _plan.Block(t, order, tuple(ext), anchor)
            external_reads.update(ext)
            done.update(order)
            flops += sum(g.flops[p] for p in order)
        if g.outs[t]:
            last_bwd_val = g.outs[t][-1]
    # Dead-code: a forward equation stays when one of its outputs is still read in the original
    # form (by the forward, the backward through a kept value, a recompute block, or the outputs).
    needed = {v for v in g.jaxpr.outvars if _plan.is_var(v)} | external_reads
    for t in g.backward:
        needed.update(v for v in ins[t] if producer.get(v) not in rec)
    dead = set()
    eqns = g.jaxpr.eqns
    for i in reversed(g.forward):
        if eqns[i].effects or any(v in needed for v in g.outs[i]):
            needed.update(ins[i])
        else:
            dead.add(i)
    return _plan.Schedule(rec, blocks, frozenset(dead), flops)


def _reference_peak(g, s) -> tuple[int, int]:
    producer, rec, nb = g.producer, s.recompute, g.nbytes
    ops: list[tuple[list, list]] = []
    for t in range(len(g.ins)):
        if t in s.dead:
            continue
        b = s.blocks.get(t)
        if b is not None:
            ops.append((list(b.externals) + ([b.anchor] if b.anchor is not None else []), []))
            for p in b.eqns:
                ops.append(
                    (
                        [("re", u) if producer.get(u) in rec else u for u in g.ins[p]],
                        [("re", v) for v in g.outs[p]],
                    )
                )
        if t in g.backward:
            ops.append(([("re", u) if producer.get(u) in rec else u for u in g.ins[t]], g.outs[t]))
        else:
            ops.append((g.ins[t], g.outs[t]))
    last: dict = {}
    for k, (ins, _) in enumerate(ops):
        for v in ins:
            last[v] = k
    for v in g.jaxpr.outvars:
        if _plan.is_var(v):
            last[v] = len(ops)
    live = peak = integral = 0
    for k, (ins, outs) in enumerate(ops):
        for v in outs:
            if v in last:
                live += nb[v[1]] if isinstance(v, tuple) else nb[v]
        if live > peak:
            peak = live
        integral += live
        for v in set(ins):
            if last.get(v) == k:
                live -= nb[v[1]] if isinstance(v, tuple) else nb[v]
    return peak, integral


def _ln(x):
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-5)


def residual_step(ps, x):
    def loss(ps):
        h = x
        for w1, w2 in ps:
            h = h + jax.nn.gelu(_ln(h) @ w1) @ w2
        return jnp.mean(h**2)

    value, g = jax.value_and_grad(loss)(ps)
    return [(w1 - 0.1 * g1, w2 - 0.1 * g2) for (w1, w2), (g1, g2) in zip(ps, g)], value


def attention_step(ws, x):
    def loss(ws):
        h = x
        for wq, wk in ws:
            q, k = h @ wq, h @ wk
            att = jax.nn.softmax(q @ k.T / math.sqrt(q.shape[-1]))
            h = h + jnp.tanh(att @ h)
        return jnp.mean(h**2)

    value, g = jax.value_and_grad(loss)(ws)
    return [(a - 0.1 * ga, b - 0.1 * gb) for (a, b), (ga, gb) in zip(ws, g)], value


def _graph(name):
    if name == "residual":
        ps = [(jnp.ones((32, 128)), jnp.ones((128, 32))) for _ in range(3)]
        closed = jax.make_jaxpr(residual_step)(ps, jnp.ones((64, 32)))
    else:
        ws = [(jnp.ones((32, 32)), jnp.ones((32, 32))) for _ in range(3)]
        closed = jax.make_jaxpr(attention_step)(ws, jnp.ones((16, 32)))
    g = _plan.joint_graph(closed.jaxpr)
    assert g is not None
    return g


@pytest.mark.parametrize("name", ["residual", "attention"])
def test_the_estimate_is_the_reference_on_every_schedule(name, monkeypatch):
    g = _graph(name)
    seen = []
    fast, fast_schedule = _plan.simulated_peak, _plan.schedule

    def both(g_, s):
        got = fast(g_, s)
        assert got == _reference_peak(g_, s)
        seen.append(s)
        return got

    def both_schedules(g_, recompute):
        got = fast_schedule(g_, recompute)
        assert got == _reference_schedule(g_, recompute)
        return got

    monkeypatch.setattr(_plan, "simulated_peak", both)
    monkeypatch.setattr(_plan, "schedule", both_schedules)
    base = _plan.cheap_plan(g)
    _plan.partial_plans(g, base, math.inf)
    _plan.partial_plans(g, base, math.inf, allow_heavy=False)
    _plan.segment_plans(g, base)
    assert len(seen) > 10
    assert _plan.residual_bytes(g.jaxpr) == g.residual_bytes  # the gate read before the graph
    rng = random.Random(0)
    eligible = sorted(g.eligible)
    for _ in range(50):
        rec = {i for i in eligible if rng.random() < rng.random()}
        s = fast_schedule(g, rec)
        assert s == _reference_schedule(g, rec)
        assert fast(g, s) == _reference_peak(g, s)
