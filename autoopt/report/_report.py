"""``Report``: what autoopt found and changed for one signature, built from findings only.

Four parts, in the order a user reads them: a summary row per finding (kind, the user's
``file:line``, applied or why not, bytes saved, transfers avoided), the compiled memory before
and after (``memory_analysis()``), the program diff at the level of equations, and the unified
diff of the source edits an expert would make (``autoopt.codemod``). Rendering goes through rich:
coloured in a terminal, plain text when piped and in logs.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import shutil
import sys
import threading
from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr

from autoopt._finding import Finding
from autoopt._format import short_location as _short_loc
from autoopt._memory import format_bytes
from autoopt._reporting import reporting
from autoopt.report._diff import equation_diff

log = logging.getLogger("autoopt")

# A printed report shows this much of the program diff; ``report.diff`` has all of it.
_DIFF_LINES = 80
# Longer diffs are summarized by source line unless verbose (a report must fit a screen).
_SHORT_DIFF_LINES = 16
_DIFF_SOURCE_LINES = 5
_PATH_IN_TEXT = re.compile(r"(/[^\s:()\[\]`'\"]+\.py):(\d+)")
_MEMORY_COLUMNS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")


@dataclasses.dataclass
class Report:
    """Findings, the program before and after, memory figures and suggested source edits.

    ``memory`` is ``{"before": {...}, "after": {...}}`` of compiled figures in bytes
    (argument, output, alias, temp, peak), empty when no arguments were given to compile with.
    ``source_plan`` holds the edited file texts behind ``source_diff`` (``autoopt rewrite
    --write`` applies them).
    """

    findings: list[Finding]
    before: ClosedJaxpr | None = None
    after: ClosedJaxpr | None = None
    memory: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    function: str = "fn"
    location: str | None = None
    fallback: str | None = None
    source_diff: str = ""
    source_plan: Any = dataclasses.field(default=None, repr=False)
    _diff: str | None = dataclasses.field(default=None, repr=False)
    _fn: Any = dataclasses.field(default=None, repr=False)

    @property
    def diff(self) -> str:
        """Equation-level diff of the program before and after (``""`` when unchanged)."""
        if self._diff is None:
            self._diff = equation_diff(self.before, self.after)
        return self._diff

    def peak_change(self) -> tuple[int, int] | None:
        """``(before, after)`` compiled peak bytes of the memory table: plain jax.jit's
        executable, and the one the calls run (donation included); None without figures. The
        headline, the table and the budget verdict read these."""
        before, after = self.memory.get("before"), self.memory.get("after")
        if not before or not after:
            return None
        return before["peak_bytes"], after["peak_bytes"]

    def by_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    def shown(self, verbose: bool = False) -> list[tuple[Finding, list[str | None]]]:
        """The findings the printed table shows, each with the locations of the findings it
        stands for (the same kind, outcome and message, e.g. once per layer: one row with a
        count). Unless ``verbose``, findings that changed nothing and teach nothing are left
        out: an argument no output can reuse, a transfer scan that found no host value, a
        function-level "can be donated" for an argument a recorded call site did donate (its
        row says what happened at that call), or for one under 1 KiB. A function's "can be
        donated" findings sharing a reason for no source edit are one row
        (``donation.merged``)."""
        from autoopt.passes.donation import mergeable, merged

        findings = self.findings if verbose else [f for f in self.findings if not _noise(f, self)]
        groups: dict[tuple, tuple[Finding, list[str | None]]] = {}
        together: dict[tuple, list[Finding]] = {}
        for f in findings:
            if mergeable(f):
                key = ("merged", f.location, (f.details or {}).get("source_edit"))
                together.setdefault(key, []).append(f)
                if key in groups:
                    continue
            else:
                key = (f.kind, f.applied, f.message)
            if key in groups:
                groups[key][1].append(f.location)
            else:
                groups[key] = (f, [f.location])
        for key, fs in together.items():
            if len(fs) > 1:
                groups[key] = (merged(fs), [fs[0].location])
        return list(groups.values())

    def hidden(self, verbose: bool = False) -> int:
        """How many findings ``shown`` leaves out (none when ``verbose``)."""
        return 0 if verbose else sum(1 for f in self.findings if _noise(f, self))

    # --- building ------------------------------------------------------------------------------

    @classmethod
    def from_program(
        cls,
        inspection,
        args: tuple | None = None,
        kwargs: dict | None = None,
        extra_findings: Sequence[Finding] = (),
    ) -> Report:
        """The report of one signature, from ``OptimizedFunction.inspect`` of its arguments
        (``args``: compile them for the memory figures and check each source edit on them;
        ``extra_findings``: a call's placement findings, gathered after the program was built).

        The report keeps no reference to ``args``: an array it held would be a second holder,
        and the caller's next ``state = step(state)`` could not donate it."""
        findings = _with_call_sites(list(inspection.findings), inspection) + list(extra_findings)
        memory: dict[str, dict[str, int]] = {}
        if args is not None:
            memory = _memory_before_after(inspection, args, kwargs or {})
        report = cls(
            findings=findings,
            before=inspection.traced,
            after=inspection.optimized,
            memory=memory,
            function=getattr(inspection.function, "__qualname__", "fn"),
            location=inspection.location,
            fallback=inspection.fallback,
        )
        report._fn = inspection.function
        call = None
        if args is not None:
            from autoopt.codemod import CheckCall, effectful_callbacks

            options = inspection.options
            before = memory.get("before") or {}
            call = CheckCall(
                tuple(args),
                dict(kwargs or {}),
                options.static_argnums,
                options.static_argnames,
                original_peak=before.get("peak_bytes"),
                effectful_callbacks=effectful_callbacks(inspection.traced),
            )
        report._add_source_edits(call)
        return report

    def _add_source_edits(self, call) -> None:
        """Fill ``source_diff`` and say in each finding that wanted an edit why it got none
        (``call``: the ``CheckCall`` each edit is checked on before it is offered)."""
        raw = list(self.findings)
        try:
            from autoopt.codemod import plan_source_edits

            plan = plan_source_edits(self._fn, raw, call=call)
        except Exception as e:  # noqa: BLE001 - a report without source edits beats no report
            log.debug("source edits failed: %s", e)
            return
        self.source_plan = plan
        self.source_diff = plan.diff
        out = []
        for i, f in enumerate(raw):
            if i in plan.notes and _no_user_source(f, plan.notes[i]):
                # Library code or no source line: said once under the table, not per row.
                f = f.replace(details={**f.details, "source_edit": plan.notes[i]})
            elif i in plan.notes:
                note = plan.notes[i]
                f = f.replace(
                    message=f"{f.message.rstrip()} No source edit: {note}.",
                    details={**f.details, "source_edit": note},
                )
            elif i in plan.edited:
                f = f.replace(details={**f.details, "source_edit": "in the source diff"})
            out.append(f)
        self.findings = out

    # --- rendering -----------------------------------------------------------------------------

    def render(
        self, color: bool | None = None, width: int | None = None, verbose: bool = False
    ) -> str:
        """The report as text. ``color=None`` colours only when stdout is a terminal (and
        ``NO_COLOR`` is unset); otherwise the text has no escape codes at all. ``verbose``:
        every finding, also those that changed nothing and teach nothing (``shown``)."""
        from rich.console import Console

        if color is None:
            color = _stdout_is_terminal()
        if width is None:
            width = shutil.get_terminal_size((110, 24)).columns if color else 110
        buf = io.StringIO()
        console = Console(
            file=buf,
            force_terminal=color,
            color_system="standard" if color else None,
            no_color=not color,
            width=width,
            highlight=False,
            emoji=False,
            soft_wrap=False,
            force_jupyter=False,
        )
        _render(self, console, verbose)
        text = buf.getvalue()
        if not color:  # rich pads table cells to the width; pipes and logs want no trailing blanks
            text = "\n".join(line.rstrip() for line in text.splitlines())
        return text.rstrip() + "\n"

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        applied = sum(f.applied for f in self.findings)
        return (
            f"<autoopt.Report of {self.function}: {len(self.findings)} findings, {applied} applied>"
        )

    def plot_memory(self, path: str) -> str:
        """Draw live bytes over program order, before and after, to ``path`` (PNG): a static
        estimate in program order, with the compiled peaks of the report's memory table as
        dashed lines (the figures the table gives).

        Needs matplotlib (``pip install 'autoopt[plot]'``).
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("plot_memory needs matplotlib: pip install 'autoopt[plot]'") from e
        from autoopt._memory import live_bytes_timeline

        fig, ax = plt.subplots(figsize=(8, 3.5))
        for label, closed in (("before", self.before), ("after", self.after)):
            if closed is None:
                continue
            t = live_bytes_timeline(closed)
            line = ax.step(
                range(len(t)), [x / 2**20 for x in t], where="post", label=f"{label} (estimate)"
            )[0]
            # The compiled peak, the figure the report's table gives: XLA's schedule and fusion
            # differ from program order, so the estimate's curve can sit above or below it.
            peak = self.memory.get(label, {}).get("peak_bytes")
            if peak is not None:
                ax.axhline(
                    peak / 2**20,
                    linestyle="--",
                    color=line.get_color(),
                    label=f"{label}: compiled peak {peak / 2**20:.1f} MiB",
                )
        ax.set_xlabel("equation (program order)")
        ax.set_ylabel("live MiB")
        ax.set_title(f"autoopt: live memory of {self.function}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


# A finding's note when its edit was written, run and refused (codemod.plan_source_edits).
_CHECKED = "the edit was checked and is not offered: "


def _no_user_source(f: Finding, note: str) -> bool:
    """The finding has no line of the user's to edit (no location, library code)."""
    return (
        f.location is None
        or "no source line" in note
        or "no source location" in note
        or "in a library" in note
    )


def _stdout_is_terminal() -> bool:
    if os.environ.get("NO_COLOR") is not None or os.environ.get("TERM") == "dumb":
        return False
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        return False


def log_report(inspection) -> None:
    """``optimize(..., explain=True)``: log the report of a freshly built program, as plain text.

    When nothing configured logging, the report would vanish (Python shows only warnings by
    default), so a stderr handler is attached to the ``autoopt`` logger for it: asking for
    ``explain=True`` must show something. Building the report never breaks the call.
    """
    try:
        text = Report.from_program(inspection).render(color=False)
    except Exception as e:  # noqa: BLE001
        log.warning("autoopt could not build the explain report: %s", e)
        return
    with _HANDLER_LOCK:
        if not log.hasHandlers():
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            log.addHandler(handler)
            if log.level == logging.NOTSET:
                log.setLevel(logging.INFO)
    log.info("%s", text.rstrip())


_HANDLER_LOCK = threading.Lock()


def _with_call_sites(findings: list[Finding], inspection) -> list[Finding]:
    """Add what the recorded call sites proved (donation under ``"safe"``), and what their
    calls' run-time checks then did (``Inspection.site_calls``)."""
    sites = list(inspection.call_sites)
    if not sites:
        return findings
    out = list(findings)
    # A call site's argument k is the program's argument k + shift (equinox's inner program
    # takes arguments of its own first): the pass's findings are keyed by the program's.
    shift = getattr(inspection, "site_shift", 0)
    calls_at = getattr(inspection, "site_calls", None) or {}

    def arg_of(key):
        return key + shift if isinstance(key, int) else key

    # What the donation pass knows per argument: its name, and whether any output could reuse
    # it (a call site's reasons about an argument nothing can reuse are noise).
    names = {
        f.details.get("arg"): f.details.get("name")
        for f in findings
        if f.kind == "donate" and "arg" in f.details
    }
    nbytes = {
        f.details.get("arg"): f.bytes_saved
        for f in findings
        if f.kind == "donate" and f.details.get("aliasable") is True
    }
    useless = {
        f.details.get("arg")
        for f in findings
        if f.kind == "donate" and f.details.get("aliasable") is False
    }
    # What the executable of a call site that rebinds everything donates: a proven site
    # donates no more (a program calling back into Python donates nothing under "safe"; the
    # function's own row says why). Unknown (no jit object chosen yet): the proofs alone.
    donatable = None
    if getattr(inspection, "jit", None) is not None:
        positions, names_donated = inspection.donated
        donatable = set(positions) | set(names_donated)

    def label(key) -> str:
        name = names.get(arg_of(key))
        return f"argument {key!r}" + (f" (`{name}`)" if name and name != key else "")

    for proof in sites:
        calls = calls_at.get(proof.location)
        for key in list(proof.positions) + list(proof.names):
            arg = arg_of(key)
            if arg in useless or (donatable is not None and arg not in donatable):
                continue
            out.append(_site_donation(proof, key, arg, label(key), nbytes.get(arg), calls))
        for key, why in proof.reasons:
            if arg_of(key) in useless:
                continue
            out.append(
                Finding(
                    kind="donate",
                    applied=False,
                    location=proof.location,
                    pass_name="donation",
                    message=f"{label(key)} not donated at this call site: {why}.",
                    details={"arg": arg_of(key), "site": proof.location},
                )
            )
    return out


def _site_donation(proof, key, arg, label: str, nbytes: int | None, calls) -> Finding:
    """The row of an argument a call site proves dead, as its calls' run-time checks left it
    (``SiteCalls``: recorded where a call takes the general path, so ``donated`` is a lower
    bound and a refusal is always counted)."""
    refused = calls.refused.get(key, 0) if calls is not None else 0
    donated = calls.donated.get(key, 0) if calls is not None else 0
    narrowed = calls is not None and key in calls.narrowed
    after = calls.narrowed_after if calls is not None else 0
    details = {"arg": arg, "site": proof.location}
    rebinds = f"`{proof.statement}` rebinds it"
    if not (refused or narrowed):
        return Finding(
            kind="donate",
            applied=True,
            location=proof.location,
            pass_name="donation",
            message=(
                f"{label} donated at this call site: {rebinds}, so its buffers are dead after "
                "the call (when an output can reuse them and nothing else refers to them)."
            ),
            details=details,
            bytes_saved=nbytes,
        )
    details.update(refused_calls=refused, donated_calls=donated, narrowed=narrowed)
    why = calls.why.get(key) if calls is not None else None
    because = f": {why}" if why else ""
    times = f"{refused} call{'s' if refused != 1 else ''}"
    applied = False
    if narrowed:
        message = (
            f"{label} not donated at this call site now: {rebinds}, but the run-time check "
            f"refused it at {times}{because}; after {after} refused calls "
            "in a row the site runs an executable that does not donate it (no device copies), "
            "checking again now and then."
        )
    elif donated == 0 and calls is not None and calls.exact:
        message = (
            f"{label} not donated at this call site: {rebinds}, but the run-time check refused "
            f"it at every call so far ({times}){because}; each call passed a device copy of it "
            "to the executable that donates it."
        )
    elif donated == 0:
        message = (
            f"{label} donated at this call site only where the run-time check passed: "
            f"{rebinds}, but the check refused it at {times}{because} (each passed a device "
            "copy of it); the calls in between are not counted (counting them would cost "
            "every call)."
        )
    else:
        applied = True
        message = (
            f"{label} donated at this call site: {rebinds}, so its buffers are dead after the "
            f"call; except at {times} refused by the run-time check{because} (each passed a "
            "device copy of it)."
        )
    return Finding(
        kind="donate",
        applied=applied,
        location=proof.location,
        pass_name="donation",
        message=message,
        details=details,
        bytes_saved=nbytes if applied else None,
    )


def _replay_original(inspection):
    """A function with the user's signature that evaluates the traced, unoptimized program."""
    import functools

    from jax import tree_util

    from autoopt import _jaxpr, _trace

    closed, out_tree = inspection.traced, inspection.program.traced.out_tree
    static_argnums = inspection.options.static_argnums
    static_argnames = inspection.options.static_argnames

    def replay(*args, **kwargs):
        dyn, _statics = _trace.split_args(args, kwargs, static_argnums, static_argnames)
        outs = _jaxpr.eval_closed(closed, *tree_util.tree_leaves(dyn))
        return tree_util.tree_unflatten(out_tree, outs)

    # jax.jit reads static_argnames/donate_argnames from the signature, through __wrapped__.
    functools.update_wrapper(replay, inspection.function, updated=())
    return replay


def _memory_before_after(inspection, args: tuple, kwargs: dict) -> dict[str, dict[str, int]]:
    import jax

    from autoopt._memory import compiled_memory

    out: dict[str, dict[str, int]] = {}
    jit_kwargs = {k: v for k, v in inspection.options.jit_kwargs.items()}
    try:
        # "before": the program as traced, before any pass, under the user's own jit options.
        # Replayed from the traced jaxpr rather than by tracing the user's function again, so
        # explain() runs the function's Python (and its side effects) once, as a call does.
        before = compiled_memory(
            jax.jit(_replay_original(inspection), **jit_kwargs).lower(*args, **kwargs).compile()
        )
        # "after": as the call inspect() describes compiles (under "safe": a call site that
        # rebinds the arguments it passes); a report's compile, not a call's (``reporting``).
        with reporting():
            after = compiled_memory(inspection.jit.lower(*args, **kwargs).compile())
    except Exception as e:  # noqa: BLE001 - a report without figures beats no report
        return {"error": {"message": str(e)}}  # type: ignore[dict-item]
    if before is not None:
        out["before"] = before.as_dict()
    if after is not None:
        out["after"] = after.as_dict()
    return out


# --- rendering ---------------------------------------------------------------------------------


# Below this, a function-level "can be donated" row is left to verbose: donating a scalar or a
# counter saves nothing a user would act on (a sampler's report had five 15-line rows, three of
# them for 4- and 8-byte arguments).
_SMALL_DONATION_BYTES = 1024


def _noise(f: Finding, report: Report) -> bool:
    """A finding the default table leaves out (``Report.shown``)."""
    d = f.details or {}
    if f.kind == "donate" and not f.applied:
        if d.get("aliasable") is False:
            return True  # no output can reuse it: nothing to do, nothing to learn
        if "site" not in d and f.bytes_saved is not None and f.bytes_saved < _SMALL_DONATION_BYTES:
            return True
        if "site" not in d and "arg" in d:  # the function-level "can be donated"
            return any(
                g.kind == "donate"
                and g.applied
                and "site" in g.details
                and g.details.get("arg") == d["arg"]
                for g in report.findings
            )
    if f.kind == "transfer" and not f.applied:
        return not d.get("before") and not d.get("implicit") and not d.get("explicit")
    return False


def _render(report: Report, console: Any, verbose: bool = False) -> None:
    from rich.text import Text

    title = Text(f"autoopt report for {report.function}", style="bold")
    if report.location:
        title.append(f"  ({_display_path(report.location)})", style="dim")
    console.print(title)
    if report.fallback:
        console.print(Text(f"fell back to plain jax.jit: {report.fallback}", style="red"))
    _render_summary(report, console, verbose)
    _render_memory(report, console)
    for section in _pass_sections():  # each pass's own tables (remat's plans), in pass order
        section(report, console)
    diff = report.diff
    lines = diff.splitlines()
    if diff and not verbose and len(lines) > _SHORT_DIFF_LINES:
        # Past a screen the equations drown the findings: by default, how many changed at
        # which source line; render(verbose=True) (autoopt explain --diff) prints them.
        console.print()
        counts = _diff_by_line(lines)
        console.print(
            Text(
                f"program diff: {sum(r + a for r, a in counts.values())} equations changed "
                f"({len(lines)} lines: render(verbose=True) or `autoopt explain --diff` "
                "prints them)",
                style="bold",
            )
        )
        top = sorted(counts.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
        for loc, (removed, added) in top[:_DIFF_SOURCE_LINES]:
            console.print(
                f"  {_short_loc(loc) if loc else '(no source line)'}: -{removed} +{added}"
            )
        if len(top) > _DIFF_SOURCE_LINES:
            console.print(f"  ... {len(top) - _DIFF_SOURCE_LINES} more source lines")
    elif diff:
        console.print()
        console.print(
            Text("program diff (equations: - removed, + added, # your source line)", style="bold")
        )
        if len(lines) > _DIFF_LINES and not verbose:
            hidden = len(lines) - _DIFF_LINES
            lines = lines[:_DIFF_LINES] + [f"  ... {hidden} more lines (report.diff has them all)"]
        for line in lines:
            head, sep, loc = line.rpartition("  # ")
            if sep:
                line = f"{head}  # {_display_path(loc)}"
            mark = line.lstrip()[:1]
            style = (
                "red"
                if mark == "-"
                else "green"
                if mark == "+"
                else "cyan"
                if mark == "~"
                else ""  # rich's "no style"
            )
            console.print(Text(line, style=style), no_wrap=True, overflow="ignore", crop=False)
    elif report.before is not None and report.after is not None:
        console.print()
        console.print(
            "program diff: no equation changed (donation and placement are options "
            "of the compiled call, not edits of the program)."
            if report.findings
            else "program diff: no equation changed."
        )
    if report.source_diff:
        console.print()
        console.print(
            Text("suggested source edits (autoopt rewrite ... --write applies them)", style="bold")
        )
        for line in report.source_diff.splitlines():
            if line.startswith(("--- a/", "+++ b/")):
                line = line[:6] + _display_path(line[6:] + ":").rstrip(":")
            style = (
                "bold"
                if line.startswith(("---", "+++"))
                else "red"
                if line.startswith("-")
                else "green"
                if line.startswith("+")
                else "cyan"
                if line.startswith("@@")
                else ""  # rich's "no style"
            )
            console.print(Text(line, style=style), no_wrap=True, overflow="ignore", crop=False)


def _pass_sections() -> list:
    from autoopt.passes import report_sections

    return report_sections()


def _render_summary(report: Report, console: Any, verbose: bool = False) -> None:
    from rich.table import Table
    from rich.text import Text

    findings = report.findings
    if not findings:
        console.print("no findings: nothing to optimize for these arguments.")
        return
    applied = [f for f in findings if f.applied]
    transfers = sum(f.transfers_avoided or 0 for f in applied)
    rows = report.shown(verbose)
    head = f"{len(findings)} findings, {len(applied)} applied"
    figures = report.peak_change()
    if figures is not None:
        # One figure, the memory table's: rows' savings overlap (one argument donated at two
        # call sites is one buffer; remat and donation change the same peak).
        before, after = figures
        # The table's "after" executable donates what a call rebinding its arguments would:
        # with no donation applied (no call recorded at such a site), its saving is one that
        # such a call gets, not one these findings made.
        aliased = (report.memory.get("after") or {}).get("alias_bytes") and not (
            report.memory.get("before") or {}
        ).get("alias_bytes")
        where = (
            " where a call rebinds its arguments"
            if aliased and not any(f.applied and f.kind == "donate" for f in applied)
            else ""
        )
        if after < before:
            head += (
                f"; peak {format_bytes(before)} -> {format_bytes(after)} per call{where}, "
                f"{format_bytes(before - after)} saved (memory table)"
            )
        elif after > before:
            # A larger peak is said as plainly as a smaller one: XLA's executable with an
            # argument donated can hold more temporaries than the one without.
            head += (
                f"; peak {format_bytes(before)} -> {format_bytes(after)} per call{where}, "
                f"{format_bytes(after - before)} more (memory table)"
            )
    else:
        saved = sum(f.bytes_saved or 0 for f in applied)
        if saved:
            head += f"; {format_bytes(saved)} saved (sum over findings and call sites)"
    if transfers:
        head += f"; {transfers} transfers avoided per call"
    hidden = report.hidden(verbose)
    if hidden:
        head += f" ({hidden} that change nothing not shown: render(verbose=True) shows them)"
    console.print(head)
    table = Table(box=None, pad_edge=False, expand=False, show_edge=False)
    table.add_column("kind", no_wrap=True)
    table.add_column("where", no_wrap=True)
    table.add_column("applied", no_wrap=True)
    table.add_column("saved", justify="right", no_wrap=True)
    table.add_column("transfers", justify="right", no_wrap=True)
    table.add_column("what (and why not)", overflow="fold", ratio=1)
    # What was done first, then what could be done (it has a saving), then the rest.
    order = sorted(
        rows, key=lambda r: (not r[0].applied, not (r[0].bytes_saved or r[0].transfers_avoided))
    )
    withheld: list[tuple[Finding, str]] = []
    for f, locs in order:
        where = _short_loc(f.location) if f.location else "(library)"
        message = f.message
        note = (f.details or {}).get("source_edit") or ""
        if not verbose and note.startswith(_CHECKED):
            # The edit autoopt would write does not reproduce the finding (on XLA:CPU a plan
            # written as jax.checkpoint is merged back by CSE): it is not offered, and the
            # row does not promise it; one line under the table says why (verbose: the row).
            message = message.replace(f" No source edit: {note}.", "")
            withheld.append((f, note.removeprefix(_CHECKED)))
        message = _display_paths_in(message)
        if len(locs) > 1:
            where += f" (x{len(locs)})"
            others = sorted({_short_loc(loc) for loc in locs[1:]} - {_short_loc(f.location)})
            if others:
                message += f" (also at {', '.join(others[:6])}{', ...' if len(others) > 6 else ''})"
        table.add_row(
            f.kind,
            where,
            Text("yes", style="green") if f.applied else Text("no", style="yellow"),
            # What a finding not applied would save is in its message, not in this column.
            format_bytes(f.bytes_saved) if f.bytes_saved and f.applied else "-",
            str(f.transfers_avoided) if f.transfers_avoided and f.applied else "-",
            message,
        )
    console.print(table)
    for f, why in withheld:
        what = "remat plan" if f.kind == "remat" else f"{f.kind} finding"
        where = f" at {_short_loc(f.location)}" if f.location and len(withheld) > 1 else ""
        console.print(
            f"(no source edit for the {what}{where}: {_display_paths_in(why)})", style="dim"
        )
    unsourced = sum(
        len(locs)
        for f, locs in rows
        if (f.details or {}).get("source_edit") and _no_user_source(f, f.details["source_edit"])
    )
    if unsourced:
        console.print(
            f"({unsourced} of these have no source line in your files (library code): "
            "no source edit for them)",
            style="dim",
        )


def _render_memory(report: Report, console: Any) -> None:
    from rich.table import Table

    mem = report.memory
    if "error" in mem:
        console.print(f"compiled memory: not available ({mem['error'].get('message', '')})")
        return
    if not (mem.get("before") and mem.get("after")):
        return
    console.print()
    # "peak" is autoopt's figure, not XLA's peak_memory_in_bytes, which on XLA:CPU is far
    # below what the process holds (benchmarks/RESULTS.md, "memory truth"). A line of its own,
    # not the table's title: a title wraps at the width of a narrow table.
    console.print("compiled memory (peak = argument + output - alias + temp)")
    t = Table(
        box=None,
        pad_edge=False,
        show_edge=False,
    )
    t.add_column("")
    for col in ("argument", "output", "alias", "temp", "peak"):
        t.add_column(col, justify="right")
    before, after = mem["before"], mem["after"]
    t.add_row("before", *(format_bytes(before[k]) for k in _MEMORY_COLUMNS))
    t.add_row("after", *(format_bytes(after[k]) for k in _MEMORY_COLUMNS))
    t.add_row("change", *(_signed(after[k] - before[k]) for k in _MEMORY_COLUMNS))
    console.print(t)
    if after.get("alias_bytes") and not before.get("alias_bytes"):
        # _memory_before_after compiles "after" as a donating call would: say so, since a
        # call site that keeps its arguments (donation not applied there) aliases nothing.
        console.print(
            "(after: the executable a call site that rebinds its arguments runs; one that "
            "keeps them holds the alias bytes more)"
        )


def _signed(n: int) -> str:
    return "0" if n == 0 else ("+" if n > 0 else "-") + format_bytes(abs(n))


def _display_path(loc: str) -> str:
    """``path:line`` relative to the working directory when under it, from the package on
    when installed (``site-packages/pkg/mod.py`` -> ``pkg/mod.py``), else as it is."""
    path, _, line = loc.rpartition(":")
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    shown = path if rel.startswith("..") else rel
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if shown is path and marker in path:
            shown = path.split(marker, 1)[1]
    return f"{shown}:{line}"


def _display_paths_in(text: str) -> str:
    """Every ``/abs/path.py:LINE`` of a message as ``file.py:LINE``, as the table's "where"."""
    return _PATH_IN_TEXT.sub(lambda m: _short_loc(f"{m.group(1)}:{m.group(2)}"), text)


def _diff_by_line(lines: list[str]) -> dict[str | None, tuple[int, int]]:
    """``{source line: (equations removed, added)}`` of an equation diff's text."""
    out: dict[str | None, tuple[int, int]] = {}
    for line in lines:
        mark = line.lstrip()[:1]
        if mark not in ("-", "+"):
            continue
        head, sep, loc = line.rpartition("  # ")
        key = loc.strip() if sep else None
        removed, added = out.get(key, (0, 0))
        out[key] = (removed + (mark == "-"), added + (mark == "+"))
    return out
