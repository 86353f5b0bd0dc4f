"""Remat's section of the report (``Pass(report_section=...)``): per applied plan, what the
backward recomputes and what it keeps, by source line, with the bytes and the FLOPs the
recomputation adds. Read from the finding's details, never from its message."""

from __future__ import annotations

from typing import Any

from autoopt._format import format_count, short_location
from autoopt._memory import format_bytes


def plans_section(report, console: Any) -> None:
    from rich.table import Table
    from rich.text import Text

    for f in report.findings:
        rows = [*(f.details.get("recomputed") or ()), *(f.details.get("kept") or ())]
        if f.kind != "remat" or not f.applied or not rows:
            continue
        console.print()
        console.print(Text("remat: what the backward recomputes and keeps", style="bold"))
        console.print(
            Text(
                f"plan {f.details.get('plan', '?')}; {f.details.get('mechanism', '?')}", style="dim"
            )
        )
        table = Table(box=None, pad_edge=False, expand=False, show_edge=False)
        for col, right in (
            ("", False),
            ("source line", False),
            ("values", True),
            ("bytes", True),
            ("added FLOPs", True),
        ):
            table.add_column(col, justify="right" if right else "left", no_wrap=True)
        table.add_column("operations", overflow="fold", ratio=1)
        for r in rows:
            flops = r.get("flops")
            table.add_row(
                r.get("what", ""),
                short_location(r.get("location")),
                str(r.get("values", "")),
                format_bytes(r.get("bytes") or 0),
                "-" if flops is None else format_count(flops),
                "/".join(r.get("primitives", ())),
            )
        console.print(table)
