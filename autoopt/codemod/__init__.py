"""Source rewrites (libcst): the edits an expert would make, built from the report's findings.

One command per pass, declared by it (``Pass(codemod="module:Class")``) and living in its
package; ``commands()`` (and ``COMMANDS``) lists the registered passes' commands. Each is a
LibCST ``VisitorBasedCodemodCommand`` with a ``DESCRIPTION``; the built-ins:

================================  ===============  =========================================
command                           finding kind     edit
================================  ===============  =========================================
``ScatterToDUSCommand``           scatter_to_dus   ``x.at[i].set(v)`` -> ``lax.dynamic_update_*``
``RematCommand``                  remat            ``jax.checkpoint`` around a body or a call
``DonateCommand``                 donate           ``@partial(jax.jit, donate_argnums=...)``
``PlacementCommand``              placement        ``autoopt.prefetch`` / ``jax.device_put``
================================  ===============  =========================================

``rewrite_code`` runs them over one file's text (never raising: a failing command leaves the
text as it was and says why in the finding's note); ``plan_source_edits`` does it for every file
the findings point into and returns the new texts, the unified diff and a note for each finding
that got no edit (a lambda, a notebook cell, a library, or no matching code on its line). No
edit is offered unchecked: ``plan_source_edits`` runs the rewritten function under plain
``jax.jit`` on the report's arguments (``CheckCall``) and drops an edit whose numbers differ
from the original's (``_check``), saying why in the finding's note.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import libcst as cst
from libcst.codemod import (
    CodemodContext,
    TransformFailure,
    TransformSuccess,
    transform_module,
)
from libcst.codemod.visitors import AddImportsVisitor

from autoopt._finding import Finding
from autoopt.codemod._base import (
    LIBRARY_ROOTS,
    FindingCommand,
    ModuleImports,
    OwnScopeVisitor,
    comma_separated,
    dotted_name,
    finding_line,
    template,
)
from autoopt.codemod._check import (
    CheckCall,
    EditChecker,
    checking,
    effectful_callbacks,
    unwrap,
)

__all__ = [
    # the runner
    "COMMANDS",
    "CheckCall",
    "FileEdit",
    "RewriteResult",
    "SourcePlan",
    "commands",
    "effectful_callbacks",
    "plan_source_edits",
    "rewrite_code",
    "source_diff_for",
    # the base every pass's command builds on (commands live with their pass)
    "LIBRARY_ROOTS",
    "FindingCommand",
    "ModuleImports",
    "OwnScopeVisitor",
    "comma_separated",
    "dotted_name",
    "finding_line",
    "template",
]


def commands() -> tuple[type[FindingCommand], ...]:
    """The registered passes' commands (``Pass(codemod=...)``), in pipeline order, with those
    that may insert statements (``INSERTS_STATEMENTS``) last: in-line edits first (the lines of
    earlier findings are re-mapped after every command anyway)."""
    from autoopt.passes import codemods

    return tuple(sorted(codemods(), key=lambda c: c.INSERTS_STATEMENTS))  # sorted() is stable


def _by_kind() -> dict[str, type[FindingCommand]]:
    return {c.KIND: c for c in commands()}


if TYPE_CHECKING:  # for type checkers: COMMANDS itself comes from __getattr__ below
    COMMANDS: tuple[type[FindingCommand], ...]


def __getattr__(name: str):
    # COMMANDS is derived on every read, so a pass registered later has its command in it.
    if name == "COMMANDS":
        return commands()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class RewriteResult:
    """One file rewritten: the new text, and per finding index None (edited) or why not."""

    code: str
    outcomes: dict[int, str | None]


def _line_map(old: str, new: str) -> dict[int, int]:
    """Old line number -> new line number (1-based) for lines an edit kept or replaced."""
    a, b = old.splitlines(), new.splitlines()
    out: dict[int, int] = {}
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        for k in range(i2 - i1):
            out[i1 + k + 1] = j1 + min(k, max(j2 - j1 - 1, 0)) + 1 if tag != "delete" else j1 + 1
    return out


def _moved(f: Finding, lines: dict[int, int]) -> Finding:
    line = finding_line(f)
    if line is None or lines.get(line, line) == line:
        return f
    assert f.location is not None  # finding_line read a line number from it
    path = f.location.rpartition(":")[0]
    return f.replace(location=f"{path}:{lines[line]}")


def rewrite_code(
    code: str,
    findings: Sequence[Finding],
    *,
    function: str | None = None,
    function_line: int | None = None,
    style: str = "jax",
    path: str | None = None,
) -> RewriteResult:
    """Apply every command to ``code``. Never raises; a command that fails changes nothing."""
    original = code
    outcomes: dict[int, str | None] = {}
    imports: list = []
    for command in commands():
        lines = _line_map(original, code) if code is not original else {}
        current = [_moved(f, lines) for f in findings]
        fn_line = lines.get(function_line, function_line) if function_line else function_line
        context = CodemodContext(filename=path)
        cmd = command(
            context,
            current,
            function=function,
            function_line=fn_line,
            style=style,
            defer_imports=True,
        )
        if not cmd.targets:
            continue
        result = transform_module(cmd, code)
        if isinstance(result, TransformFailure):
            for i in cmd.targets:
                outcomes[i] = (
                    f"{command.__name__} failed ({type(result.error).__name__}: {result.error})"
                )
            continue
        outcomes.update(cmd.outcomes)
        if isinstance(result, TransformSuccess):
            code = result.code
            imports.extend(context.scratch.get(AddImportsVisitor.CONTEXT_KEY, []))
    if imports and code != original:
        try:
            code = (
                AddImportsVisitor(CodemodContext(), imports)
                .transform_module(cst.parse_module(code))
                .code
            )
        except Exception as e:  # noqa: BLE001 - an edit without its import is worse than none
            for i, v in outcomes.items():
                if v is None:
                    outcomes[i] = f"adding the imports failed ({e})"
            code = original
    return RewriteResult(code, outcomes)


@dataclasses.dataclass(frozen=True)
class FileEdit:
    """One file's text before and after the edits."""

    path: str
    original: str
    new: str

    @property
    def display_path(self) -> str:
        try:
            rel = os.path.relpath(self.path)
        except ValueError:
            return self.path
        return self.path if rel.startswith("..") else rel

    @property
    def diff(self) -> str:
        name = self.display_path
        lines = difflib.unified_diff(
            self.original.splitlines(keepends=True),
            self.new.splitlines(keepends=True),
            fromfile=f"a/{name}",
            tofile=f"b/{name}",
        )
        return "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            for line in lines
        )


@dataclasses.dataclass(frozen=True)
class SourcePlan:
    """The suggested edits for one report: per file, and per finding (by index)."""

    edits: tuple[FileEdit, ...] = ()
    notes: dict[int, str] = dataclasses.field(default_factory=dict)  # why no edit
    edited: frozenset[int] = frozenset()

    @property
    def diff(self) -> str:
        return "".join(e.diff for e in self.edits)


def no_source_reason(path: str | None) -> str | None:
    """Why the file at ``path`` cannot be edited, or None when it can."""
    if not path:
        return "no source location"
    base = os.path.basename(path)
    if "ipykernel_" in path or base.startswith("<ipython-input"):
        return "the code is in a notebook cell, which has no file to rewrite: edit the cell"
    if path.startswith("<"):
        return f"the code has no source file ({path}: interactive input or exec)"
    if not os.path.isfile(path):
        return f"the source file {path} is not there"
    real = os.path.realpath(path)
    if real.startswith(_examples_dir() + os.sep):
        return None  # autoopt's bundled examples are shown as user code, even when installed
    roots = {sysconfig.get_paths().get(k) for k in ("purelib", "platlib", "stdlib", "platstdlib")}
    if (
        any(r and real.startswith(os.path.realpath(r) + os.sep) for r in roots)
        or f"{os.sep}site-packages{os.sep}" in real
        or f"{os.sep}dist-packages{os.sep}" in real
    ):
        return f"the code is in a library ({path}), not in your files"
    return None


def _examples_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("autoopt.examples")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return os.path.realpath(locations[0]) if locations else "\0"


def read_source(path: str) -> str:
    """A file's text as Python reads it (its declared encoding, newlines kept)."""
    with open(path, "rb") as fh:
        encoding, _ = tokenize.detect_encoding(fh.readline)
    with open(path, encoding=encoding, newline="") as fh:
        return fh.read()


def plan_source_edits(
    fn: Callable | None,
    findings: Sequence[Finding],
    *,
    style: str = "jax",
    call: CheckCall | None = None,
) -> SourcePlan:
    """The edits for ``findings`` of ``fn``, for every file they point into. Never raises.

    Every edit is checked before it is offered (``EditChecker``): the rewritten function, run
    under plain ``jax.jit`` on ``call``'s arguments, must give the original's numbers. An edit
    that fails (or that cannot be checked: no ``call``, another file than the function's) gets
    a note saying why instead."""
    if checking():  # a report made by a file that is being run to check an edit
        return SourcePlan()
    fn = unwrap(fn) if fn is not None else None
    code_obj = getattr(fn, "__code__", None)
    fn_file = code_obj.co_filename if code_obj is not None else None
    fn_line = code_obj.co_firstlineno if code_obj is not None else None
    fn_name = getattr(fn, "__name__", None)
    findings = [_with_params(f, fn) for f in findings]
    by_kind = _by_kind()
    groups: dict[str | None, list[int]] = {}
    for i, f in enumerate(findings):
        command = by_kind.get(f.kind)
        if command is None or not command.wants(f):
            continue
        path = (
            fn_file
            if f.kind == "donate"
            else (f.location.rpartition(":")[0] if f.location else fn_file)
        )
        groups.setdefault(path, []).append(i)
    # Donate findings no command edits are evidence for the donate command (a call site that
    # reuses an argument must stop it from suggesting donate_argnums for that argument).
    donate = by_kind.get("donate")
    evidence = [f for f in findings if f.kind == "donate" and donate and not donate.wants(f)]
    checker = EditChecker(fn, call) if fn is not None and call is not None else None
    notes: dict[int, str] = {}
    edited: set[int] = set()
    edits: list[FileEdit] = []
    for path, idxs in groups.items():
        why = no_source_reason(path)
        if why is not None:
            for i in idxs:
                notes[i] = f"{why}; {by_kind[findings[i].kind].HINT}"
            continue
        assert path is not None  # no_source_reason gives a reason for a missing path
        try:
            original = read_source(path)
        except (OSError, SyntaxError, UnicodeDecodeError) as e:
            for i in idxs:
                notes[i] = f"could not read {path} ({e})"
            continue
        same = fn_file is not None and os.path.realpath(path) == os.path.realpath(fn_file)
        local = [findings[i] for i in idxs]

        def rewrite(keep: set[int], local=local, same=same, path=path, original=original):
            # Findings left out stay in place as placeholders no command wants, so the
            # outcomes keep the same indexes.
            kept = [f if k in keep else _placeholder(f) for k, f in enumerate(local)]
            return rewrite_code(
                original,
                kept + evidence,
                function=fn_name,
                function_line=fn_line if same else None,
                style=style,
                path=path,
            )

        def check(
            code: str, ks: set[int], local=local, same=same, path=path, original=original
        ) -> str | None:
            if checker is None:
                return (
                    "not checked, as every edit is, on the report's arguments: it has none "
                    "(autoopt.explain(fn, *args) checks and shows the edit)"
                )
            if not same:
                return (
                    f"the edit is in {path}, not in the function's file; autoopt offers an "
                    "edit only after running the rewritten function, which it does in the "
                    "function's own file"
                )
            exact = not any(local[k].kind == "remat" for k in ks)
            # A remat edit claims the plan's measured peak: its compile must reproduce it.
            claims = [
                local[k].details["after"]["peak_bytes"]
                for k in ks
                if local[k].kind == "remat" and "peak_bytes" in local[k].details.get("after", {})
            ]
            return checker.why_not(
                path, original, code, exact=exact, claimed_peak=max(claims) if claims else None
            )

        result = rewrite(set(range(len(idxs))))
        outcomes = {k: result.outcomes.get(k, "no codemod ran for it") for k in range(len(idxs))}
        offered = {k for k, v in outcomes.items() if v is None}
        code = result.code
        runs_effects = checker.call.effectful_callbacks if checker is not None else ()
        if code != original and runs_effects:
            # (before anything runs: the check would run the original and the edit)
            for k in offered:
                outcomes[k] = (
                    "an edit is offered only after running the function and its rewritten "
                    "version on the report's arguments, and the program calls back into Python "
                    f"({', '.join(runs_effects)}), whose effects that would repeat"
                )
            code = original
        elif code != original and (why := check(code, offered)) is not None:
            # One edit may be wrong and the others right: check each alone, then together.
            good = set()
            for k in sorted(offered):
                alone = rewrite({k})
                failed = (
                    alone.outcomes.get(k) or why
                    if alone.code == original or alone.outcomes.get(k) is not None
                    else check(alone.code, {k})
                )
                if failed is None:
                    good.add(k)
                else:
                    outcomes[k] = f"the edit was checked and is not offered: {failed}"
            code = original
            if good:
                together = rewrite(good)
                failed = (
                    check(together.code, good)
                    if together.code != original
                    and all(together.outcomes.get(k) is None for k in good)
                    else why
                )
                if failed is None:
                    code = together.code
                else:
                    for k in good:
                        outcomes[k] = f"the edit was checked and is not offered: {failed}"
        for k, i in enumerate(idxs):
            if outcomes[k] is None and code != original:
                edited.add(i)
            else:
                notes[i] = outcomes[k] or "no codemod ran for it"
        if code != original:
            edits.append(FileEdit(os.path.abspath(path), original, code))
    return SourcePlan(tuple(edits), notes, frozenset(edited))


def _placeholder(f: Finding) -> Finding:
    """A finding of the same kind that no command acts on."""
    return Finding(f.kind, False, "", location=None)


def _with_params(f: Finding, fn: Callable | None) -> Finding:
    """A placement finding names leaves by the function's parameters (``batch['x']``); the call
    site may name its arguments differently, so add their positions: ``details["params"]``."""
    if f.kind != "placement" or "params" in f.details or fn is None:
        return f
    names = [
        n
        for n in (f.details.get("leaf"), f.details.get("name"), *(f.details.get("leaves") or ()))
        if isinstance(n, str)
    ]
    if not names:
        return f
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return f
    roots = dict.fromkeys(n.split("[")[0].split(".")[0] for n in names)
    pairs = [(params.index(r) if r in params else None, r) for r in roots]
    return f.replace(details={**f.details, "params": pairs})


def source_diff_for(
    fn: Callable | None, findings: Sequence[Finding], call: CheckCall | None = None
) -> str:
    """Unified diff of the suggested edits to the user's files (``""`` when none)."""
    try:
        return plan_source_edits(fn, findings, call=call).diff
    except Exception as e:  # noqa: BLE001 - the report must render without its source diff
        print(f"autoopt: building the source diff failed: {e}", file=sys.stderr)
        return ""
