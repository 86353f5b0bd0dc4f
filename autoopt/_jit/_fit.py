"""remat="fit", the default: a signature's first call compiles the original program only, as
jax.jit does, and plans remat only when that executable does not fit.

How a first call is caught without costing later calls anything: under "fit", jit's trace of
the wrapper for a top-level call of a signature not yet checked raises ``FitCheck`` before
anything is lowered (as the placer's ``HoistConstants`` does). The call site that called the
jit object catches it and calls again through ``checked_call``, which lowers and compiles the
same jit object for the same arguments, reads that executable's compiled peak (argument +
output + temp - alias bytes), and compares it with ``memory_budget`` and the device's free
memory (``_memory.device_memory``). When it fits, the call runs that executable through the
jit object, which finds it in jax's caches (the lowering cache keeps the executable: one
backend compile in all, as jax.jit's first call; ``tests/test_fit_first_call.py`` counts
them): bit-identical to jax.jit. (Calling the ``Compiled`` itself was tried: it refuses
arguments jit accepts, tokens and ``autoopt.constant`` trees.) When it does not, or
when compiling or running it raises out-of-memory (RESOURCE_EXHAUSTED), the passes run again
with the budget (``passes.remat.Fit``), the jit object's caches are cleared (jax keeps one
trace per signature), and the call runs the plan; once. Cleared caches cost the jit object's
other signatures one compile each, on a path taken only when memory is short.

A program with large constants the placer passes as device arguments (``_hoist``) is checked
on the call that passes them: the check's own trace stops at them (``HoistConstants``) the
first time, the placer places them and calls the stand-in again, and the check, still
pending, compiles the executable with them as arguments (the one that runs).

A signature first met inside another trace (an outer jit, vmap) is not checked: jax keeps one
trace of it for every context, and the outer program's executable is what runs.

Under remat="auto" the same check measures the original for remat's decision
(``_checked_auto``): the build leaves it to the check (``passes.remat._defers``), which
compiles the call's executable of the original through the jit object while remat measures
its candidates, donating what that executable donates (nothing where the call keeps its
arguments), and plans with that executable's figures; when no plan is applied, that
executable runs (one compile fewer). A decision kept on disk is read by the build; the check
makes it again only when it was measured donating other inputs than the call's executable.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import jax

from autoopt import _compat, _jaxpr, _multiprocess
from autoopt._errors import FitCheck
from autoopt._jit._program import Program
from autoopt._memory import (
    CompiledMemory,
    compiled_memory,
    device_memory,
    format_bytes,
    is_out_of_memory,
    live_at_peak,
    simulated_memory,
)

if TYPE_CHECKING:
    from autoopt._jit._function import OptimizedFunction

log = logging.getLogger("autoopt")


# The code of the functions that call a jit object and catch ``FitCheck`` (filled by
# ``_function``): a trace raises it only when one of them is on the stack, so a jit object a
# user holds (``fast.inspect(x).jit.lower(x)``) never sees it.
CATCHERS: set = set()
# Whether this thread is inside an executable the C call path runs (``_native.catching``), which
# catches ``FitCheck`` as the Python plans do; set by ``_function`` when that path is on.
NATIVE_CATCHING: Any = None


def call_checks_next() -> bool:
    """Whether the program being built is for a call whose first-call check follows (a
    function that calls a jit object and catches ``FitCheck`` on the stack, at the top level
    of tracing, not inside this thread's own check): ``remat="auto"`` may then leave its
    measurements to the check, which compiles the call's own executable (``checked_call``).
    ``_program_for_call`` alone (for ``inspect``/``explain``/``lower``) is not a call."""
    if getattr(_CHECKING, "program", None) is not None or not _compat.top_level_trace():
        return False
    if NATIVE_CATCHING is not None and NATIVE_CATCHING():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code in CATCHERS and code.co_qualname != "OptimizedFunction._program_for_call":
            return True
        frame = frame.f_back
    return False


def needs_check(of: OptimizedFunction, program: Program) -> bool:
    """Whether a signature's first call goes through the check: always under remat="fit";
    under remat="auto" only where remat left its top-level decision to it or measured one,
    whose figures depend on what the call's executable donates (a program without a backward,
    or below remat's gate, is called as jax.jit calls it). A decision measured (or read from
    disk) donating what the executable being traced donates needs no check: the check would
    find the same and run it; the trace goes on instead of stopping to call again (a warm
    process's first call traces the wrapper once more than jax.jit otherwise)."""
    if of._policy.options.remat != "auto":
        return True
    from autoopt.passes.remat import deferred, measured_donating

    findings = program.pipeline.findings if program.pipeline is not None else ()
    if deferred(findings):
        return True
    donating = measured_donating(findings)
    if donating is None:
        return False
    tls = of._caches.tls
    jit = getattr(tls, "calling", None)
    if jit is None or getattr(tls, "trace_only", False):
        return True  # (the executable is not known here: the check asks for it)
    return _donated_by(of, program, jit) != donating


def calling(of: OptimizedFunction, jit: Any) -> Any:
    """Say that this thread calls ``jit`` (of ``of``) until ``called(of, <the result>)``: a
    signature's first trace through it knows what its executable donates (``needs_check``)."""
    tls = of._caches.tls
    outer = getattr(tls, "calling", None)
    tls.calling = jit
    return outer


def called(of: OptimizedFunction, outer: Any) -> None:
    of._caches.tls.calling = outer


# The program this thread's check is compiling (``checked_call``): a build inside it (a
# ``clear_cache()`` from another thread made its compile trace anew) measures as before.
_CHECKING = threading.local()


def caught_here() -> bool:
    """Whether a function that catches ``FitCheck`` is on this thread's stack. Walked only on
    a signature's first trace (milliseconds of tracing; the walk costs microseconds)."""
    if NATIVE_CATCHING is not None and NATIVE_CATCHING():
        return True
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in CATCHERS:
            return True
        frame = frame.f_back
    return False


def simulated_out_of_memory(memory: CompiledMemory | None) -> None:
    """Under ``autoopt.testing.simulated_device_memory``: raise what XLA raises when an
    executable's peak is above the device's memory."""
    sim = simulated_memory()
    if sim is None or memory is None or memory.peak_bytes <= sim[0]:
        return
    raise jax.errors.JaxRuntimeError(
        f"RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        f"{memory.peak_bytes} bytes (simulated by autoopt.testing.simulated_device_memory: "
        f"memory limit {sim[0]} bytes)."
    )


class _Checked:
    """Stands in for a jit object on a signature's first call, for the placer, which calls
    it with the arguments it placed."""

    __slots__ = ("of", "program", "jit")

    def __init__(self, of: OptimizedFunction, program: Program, jit: Any):
        self.of, self.program, self.jit = of, program, jit

    def __call__(self, *args, **kwargs):
        return checked_call(self.of, self.program, self.jit, args, kwargs)


def fit_check(of: OptimizedFunction, program: Program) -> FitCheck:
    """The exception the wrapper's trace raises for ``program``'s first call."""

    def standin(jit: Any) -> _Checked:
        if program.fit is None:
            program.fit = "checking"  # the wrapper's next trace of it goes on to compile
        return _Checked(of, program, jit)

    return FitCheck(program, standin)


def first_call(check: FitCheck, jit: Any, placer: Any, args: tuple, kwargs: dict):
    """The call that raised ``check``, made again with the check."""
    # The traceback's frames hold the exception's catcher, which holds the exception: a cycle
    # keeping the program (and the call's arguments) alive until the garbage collector runs,
    # and jax reuses a closed-over NumPy constant's conversion while its program lives.
    check.__traceback__ = None
    checked = check.standin(jit)
    try:
        return checked(*args, **kwargs) if placer is None else placer(checked, args, kwargs)
    except BaseException as error:
        # Called while the caller handles ``check``: an error of the call would name it as
        # its context ("During handling of the above exception ..."), which jax.jit's never
        # shows, and hold the program alive through it.
        _forget_context(error, check)
        raise


def _forget_context(error: BaseException, check: FitCheck) -> None:
    seen = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if link.__context__ is check:
            link.__context__ = None
            return
        link = link.__context__


def _device_of(args: tuple, kwargs: dict, platform: str):
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.Array):
            try:
                return next(iter(leaf.devices()))
            except Exception:  # noqa: BLE001 - a deleted array: jax's own call will say so
                break
    try:
        return jax.devices(platform)[0]
    except Exception:  # noqa: BLE001
        return None


def _does_not_fit(of: OptimizedFunction, memory: CompiledMemory | None, device):
    """``(budget, reason)`` when the executable does not fit, else None."""
    if memory is None:
        return None
    budget = of._policy.options.memory_budget
    if budget is not None and memory.peak_bytes > budget:
        return budget, (
            f"the original's compiled peak {format_bytes(memory.peak_bytes)} is above "
            f"memory_budget {format_bytes(budget)}"
        )
    dm = device_memory(device)
    if dm is not None and not dm.fits(memory):
        return dm.budget(memory), (
            f"the original needs {format_bytes(dm.needed(memory))}, more than "
            f"{dm.source} ({format_bytes(dm.free_bytes)})"
        )
    return None


def _oom_budget(error: BaseException, memory: CompiledMemory | None, device) -> int | None:
    from autoopt._memory import bytes_named_in

    named = bytes_named_in(error)
    dm = device_memory(device)
    if dm is None and named is None:
        sim = simulated_memory()
        named = sim[0] if sim is not None else None
    if named is not None:
        return named
    if dm is not None and memory is not None:
        return dm.budget(memory)
    return dm.free_bytes if dm is not None else None


def _placer_retries(error: BaseException) -> bool:
    """Whether ``error`` is the placer's signal to place large constants and call again
    (``HoistConstants``, raised out of the check's own trace when the first call did not pass
    them yet): the check is not over, it is made again on the call that passes them."""
    from autoopt.passes.placement import HoistConstants

    return isinstance(error, HoistConstants)


def checked_call(of: OptimizedFunction, program: Program, jit: Any, args: tuple, kwargs: dict):
    """Compile the call's executable, plan when it does not fit or runs out of memory (once),
    and run it. One thread checks a program; the others wait and run what it decided (a
    compile each would be one more than jax.jit's). A program of this process's own decides
    here alone (``Program.local``)."""
    with _multiprocess.local(program.local):
        return _checked_call_of_signature(of, program, jit, args, kwargs)


def _checked_call_of_signature(
    of: OptimizedFunction, program: Program, jit: Any, args: tuple, kwargs: dict
):
    caches = of._caches
    with caches.lock:
        lock = caches.key_locks.setdefault(("fit", program.key), threading.RLock())
    with lock:
        if program.fit != "checking":  # decided by another thread: its executable is cached
            out = jit(*args, **kwargs)
        else:
            outer, caches.tls.fit_checking = getattr(caches.tls, "fit_checking", None), program
            outer_checking, _CHECKING.program = getattr(_CHECKING, "program", None), program
            try:
                if of._policy.options.remat == "auto":
                    out = _checked_auto(of, program, jit, args, kwargs)
                else:
                    out = _checked_call(of, program, jit, args, kwargs)
            finally:
                caches.tls.fit_checking = outer
                _CHECKING.program = outer_checking
    # The aborted trace left this signature's dispatch entry on jax's slow path for good.
    _compat.reset_dispatch_cache(jit)
    return out


def _checked_auto(of: OptimizedFunction, program: Program, jit: Any, args: tuple, kwargs: dict):
    """remat="auto": run the call, planning first when the build left remat's measurements to
    this check (``passes.remat.deferred``). The original and the plans are measured donating
    what ``jit`` donates (the executable the call runs: nothing where the statement keeps its
    arguments). The call's own executable of the original is compiled through ``jit`` (XLA
    releases the GIL: while remat enumerates and compiles its candidates) and stands for the
    original's measuring compile (``passes.remat._known_base``): when no plan is applied, it
    is the executable the call runs, from jax's caches. When a plan is applied, ``jit``'s
    caches are cleared (``replan``), so this is done only while no other signature was
    compiled; otherwise remat measures the original itself, as at a build, and ``jit``
    compiles only what was decided. A decision the build read from disk that was measured
    donating other inputs than ``jit`` does is made again for ``jit``'s."""
    from autoopt.passes.remat import deferred, measured_donating

    try:
        findings = program.pipeline.findings if program.pipeline is not None else ()
        donated = _donated_by(of, program, jit)
        if deferred(findings):
            original = _original(of, program, jit, kwargs, concurrent.futures.Future())
            if original is not None and not _compiled_others(of, program):
                lowered = jit.lower(*args, **kwargs)
                with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                    compiled = pool.submit(_measured_compile, lowered)
                    original = dataclasses.replace(original, measured=compiled)
                    _plan_deferred(of, program, jit, original, donated)
                    compiled.result()  # (in jit's caches: the call below runs it if kept)
            else:  # (jit has not traced this signature: nothing to clear)
                _plan_deferred(of, program, None, None, donated)
        elif donated is not None and measured_donating(findings) not in (None, donated):
            _plan_deferred(of, program, None, None, donated)
        out = jit(*args, **kwargs)
    except Exception as e:
        if _placer_retries(e):
            raise  # still "checking": the placer calls the stand-in again, with what it placed
        if program.fit == "checking":
            program.fit = "fits"
        raise
    if program.fit == "checking":
        program.fit = "fits"
    return out


def _compiled_others(of: OptimizedFunction, program: Program) -> bool:
    """Whether a jit object of ``of`` may hold an executable of another signature (which
    clearing ``jit``'s caches for a plan would cost a compile)."""
    return any(p.compiled for p in list(of._caches.programs.values()) if p is not program)


def _measured_compile(lowered: Any):
    """The figures of ``lowered``'s executable, compiled (jax keeps it for the jit object)."""
    from autoopt.passes.remat import measured_of

    t0 = time.perf_counter()
    compiled = lowered.compile()
    return measured_of(compiled, time.perf_counter() - t0)


def _plan_deferred(
    of: OptimizedFunction,
    program: Program,
    jit: Any,
    original: Any,
    donated: tuple[int, ...] | None,
) -> Program | None:
    """remat="auto"'s decision for ``program``, made now (``_checked_auto``): the passes run
    again with the original's figures from the call (``original``; None: remat measures it),
    measuring donated the flat inputs ``donated`` (None: what a call rebinding its arguments
    would donate). ``jit``: the jit object whose caches hold the original, cleared if a plan is
    applied."""
    extra = {**program.ctx.extra, "remat_defer": False}
    if original is not None:
        extra["original"] = original
    if donated is not None:
        extra["remat_donate"] = donated
    return _run_again(of, program, jit, dataclasses.replace(program.ctx, extra=extra))


def _checked_call(of: OptimizedFunction, program: Program, jit: Any, args: tuple, kwargs: dict):
    device = _device_of(args, kwargs, of._policy.platform())
    memory = compiled = None
    planned: Program | None = None
    seconds = 0.0
    try:
        t0 = time.perf_counter()
        compiled = jit.lower(*args, **kwargs).compile()
        seconds = program.compile_s = time.perf_counter() - t0
        memory = compiled_memory(compiled)
        over = _does_not_fit(of, memory, device)
        if _multiprocess.several():
            # Every process of a jax.distributed job must build the same program: process 0's
            # figures decide (as its remat measurements do).
            local = over
            over = _multiprocess.shared(
                "fit",
                program.fingerprint,
                lambda: local,
                lambda v: None if v is None else [v[0], v[1]],
                lambda v: None if v is None else (int(v[0]), str(v[1])),
            )
        if over is not None:
            original = _original(of, program, jit, kwargs, compiled, seconds)
            planned = replan(of, program, jit, over[0], over[1], original)
            if planned is not None:
                memory = compiled_memory(jit.lower(*args, **kwargs).compile())
        simulated_out_of_memory(memory)
        out = jit(*args, **kwargs)
    except Exception as e:
        if _placer_retries(e):
            raise  # still "checking": the placer calls the stand-in again, with what it placed
        if not is_out_of_memory(e):
            if program.fit == "checking":
                program.fit = "fits"  # the user's error, or jax's: the next call finds it again
            raise
        # (a process of a jax.distributed job cannot re-plan alone: the others would wait for
        # a program it no longer builds; it raises with the list, as where no plan fits)
        if planned is None and program.fit == "checking" and not _multiprocess.several():
            budget = _oom_budget(e, memory, device)
            if budget is not None:
                original = (
                    None
                    if compiled is None  # (compiling it ran out of memory)
                    else _original(of, program, jit, kwargs, compiled, seconds)
                )
                planned = replan(
                    of,
                    program,
                    jit,
                    budget,
                    f"out of memory: {str(e).splitlines()[0][:200]}",
                    original,
                )
            if planned is not None:
                try:
                    simulated_out_of_memory(compiled_memory(jit.lower(*args, **kwargs).compile()))
                    return jit(*args, **kwargs)
                except Exception as again:
                    if not is_out_of_memory(again):
                        raise
                    e = again
        raise _with_live_values(e, planned or program) from None
    if program.fit == "checking":
        program.fit = "fits"
    return out


def _original(
    of: OptimizedFunction,
    program: Program,
    jit: Any,
    kwargs: dict,
    compiled: Any,
    seconds: float = 0.0,
):
    """What planning may take from the check's executable instead of compiling the original
    again (``passes.remat.Original``): the program it evaluated, the flat inputs it donates,
    its figures. None where its inputs are not the program's (constants the placer passes as
    arguments, packed host leaves) or its donation is not known here."""
    from autoopt.passes.remat import Original, measured_of

    if program.ctx is None or any(k.startswith("_autoopt_") for k in kwargs):
        return None
    donated = _donated_by(of, program, jit)
    if donated is None:
        return None
    if isinstance(compiled, concurrent.futures.Future):  # (its figures, once compiled)
        return Original(program.final, donated, compiled)
    measured = measured_of(compiled, seconds)
    if measured is None:
        return None
    return Original(program.final, donated, measured)


def _donated_by(of: OptimizedFunction, program: Program, jit: Any) -> tuple[int, ...] | None:
    """The flat inputs of ``program`` that ``jit``'s executable donates; None when not known
    here (a jit object not of ``of``'s)."""
    if program.ctx is None:
        return None
    policy = of._policy
    if policy.donate == "explicit":
        nums = policy.jit_kwargs.get("donate_argnums")
        names = policy.jit_kwargs.get("donate_argnames")
        positions = (nums,) if isinstance(nums, int) else tuple(nums or ())
        names = (names,) if isinstance(names, str) else tuple(names or ())
    elif jit is of._plain:
        positions, names = (), ()
    else:
        found = [key for key, j in list(of._caches.jits.items()) if j is jit]
        if not found:
            return None
        positions, names = found[0][:2]  # (the key's third item: ``bounded``)
    chosen = set(positions) | set(names)
    return tuple(i for i, a in enumerate(program.ctx.in_arg_of_leaf) if a in chosen)


def replan(
    of: OptimizedFunction,
    program: Program,
    jit: Any,
    budget: int,
    reason: str,
    original: Any = None,
) -> Program | None:
    """The signature's program planned for ``budget``, in place of ``program`` in the caches
    (``jit``'s cleared, so its next call traces it); None when no pass changed anything.
    ``original``: the check's executable (``_original``), whose figures planning reuses."""
    from autoopt.passes.remat import Fit

    if program.ctx is None or program.key is None:
        return None
    live = tuple(live_at_peak(program.final, _jaxpr.user_location))
    fit = Fit(budget, reason, live, original)
    extra = {**program.ctx.extra, "fit": fit}
    donated = _donated_by(of, program, jit)
    if donated is not None:  # measured as the executable that runs donates (``_checked_auto``)
        extra["remat_donate"] = donated
    ctx = dataclasses.replace(program.ctx, extra=extra)
    return _run_again(of, program, jit, ctx, reason)


def _run_again(
    of: OptimizedFunction, program: Program, jit: Any, ctx: Any, fit_reason: str | None = None
) -> Program | None:
    """The passes run again on ``program``'s trace with ``ctx``: the planned program in its
    place when remat applied a plan (``replan``), else None (the findings say why).
    ``fit_reason``: remat="fit"'s, whose findings are logged."""
    from autoopt.passes import run_pipeline

    if program.ctx is None or program.key is None:
        return None
    try:
        pipeline = run_pipeline(program.traced.closed, ctx)
    except Exception as e:  # noqa: BLE001 - the original still runs
        of._fall_back(e, "remat='fit'" if fit_reason is not None else "remat='auto'")
        return None
    found = [f for f in pipeline.findings if f.kind == "remat"]
    if fit_reason is not None:
        for f in found:
            log.warning("autoopt: %s: %s", getattr(of.__wrapped__, "__name__", "fn"), f.message)
    if not any(f.applied for f in found):
        if not found and fit_reason is not None:
            log.warning(
                "autoopt: %s: %s; remat found no plan that lowers the peak",
                getattr(of.__wrapped__, "__name__", "fn"),
                fit_reason,
            )
        program.fit = "fits"
        program.pipeline = pipeline  # the findings say why nothing was applied
        return None
    new = Program(program.traced, pipeline, None)
    new.key, new.ctx, new.fit = program.key, ctx, "planned"
    new.compiled, new.donates, new.fingerprint = (
        program.compiled,
        program.donates,
        program.fingerprint,
    )
    caches = of._caches
    with caches.lock:
        caches.programs[program.key] = new
        for k, v in list(caches.by_call.items()):
            if v is program:
                caches.by_call[k] = new
    program.fit = "replaced"
    if jit is not None:
        jit.clear_cache()  # jax keeps one trace per signature: the next call traces the plan
    return new


def _with_live_values(error: BaseException, program: Program) -> BaseException:
    """jax's own out-of-memory error with the largest values live at the program's peak."""
    live = live_at_peak(program.final, _jaxpr.user_location)
    if not live:
        return error
    lines = "\n".join(
        f"  {format_bytes(b.bytes):>10}  {b.type}  {b.location or '(an argument)'}" for b in live
    )
    extra = (
        "\n\nautoopt (remat='fit'): no remat plan fits. Largest values live at the program's "
        f"peak:\n{lines}"
    )
    try:
        return type(error)(str(error) + extra)
    except Exception:  # noqa: BLE001 - an error type that takes other arguments
        error.add_note(extra)
        return error


def would_apply(program: Program) -> list:
    """For a report under remat="fit" of a program left as it is: the plan remat="auto" would
    apply and what it would save, as findings not applied (so the user can opt in). Plans by
    compiling candidates: for explain only, never on a call."""
    from autoopt.passes import run_pipeline
    from autoopt.passes.remat import with_remat

    ctx = program.ctx
    if ctx is None or program.fit == "planned" or ctx.options.remat != "fit":
        return []
    auto = dataclasses.replace(
        ctx, options=with_remat(ctx.options, "auto", ctx.options.memory_budget)
    )
    try:
        pipeline = run_pipeline(program.traced.closed, auto)
    except Exception as e:  # noqa: BLE001 - a report figure is not worth failing explain
        log.debug("remat: could not plan remat='auto' for the report: %s", e)
        return []
    out = []
    for f in pipeline.findings:
        if f.kind != "remat":
            continue
        if not f.applied:
            out.append(
                dataclasses.replace(f, message=f"remat='auto' (opt-in) would not plan: {f.message}")
            )
            continue
        before, after = f.details.get("before"), f.details.get("after")
        saved = before["peak_bytes"] - after["peak_bytes"] if before and after else None
        out.append(
            dataclasses.replace(
                f,
                applied=False,
                bytes_saved=None,
                message=(
                    f"not applied (remat='fit' plans only when the program does not fit the "
                    f"device or memory_budget; pass remat='auto' to apply it): remat='auto' "
                    f"would have {f.message}"
                ),
                details={**f.details, "would_save": saved, "opt_in": "remat='auto'"},
            )
        )
    return out
