"""The remat pass: choose what the backward recomputes instead of keeping, and keep a choice only
when compiling it proves the memory dropped.

Where decisions are made:

1. The program differentiates inside (a training step calling ``jax.grad``): the jaxpr holds
   forward and backward. ``_remat_plan`` proposes plans (which forward equations the backward
   recomputes) and ranks them with a static liveness simulation.
2. The program is a forward that the user differentiates from outside
   (``jax.grad(autoopt.optimize(loss))``): ``_remat_forward`` wraps segments of the forward, and
   scan bodies, in ``jax.checkpoint``; JAX's autodiff does the rest when it differentiates the jit.
   Applied eagerly (``ctx.under_autodiff``, the call path's ``_eager_ad_call``), JAX runs the
   forward and the backward as two executables with the residuals alive in between, so plans
   are measured that way (``_measure_split_vjp``) and every segment is checkpointed, the last
   one too; under an outer jit the two halves are one program (``_measure_vjp``).
3. Loops: scan bodies checkpointed (one carry kept per iteration), and long scans nested
   (sqrt(n) carries kept). A training step inside a ``scan``/``while``/``cond`` body is planned
   at that level.

Keeping the recomputation apart from the forward, per backend (``fence_for``): behind
``optimization_barrier``s on GPU/TPU, and on XLA:CPU inside ``lax.cond``s whose two branches are
the same recomputation (``_remat_plan._cond_fenced``), because XLA:CPU expands barriers away
before CSE (jax-ml/jax#19822) but does not CSE across computations nor fold the runtime
predicate. A user who compiles with ``CPU_FLAGS`` gets barriers on CPU too. Forward programs
(case 2) use ``jax.checkpoint``, whose barriers on CPU survive only in loop bodies or with the
flag; candidates are always measured with the options the final program gets.

The default, ``remat="fit"``, does nothing here unless the call path found that the original
does not fit (its compiled peak above ``memory_budget`` or the device's free memory, or an
out-of-memory error: ``autoopt/_jit/_fit.py``); then it runs the rule below with that budget
(``PassContext.extra["fit"]``), and its findings say why and list the values live at the
original's peak.

Rule (``remat="auto"``, opt-in): keep a plan only when the compiled peak (argument + output + temp -
alias bytes, ``memory_analysis()``) drops by at least 20% for at most 10% more FLOPs
(``cost_analysis()``), or when ``memory_budget`` requires it; with a budget, take the rule's plan
when it meets the budget (a budget never costs memory against the default), else the plan with
the fewest FLOPs that meets it, or else the lowest-memory plan, and say what the floor is.
Without a budget the plan with the lowest estimated peak within the FLOPs cap is compiled
first; it may recompute a matmul or a reduction (AOTAutograd's partitioner never does without a
budget, as it cannot measure; here the 10% cap and the compile bound the cost), and the best
plan that recomputes only elementwise work is compiled as the fallback.
``remat=<jax.checkpoint_policies name>`` applies that policy without asking.

Only programs that are differentiated are planned: one with its own backward (case 1), or a
forward differentiated eagerly from outside (case 2, ``ctx.under_autodiff``). Without a
``memory_budget``, a forward called plainly, or traced under an outer
``jax.jit(jax.grad(fast))``, is left alone (the trace does not say that a transformation
outside will differentiate it); with one, it is planned as before.

Cost: a program with nothing to gain (no backward, small residuals, no plan the static estimate
likes) is never compiled here and costs one walk over its equations. Otherwise the first call of
a signature compiles the original and the first candidate at once, and without a budget a
further candidate only when the estimate, corrected by the first one's compile, lets it pass
the rule (``_may_pass``); with a budget, up to six. Each is about one extra compile of the
training step (0.1-0.2 s for the 16-layer MLP of the benchmark, seconds for big models). On a
call (not ``lower``/``inspect``), the top level's decision is left to the call's first-call
check (``_defers``): it compiles the call's own executable of the original, whose figures
stand for the original's measuring compile, and the plans are measured donating what that
executable donates (``extra["remat_donate"]``: nothing where the call keeps its arguments,
``out = step(state, x)``), so that when no plan is applied, the executable measured is the
one that runs (``autoopt/_jit/_fit.py``, ``_checked_auto``). ``lower``/``inspect`` measure
donating what a call rebinding its arguments would (``_donated_leaves``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import functools
import logging
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

from autoopt import _compat, _jaxpr, _multiprocess, _plan_cache
from autoopt._finding import Finding
from autoopt._memory import CompiledMemory, compiled_memory
from autoopt._options import Option, parse_bytes
from autoopt.passes._base import Pass, PassContext, PassResult
from autoopt.passes.remat import _forward as _remat_forward
from autoopt.passes.remat import _plan as _remat_plan

log = logging.getLogger("autoopt")

MIN_DROP = 0.20  # the compiled peak must drop by this much ...
MAX_EXTRA_FLOPS = 0.10  # ... for at most this many more FLOPs (remat="auto", no budget)
# Below this many bytes of residuals a program is left alone without compiling anything.
MIN_RESIDUAL_BYTES = 1 << 20
MAX_COMPILES = 6  # candidates compiled per decision, the original not counted
AUTO_COMPILES = 3  # of which without a budget (see _auto_order)
FLOOR_EXTRA_COMPILES = 2  # more, when the lowest-memory plan misses the budget (_choose)
CALIBRATION_SLACK = 0.05  # of the original's peak (_may_pass)

# XLA:CPU expands optimization barriers away before CSE (jax-ml/jax#19822), which merges every
# recomputation back into the forward; by default plans there recompute inside conditionals
# instead (fence_for). Disabling that one pass keeps barriers, but it is NOT applied by
# default: with it, XLA:CPU aborts the process (a C++ CHECK in
# IrEmitter::HandleOptimizationBarrier) on a barrier inside a scan body, e.g. the gradient of a
# user's own checkpointed scan
# (tests/regressions/test_remat_cpu_flag_aborts_on_checkpointed_scan.py).
# A user may opt in with optimize(..., compiler_options=CPU_FLAGS); candidates are always
# compiled with the options the final program gets, so plans that need the flag are rejected
# by measurement when it is absent.
CPU_FLAGS = {"xla_disable_hlo_passes": "cse_barrier_expander"}

_POLICY_FACTORIES_WITHOUT_ARGS = (
    "save_only_these_names",
    "save_any_names_but_these",
    "save_anything_except_these_names",
)


def fence_for(backend: str, compiler_options) -> str:
    """How recomputation in the backward is kept apart from the forward on ``backend``:
    ``"barrier"`` (``optimization_barrier``) where barriers survive, ``"cond"`` on XLA:CPU
    unless the user compiles with ``CPU_FLAGS`` (see ``_remat_plan._cond_fenced``)."""
    if backend != "cpu":
        return "barrier"
    disabled = str((compiler_options or {}).get("xla_disable_hlo_passes", ""))
    return "barrier" if "cse_barrier_expander" in disabled.split(",") else "cond"


# Measuring compiles on XLA:CPU skip LLVM's optimizations: memory_analysis() and
# cost_analysis() come from the HLO passes and buffer assignment, which these options leave as
# they are; the machine code, which they change, is never run (benchmarks/RESULTS.md, "First
# call": half the compile time).
_CPU_MEASURING_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def measuring_options(compiler_options, backend: str) -> dict | None:
    """The compiler options candidates are measured with: the final program's, plus on CPU the
    options that skip code generation work the figures do not depend on."""
    if backend != "cpu":
        return compiler_options
    return {**_CPU_MEASURING_OPTIONS, **(compiler_options or {})}


def jit_options(options, backend: str | None) -> dict:
    # No compile option is forced on every signature of a function: see CPU_FLAGS.
    return {}


def _policy(name: str):
    """The policy function for a ``jax.checkpoint_policies`` name; factories that select by
    ``checkpoint_name`` are called without names (so they save no named value)."""
    obj = getattr(jax.checkpoint_policies, name)
    if name in _POLICY_FACTORIES_WITHOUT_ARGS:
        return obj()
    if name == "offload_dot_with_no_batch_dims":
        # Host offload is not implemented by autoopt; the closest save-or-recompute policy.
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if name == "save_from_both_policies":
        return jax.checkpoint_policies.nothing_saveable
    return obj


# --- measuring -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measured:
    memory: CompiledMemory
    flops: float
    seconds: float

    @property
    def peak(self) -> int:
        return self.memory.peak_bytes


def _structs(avals) -> list:
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in avals
    ]


def _compile(fn: Callable, avals, compiler_options, donate: tuple = ()) -> Measured | None:
    """Compile ``fn`` at ``avals`` with the options the final program gets, donating the flat
    inputs ``donate`` as the calls' executable does; None when the backend gives no memory
    figures. Runs inside the outer jit's trace, which is fine: lowering opens its own trace."""
    t0 = time.perf_counter()
    compiled = (
        jax.jit(fn, compiler_options=compiler_options or None, donate_argnums=donate or None)
        .lower(*_structs(avals))
        .compile()
    )
    mem = compiled_memory(compiled)
    if mem is None:
        return None
    return Measured(mem, _flops(compiled), time.perf_counter() - t0)


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def _measure_closed(closed: ClosedJaxpr, compiler_options, donate: tuple = ()) -> Measured | None:
    # Staged by copying its equations, as the call's wrapper stages the program that runs: the
    # same StableHLO as binding each primitive again, in a fraction of the time, on the cold
    # first call's critical path (benchmarks/RESULTS.md). Named for jax's compile logs and
    # monitoring events: ``jit(remat_measured)``.
    def remat_measured(*args):
        return _jaxpr.stage_closed(closed, *args)

    return _compile(remat_measured, closed.in_avals, compiler_options, donate)


def _donated_leaves(closed: ClosedJaxpr, ctx: PassContext) -> tuple[int, ...]:
    """The flat inputs of the top-level program that the calls' executable donates (a call site
    rebinding its arguments under "safe"), so that plans and the budget are judged on the
    executable that runs (issue 28: a budget met thanks to donation was called unmeetable)."""
    from autoopt.passes.donation import donatable_args, host_callbacks

    options, arg_of_leaf = ctx.options, ctx.in_arg_of_leaf
    if ctx.extra.get("remat_top") is not closed or len(arg_of_leaf) != len(closed.in_avals):
        return ()  # a loop or branch body: the caller's donation does not reach it
    if ctx.extra.get("remat_donate") is not None:
        # what the call's own executable donates, known to its first-call check (remat="auto":
        # ``autoopt/_jit/_fit.py``): the original and the plans are measured as it runs
        return tuple(ctx.extra["remat_donate"])
    if options.explicit_donation:
        nums = options.jit_kwargs.get("donate_argnums")
        names = options.jit_kwargs.get("donate_argnames")
        nums = (nums,) if isinstance(nums, int) else tuple(nums or ())
        names = (names,) if isinstance(names, str) else tuple(names or ())
        chosen = set(nums) | set(names)
    elif options.donate == "auto" or (options.donate == "safe" and not host_callbacks(closed)):
        # As Program.arguments: an argument with a key or a token leaf is never donated.
        keys = {
            a
            for v, a in zip(closed.in_avals, arg_of_leaf)
            if not hasattr(v, "dtype") or jax.numpy.issubdtype(v.dtype, jax.dtypes.extended)
        }
        plain = [a for a in dict.fromkeys(arg_of_leaf) if a not in keys]
        chosen, _ = donatable_args(closed.in_avals, closed.out_avals, arg_of_leaf, plain)
    else:
        return ()
    return tuple(i for i, a in enumerate(arg_of_leaf) if a in chosen)


def _measure_split_vjp(closed: ClosedJaxpr, compiler_options) -> Measured | None:
    """``jax.grad`` of ``closed`` applied eagerly: the forward and the backward as two
    executables, as JAX runs them, with the residuals alive in between (outputs of the first,
    arguments of the second). The peak is the larger of the two programs' peaks; the FLOPs
    their sum."""
    built = _remat_forward.vjp_halves(closed)
    if built is None:
        return None
    fwd, bwd, avals = built
    t0 = time.perf_counter()
    structs = _structs(avals)
    f = jax.jit(fwd, compiler_options=compiler_options or None).lower(*structs).compile()
    res = jax.eval_shape(fwd, *structs)
    b = jax.jit(bwd, compiler_options=compiler_options or None).lower(res).compile()
    f_mem, b_mem = compiled_memory(f), compiled_memory(b)
    if f_mem is None or b_mem is None:
        return None
    return Measured(
        max([f_mem, b_mem], key=lambda m: m.peak_bytes),
        _flops(f) + _flops(b),
        time.perf_counter() - t0,
    )


def _measure_vjp(closed: ClosedJaxpr, compiler_options) -> Measured | None:
    built = _remat_forward.vjp_program(closed)
    if built is None:
        return None
    fn, avals = built
    return _compile(fn, avals, compiler_options)


# --- choosing ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
    name: str
    build: Callable[[], ClosedJaxpr]
    est_peak: float  # static estimate, only for ranking
    est_extra_flops: float
    describe: Callable[[], dict] = dict
    heavy: bool = False  # recomputes a matmul, convolution or reduction
    recompute: frozenset[int] | None = None  # a joint plan's recomputed nodes (kept on disk)
    _built: ClosedJaxpr | None = None

    def program(self) -> ClosedJaxpr:
        if self._built is None:
            self._built = self.build()
        return self._built


@dataclasses.dataclass
class Decision:
    chosen: Candidate | None
    base: Measured | None
    after: Measured | None
    reason: str
    tried: list[tuple[str, Measured | None]]
    floor: int | None = None


def _choose(
    auto_order: list[Candidate],
    front: list[Candidate],
    measure: Callable[[ClosedJaxpr], Measured | None],
    base_program: ClosedJaxpr,
    budget: int | None,
    bisect: bool = True,
    floor_extra: list[Candidate] | None = None,
    base: Measured | concurrent.futures.Future | None = None,
) -> Decision:
    """``_choose_here``, or the same decision measured before: by another process of a
    ``jax.distributed`` job (process 0 measures, the others read its decision: compiled memory
    is measured per process, and the plan is part of the program every process must build
    alike, ``_multiprocess``), or by an earlier process, kept beside JAX's persistent
    compilation cache when one is configured (``_plan_cache``). Either way nothing is
    compiled here."""
    by_name = {c.name: c for c in [*auto_order, *front, *(floor_extra or [])]}

    def here() -> Decision:
        return _choose_here(
            auto_order, front, measure, base_program, budget, bisect, floor_extra, base
        )

    def on_disk() -> Decision:
        parts = [
            program_digest(base_program),
            budget,
            bisect,
            [c.name for c in auto_order],
            [c.name for c in front],
            [c.name for c in floor_extra or []],
            _measure_key(measure),
        ]

        def decode(v: dict) -> Decision | None:
            # (a stored plan this process did not propose is a miss: measured again)
            return _decision_from(v, by_name) if v.get("chosen") in (None, *by_name) else None

        return _plan_cache.cached("remat", _backend_of(), parts, here, _decision_to, decode)

    if not _multiprocess.several():
        # (nothing kept on disk: the key, the program's text, is not computed)
        return here() if _plan_cache.directory() is None else on_disk()

    def decode_shared(v: dict) -> Decision:
        chosen = v["chosen"]
        if chosen is not None and chosen not in by_name:
            raise _multiprocess.ProcessMismatchError(
                f"remat: process 0 chose the plan {chosen!r}, which this process did not "
                "propose for the same program"
            )
        return _decision_from(v, by_name)

    return _multiprocess.shared("remat", str(base_program), on_disk, _decision_to, decode_shared)


def _measure_key(measure: Callable) -> list:
    """What a measurement depends on besides the program: how it measures (a whole program,
    or the forward and backward apart) and its compiler options and donation."""
    if isinstance(measure, functools.partial):
        return [getattr(measure.func, "__name__", repr(measure.func)), measure.keywords]
    return [getattr(measure, "__name__", repr(measure))]


def _backend_of() -> str | None:
    """Where measuring compiles run (jax.jit's default backend)."""
    try:
        return jax.default_backend()
    except Exception:  # noqa: BLE001
        return None


def _decision_from(v: dict, by_name: dict[str, Candidate]) -> Decision:
    """The decision ``_decision_to`` stored, or an exception for an entry of any other form (a
    truncated, hand-edited or foreign file: its readers take that for a miss and measure
    again, which writes a good entry over it)."""
    chosen = v["chosen"]
    reason, floor, tried = v["reason"], v["floor"], v["tried"]
    if not (
        (chosen is None or isinstance(chosen, str))
        and isinstance(reason, str)
        and (floor is None or (isinstance(floor, int) and not isinstance(floor, bool)))
        and isinstance(tried, list)
        and all(isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) for t in tried)
    ):
        raise ValueError("a stored remat decision of another form")
    return Decision(
        by_name[chosen] if chosen is not None else None,
        _measured_from(v["base"]),
        _measured_from(v["after"]),
        reason,
        [(n, _measured_from(m)) for n, m in tried],
        floor,
    )


def _decision_to(d: Decision) -> dict:
    return {
        "chosen": d.chosen.name if d.chosen is not None else None,
        "base": _measured_to(d.base),
        "after": _measured_to(d.after),
        "reason": d.reason,
        "tried": [[n, _measured_to(m)] for n, m in d.tried],
        "floor": d.floor,
    }


def _measured_to(m: Measured | None) -> list | None:
    if m is None:
        return None
    mem = m.memory
    return [
        mem.argument_bytes,
        mem.output_bytes,
        mem.alias_bytes,
        mem.temp_bytes,
        m.flops,
        m.seconds,
    ]


def _measured_from(v: list | None) -> Measured | None:
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 6):
        raise ValueError("a stored measurement of another form")
    return Measured(CompiledMemory(*(int(x) for x in v[:4])), float(v[4]), float(v[5]))


def _choose_here(
    auto_order: list[Candidate],
    front: list[Candidate],
    measure: Callable[[ClosedJaxpr], Measured | None],
    base_program: ClosedJaxpr,
    budget: int | None,
    bisect: bool = True,
    floor_extra: list[Candidate] | None = None,
    known_base: Measured | concurrent.futures.Future | None = None,
) -> Decision:
    """Apply the rule, compiling as few programs as possible.

    ``auto_order``: candidates the static estimate says may pass the 20%/10% rule, in the
    order they are compiled until one passes (``_auto_order``). ``front``: candidates for a
    budget, by FLOPs ascending and memory descending; bisected when ``bisect``, else tried in
    order.
    ``floor_extra``: candidates by estimated peak; when the front's lowest-memory plan misses
    the budget, the next ones not yet compiled are tried too. The estimate ranks far-apart
    plans well but not plans a few MiB apart (the benchmark's transformer: the lowest
    estimate compiles to 75 MiB, the second lowest to 67 MiB).
    ``known_base``: the original's figures, measured by the call (``_known_base``): not compiled.
    """
    tried: list[tuple[str, Measured | None]] = []
    cache: dict[str, Measured | None] = {}
    pending: dict[str, concurrent.futures.Future] = {}

    def attempt(c: Candidate) -> Measured | None:
        try:
            return measure(c.program())
        except Exception as e:  # noqa: BLE001 - a candidate that does not build is skipped
            log.debug("remat: candidate %s failed: %s", c.name, e)
            return None

    def m(c: Candidate) -> Measured | None:
        if c.name not in cache:
            fut = pending.pop(c.name, None)
            cache[c.name] = fut.result() if fut is not None else attempt(c)
            tried.append((c.name, cache[c.name]))
        return cache[c.name]

    if budget is None and not auto_order:
        return Decision(
            None,
            None,
            None,
            "no plan is estimated to cut the peak by "
            f"{MIN_DROP:.0%} for at most {MAX_EXTRA_FLOPS:.0%} more FLOPs",
            tried,
        )
    # The original and the first candidate compile at once (XLA releases the GIL while it
    # compiles): the candidate is needed whenever the original is, and the first call waits
    # for the slower of the two instead of both.
    first = auto_order[:1] if budget is None else (auto_order or front)[:1]
    with concurrent.futures.ThreadPoolExecutor(max_workers=1 + len(first)) as pool:
        for c in first:
            pending[c.name] = pool.submit(attempt, c)
        base = _measured_now(known_base) if known_base is not None else measure(base_program)
        if base is None:
            for fut in pending.values():
                fut.result()  # finish before the pool closes; the figures are not used
            return Decision(None, None, None, "the backend reports no memory figures", tried)
        return _rule_and_budget(
            auto_order, front, base, budget, bisect, floor_extra, m, tried, cache
        )


def _rule_and_budget(
    auto_order, front, base, budget, bisect, floor_extra, m, tried, cache
) -> Decision:
    """``_choose`` once the original is measured; ``m(candidate)`` measures (memoized)."""

    def acceptable(base: Measured, got: Measured | None) -> bool:
        return (
            got is not None
            and got.peak <= (1 - MIN_DROP) * base.peak
            and got.flops <= (1 + MAX_EXTRA_FLOPS) * max(base.flops, 1.0)
        )

    # the first of auto_order that passes the rule, with its figures
    rule: tuple[Candidate, Measured] | None = None
    offset: float | None = None  # a compiled candidate's peak minus its estimate
    for c in auto_order[:AUTO_COMPILES]:
        if budget is None and offset is not None and not _may_pass(c, offset, base):
            continue
        got = m(c)
        if got is not None and acceptable(base, got):
            rule = (c, got)
            break
        if got is not None and offset is None:
            offset = got.peak - c.est_peak
    if budget is None or base.peak <= budget:
        if rule is not None:
            return Decision(rule[0], base, rule[1], "rule", tried)
        why = (
            "already within the memory budget"
            if budget is not None
            else f"no compiled plan cut the peak by {MIN_DROP:.0%} for at most "
            f"{MAX_EXTRA_FLOPS:.0%} more FLOPs"
        )
        return Decision(None, base, None, why, tried)
    # A budget the original exceeds. First the plan the rule would apply without a budget, when
    # it meets the budget too: a budget only ever adds memory savings to the default (else a
    # generous budget would pick the fewest-FLOPs plan below it, which can hold more memory
    # than the default's: 0.58x against 0.44x of plain on the benchmark's transformer).
    if rule is not None and rule[1].peak <= budget:
        return Decision(rule[0], base, rule[1], "budget", tried)
    # Then the plan with the fewest FLOPs that meets it. The lowest-memory plan first: when even
    # it misses the budget it is the answer (the floor).
    found = None
    if bisect and front:
        if (got := m(front[-1])) is not None and got.peak <= budget:
            found = front[-1]
            lo, hi = 0, len(front) - 2
            while lo <= hi and len(tried) < MAX_COMPILES:
                mid = (lo + hi) // 2
                got = m(front[mid])
                if got is not None and got.peak <= budget:
                    found, hi = front[mid], mid - 1
                else:
                    lo = mid + 1
        else:
            for c in [c for c in floor_extra or [] if c.name not in cache][:FLOOR_EXTRA_COMPILES]:
                if (got := m(c)) is not None and got.peak <= budget:
                    found = c
                    break
    else:
        for c in front[: MAX_COMPILES // 2]:
            got = m(c)
            if got is not None and got.peak <= budget:
                found = c
                break
    if found is not None:
        return Decision(found, base, cache[found.name], "budget", tried)
    compiled = [
        (c, got) for c in [*front, *(floor_extra or [])] if (got := cache.get(c.name)) is not None
    ]
    best = min(compiled, key=lambda pair: pair[1].peak, default=None)
    if best is None or best[1].peak >= base.peak:
        return Decision(None, base, None, "no plan lowers the peak", tried, floor=base.peak)
    return Decision(best[0], base, best[1], "floor", tried, floor=best[1].peak)


def _may_pass(c: Candidate, offset: float, base: Measured) -> bool:
    """Whether ``c`` is worth a compile for the rule once one candidate failed it: the static
    estimate misses a nearly constant amount per program (the arguments, outputs and buffers
    XLA adds; measured 7.75-8.25 MiB on every candidate of the GPT, MLP and deep-MLP
    benchmarks), so the failed candidate's ``offset`` (compiled minus estimated peak) corrects
    the others' estimates. ``CALIBRATION_SLACK`` of the original's peak is allowed for the
    rest of the error. Skipping only forgoes a saving; what is applied is still decided by a
    compile. Without a budget only: a budget's search compiles what it needs."""
    return c.est_peak + offset <= (1 - MIN_DROP + CALIBRATION_SLACK) * base.peak


def _pareto(cands: list[Candidate]) -> list[Candidate]:
    out: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (c.est_extra_flops, c.est_peak)):
        if not out or c.est_peak < out[-1].est_peak:
            out.append(c)
    return out


def _lowest_estimates(cands: list[Candidate]) -> list[Candidate]:
    """Candidates by estimated peak, lowest first (the floor search of ``_choose``)."""
    return sorted(cands, key=lambda c: (c.est_peak, c.est_extra_flops))


def _auto_order(cands: list[Candidate], est_base: float, total_flops: float) -> list[Candidate]:
    """The candidates compiled for the rule, in order: the two with the lowest estimated peak,
    then the best that recomputes no matmul or reduction (when neither of the first two is
    such), so that a misestimated heavy plan falls back to the elementwise min-cut."""
    ok = sorted(
        (
            c
            for c in cands
            if c.est_extra_flops <= MAX_EXTRA_FLOPS * total_flops
            and c.est_peak <= (1 - MIN_DROP) * est_base
        ),
        key=lambda c: c.est_peak,
    )
    order = ok[:2]
    if all(c.heavy for c in order):
        order += [c for c in ok[2:] if not c.heavy][:1]
    return order


# --- case 1: a program with its own backward ----------------------------------------------------


def _joint_candidates(
    closed: ClosedJaxpr,
    g: _remat_plan.JointGraph,
    total: float,
    budget: int | None,
    fence: str = "barrier",
) -> tuple[list[Candidate], float]:
    base = _remat_plan.cheap_plan(g)
    if budget is None:
        # Without a budget: the min-cut, more elementwise work segment by segment, and the
        # knapsack within the rule's FLOPs cap. AOTAutograd's partitioner never recomputes a
        # matmul without a budget, because it cannot measure; here the cap bounds the extra
        # work and the compile checks it. Measured on the benchmark's transformer: recomputing
        # some matmuls too takes the peak from 0.58x to 0.44x of plain for +8% FLOPs, at the
        # same step time (benchmarks/RESULTS.md).
        cap = MAX_EXTRA_FLOPS * total
        plans = [
            base,
            *_remat_plan.partial_plans(g, base, cap, allow_heavy=False, label="elementwise"),
            *_remat_plan.partial_plans(g, base, cap),
        ]
    else:
        plans = [
            base,
            *_remat_plan.segment_plans(g, base),
            *_remat_plan.partial_plans(g, base, 10.0 * total),
        ]
    plans = _remat_plan.estimate(g, plans)
    # The baseline is the program as it is, although XLA's fusion already recomputes some cheap
    # values by itself: a plan it makes redundant costs a compile and is then rejected.
    est_base = _remat_plan.estimate(g, [_remat_plan.Plan("none", frozenset())])[0].est_peak

    def cand(p: _remat_plan.Plan) -> Candidate:
        return Candidate(
            p.name,
            lambda: _remat_plan.apply(closed, g, p.recompute, fence),
            p.est_peak,
            p.est_flops,
            lambda: _remat_plan.describe(g, p.recompute),
            heavy=_remat_plan.recomputes_heavy(g, p.recompute),
            recompute=p.recompute,
        )

    unique = {p.recompute: p for p in reversed(plans) if p.recompute}  # the first of equals
    cands = [cand(p) for p in plans if p.recompute and unique[p.recompute] is p]
    pairs = _remat_plan.scan_pairs(g) if budget is not None else []
    if pairs:
        saved = sum(p.saved_bytes - p.carry_bytes for p in pairs)
        cands.append(
            Candidate(
                "checkpoint scan bodies",
                lambda: _remat_plan.apply_scan_checkpoints(closed, g, pairs),
                est_base - saved,
                sum(p.flops for p in pairs),
                lambda: {
                    "recomputed": [
                        {
                            "location": g.location(p.fwd) or "?",
                            "values": len(p.res_out),
                            "bytes": p.saved_bytes,
                            "primitives": ["scan"],
                            "what": "recomputed",
                        }
                        for p in pairs
                    ],
                    "kept_bytes": sum(p.carry_bytes for p in pairs),
                },
            )
        )
    return cands, est_base


@dataclasses.dataclass(frozen=True)
class _JointSetup:
    """How a joint level is measured and fenced, and the key of its decision on disk: all
    known before the level's graph is built."""

    donate: tuple[int, ...]
    measure: Callable[[ClosedJaxpr], Measured | None]
    fence: str

    @property
    def mechanism(self) -> str:
        return (
            "recompute in the backward behind optimization barriers"
            if self.fence == "barrier"
            else "recompute in the backward inside conditionals (XLA:CPU)"
        )


def _joint_setup(
    closed: ClosedJaxpr, ctx: PassContext, donate: tuple[int, ...] | None = None
) -> _JointSetup:
    """``donate``: the flat inputs measured as donated; None: ``_donated_leaves``."""
    compiler_options = ctx.options.jit_kwargs.get("compiler_options")
    donate = _donated_leaves(closed, ctx) if donate is None else donate
    measure = functools.partial(
        _measure_closed,
        compiler_options=measuring_options(compiler_options, ctx.backend),
        donate=donate,
    )
    return _JointSetup(donate, measure, fence_for(ctx.backend, compiler_options))


def _joint_parts(closed: ClosedJaxpr, ctx: PassContext, setup: _JointSetup) -> list:
    """What a joint decision on disk is keyed by besides the device and versions."""
    return [
        program_digest(closed),
        ctx.options.memory_budget,
        setup.fence,
        _measure_key(setup.measure),
    ]


# The last program fingerprinted for a key on disk, weakly (a jaxpr holds its constants): a
# warm first call asks for the same program's key several times (the donation it would
# measure, the donation a keeping call measured, the decision itself).
_DIGESTED: list = [None, None]


def program_digest(closed: ClosedJaxpr) -> str:
    """``closed``'s fingerprint (``_jaxpr.fingerprint``: what its text shows), which keys its
    decisions on disk."""
    ref, digest = _DIGESTED
    if ref is not None and ref() is closed:
        return digest
    digest = _jaxpr.fingerprint(closed)
    _DIGESTED[:] = [weakref.ref(closed), digest]
    return digest


def _stored_joint(closed: ClosedJaxpr, ctx: PassContext, residual: int | None):
    """``(setup, parts, stored value)`` of the top level's joint decision when it is kept on
    disk (read before the level's graph is built: a stored "no plan" needs none), else None.
    Not asked for a level the residual gate of ``_plan_joint`` would leave alone (nothing is
    stored for it, and its key would cost more than the gate). ``residual``: the level's
    ``_remat_plan.residual_bytes``."""
    if (
        ctx.options.remat != "auto"
        or ctx.extra.get("remat_top") is not closed
        or _multiprocess.several()
        or _plan_cache.directory() is None
    ):
        return None
    if residual is None or (residual < MIN_RESIDUAL_BYTES and ctx.options.memory_budget is None):
        return None
    setup = _joint_setup(closed, ctx)
    parts = _joint_parts(closed, ctx, setup)
    found = _plan_cache.stored("remat-joint", _backend_of(), parts)
    if found is None and setup.donate and ctx.extra.get("remat_defer"):
        # A call's executable donates what its call site proves dead; one whose statement keeps
        # its arguments donates nothing, and its decision was measured (and kept) so. Which of
        # the two this call is, its first-call check says: it plans again when the decision
        # read here was measured with another donation (``measured_donating``).
        kept = _joint_setup(closed, ctx, donate=())
        kept_parts = _joint_parts(closed, ctx, kept)
        found_kept = _plan_cache.stored("remat-joint", _backend_of(), kept_parts)
        if found_kept is not None:
            return kept, kept_parts, found_kept
    return setup, parts, found


def _stored_no_plan(found: Any) -> Decision | None:
    """A stored joint decision that applies no plan (it needs no graph to rebuild)."""
    if not isinstance(found, dict) or "unusable" in found or found.get("chosen", "") is not None:
        return None
    try:
        return _decision_from(found, {})
    except Exception:  # noqa: BLE001 - a stale entry: measured again
        return None


def _plan_joint(
    closed: ClosedJaxpr, g, ctx: PassContext, where: str, stored: tuple | None = None
) -> tuple[ClosedJaxpr, list[Finding]]:
    """``stored``: what ``_stored_joint`` read, if it was asked."""
    options = ctx.options
    setup = stored[0] if stored is not None else _joint_setup(closed, ctx)
    donate, measure, fence = setup.donate, setup.measure, setup.fence
    mechanism = setup.mechanism
    if options.remat not in ("auto", "off"):
        plan = _remat_plan.policy_plan(g, _policy(options.remat))
        if not plan.recompute:
            return closed, [
                Finding(
                    "remat",
                    False,
                    f"policy {options.remat!r} saves every "
                    f"residual of {where}; nothing to recompute",
                    location=ctx.fn_location,
                )
            ]
        new = _remat_plan.apply(closed, g, plan.recompute, fence)
        details = {
            **_remat_plan.describe(g, plan.recompute),
            "policy": options.remat,
            "mechanism": mechanism,
        }
        before, after = _safe(measure, closed), _safe(measure, new)
        return new, [
            _finding(
                True,
                f"remat={options.remat!r} forced",
                where,
                ctx,
                before,
                after,
                details,
                "policy",
                None,
            )
        ]
    if g.residual_bytes < MIN_RESIDUAL_BYTES and options.memory_budget is None:
        return closed, []

    def decide() -> Decision:
        total = _remat_plan.jaxpr_flops(closed)
        cands, est_base = _joint_candidates(closed, g, total, options.memory_budget, fence)
        return _choose(
            _auto_order(cands, est_base, total),
            _pareto(cands),
            measure,
            closed,
            options.memory_budget,
            floor_extra=_lowest_estimates(cands),
            base=_known_base(closed, ctx, donate),
        )

    if _multiprocess.several() or (stored is None and _plan_cache.directory() is None):
        # (process 0 decides for all: _choose; or nothing is kept: no key to compute)
        dec = decide()
    else:
        # Kept whole, with the chosen plan's recomputed nodes: a later process rebuilds that
        # plan alone, without enumerating and estimating the candidates (most of a warm first
        # call's planning time).
        dec = _plan_cache.cached(
            "remat-joint",
            _backend_of(),
            stored[1] if stored is not None else _joint_parts(closed, ctx, setup),
            decide,
            _joint_decision_to,
            lambda v: _joint_decision_from(v, closed, g, fence),
            **({"found": stored[2]} if stored is not None else {}),
        )
    top = ctx.extra.get("remat_top") is closed
    return _finish(closed, dec, where, ctx, mechanism, donated=donate if top else None)


def _defers(closed: ClosedJaxpr, ctx: PassContext, stored: tuple | None) -> bool:
    """Whether remat="auto" leaves this level's decision to the call's first-call check
    (``ctx.extra["remat_defer"]``, set by the call path when that check follows the build):
    the check compiles the call's own executable of the original and plans with its figures
    (``extra["original"]``), so that where no plan is applied, the executable measured is the
    one that runs (``autoopt/_jit/_fit.py``). Only the top level, when nothing kept on disk
    answers it and no other process decides for this one."""
    return (
        bool(ctx.extra.get("remat_defer"))
        and ctx.options.remat == "auto"
        and ctx.extra.get("remat_top") is closed
        and (stored is None or stored[2] is None)
        and not _multiprocess.several()
    )


def _deferred(where: str, ctx: PassContext, mechanism: str) -> Finding:
    return Finding(
        "remat",
        False,
        f"not planned yet: {where} is measured on its first call, against the "
        "executable that call compiles",
        location=ctx.fn_location,
        details={"deferred": True, "mechanism": mechanism},
    )


def deferred(findings) -> bool:
    """Whether remat left its decision to the first call's check (``_defers``)."""
    return any(f.kind == "remat" and f.details.get("deferred") for f in findings)


def measured_donating(findings) -> tuple[int, ...] | None:
    """The flat inputs the top level's decision was measured donating (``_finish``); None
    when no top-level decision was measured."""
    for f in findings:
        if f.kind == "remat" and "measured_donating" in f.details:
            return tuple(f.details["measured_donating"])
    return None


def _joint_decision_to(d: Decision) -> dict:
    chosen = d.chosen
    if chosen is not None and chosen.recompute is None:
        return {"unusable": "the chosen plan is not a set of recomputed nodes"}
    return {
        **_decision_to(d),
        "recompute": sorted(chosen.recompute) if chosen is not None and chosen.recompute else None,
        "estimate": [chosen.est_peak, chosen.est_extra_flops] if chosen is not None else None,
    }


def _joint_decision_from(
    v: dict, closed: ClosedJaxpr, g: _remat_plan.JointGraph, fence: str
) -> Decision | None:
    if "unusable" in v:
        return None
    if v["chosen"] is None:
        return _decision_from(v, {})
    recompute = frozenset(int(i) for i in v["recompute"])
    if not recompute or not recompute <= g.eligible:
        return None  # not equations this graph may recompute: measured again
    chosen = Candidate(
        v["chosen"],
        lambda: _remat_plan.apply(closed, g, recompute, fence),
        float(v["estimate"][0]),
        float(v["estimate"][1]),
        lambda: _remat_plan.describe(g, recompute),
        heavy=_remat_plan.recomputes_heavy(g, recompute),
        recompute=recompute,
    )
    return _decision_from(v, {chosen.name: chosen})


# --- case 2 and 3: a forward the user differentiates --------------------------------------------


def _forward_candidates(
    closed: ClosedJaxpr, budget: int | None, eager: bool = False
) -> list[Candidate]:
    """Checkpointed scan bodies, nested scans, and segment counts nearest sqrt(n) first. Without
    a budget only ``dots_saveable`` (matmul outputs kept: the backward recomputes elementwise
    work only); with one, ``nothing_saveable`` first. ``eager``: the last segment is
    checkpointed too (its residuals would otherwise stay alive between the two programs: on
    the benchmark's MLP 80 MiB kept instead of 32)."""
    cp = jax.checkpoint_policies
    policies = (
        [("dots_saveable", cp.dots_saveable)]
        if budget is None
        else [("nothing_saveable", cp.nothing_saveable), ("dots_saveable", cp.dots_saveable)]
    )
    scans = _remat_forward.forward_scans(closed)
    counts = _remat_forward.forward_segment_counts(closed)
    sqrt_n = math.sqrt(len(_remat_forward.forward_cuts(closed)) + 1)
    cands = []
    for pname, pol in policies:
        if scans:
            cands.append(
                Candidate(
                    f"checkpoint scan bodies ({pname})",
                    lambda pol=pol: _remat_forward.checkpoint_scans(closed, pol, nest=False),
                    0,
                    0,
                    lambda pname=pname: {"policy": pname},
                )
            )
            if budget is not None and any(
                e.params["length"] >= _remat_forward.NEST_MIN_LENGTH for e in scans
            ):
                cands.append(
                    Candidate(
                        f"nested sqrt(n) scans ({pname})",
                        lambda pol=pol: _remat_forward.checkpoint_scans(closed, pol, nest=True),
                        0,
                        0,
                        lambda pname=pname: {"policy": pname},
                    )
                )
        for k in sorted(counts, key=lambda k: abs(k - sqrt_n))[: 2 if budget is not None else 1]:
            bounds = _remat_forward.segment_bounds(closed, k)
            if bounds is not None:
                cands.append(
                    Candidate(
                        f"checkpoint {len(bounds) - 1} segments ({pname})",
                        lambda b=bounds, pol=pol: _remat_forward.checkpoint_segments(
                            closed, b, pol, skip_last=not eager
                        ),
                        0,
                        0,
                        lambda pname=pname: {"policy": pname},
                    )
                )
    return cands


def _plan_forward(closed: ClosedJaxpr, ctx: PassContext) -> tuple[ClosedJaxpr, list[Finding]]:
    options = ctx.options
    where = "the forward (checkpoint segments take effect when it is differentiated)"
    if not any(_remat_forward._floating(a) for a in closed.in_avals):
        return closed, []
    if options.remat not in ("auto", "off"):
        new = _remat_forward.checkpoint_segments(
            closed, [0, len(closed.jaxpr.eqns)], _policy(options.remat), skip_last=False
        )
        return new, [
            Finding(
                "remat",
                True,
                f"remat={options.remat!r} forced: the forward runs "
                "under jax.checkpoint with that policy",
                location=ctx.fn_location,
                details={"plan": "policy", "mechanism": "jax.checkpoint", "policy": options.remat},
            )
        ]
    if not _remat_forward.has_loops_or_segments(closed):
        return closed, []
    # Static gate, no compile: the residuals JAX would save, and whether any recompute plan of
    # that training step is estimated to pay for itself.
    try:
        joint = _remat_forward.vjp_jaxpr(closed)
    except Exception as e:  # noqa: BLE001 - not differentiable (integer-only, while loops, ...)
        log.debug("remat: forward not differentiable: %s", e)
        return closed, []
    if joint is None:
        return closed, []
    g = _remat_plan.joint_graph(joint.jaxpr)
    if g is None or (g.residual_bytes < MIN_RESIDUAL_BYTES and options.memory_budget is None):
        return closed, []
    total = _remat_plan.jaxpr_flops(joint)
    eager = ctx.under_autodiff
    if eager:
        where = (
            "the forward, differentiated eagerly (forward and backward run as two "
            "programs, the residuals alive in between)"
        )
    elif options.memory_budget is None and not _remat_forward.forward_scans(closed):
        jc, est_base = _joint_candidates(joint, g, total, None)
        if not _auto_order(jc, est_base, total):
            return closed, []
    cands = _forward_candidates(closed, options.memory_budget, eager)
    if not cands:
        return closed, []
    # Loops first (their recomputation is a loop body's worth, and needs no compiler flag),
    # then segments. The compile decides.
    # An eager call's jit runs without compiler options (jax refuses them inside a trace).
    measure = functools.partial(
        _measure_split_vjp if eager else _measure_vjp,
        compiler_options=None
        if eager
        else measuring_options(ctx.options.jit_kwargs.get("compiler_options"), ctx.backend),
    )
    dec = _choose(cands, cands, measure, closed, options.memory_budget, bisect=False)
    return _finish(closed, dec, where, ctx, mechanism="jax.checkpoint in the forward")


# --- findings ------------------------------------------------------------------------------------


def _safe(measure, closed):
    try:
        return measure(closed)
    except Exception as e:  # noqa: BLE001 - a report figure is not worth failing the pass
        log.debug("remat: could not compile for figures: %s", e)
        return None


def _finding(
    applied: bool,
    headline: str,
    where: str,
    ctx: PassContext,
    before: Measured | None,
    after: Measured | None,
    details: dict,
    plan: str,
    dec: Decision | None,
) -> Finding:
    details = dict(details)
    details.update(plan=plan, where=where)
    if before is not None:
        details["before"] = {**before.memory.as_dict(), "flops": before.flops}
    if after is not None:
        details["after"] = {**after.memory.as_dict(), "flops": after.flops}
    if dec is not None:
        details["tried"] = [(n, None if m is None else m.peak) for n, m in dec.tried]
        details["compile_seconds"] = sum(m.seconds for _, m in dec.tried if m is not None) + (
            dec.base.seconds if dec.base is not None else 0.0
        )
        if dec.floor is not None:
            details["floor_bytes"] = dec.floor
    if ctx.backend == "cpu":
        details["host_offload"] = "not available on cpu"
    else:
        details["host_offload"] = "not implemented by autoopt"
    saved = None
    parts = [headline]
    if before is not None and after is not None:
        saved = before.peak - after.peak
        extra = (after.flops / before.flops - 1) if before.flops else 0.0
        parts.append(
            f"peak {_mb(before.peak)} -> {_mb(after.peak)} "
            f"({saved / max(before.peak, 1):.0%} less) for {extra:+.0%} FLOPs"
        )
    rec = details.get("recomputed") or []
    if rec:
        parts.append(
            "recomputes "
            + ", ".join(
                f"{r['values']} value(s) {_mb(r['bytes'])} from {r['location']} "
                f"({'/'.join(r['primitives'])})"
                for r in rec[:3]
            )
        )
    if details.get("kept_bytes"):
        parts.append(f"keeps {_mb(details['kept_bytes'])} for the backward")
    location = rec[0]["location"] if rec and rec[0]["location"] != "?" else ctx.fn_location
    return Finding(
        "remat",
        applied,
        "; ".join(parts) + f" [{where}]",
        location=location,
        bytes_saved=saved if applied else None,
        details=details,
    )


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _finish(
    closed: ClosedJaxpr,
    dec: Decision,
    where: str,
    ctx: PassContext,
    mechanism: str,
    donated: tuple[int, ...] | None = None,
) -> tuple[ClosedJaxpr, list[Finding]]:
    """``donated``: the top level's flat inputs its figures were measured donating (said in
    the finding's ``measured_donating``: a call's check plans again when its executable
    donates others, ``autoopt/_jit/_fit.py``)."""
    if donated is not None and (dec.base is not None or dec.tried):
        mechanism_details = {"mechanism": mechanism, "measured_donating": list(donated)}
    else:  # (nothing measured: the static estimate alone decided, whatever is donated)
        mechanism_details = {"mechanism": mechanism}
    budget = ctx.options.memory_budget
    if dec.chosen is None:
        msg = f"not applied: {dec.reason}"
        if (
            dec.base is None
            and budget is None
            and not dec.tried
            and dec.reason.startswith("no plan is estimated")
        ):
            # Nothing compiled (the static estimate ruled every plan out): say so, and what a
            # budget would do, so that a user with a large backward is not left guessing.
            msg += (
                "; memory_budget=... lets it recompute more (matmuls, loop bodies) to meet a budget"
            )
            return closed, [
                _finding(False, msg, where, ctx, None, None, mechanism_details, "none", dec)
            ]
        if dec.base is None and budget is None:
            return closed, []  # no memory figures from this backend: nothing to report
        if budget is not None and dec.base is not None and dec.base.peak > budget:
            msg = (
                f"memory budget {_mb(budget)} cannot be met: the original peak is "
                f"{_mb(dec.base.peak)} and no plan lowers it"
            )
        f = _finding(False, msg, where, ctx, dec.base, None, mechanism_details, "none", dec)
        return closed, [f]
    details = {**(dec.chosen.describe() or {}), **mechanism_details}
    if dec.reason == "rule":
        head = f"applied {dec.chosen.name}"
    elif dec.reason == "budget":
        head = f"applied {dec.chosen.name} to meet the memory budget {_mb(budget)}"
    else:
        assert dec.floor is not None  # a "floor" decision, the only other kind, carries its floor
        head = (
            f"memory budget {_mb(budget)} cannot be met; applied the lowest-memory plan "
            f"{dec.chosen.name}, floor {_mb(dec.floor)}"
        )
    return dec.chosen.program(), [
        _finding(True, head, where, ctx, dec.base, dec.after, details, dec.chosen.name, dec)
    ]


# --- the pass ------------------------------------------------------------------------------------


def forward_plannable(closed: ClosedJaxpr) -> bool:
    """Whether case 2 could plan ``closed`` (no backward of its own, a floating input, segments
    or loops to checkpoint): the call path then watches for eager ``jax.grad`` of it."""
    return (
        not _has_backward(closed.jaxpr)
        and any(_remat_forward._floating(a) for a in closed.in_avals)
        and _remat_forward.has_loops_or_segments(closed)
    )


def _has_backward(j: Jaxpr) -> bool:
    return any(_compat.in_transpose(site.eqn.source_info) for site in _jaxpr.iter_eqns(j))


def _plan_level(
    closed: ClosedJaxpr, ctx: PassContext, where: str
) -> tuple[ClosedJaxpr, list[Finding]]:
    """Plan this level if it holds a backward, else the sub-jaxprs (loop and branch bodies,
    inner jits) that do. A decision kept on disk for the top level is read first: when it
    applies no plan, the level's graph is not built (a warm process's first call)."""
    auto = ctx.options.remat == "auto"
    residual = _remat_plan.residual_bytes(closed.jaxpr) if auto else None
    if auto and ctx.options.memory_budget is None:
        if residual is not None and residual < MIN_RESIDUAL_BYTES:
            return closed, []  # (``_plan_joint``'s gate, without building the graph)
    stored = _stored_joint(closed, ctx, residual)
    if stored is not None:
        dec = _stored_no_plan(stored[2])
        if dec is not None:
            setup = stored[0]
            return _finish(closed, dec, where, ctx, setup.mechanism, donated=setup.donate)
    if residual is not None and _defers(closed, ctx, stored):
        # (past the gate above: a level with a backward, its residuals above the gate or a
        # budget set; the graph is built once, by the check's planning)
        setup = stored[0] if stored is not None else _joint_setup(closed, ctx)
        return closed, [_deferred(where, ctx, setup.mechanism)]
    g = _remat_plan.joint_graph(closed.jaxpr)
    if g is not None:
        return _plan_joint(closed, g, ctx, where, stored)
    findings: list[Finding] = []
    new_eqns = []
    changed = False
    for eqn in closed.jaxpr.eqns:

        def plan(sub: ClosedJaxpr, eqn=eqn) -> ClosedJaxpr:
            if not _has_backward(sub.jaxpr):
                return sub
            where = f"the {eqn.primitive.name} body at {_jaxpr.user_location(eqn)}"
            new_sub, fs = _plan_level(sub, ctx, where)
            findings.extend(fs)
            return new_sub

        # No re-trace of this level: only the changed bodies are swapped into its equations.
        params = _jaxpr.with_subjaxprs(eqn, plan)
        if params is not None:
            eqn = eqn.replace(params=params)
            changed = True
        new_eqns.append(eqn)
    if not changed:
        return closed, findings
    return ClosedJaxpr(closed.jaxpr.replace(eqns=new_eqns), closed.consts), findings


def remat(closed: ClosedJaxpr, ctx: PassContext) -> PassResult:
    if ctx.options.remat == "fit":
        # The default plans only for a program that does not fit: the call path compiles the
        # original first and, when its compiled peak is above the device's free memory or
        # ``memory_budget`` (or an out-of-memory error says so), runs the passes again with
        # ``extra["fit"]`` naming the budget. Otherwise nothing here: bit-identical to jax.jit.
        fit = ctx.extra.get("fit")
        if fit is None:
            return PassResult.unchanged(closed)
        ctx = dataclasses.replace(ctx, options=with_remat(ctx.options, "auto", fit.budget))
        result = remat(closed, ctx)
        return dataclasses.replace(
            result, findings=tuple(_fit_finding(f, fit) for f in result.findings)
        )
    if any(_is_tracer(c) for c in closed.consts):
        return PassResult.unchanged(closed)  # closes over an outer trace: cannot compile alone
    where = ctx.fn_name
    try:
        if _has_backward(closed.jaxpr):
            top = dataclasses.replace(ctx, extra={**ctx.extra, "remat_top": closed})
            new, findings = _plan_level(closed, top, where)
        elif (
            ctx.under_autodiff
            or ctx.options.remat != "auto"
            or ctx.options.memory_budget is not None
        ):
            new, findings = _plan_forward(closed, ctx)
        else:
            # No backward here: nothing to recompute for, and measuring candidates would make
            # a decoding loop's first call several times jax.jit's. A forward is planned when
            # it is differentiated eagerly (jax.grad(fast)(x): ctx.under_autodiff), or when the
            # user asks for it with a memory budget.
            new, findings = closed, []
    except Exception as e:  # noqa: BLE001 - remat is an optimization: skip it, keep the others
        if ctx.options.fallback == "raise":
            raise
        log.warning("autoopt: remat skipped for %s: %s: %s", where, type(e).__name__, e)
        return PassResult.unchanged(
            closed,
            [
                Finding(
                    "remat",
                    False,
                    f"remat skipped: {type(e).__name__}: {e}",
                    location=ctx.fn_location,
                )
            ],
        )
    return PassResult(new, new is not closed, tuple(findings))


@dataclasses.dataclass(frozen=True)
class Fit:
    """Why remat="fit" plans (``PassContext.extra["fit"]``): the budget a plan must reach, what
    set it, and the values live at the original's peak (``_memory.live_at_peak``).
    ``original``: the executable the call's check compiled (``Original``), whose figures stand
    for the original's measuring compile when it is the same computation (``_known_base``)."""

    budget: int
    reason: str
    live: tuple = ()
    original: Original | None = None


@dataclasses.dataclass(frozen=True)
class Original:
    """The original program as the call's fit check compiled it: the jaxpr it evaluated into
    jit's trace, the flat inputs that executable donates, and its figures."""

    program: ClosedJaxpr
    donated: tuple[int, ...]
    # (a future while the call's check compiles it, under remat="auto": ``_known_base``)
    measured: Measured | concurrent.futures.Future


def measured_of(compiled, seconds: float) -> Measured | None:
    """A compiled executable's figures, as a measuring compile reads them."""
    mem = compiled_memory(compiled)
    return None if mem is None else Measured(mem, _flops(compiled), seconds)


def _measured_now(m: Measured | concurrent.futures.Future | None) -> Measured | None:
    """The figures of an executable the call compiles meanwhile (a future), once compiled."""
    return m.result() if isinstance(m, concurrent.futures.Future) else m


def _known_base(
    closed: ClosedJaxpr, ctx: PassContext, donate: tuple
) -> Measured | concurrent.futures.Future | None:
    """The original's figures without compiling it again: those of the executable the call's
    fit check compiled, when that executable is the program measured here (the same equations,
    the top level, donating the same inputs). Its options differ only by what
    ``measuring_options`` adds, which leaves memory and FLOPs as they are
    (tests/test_remat_first_call.py); anything else (another donation, constants passed as
    arguments) is compiled as before."""
    fit = ctx.extra.get("fit")
    original = getattr(fit, "original", None) or ctx.extra.get("original")
    if original is None or ctx.extra.get("remat_top") is not closed:
        return None
    if tuple(original.donated) != tuple(donate):
        return None
    if original.program is not closed and (
        original.program.in_avals != closed.in_avals
        or original.program.out_avals != closed.out_avals
        or program_digest(original.program) != program_digest(closed)
    ):
        return None
    return original.measured


def with_remat(options, remat: str, budget: int | None):
    """``options`` with remat and memory_budget replaced."""
    return dataclasses.replace(
        options,
        pass_options={**options.pass_options, "remat": remat, "memory_budget": budget},
    )


def _fit_finding(f: Finding, fit: Fit) -> Finding:
    """A finding of the plan "fit" took: why it planned, and the largest values live at the
    original's peak, each with what the plan did with it (recomputed, or kept)."""
    if f.kind != "remat":
        return f
    recomputed = {r.get("location") for r in f.details.get("recomputed") or ()}
    live = [
        {
            "bytes": b.bytes,
            "type": b.type,
            "location": b.location,
            "plan": (
                "recomputed in the backward"
                if f.applied and b.location in recomputed
                else "an input"
                if b.location is None
                else "kept"
            ),
        }
        for b in fit.live
    ]
    listed = "; ".join(
        f"{_mb(b['bytes'])} {b['type']} from {b['location'] or 'an argument'} ({b['plan']})"
        for b in live
    )
    message = f"remat='fit': {fit.reason}; {f.message}"
    if listed:
        message += f". Largest values live at the original's peak: {listed}"
    return dataclasses.replace(
        f, message=message, details={**f.details, "fit": fit.reason, "live_at_peak": live}
    )


def _is_tracer(x: Any) -> bool:
    return _compat.is_tracer(x)  # isinstance(x, jax.core.Tracer)


# --- the declaration -----------------------------------------------------------------------------

# jax.checkpoint_policies names a user may force; "fit", "auto" and "off" are ours.
REMAT_CHOICES = ("fit", "auto", "off")


def _policy_names() -> tuple[str, ...]:
    return tuple(
        n
        for n in dir(jax.checkpoint_policies)
        if not n.startswith("_") and callable(getattr(jax.checkpoint_policies, n))
    )


def _check_remat(remat):
    policies = _policy_names()
    if not isinstance(remat, str) or (remat not in REMAT_CHOICES and remat not in policies):
        close = difflib.get_close_matches(str(remat), REMAT_CHOICES + policies, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        named = [n for n in policies if getattr(jax.checkpoint_policies, n, None) is remat]
        if named:  # the policy object itself: the option takes its name
            hint = (
                " Pass the policy's name as a string: "
                + " or ".join(f"remat={n!r}" for n in named)
                + "."
            )
        raise ValueError(
            f"remat={remat!r} is not a remat policy.{hint} Use 'fit' (the default), 'auto', "
            "'off', or one of "
            f"jax.checkpoint_policies: {', '.join(policies)}."
        )
    return remat


def _check_budget_needs_remat(values) -> None:
    if values["remat"] == "off" and values["memory_budget"] is not None:
        raise ValueError(
            "memory_budget is only met by rematerialization, which remat='off' turns "
            "off: drop one of the two (remat='auto' with the budget recomputes to "
            "meet it)."
        )


# A rewrite that must see the final forward/backward: after every other rewrite.
PASS = Pass(
    name="remat",
    run=remat,
    kinds=("remat",),
    after=("scatter_to_dus",),
    options=(
        Option(
            "remat",
            "fit",
            _check_remat,
            "'fit' (plan only when the program does not fit), 'auto', 'off', or a "
            "jax.checkpoint_policies name: what the backward recomputes",
        ),
        Option(
            "memory_budget",
            None,
            parse_bytes,
            "bytes or a string like '2GB': the compiled peak remat must reach",
        ),
    ),
    check_options=_check_budget_needs_remat,
    enabled=lambda o: o.remat != "off",
    jit_options=jit_options,
    codemod="autoopt.passes.remat.codemod:RematCommand",
    report_section="autoopt.passes.remat._report:plans_section",
)


__all__ = ["PASS", "Fit", "Original", "measured_of", "remat", "jit_options", "with_remat"]
