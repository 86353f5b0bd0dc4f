"""``Report``: what autoopt found and changed for one signature, built from findings only."""

from __future__ import annotations

import dataclasses
import io
import os
import sys
from typing import Any

from jax.extend.core import ClosedJaxpr

from autoopt.explain._diff import equation_diff
from autoopt.explain._finding import Finding


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass
class Report:
    """Findings, the program before and after, memory figures and suggested source edits.

    ``memory`` is ``{"before": {...}, "after": {...}}`` of compiled figures in bytes
    (argument, output, alias, temp, peak), empty when no arguments were given to compile with.
    """

    findings: list[Finding]
    before: ClosedJaxpr | None = None
    after: ClosedJaxpr | None = None
    memory: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    function: str = "fn"
    location: str | None = None
    fallback: str | None = None
    source_diff: str = ""
    _diff: str | None = dataclasses.field(default=None, repr=False)

    @property
    def diff(self) -> str:
        """Equation-level diff of the program before and after (``""`` when unchanged)."""
        if self._diff is None:
            self._diff = (equation_diff(self.before, self.after)
                          if self.before is not None and self.after is not None else "")
        return self._diff

    def by_kind(self, kind: str) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind]

    # --- building ------------------------------------------------------------------------------

    @classmethod
    def from_program(cls, optimized, program, args: tuple | None = None,
                     kwargs: dict | None = None) -> Report:
        findings = list(program.pipeline.findings) if program.pipeline is not None else []
        findings = _with_call_sites(findings, optimized)
        memory: dict[str, dict[str, int]] = {}
        if args is not None:
            memory = _memory_before_after(optimized, args, kwargs or {})
        report = cls(
            findings=findings,
            before=program.traced.closed,
            after=program.final,
            memory=memory,
            function=getattr(optimized.__wrapped__, "__qualname__", "fn"),
            location=optimized._fn_location,
            fallback=program.fallback_reason,
        )
        try:
            from autoopt.codemod import source_diff_for

            report.source_diff = source_diff_for(optimized.__wrapped__, report.findings)
        except ImportError:
            pass
        return report

    # --- rendering -----------------------------------------------------------------------------

    def render(self, color: bool | None = None, width: int = 110) -> str:
        """The report as text; ``color=None`` colours only when writing to a terminal."""
        from rich.console import Console

        if color is None:
            color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
        buf = io.StringIO()
        console = Console(file=buf, force_terminal=color, color_system="auto" if color else None,
                          width=width, no_color=not color, highlight=False)
        _render(self, console)
        return buf.getvalue().rstrip() + "\n"

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        applied = sum(f.applied for f in self.findings)
        return f"<autoopt.Report of {self.function}: {len(self.findings)} findings, {applied} applied>"

    def plot_memory(self, path: str) -> str:
        """Draw live bytes over program order, before and after, to ``path`` (PNG).

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
            ax.plot(range(len(t)), [x / 2**20 for x in t], label=label)
        ax.set_xlabel("equation (program order)")
        ax.set_ylabel("live MiB (static estimate)")
        ax.set_title(f"autoopt: live memory of {self.function}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _with_call_sites(findings: list[Finding], optimized) -> list[Finding]:
    """Add what the recorded call sites proved (donation under ``"safe"``)."""
    sites = list(getattr(optimized, "_site_reasons", {}).values())
    if not sites:
        return findings
    out = list(findings)
    for proof in sites:
        for key in list(proof.positions) + list(proof.names):
            out.append(Finding(
                kind="donate", applied=True, location=proof.location, pass_name="donation",
                message=(f"argument {key!r} donated at this call site: `{proof.statement}` rebinds "
                         "it, so its buffers are dead after the call (when an output can reuse "
                         "them and nothing else refers to them)."),
                details={"arg": key, "site": proof.location},
            ))
        for key, why in proof.reasons:
            out.append(Finding(
                kind="donate", applied=False, location=proof.location, pass_name="donation",
                message=f"argument {key!r} not donated at this call site: {why}.",
                details={"arg": key, "site": proof.location},
            ))
    return out


def _memory_before_after(optimized, args: tuple, kwargs: dict) -> dict[str, dict[str, int]]:
    import jax

    from autoopt._memory import compiled_memory

    out: dict[str, dict[str, int]] = {}
    jit_kwargs = {k: v for k, v in optimized._options.jit_kwargs.items()}
    try:
        before = compiled_memory(jax.jit(optimized.__wrapped__, **jit_kwargs)
                                 .lower(*args, **kwargs).compile())
        program = optimized._program_concrete(args, kwargs)
        if optimized._explicit_donation:
            jitted = optimized._plain
        else:
            # "after": as a call that donates every aliasable argument would compile.
            pos, nms = program.donatable(tuple(range(len(args))), tuple(kwargs))
            jitted = optimized._jit_for(pos, nms)
        after = compiled_memory(jitted.lower(*args, **kwargs).compile())
    except Exception as e:  # noqa: BLE001 - a report without figures beats no report
        return {"error": {"message": str(e)}}  # type: ignore[dict-item]
    if before is not None:
        out["before"] = before.as_dict()
    if after is not None:
        out["after"] = after.as_dict()
    return out


def _render(report: Report, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    title = f"autoopt report for {report.function}"
    if report.location:
        title += f" ({report.location})"
    console.print(Text(title, style="bold"))
    if report.fallback:
        console.print(Text(f"fell back to plain jax.jit: {report.fallback}", style="red"))
    if report.findings:
        table = Table(show_lines=False, expand=False, box=None, pad_edge=False)
        for col in ("kind", "where", "applied", "saved", "what"):
            table.add_column(col, overflow="fold")
        for f in report.findings:
            table.add_row(
                f.kind,
                _short_loc(f.location),
                Text("yes", style="green") if f.applied else Text("no", style="yellow"),
                _fmt_bytes(f.bytes_saved) if f.bytes_saved else "-",
                f.message,
            )
        console.print(table)
    else:
        console.print("no findings: nothing to optimize for these arguments.")
    mem = report.memory
    if mem.get("before") and mem.get("after"):
        t = Table(title="compiled memory (memory_analysis)", box=None, pad_edge=False)
        for col in ("", "argument", "output", "alias", "temp", "peak"):
            t.add_column(col, justify="right")
        for side in ("before", "after"):
            m = mem[side]
            t.add_row(side, *(_fmt_bytes(m[k]) for k in
                              ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes")))
        console.print(t)
    diff = report.diff
    if diff:
        console.print(Text("program diff (equations; - removed, + added):", style="bold"))
        for line in diff.splitlines():
            style = "red" if line.lstrip().startswith("-") else "green" if line.lstrip().startswith("+") else None
            console.print(Text(line, style=style))
    if report.source_diff:
        console.print(Text("suggested source edits:", style="bold"))
        for line in report.source_diff.splitlines():
            style = "red" if line.startswith("-") and not line.startswith("---") else \
                "green" if line.startswith("+") and not line.startswith("+++") else None
            console.print(Text(line, style=style))


def _short_loc(loc: str | None) -> str:
    if not loc:
        return "-"
    path, _, line = loc.rpartition(":")
    return f"{os.path.basename(path)}:{line}"
