"""Rematerialization plans for a jaxpr that holds its own backward pass (a training step that
calls ``jax.grad``/``value_and_grad``/``vjp`` inside), and the rewrite that applies one.

The forward and the backward are told apart by JAX's name stack: every equation JAX's transpose
emits runs under ``transpose(jvp(...))``. A *residual* is a forward value that a backward
equation reads. A *plan* is the set of forward equations whose outputs the backward recomputes
instead of reading the saved value; everything else stays as it is. NB: the analogue is the
joint-graph partitioner of PyTorch's AOTAutograd (``torch/_functorch/partitioners.py``): a min-cut
over cheap pointwise operations, and a knapsack over matmuls when a memory budget demands it.

Three plan families, all expressed as "recompute these forward equations":

- ``cheap_plan``: the min-cut. Recomputing elementwise and layout operations is nearly free;
  saving the smallest set of values from which the backward can recompute the rest costs no
  matmul. XLA's fusion already does much of this, so it is rarely worth a plan on its own, but
  every other plan includes it.
- ``segment_plans``: sqrt(n)-style checkpointing generalized to any DAG: the forward is cut, in
  program order, at points where few bytes cross (the residual stream between transformer
  blocks), and each segment but the last is recomputed from its boundary during the backward.
- ``partial_plans``: the knapsack: one fine segment (one matmul each) at a time, chosen greedily
  by simulated peak saved per FLOP added, up to a FLOPs limit (without a memory budget, the
  rule's 10%). ``allow_heavy=False`` gives the same sequence over the segments' elementwise
  work only, the fallback when a plan that recomputes matmuls does not pass the compile.

Each recomputation is placed just before the first backward equation that needs it, behind an
``optimization_barrier`` over its inputs and one backward value, so that XLA neither merges it
with the forward copy (CSE) nor schedules it early. XLA:CPU removes barriers before CSE unless
compiled with ``xla_disable_hlo_passes=cse_barrier_expander`` (jax-ml/jax#19822), so there the
pass asks ``apply`` for ``fence="cond"``: each recomputation runs inside a ``lax.cond`` whose
two branches are that recomputation followed by the backward equations up to the next one, on
a predicate read from the backward value (on the benchmark's transformer about as low a peak
as the barrier with the flag, and lower than the recomputation alone in the cond). Plans
are ranked here with a static liveness simulation; the pass keeps one only after compiling it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

from autoopt import _compat, _jaxpr
from autoopt._memory import aval_bytes

# --- cost model ----------------------------------------------------------------------------------

# Recomputed only by the knapsack (partial and segment plans), never by the min-cut: matmuls,
# convolutions, reductions, sorts, scans of prefix sums, linear algebra. NB: AOTAutograd bans
# the same set ("non-fusible" ops) from recomputation without a budget.
HEAVY = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "ragged_dot_general",
        "fft",
        "cholesky",
        "triangular_solve",
        "lu",
        "qr",
        "svd",
        "eigh",
        "eig",
        "schur",
        "sort",
        "top_k",
        "cumsum",
        "cumprod",
        "cummax",
        "cummin",
        "cumlogsumexp",
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
        "reduce_window",
        "reduce_window_sum",
        "reduce_window_max",
        "reduce_window_min",
        "select_and_scatter_add",
        "select_and_gather_add",
    }
)
# Recomputable, but not free: they read (and so keep alive) a whole operand.
_NOT_CHEAP = frozenset(
    {
        "gather",
        "scatter",
        "scatter-add",
        "scatter_add",
        "scatter_mul",
        "scatter_min",
        "scatter_max",
        "dynamic_slice",
        "dynamic_update_slice",
        "concatenate",
        "pad",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
    }
)
# Never recomputed: not deterministic, or opaque, or their cost is unknown.
_UNRECOMPUTABLE = frozenset(
    {
        "rng_uniform",
        "random_seed",
        "while",
        "shard_map",
        "pallas_call",
        "custom_partitioning",
        "optimization_barrier",
        "name",
        "device_put",
        "psum",
        "all_gather",
        "all_to_all",
        "ppermute",
        "reduce_scatter",
        "axis_index",
        "pure_callback",
        "io_callback",
        "debug_callback",
    }
)


def _size(aval) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def jaxpr_flops(jaxpr: ClosedJaxpr | Jaxpr) -> float:
    j = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    return float(sum(eqn_flops(e) for e in j.eqns))


def eqn_flops(eqn: JaxprEqn) -> float:
    """A static FLOP estimate: 2*M*N*K for matmuls, operand size for reductions, output size for
    elementwise work, bodies times trip counts for loops. Ranks plans; the compiled
    ``cost_analysis()`` decides."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _rc), _ = eqn.params["dimension_numbers"]
        lhs = _jaxpr.shaped(eqn.invars[0])
        k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64)) if lc else 1
        return 2.0 * _size(eqn.outvars[0].aval) * k
    if name == "conv_general_dilated":
        rhs = _jaxpr.shaped(eqn.invars[1])
        dn = eqn.params.get("dimension_numbers")
        out_feat = rhs.shape[dn.rhs_spec[0]] if dn is not None else rhs.shape[0]
        return 2.0 * _size(eqn.outvars[0].aval) * _size(rhs) / max(1, out_feat)
    if name == "scan":
        return eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"])
    if name == "cond":
        return max((jaxpr_flops(b) for b in eqn.params["branches"]), default=0.0)
    subs = _jaxpr.subjaxprs(eqn)
    if subs:
        return sum(jaxpr_flops(s) for _, _, s in subs)
    if name.startswith("reduce") or name in ("argmax", "argmin", "sort", "cumsum"):
        return float(sum(_size(v.aval) for v in eqn.invars))
    return float(sum(_size(v.aval) for v in eqn.outvars))


def recomputable(eqn: JaxprEqn) -> bool:
    """Pure and deterministic, so running it twice gives the same values."""
    if eqn.effects or eqn.primitive.name in _UNRECOMPUTABLE:
        return False
    return all(recomputable(e) for _, _, s in _jaxpr.subjaxprs(eqn) for e in _as_jaxpr(s).eqns)


def cheap(eqn: JaxprEqn) -> bool:
    """Elementwise and layout work that costs about as much as reading its inputs."""
    name = eqn.primitive.name
    return (
        name not in HEAVY
        and name not in _NOT_CHEAP
        and not _jaxpr.subjaxprs(eqn)
        and recomputable(eqn)
    )


def heavy(eqn: JaxprEqn) -> bool:
    if eqn.primitive.name in HEAVY:
        return True
    return any(heavy(e) for _, _, s in _jaxpr.subjaxprs(eqn) for e in _as_jaxpr(s).eqns)


def recomputes_heavy(g: JointGraph, recompute: Iterable[int]) -> bool:
    """Whether a plan recomputes a matmul, convolution or reduction (see ``HEAVY``)."""
    return any(heavy(g.jaxpr.eqns[i]) for i in recompute)


def _as_jaxpr(j) -> Jaxpr:
    return j.jaxpr if isinstance(j, ClosedJaxpr) else j


def is_var(v) -> bool:
    return isinstance(v, Var) and not isinstance(v, Literal) and not isinstance(v, DropVar)


# --- the joint graph -----------------------------------------------------------------------------


@dataclasses.dataclass
class JointGraph:
    """One jaxpr level, split into forward and backward equations."""

    jaxpr: Jaxpr
    backward: frozenset[int]  # indices of equations emitted by JAX's transpose
    producer: dict  # Var -> index of the equation defining it
    residuals: tuple  # forward-defined Vars read by a backward equation
    forward: tuple[int, ...]  # indices of the other equations, in order
    eligible: frozenset[int]  # forward equations a plan may recompute
    ins: list  # per equation: its Var inputs (literals dropped)
    outs: list  # per equation: its Var outputs (dropped outputs dropped)
    nbytes: dict  # Var -> bytes
    flops: list  # per equation: eqn_flops

    @property
    def backward_order(self) -> list[int]:
        order = self.__dict__.get("_backward_order")
        if order is None:
            order = self.__dict__["_backward_order"] = sorted(self.backward)
        return order

    @property
    def residual_bytes(self) -> int:
        return sum(aval_bytes(v.aval) for v in self.residuals)

    def location(self, i: int) -> str | None:
        return _jaxpr.user_location(self.jaxpr.eqns[i])


def residual_bytes(jaxpr: Jaxpr) -> int | None:
    """``joint_graph(jaxpr).residual_bytes`` without building the graph (None without a
    backward): the gate a level passes before its decision is looked up."""
    eqns = jaxpr.eqns
    backward = [_compat.in_transpose(e.source_info) for e in eqns]
    if not any(backward):
        return None
    forward_defined = set()
    for e, bwd in zip(eqns, backward):
        if not bwd:
            forward_defined.update(v for v in e.outvars if is_var(v))
    seen: set = set()
    total = 0
    for e, bwd in zip(eqns, backward):
        if bwd:
            for v in e.invars:
                if is_var(v) and v in forward_defined and v not in seen:
                    seen.add(v)
                    total += aval_bytes(v.aval)
    return total


def joint_graph(jaxpr: Jaxpr) -> JointGraph | None:
    """The split of ``jaxpr`` (one level, sub-jaxprs not entered), or None without a backward."""
    eqns = jaxpr.eqns
    backward = frozenset(i for i, e in enumerate(eqns) if _compat.in_transpose(e.source_info))
    if not backward:
        return None
    producer: dict = {}
    for i, e in enumerate(eqns):
        for v in e.outvars:
            if is_var(v):
                producer[v] = i
    forward = tuple(i for i in range(len(eqns)) if i not in backward)
    seen: set = set()
    residuals = []
    for i in sorted(backward):
        for v in eqns[i].invars:
            if is_var(v) and v in producer and producer[v] not in backward and v not in seen:
                seen.add(v)
                residuals.append(v)
    # A forward equation may be recomputed when it is pure and reads only forward values or
    # inputs (an equation after the backward that reads gradients is not "forward" in time).
    eligible = set()
    for i in forward:
        e = eqns[i]
        if not recomputable(e):
            continue
        if all(not is_var(v) or v not in producer or producer[v] not in backward for v in e.invars):
            eligible.add(i)
    ins = [[v for v in e.invars if is_var(v)] for e in eqns]
    outs = [[v for v in e.outvars if is_var(v)] for e in eqns]
    nbytes = {v: aval_bytes(v.aval) for vs in ins + outs for v in vs}
    nbytes.update((v, aval_bytes(v.aval)) for v in jaxpr.outvars if is_var(v))
    flops = [eqn_flops(e) if i not in backward else 0.0 for i, e in enumerate(eqns)]
    return JointGraph(
        jaxpr,
        backward,
        producer,
        tuple(residuals),
        forward,
        frozenset(eligible),
        ins,
        outs,
        nbytes,
        flops,
    )


# --- schedules: where each equation (and each recomputation) runs --------------------------------


@dataclasses.dataclass(frozen=True)
class Block:
    """Recompute ``eqns`` (original indices, in order) just before backward equation ``before``,
    from ``externals`` (values kept from the forward or inputs) behind a barrier with ``anchor``."""

    before: int
    eqns: tuple[int, ...]
    externals: tuple
    anchor: Any


@dataclasses.dataclass(frozen=True)
class Schedule:
    recompute: frozenset[int]  # equations whose backward uses read recomputed values
    blocks: dict  # backward index -> Block
    dead: frozenset[int]  # forward equations no longer needed
    flops: float  # added by the recomputation


def schedule(g: JointGraph, recompute: Iterable[int]) -> Schedule:
    """Place each recomputation just before its first backward use, and drop forward equations
    that only fed the backward. Kept per graph and recompute set: a plan search asks again
    for sets it scheduled (each family's first step, the estimates of the plans it returns)."""
    rec = frozenset(i for i in recompute if i in g.eligible)
    known = g.__dict__.setdefault("_schedules", {})
    got = known.get(rec)
    if got is None:
        got = known[rec] = _schedule(g, rec)
    return got


def _schedule(g: JointGraph, rec: frozenset[int]) -> Schedule:
    producer, ins = g.producer, g.ins
    done: set[int] = set()
    blocks: dict[int, Block] = {}
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
            blocks[t] = Block(t, order, tuple(ext), anchor)
            external_reads.update(ext)
            done.update(order)
            flops += sum(g.flops[p] for p in order)
        if g.outs[t]:
            last_bwd_val = g.outs[t][-1]
    # Dead-code: a forward equation stays when one of its outputs is still read in the original
    # form (by the forward, the backward through a kept value, a recompute block, or the outputs).
    needed = {v for v in g.jaxpr.outvars if is_var(v)} | external_reads
    needed.update(v for v in _backward_reads(g) if producer.get(v) not in rec)
    dead = set()
    eqns = g.jaxpr.eqns
    for i in reversed(g.forward):
        if eqns[i].effects or any(v in needed for v in g.outs[i]):
            needed.update(ins[i])
        else:
            dead.add(i)
    return Schedule(rec, blocks, frozenset(dead), flops)


def _backward_reads(g: JointGraph) -> tuple:
    """The distinct values backward equations read (computed once per graph)."""
    got = g.__dict__.get("_backward_reads")
    if got is None:
        got = g.__dict__["_backward_reads"] = tuple(
            dict.fromkeys(v for t in sorted(g.backward) for v in g.ins[t])
        )
    return got


def simulated_peak(g: JointGraph, s: Schedule) -> tuple[int, int]:
    """``(peak, integral)`` of live bytes over the rewritten program in program order, inputs not
    counted. A static stand-in for XLA's allocator, good for ranking plans of one program.

    Values are numbered once per graph (``_numbered``): a value ``i`` recomputed in the backward
    is ``i + n``. Called for every step of every plan family's search (``partial_plans``);
    kept per graph and recompute set, as ``schedule`` is (a schedule depends on nothing else)."""
    known = g.__dict__.setdefault("_peaks", {})
    got = known.get(s.recompute)
    if got is None:
        got = known[s.recompute] = _simulated_peak(g, s)
    return got


def _simulated_peak(g: JointGraph, s: Schedule) -> tuple[int, int]:
    num = _numbered(g)
    n, prod, nb, ins, outs, backward = num.n, num.prod, num.nb, num.ins, num.outs, num.backward
    rec, dead, blocks = s.recompute, s.dead, s.blocks
    op_ins: list = []
    op_outs: list = []
    empty: tuple = ()
    for t in range(len(ins)):
        if t in dead:
            continue
        b = blocks.get(t)
        if b is not None:
            head = [num.idx[v] for v in b.externals]
            if b.anchor is not None:
                head.append(num.idx[b.anchor])
            op_ins.append(set(head))
            op_outs.append(empty)
            for p in b.eqns:
                op_ins.append([u + n if prod[u] in rec else u for u in ins[p]])
                op_outs.append([v + n for v in outs[p]])
        if backward[t]:
            op_ins.append([u + n if prod[u] in rec else u for u in ins[t]])
        else:
            op_ins.append(ins[t])
        op_outs.append(outs[t])
    count = len(op_ins)
    last = [-1] * (2 * n)
    for k, vs in enumerate(op_ins):
        for v in vs:
            last[v] = k
    for v in num.outvars:
        last[v] = count
    live = peak = integral = 0
    for k in range(count):
        for v in op_outs[k]:
            if last[v] >= 0:
                live += nb[v]
        if live > peak:
            peak = live
        integral += live
        for v in op_ins[k]:
            if last[v] == k:
                live -= nb[v]
    return peak, integral


@dataclasses.dataclass(frozen=True)
class _Numbered:
    """A graph's values as integers (see ``simulated_peak``): ``idx`` Var -> i; per equation
    its distinct inputs and its outputs; ``prod[i]``, the equation defining i (-1: an input);
    ``nb[i]`` and ``nb[i + n]``, its bytes; the program's outputs; which equations are
    backward."""

    n: int
    idx: dict
    ins: list
    outs: list
    prod: list
    nb: list
    outvars: list
    backward: list


def _numbered(g: JointGraph) -> _Numbered:
    got = g.__dict__.get("_numbered")
    if got is None:
        idx: dict = {}
        for vs in [*g.ins, *g.outs, [v for v in g.jaxpr.outvars if is_var(v)]]:
            for v in vs:
                if v not in idx:
                    idx[v] = len(idx)
        n = len(idx)
        prod = [-1] * n
        nb = [0] * n
        for v, i in idx.items():
            prod[i] = g.producer.get(v, -1)
            nb[i] = g.nbytes[v]
        got = g.__dict__["_numbered"] = _Numbered(
            n,
            idx,
            [list(dict.fromkeys(idx[v] for v in vs)) for vs in g.ins],
            [[idx[v] for v in vs] for vs in g.outs],
            prod,
            nb + nb,
            [idx[v] for v in g.jaxpr.outvars if is_var(v)],
            [t in g.backward for t in range(len(g.ins))],
        )
    return got


# --- plan families -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    recompute: frozenset[int]
    est_peak: int = 0
    est_flops: float = 0.0


def _max_flow_min_cut(nodes: int, edges: list[tuple[int, int, float]], s: int, t: int) -> set[int]:
    """Nodes on the source side of a minimum s-t cut (Edmonds-Karp; graphs here are small)."""
    cap: list[dict[int, float]] = [dict() for _ in range(nodes)]
    for a, b, c in edges:
        cap[a][b] = cap[a].get(b, 0.0) + c
        cap[b].setdefault(a, 0.0)
    while True:
        parent = [-1] * nodes
        parent[s] = s
        q = deque([s])
        while q and parent[t] < 0:
            a = q.popleft()
            for b, c in cap[a].items():
                if c > 0 and parent[b] < 0:
                    parent[b] = a
                    q.append(b)
        if parent[t] < 0:
            break
        f = math.inf
        b = t
        while b != s:
            f = min(f, cap[parent[b]][b])
            b = parent[b]
        b = t
        while b != s:
            a = parent[b]
            cap[a][b] -= f
            cap[b][a] += f
            b = a
    side = {s}
    q = deque([s])
    while q:
        a = q.popleft()
        for b, c in cap[a].items():
            if c > 0 and b not in side:
                side.add(b)
                q.append(b)
    return side


def cheap_plan(g: JointGraph) -> Plan:
    """The min-cut over cheap forward operations: save the fewest bytes from which the backward
    recomputes the residuals using elementwise and layout work only."""
    eqns = g.jaxpr.eqns
    fwd_vars = [v for i in g.forward for v in eqns[i].outvars if is_var(v)]
    index = {v: k for k, v in enumerate(fwd_vars)}
    n = 2 * len(fwd_vars) + 2
    src, snk = n - 2, n - 1
    inf = float(sum(aval_bytes(v.aval) for v in fwd_vars) + 1) * 4
    edges: list[tuple[int, int, float]] = []
    residual = set(g.residuals)
    for v, k in index.items():
        p = g.producer[v]
        edges.append((2 * k, 2 * k + 1, float(aval_bytes(v.aval)) or 1e-3))
        if p not in g.eligible or not cheap(eqns[p]):
            edges.append((src, 2 * k, inf))
        if v in residual:
            edges.append((2 * k + 1, snk, inf))
        for u in eqns[p].invars:
            if is_var(u) and u in index:
                edges.append((2 * index[u] + 1, 2 * k, inf))
    side = _max_flow_min_cut(n, edges, src, snk)
    rec = frozenset(
        g.producer[v] for v, k in index.items() if 2 * k not in side and g.producer[v] in g.eligible
    )
    return Plan("cheap", rec)


def fine_cuts(eqns: Sequence[JaxprEqn], end: int | None = None) -> list[tuple[int, int]]:
    """Cut points in ``eqns`` (a straight-line forward program), one between each pair of heavy
    operations, where the fewest bytes of values defined in ``eqns`` cross:
    ``[(position, crossing bytes)]``; the cut at position k runs before ``eqns[k]``. Only
    positions up to ``end`` are considered."""
    end = len(eqns) - 1 if end is None else end
    producer = {v: k for k, e in enumerate(eqns) for v in e.outvars if is_var(v)}
    last_use: dict = {}
    for k, e in enumerate(eqns):
        for v in e.invars:
            if is_var(v) and v in producer:
                last_use[v] = k
    delta = [0] * (len(eqns) + 2)
    for v, k_last in last_use.items():
        k_def = producer[v]
        if k_last > k_def:  # crosses every cut in (k_def, k_last]
            b = aval_bytes(v.aval)
            delta[k_def + 1] += b
            delta[k_last + 1] -= b
    crossing = list(np.cumsum(delta))
    heavy_pos = [k for k, e in enumerate(eqns) if k <= end and heavy(e)]
    cuts = []
    for a, b in zip(heavy_pos, heavy_pos[1:]):
        best = min(range(a + 1, b + 1), key=lambda k: (crossing[k], -k))
        cuts.append((best, int(crossing[best])))
    return cuts


def segment_sizes(n_fine: int, k: int, decreasing: bool = False) -> list[float] | None:
    """The lengths, in fine segments, of ``k`` segments covering ``n_fine``: equal, or
    ``decreasing`` by one fine segment each, so that while the backward runs segment j (last
    first) the j - 1 boundaries still kept plus segment j's recomputed values stay about
    constant: a peak near sqrt(2n) fine segments instead of 2 sqrt(n) - 1 for equal ones
    (lower on the benchmark's 16-layer MLP). None when ``k`` is too many for decreasing sizes."""
    if not decreasing:
        return [n_fine / k] * k
    c = (n_fine + k * (k - 1) / 2) / k
    if c - (k - 1) < 1:
        return None
    return [c - j for j in range(k)]


def choose_cuts(cuts: Sequence[tuple[int, int]], k: int, decreasing: bool = False) -> list[int]:
    """``k - 1`` of the fine cuts, each the narrowest near its target; the targets split the fine
    segments into ``segment_sizes(n, k, decreasing)``. [] when those sizes do not exist."""
    n_fine = len(cuts) + 1
    sizes = segment_sizes(n_fine, k, decreasing)
    if sizes is None:
        return []
    chosen: list[int] = []
    for j in range(1, k):
        target = sum(sizes[:j]) - 1
        half = sizes[j - 1] / 2
        lo, hi = max(0, int(target - half)), min(len(cuts) - 1, int(target + half))
        window = range(lo, hi + 1) if hi >= lo else [min(len(cuts) - 1, max(0, round(target)))]
        best = min(window, key=lambda c: (cuts[c][1], abs(c - target)))
        if not chosen or cuts[best][0] > chosen[-1]:
            chosen.append(cuts[best][0])
    return chosen


def segment_counts(n_fine: int, limit: int = 8) -> list[int]:
    """Segment counts worth trying for ``n_fine`` fine segments (sqrt(n) among them)."""
    xs = (2, 3, 4, math.sqrt(n_fine), math.sqrt(2 * n_fine), 2 * math.sqrt(n_fine), n_fine / 2)
    return sorted({max(2, round(x)) for x in xs if round(x) <= n_fine})[:limit]


def _fine_cuts(g: JointGraph) -> list[tuple[int, int]]:
    eqns = [g.jaxpr.eqns[i] for i in g.forward]
    pos = {i: k for k, i in enumerate(g.forward)}
    # The residuals end where the backward begins: cut only inside the forward region.
    res_pos = [pos[g.producer[v]] for v in g.residuals if g.producer[v] in pos]
    return fine_cuts(eqns, max(res_pos) if res_pos else 0)


def _segment_recompute(
    g: JointGraph,
    bounds: Sequence[int],
    chosen: Iterable[int],
    keep_boundaries: bool = True,
    base: frozenset[int] = frozenset(),
) -> frozenset[int]:
    """Equations of the chosen segments (segment j runs over forward positions
    ``[bounds[j], bounds[j+1])``). With ``keep_boundaries`` the values that leave a segment
    (its checkpoint) are kept, so each segment is recomputed from its own start only."""
    eqns = g.jaxpr.eqns
    pos = {i: k for k, i in enumerate(g.forward)}
    out: set[int] = set()
    kept: set[int] = set()
    for j in chosen:
        lo, hi = bounds[j], bounds[j + 1]
        keep = set()
        if keep_boundaries:
            for k in range(hi, len(g.forward)):
                for v in eqns[g.forward[k]].invars:
                    if is_var(v) and lo <= pos.get(g.producer.get(v, -1), -1) < hi:
                        keep.add(g.producer[v])
        for k in range(lo, hi):
            i = g.forward[k]
            if i in g.eligible and i not in keep:
                out.add(i)
        kept.update(keep)
    return frozenset((out | base) - kept)


def _estimate(g: JointGraph, plan: Plan) -> Plan:
    s = schedule(g, plan.recompute)
    peak, _ = simulated_peak(g, s)
    return dataclasses.replace(plan, est_peak=peak, est_flops=s.flops)


def segment_plans(g: JointGraph, base: Plan) -> list[Plan]:
    """Checkpoint every segment but the last, for several segment counts (sqrt(n) among them)."""
    cuts = _fine_cuts(g)
    if not cuts:
        return []
    plans = []
    n_fine = len(cuts) + 1
    for decreasing in (False, True):
        for k in segment_counts(n_fine):
            # Decreasing sizes exist up to about sqrt(2n) segments; beyond, the most there are.
            while decreasing and k > 2 and segment_sizes(n_fine, k, True) is None:
                k -= 1
            inner = choose_cuts(cuts, k, decreasing)
            if not inner:
                continue
            bounds = [0, *inner, len(g.forward)]
            rec = _segment_recompute(g, bounds, range(len(bounds) - 2), base=base.recompute)
            name = f"{'decreasing ' if decreasing else ''}segments({len(bounds) - 1})"
            if all(p.recompute != rec for p in plans):
                plans.append(Plan(name, rec))
    return plans


def partial_plans(
    g: JointGraph,
    base: Plan,
    flop_limit: float,
    max_units: int = 24,
    lookahead: int = 6,
    allow_heavy: bool = True,
    label: str = "partial",
) -> list[Plan]:
    """Recompute fine segments (merged to at most ``max_units``) one at a time, each step the
    one that lowers the simulated peak most per FLOP added (ties by the live-bytes integral),
    until ``flop_limit``. Returns the sequence of plans, cheapest first.

    Lazy greedy (as CELF does for submodular objectives): after the first step only the
    ``lookahead`` units that scored best last time are re-evaluated. About 0.1 s for a
    1000-equation training step.
    """
    cuts = [c for c, _ in _fine_cuts(g)]
    if not cuts:
        return []
    if len(cuts) + 1 > max_units:
        step = (len(cuts) + 1) / max_units
        cuts = sorted(
            {cuts[min(len(cuts) - 1, round(step * (j + 1)) - 1)] for j in range(max_units - 1)}
        )
    bounds = [0, *cuts, len(g.forward)]
    units = [
        _segment_recompute(g, bounds, [j], keep_boundaries=False) for j in range(len(bounds) - 2)
    ]  # the last segment's recomputation would run at once
    if not allow_heavy:
        eqns = g.jaxpr.eqns
        units = [frozenset(i for i in u if not heavy(eqns[i])) for u in units]
    current = base.recompute
    s0 = schedule(g, current)
    peak, integral = simulated_peak(g, s0)
    flops = s0.flops
    prev_score: dict[int, tuple] = {j: (math.inf, math.inf) for j in range(len(units))}
    out = []
    while prev_score:
        order = sorted(prev_score, key=lambda j: prev_score[j], reverse=True)
        first = len(out) == 0
        best = None
        for j in order if first else order[:lookahead]:
            rec = current | units[j]
            sj = schedule(g, rec)
            if sj.flops > flop_limit:
                prev_score[j] = (-math.inf, -math.inf)
                continue
            p, itg = simulated_peak(g, sj)
            cost = max(sj.flops - flops, 1.0)
            score = ((peak - p) / cost, (integral - itg) / cost)
            prev_score[j] = score
            if p > peak or (p == peak and itg >= integral):
                continue
            if best is None or score > best[0]:
                best = (score, j, rec, p, itg, sj.flops)
        if best is None:
            break
        _, j, current, peak, integral, flops = best
        del prev_score[j]
        out.append(Plan(f"{label}({len(out) + 1}/{len(units) + 1})", current, peak, flops))
    return out


def policy_plan(g: JointGraph, policy) -> Plan:
    """The plan a ``jax.checkpoint_policies`` policy describes: recompute every forward equation
    whose outputs the policy does not call saveable."""
    eqns = g.jaxpr.eqns
    rec = set()
    for i in g.eligible:
        e = eqns[i]
        try:
            verdict = policy(e.primitive, *[v.aval for v in e.invars], **e.params)
        except Exception:  # noqa: BLE001 - a policy that cannot judge this equation saves it
            verdict = True
        # Offload policies answer with jax's RecomputeType / SaveableType / Offloadable (no
        # offload here: an offloadable value is kept).
        saveable = (
            verdict if isinstance(verdict, bool) else type(verdict).__name__ != "RecomputeType"
        )
        if not saveable:
            rec.add(i)
    return Plan("policy", frozenset(rec))


def estimate(g: JointGraph, plans: Sequence[Plan]) -> list[Plan]:
    return [p if p.est_peak else _estimate(g, p) for p in plans]


def pareto(plans: Sequence[Plan]) -> list[Plan]:
    """Plans not beaten on both estimated peak and FLOPs, by FLOPs ascending."""
    out: list[Plan] = []
    for p in sorted(plans, key=lambda p: (p.est_flops, p.est_peak)):
        if not out or p.est_peak < out[-1].est_peak:
            out.append(p)
    return out


# --- the rewrite ---------------------------------------------------------------------------------


def run_eqn(eqn: JaxprEqn, invals: Sequence[Any], scope: str | None = None) -> list[Any]:
    """``_jaxpr.rebind``, inside ``jax.named_scope(scope)`` when a scope is given."""
    if scope is None:
        return _jaxpr.rebind(eqn, invals)
    with _jaxpr.at_source(eqn), jax.named_scope(scope):
        return _jaxpr._bind(eqn, invals)


def apply(
    closed: ClosedJaxpr, g: JointGraph, recompute: Iterable[int], fence: str = "barrier"
) -> ClosedJaxpr:
    """``closed`` with the plan applied: the same values, the named forward equations run again
    in the backward instead of being kept. Type-checked when AUTOOPT_CHECK is set.

    ``fence`` says how each recomputation is kept apart from the forward: ``"barrier"`` (an
    ``optimization_barrier``) or ``"cond"`` (a ``lax.cond`` both of whose branches recompute, on
    a predicate read from a backward value: see ``_cond_fenced``)."""
    s = schedule(g, recompute)
    j = closed.jaxpr
    eqns = j.eqns
    readers: dict = {}
    regions: dict = {}
    escaping: set = set()
    if fence == "cond":
        for t in set(g.backward) | s.recompute:
            for u in g.ins[t]:
                readers.setdefault(u, set()).add(t)
        regions = _backward_regions(g, s)
        # Backward values defined in a region and read after it (or returned).
        in_region = {k: t for t, r in regions.items() for k in r}
        escaping = {v for v in j.outvars if is_var(v)}
        for k, ins_k in enumerate(g.ins):
            for u in ins_k:
                p = g.producer.get(u)
                if p in in_region and in_region.get(k) != in_region[p]:
                    escaping.add(u)

    def fn(*args):
        env = _jaxpr.initial_env(j, closed.consts, args)
        renv: dict = {}

        def read(v, recomputed: bool):
            if isinstance(v, Literal):
                return v.val
            if recomputed and g.producer.get(v) in s.recompute:
                return renv[v]
            return env[v]

        skip: set = set()
        for t, e in enumerate(eqns):
            if t in s.dead or t in skip:
                continue
            b = s.blocks.get(t)
            if b is not None:
                ext = [env[v] for v in b.externals]
                anchor = [env[b.anchor]] if b.anchor is not None else []
                if fence == "cond":
                    # Under the backward equation's name stack: the cond is part of the
                    # backward (a later joint_graph of this program must see it there).
                    name_stack = source_info_util.current_name_stack() + e.source_info.name_stack
                    region = regions.get(t, ())
                    with source_info_util.user_context(
                        e.source_info.traceback, name_stack=name_stack
                    ):
                        outs, bouts = _cond_fenced(
                            eqns, b, s, g, ext, anchor, renv, readers, region, env, escaping
                        )
                    renv.update(outs)
                    env.update(bouts)
                    skip.update(region)
                    if region:
                        continue
                    ins = [read(v, t in g.backward) for v in e.invars]
                    for v, val in zip(e.outvars, run_eqn(e, ins)):
                        if is_var(v):
                            env[v] = val
                    continue
                # The barrier keeps XLA from merging the recomputation into the forward (CSE)
                # and, through the backward anchor, from running it before it is needed. The
                # backward reads the anchor through the barrier from here on: an unused barrier
                # output would be pruned by JAX's dead-code elimination, and the order with it.
                fenced, fenced_anchor = jax.lax.optimization_barrier((ext, anchor))
                if b.anchor is not None:
                    env[b.anchor] = fenced_anchor[0]
                local = dict(zip(b.externals, fenced))
                for p in b.eqns:
                    pe = eqns[p]
                    ins = [
                        u.val
                        if isinstance(u, Literal)
                        else renv[u]
                        if g.producer.get(u) in s.recompute
                        else local[u]
                        for u in pe.invars
                    ]
                    for v, val in zip(pe.outvars, run_eqn(pe, ins, "autoopt_remat")):
                        if is_var(v):
                            renv[v] = val
            ins = [read(v, t in g.backward) for v in e.invars]
            for v, val in zip(e.outvars, run_eqn(e, ins)):
                if is_var(v):
                    env[v] = val
        return [read(v, False) for v in j.outvars]

    return _compat.trace_closed_jaxpr(fn, [v.aval for v in j.invars], name="autoopt.remat")


def _backward_regions(g: JointGraph, s: Schedule) -> dict[int, tuple[int, ...]]:
    """For each recompute block, the run of backward equations from its first reader up to the
    next block, which run inside the same conditional (stopping early at an equation with
    effects, a sub-jaxpr or a collective). Inside one computation XLA fuses the recomputation
    into its readers instead of materializing every recomputed value at the conditional's
    boundary: on the benchmark's transformer a lower peak than the recomputation alone, and no
    slower than plain."""
    eqns = g.jaxpr.eqns
    out = {}
    for t in sorted(s.blocks):
        run = []
        for k in range(t, len(eqns)):
            if k != t and k in s.blocks:
                break
            e = eqns[k]
            if (
                k in s.dead
                or k not in g.backward
                or e.effects
                or e.primitive.name in _UNRECOMPUTABLE
                or _jaxpr.subjaxprs(e)
            ):
                break
            run.append(k)
        out[t] = tuple(run)
    return out


def _predicate(vals: Sequence[Any]):
    """A boolean scalar XLA cannot fold: read from the first non-empty value."""
    for x in vals:
        dtype = getattr(x, "dtype", None)
        if (
            not getattr(x, "size", 0)
            or dtype is None
            or not (jax.numpy.issubdtype(dtype, jax.numpy.number) or dtype == np.bool_)
        ):
            continue
        first = jax.lax.reshape(x, (x.size,))[0] if x.ndim else x
        return first if dtype == np.bool_ else first != jax.numpy.zeros((), dtype)
    return None


def _cond_fenced(
    eqns,
    b: Block,
    s: Schedule,
    g: JointGraph,
    ext: list,
    anchor: list,
    earlier: dict,
    readers: dict,
    region: Sequence[int] = (),
    env: dict | None = None,
    escaping: frozenset | set = frozenset(),
) -> tuple[dict, dict]:
    """Run block ``b``'s recomputation, and the backward equations of ``region`` (see
    ``_backward_regions``), inside a ``lax.cond`` whose two branches are the same computation,
    on a predicate read from the backward anchor (or an input). Branches are separate HLO
    computations, which XLA's CSE does not merge with the forward, and the predicate, a runtime
    value, keeps XLA from inlining them; whichever branch runs, the values are those of the
    original program. The anchor passes through the cond (the backward reads it from there on),
    so the block runs neither before the anchor exists nor after its first reader.
    ``readers``: Var -> the backward and recomputed equations that read it; ``escaping``: the
    region values read after it. Returns the recomputed values read outside the cond, and the
    backward values (the region's escaping ones, the anchor) by Var."""
    mine = set(b.eqns) | set(region)
    env = {} if env is None else env  # backward values; read only for a region's inputs
    # Only what the backward or another block reads leaves the cond (an output of a branch is
    # materialized; a value used only inside it may fuse away).
    outs_needed = [v for p in b.eqns for v in g.outs[p] if readers.get(v, set()) - mine]
    # The backward equations of the region: their inputs from outside (backward values,
    # kept residuals, recomputed values of earlier blocks) and their escaping outputs.
    rdefs = {v for k in region for v in g.outs[k]}
    bdefs_out = [v for k in region for v in g.outs[k] if v in escaping]
    rin: list = []
    for k in region:
        for u in g.ins[k]:
            if u in rdefs or g.producer.get(u) in b.eqns or u in rin:
                continue
            rin.append(u)

    def outer(u):
        return earlier[u] if g.producer.get(u) in s.recompute else env[u]

    # Values recomputed by an earlier block that this one reads.
    prior = list(
        dict.fromkeys(
            u
            for p in b.eqns
            for u in g.ins[p]
            if g.producer.get(u) in s.recompute and g.producer[u] not in mine
        )
    )
    ext = list(ext) + [earlier[u] for u in prior]
    names = list(b.externals) + prior
    n_ext = len(ext)
    ext = ext + [outer(u) for u in rin]

    def branch(ext_vals):
        local = dict(zip(names, ext_vals[:n_ext]))
        renv: dict = {}
        for p in b.eqns:
            pe = eqns[p]
            ins = [
                u.val if isinstance(u, Literal) else renv[u] if u in renv else local[u]
                for u in pe.invars
            ]
            for v, val in zip(pe.outvars, run_eqn(pe, ins, "autoopt_remat")):
                if is_var(v):
                    renv[v] = val
        benv = dict(zip(rin, ext_vals[n_ext:]))
        for k in region:
            e = eqns[k]
            ins = [
                u.val if isinstance(u, Literal) else benv[u] if u in benv else renv[u]
                for u in e.invars
            ]
            for v, val in zip(e.outvars, run_eqn(e, ins)):
                if is_var(v):
                    benv[v] = val
        return [renv[v] for v in outs_needed] + [benv[v] for v in bdefs_out]

    pred = _predicate(anchor) if anchor else None
    if pred is None:
        pred = _predicate(ext)
    n = len(outs_needed)
    if pred is None:  # nothing to read a predicate from: recompute behind a barrier
        ext, anchor = jax.lax.optimization_barrier((ext, anchor))
        outs = branch(ext)
    else:

        def through(vals):
            e, a = vals
            return branch(e), a

        outs, anchor = jax.lax.cond(pred, through, through, (ext, anchor))
    bouts = dict(zip(bdefs_out, outs[n:]))
    if b.anchor is not None and b.anchor not in bouts:
        bouts[b.anchor] = anchor[0]
    return dict(zip(outs_needed, outs[:n])), bouts


def describe(g: JointGraph, recompute: Iterable[int], limit: int = 8) -> dict[str, Any]:
    """What a plan keeps and recomputes, by the user's source lines, for the report."""
    s = schedule(g, recompute)
    eqns = g.jaxpr.eqns
    rec_res = [v for v in g.residuals if g.producer[v] in s.recompute]
    kept = [v for v in g.residuals if g.producer[v] not in s.recompute]
    for b in s.blocks.values():
        kept.extend(v for v in b.externals if v in g.producer and v not in kept)

    recomputed_eqns = sorted({p for b in s.blocks.values() for p in b.eqns})

    def lines(vs, what, run=()):
        # Per source line: the values (and bytes) the backward reads, the primitives and FLOPs
        # of every equation ``run`` there (a recomputed matmul whose output the backward never
        # reads itself still shows, with its cost).
        out: dict[str, list] = {}
        for v in vs:
            entry = out.setdefault(g.location(g.producer[v]) or "?", [0, 0, set(), 0.0])
            entry[0] += 1
            entry[1] += aval_bytes(v.aval)
            if not run:
                entry[2].add(eqns[g.producer[v]].primitive.name)
        for p in run:
            entry = out.setdefault(g.location(p) or "?", [0, 0, set(), 0.0])
            entry[2].add(eqns[p].primitive.name)
            entry[3] += g.flops[p]
        rows = sorted(out.items(), key=lambda kv: (-kv[1][1], -kv[1][3]))[:limit]
        return [
            {
                "location": loc,
                "values": n,
                "bytes": b,
                "primitives": sorted(p),
                "what": what,
                **({"flops": f} if run else {}),
            }
            for loc, (n, b, p, f) in rows
        ]

    return {
        "recomputed": lines(rec_res, "recomputed", recomputed_eqns),
        "kept": lines(kept, "kept"),
        "recomputed_bytes": sum(aval_bytes(v.aval) for v in rec_res),
        "kept_bytes": sum(aval_bytes(v.aval) for v in set(kept)),
        "recomputed_equations": len(recomputed_eqns),
        "recomputed_matmuls": sum(heavy(eqns[p]) for p in recomputed_eqns),
        "added_flops_estimate": s.flops,
    }


# --- loops in the joint graph: checkpoint a forward scan, recompute its body in the backward ---


@dataclasses.dataclass(frozen=True)
class ScanPair:
    """A forward ``scan`` (index ``fwd``) whose stacked residual outputs (``res_out`` positions in
    its outputs) are read only by one backward ``scan`` (index ``bwd``, at ``res_in`` positions
    of its inputs)."""

    fwd: int
    bwd: int
    res_out: tuple[int, ...]
    res_in: tuple[int, ...]
    saved_bytes: int  # residual stacks no longer kept
    carry_bytes: int  # the stacked carries kept instead
    flops: float  # the forward body, run again in the backward


def scan_pairs(g: JointGraph) -> list[ScanPair]:
    eqns = g.jaxpr.eqns
    readers: dict = {}
    for t, vs in enumerate(g.ins):
        for v in vs:
            readers.setdefault(v, set()).add(t)
    for v in g.jaxpr.outvars:
        if is_var(v):
            readers.setdefault(v, set()).add(-1)
    pairs = []
    for f in g.forward:
        e = eqns[f]
        if e.primitive.name != "scan" or f not in g.eligible:
            continue
        nk = e.params["num_carry"]
        res = [
            k
            for k in range(nk, len(e.outvars))
            if is_var(e.outvars[k])
            and readers.get(e.outvars[k])
            and all(t in g.backward for t in readers[e.outvars[k]])
        ]
        bwds = {t for k in res for t in readers[e.outvars[k]]}
        if not res or len(bwds) != 1:
            continue
        (b,) = bwds
        be = eqns[b]
        if be.primitive.name != "scan" or be.params["length"] != e.params["length"]:
            continue
        first_x = be.params["num_consts"] + be.params["num_carry"]
        pos = {v: i for i, v in enumerate(be.invars) if i >= first_x and is_var(v)}
        if any(e.outvars[k] not in pos for k in res):
            continue
        if sum(1 for v in be.invars if any(v is e.outvars[k] for k in res)) != len(res):
            continue  # a residual read twice, or as a const: keep it simple
        n = e.params["length"]
        carry_bytes = n * sum(aval_bytes(v.aval) for v in e.outvars[:nk])
        saved = sum(aval_bytes(e.outvars[k].aval) for k in res)
        pairs.append(
            ScanPair(
                f,
                b,
                tuple(res),
                tuple(pos[e.outvars[k]] for k in res),
                saved,
                carry_bytes,
                n * jaxpr_flops(e.params["jaxpr"]),
            )
        )
    return [p for p in pairs if p.carry_bytes < p.saved_bytes]


def apply_scan_checkpoints(
    closed: ClosedJaxpr, g: JointGraph, pairs: Sequence[ScanPair]
) -> ClosedJaxpr:
    """``closed`` with each pair's forward scan emitting its per-iteration carries instead of the
    residual stacks, and the backward scan recomputing the residuals from them in its own body
    (as ``scan(jax.checkpoint(body))`` would). No barrier is needed: the recomputation runs in
    another loop body, which XLA's CSE does not merge with the forward's."""
    j = closed.jaxpr
    eqns = j.eqns
    by_fwd = {p.fwd: p for p in pairs}
    by_bwd = {p.bwd: p for p in pairs}

    def fn(*args):
        env = _jaxpr.initial_env(j, closed.consts, args)

        def read(v):
            return v.val if isinstance(v, Literal) else env[v]

        carries: dict[int, list] = {}
        for t, e in enumerate(eqns):
            if t in by_bwd:  # its residual inputs are recomputed from the carries, not read
                p = by_bwd[t]
                fe = eqns[p.fwd]
                ins = [None if k in p.res_in else read(v) for k, v in enumerate(e.invars)]
                outs = _recomputing_backward_scan(
                    e, ins, fe, [read(v) for v in fe.invars], p, carries[p.fwd]
                )
            elif t in by_fwd:
                outs = _checkpointed_forward_scan(
                    e, [read(v) for v in e.invars], by_fwd[t], carries, t
                )
            else:
                outs = run_eqn(e, [read(v) for v in e.invars])
            for v, val in zip(e.outvars, outs):
                if is_var(v) and val is not None:
                    env[v] = val
        return [read(v) for v in j.outvars]

    return _compat.trace_closed_jaxpr(fn, [v.aval for v in j.invars], name="autoopt.remat")


def _checkpointed_forward_scan(e: JaxprEqn, ins: list, p: ScanPair, carries: dict, t: int) -> list:
    body: ClosedJaxpr = e.params["jaxpr"]
    nc, nk = e.params["num_consts"], e.params["num_carry"]
    keep = [k for k in range(nk, len(e.outvars)) if k not in p.res_out]

    def new_body(*a):
        outs = _jaxpr.eval_closed(body, *a)
        return [*outs[:nk], *[outs[k] for k in keep], *a[nc : nc + nk]]

    nb = _compat.trace_closed_jaxpr(new_body, body.in_avals, name="autoopt.remat.fwd_scan")
    res = run_eqn(e.replace(params=dict(e.params, jaxpr=nb)), ins)
    carries[t] = res[nk + len(keep) :]
    out: list = list(res[:nk]) + [None] * (len(e.outvars) - nk)
    for i, k in enumerate(keep):
        out[k] = res[nk + i]
    return out


def _recomputing_backward_scan(
    e: JaxprEqn, ins: list, fe: JaxprEqn, f_ins: list, p: ScanPair, carry_stack: list
) -> list:
    body: ClosedJaxpr = e.params["jaxpr"]
    nc, nk = e.params["num_consts"], e.params["num_carry"]
    f_body: ClosedJaxpr = fe.params["jaxpr"]
    fnc, fnk = fe.params["num_consts"], fe.params["num_carry"]
    f_consts, f_xs = f_ins[:fnc], f_ins[fnc + fnk :]
    xs_idx = [k for k in range(nc + nk, len(e.invars)) if k not in p.res_in]
    n_fc, n_cs = len(f_consts), len(carry_stack)

    def new_body(*a):
        consts, f_c = a[:nc], a[nc : nc + n_fc]
        carry = a[nc + n_fc : nc + n_fc + nk]
        rest = a[nc + n_fc + nk :]
        xs, cs, fx = (
            rest[: len(xs_idx)],
            rest[len(xs_idx) : len(xs_idx) + n_cs],
            rest[len(xs_idx) + n_cs :],
        )
        f_out = _jaxpr.eval_closed(f_body, *f_c, *cs, *fx)
        full = list(consts) + list(carry) + [None] * (len(e.invars) - nc - nk)
        for k, x in zip(xs_idx, xs):
            full[k] = x
        for k_in, k_out in zip(p.res_in, p.res_out):
            full[k_in] = f_out[k_out]
        return _jaxpr.eval_closed(body, *full)

    # Per-iteration avals: the bodies' own (weak types included).
    tb, fb = list(body.in_avals), list(f_body.in_avals)
    avals = (
        tb[:nc]
        + fb[:fnc]
        + tb[nc : nc + nk]
        + [tb[k] for k in xs_idx]
        + fb[fnc : fnc + fnk]
        + fb[fnc + fnk :]
    )
    nb = _compat.trace_closed_jaxpr(new_body, avals, name="autoopt.remat.bwd_scan")
    new_ins = (
        list(ins[:nc])
        + list(f_consts)
        + list(ins[nc : nc + nk])
        + [ins[k] for k in xs_idx]
        + list(carry_stack)
        + list(f_xs)
    )
    params = dict(e.params, jaxpr=nb, num_consts=nc + n_fc)
    return run_eqn(e.replace(params=params), new_ins)
