"""What every codemod shares: findings as targets, the module's imports, node positions.

NB: the analogue is LibCST's own ``VisitorBasedCodemodCommand``: each command here is one, with a
``DESCRIPTION``, run through ``libcst.codemod.transform_module`` so it returns Success, Failure or
Skip and never raises. What a command adds is the link to findings: it is built from the report's
findings, edits the nodes at their ``location`` lines, and records per finding either ``None``
(edited) or the reason it did not edit, which the report shows in the finding's row.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any, ClassVar, cast

import libcst as cst
from libcst.codemod import Codemod, CodemodContext, SkipFile, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor, ImportItem
from libcst.helpers import parse_template_expression
from libcst.metadata import CodeRange, ParentNodeProvider, PositionProvider

from autoopt._finding import Finding

__all__ = [
    "FindingCommand",
    "ModuleImports",
    "finding_line",
    "dotted_name",
    "template",
    "comma_separated",
    "LIBRARY_ROOTS",
]

# Top-level packages whose functions are library code: a call to one is never "the user's
# function" (remat wraps user functions; it does not wrap jnp.tanh).
LIBRARY_ROOTS = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "scipy",
        "flax",
        "optax",
        "equinox",
        "haiku",
        "chex",
        "math",
        "functools",
        "operator",
        "itertools",
        "builtins",
        "autoopt",
        "einops",
        "diffrax",
    }
)

# How to import a name the module does not have yet, longest prefix first.
_PREFERRED_IMPORTS: dict[str, ImportItem] = {
    "jax.lax": ImportItem("jax", "lax"),
    "jax.numpy": ImportItem("jax.numpy", alias="jnp"),
    "functools.partial": ImportItem("functools", "partial"),
    "jax": ImportItem("jax"),
    "autoopt": ImportItem("autoopt"),
}


def template(text: str, **nodes: cst.CSTNode) -> cst.BaseExpression:
    """``parse_template_expression`` with each node copied, so a node used twice (the array in
    a guard and in the update) is two nodes, as libcst's metadata expects."""
    # Any: the stub types the replacements' mapping as if it could also fill ``config``
    copies: dict[str, Any] = {k: v.deep_clone() for k, v in nodes.items()}
    return parse_template_expression(text, **copies)


def comma_separated(args: list[cst.Arg]) -> list[cst.Arg]:
    """Arguments separated by ``", "``, the last without a trailing comma."""
    out = []
    for k, a in enumerate(args):
        last = k == len(args) - 1
        if last:
            out.append(a.with_changes(comma=cst.MaybeSentinel.DEFAULT))
        elif a.comma is cst.MaybeSentinel.DEFAULT:
            out.append(a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))))
        else:
            out.append(a)
    return out


def finding_line(finding: Finding) -> int | None:
    """The line number of a finding's ``"path:LINE"`` location, or None."""
    if not finding.location:
        return None
    _, _, line = finding.location.rpartition(":")
    return int(line) if line.isdigit() else None


def dotted_name(node: cst.CSTNode) -> str | None:
    """``"jax.lax.scan"`` for a Name/Attribute chain, None for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


class OwnScopeVisitor(cst.CSTVisitor):
    """A visitor of one function body's own statements: it does not descend into nested
    functions, lambdas or classes, whose names, returns and loops are their own."""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return False


class ModuleImports:
    """Module-level imports: what each local name refers to, and how to spell a new reference.

    Only top-level ``import``/``from ... import`` statements count (not imports inside functions
    or ``if TYPE_CHECKING``); a reference the module cannot spell yet schedules an import.
    """

    def __init__(self, module: cst.Module) -> None:
        self.bound: dict[str, str] = {}  # local name -> qualified name
        for stmt in module.body:
            if not isinstance(stmt, cst.SimpleStatementLine):
                continue
            for small in stmt.body:
                if isinstance(small, cst.Import):
                    for alias in small.names:
                        full = dotted_name(alias.name) or ""
                        if alias.asname is not None:
                            # an import's ``as`` target is always a Name
                            self.bound[cast(cst.Name, alias.asname.name).value] = full
                        else:
                            root = full.split(".")[0]
                            self.bound.setdefault(root, root)
                elif isinstance(small, cst.ImportFrom) and not small.relative and small.module:
                    if isinstance(small.names, cst.ImportStar):
                        continue
                    mod = dotted_name(small.module) or ""
                    for alias in small.names:
                        name = dotted_name(alias.name) or ""
                        local = (
                            cast(cst.Name, alias.asname.name).value  # ``as`` binds a Name
                            if alias.asname is not None
                            else name
                        )
                        self.bound[local] = f"{mod}.{name}"

    def qualified(self, node: cst.CSTNode) -> str | None:
        """Qualified name of a Name/Attribute chain whose root is imported, else None."""
        dotted = dotted_name(node)
        if dotted is None:
            return None
        root, _, rest = dotted.partition(".")
        if root not in self.bound:
            return None
        return self.bound[root] + (f".{rest}" if rest else "")

    def is_library(self, node: cst.CSTNode) -> bool:
        """True for a call target in library code (jnp.tanh, jax.nn.relu, len)."""
        dotted = dotted_name(node)
        if dotted is None:
            return False
        root = dotted.split(".")[0]
        if root not in self.bound:
            return root in dir(builtins)
        return self.bound[root].split(".")[0] in LIBRARY_ROOTS

    def refers_to(self, node: cst.CSTNode, qualified: str) -> bool:
        return self.qualified(node) == qualified

    def spell(self, qualified: str) -> tuple[str, ImportItem | None]:
        """How this module writes ``qualified``, and the import to add when it cannot yet."""
        best = None
        for local, q in self.bound.items():
            if qualified == q or qualified.startswith(q + "."):
                if best is None or len(q) > len(best[1]):
                    best = (local, q)
        if best is not None:
            return best[0] + qualified[len(best[1]) :], None
        for prefix, item in _PREFERRED_IMPORTS.items():
            if qualified == prefix or qualified.startswith(prefix + "."):
                local = item.alias or item.obj_name or item.module_name
                self.bound[local.split(".")[0]] = prefix if (item.alias or item.obj_name) else local
                return local + qualified[len(prefix) :], item
        raise ValueError(f"no import known for {qualified!r}")


class FindingCommand(VisitorBasedCodemodCommand):
    """A codemod driven by findings of one kind.

    ``findings`` is the report's whole list (indexes are the report's); the command acts on those
    of its ``KIND`` that ``wants`` says carry an edit. ``outcomes[i]`` is None when finding ``i``
    was applied to the source, or the reason it was not. With ``defer_imports`` the imports the
    command needs are left in ``context.scratch`` for the caller to add once, after every command
    has run (adding them early would shift the lines the next command's findings point at).
    """

    KIND: ClassVar[str] = ""
    # What to write by hand, for the finding's note when there is no source to edit.
    HINT: ClassVar[str] = ""
    # True when the command may insert whole statements: it then runs after the in-line edits
    # (``autoopt.codemod.commands``), which keeps the earlier commands' lines simple to map.
    INSERTS_STATEMENTS: ClassVar[bool] = False
    METADATA_DEPENDENCIES = (PositionProvider, ParentNodeProvider)

    def __init__(
        self,
        context: CodemodContext,
        findings: Sequence[Finding] = (),
        *,
        function: str | None = None,
        function_line: int | None = None,
        style: str = "jax",
        defer_imports: bool = False,
    ) -> None:
        super().__init__(context)
        self.findings = list(findings)
        self.targets: dict[int, Finding] = {
            i: f for i, f in enumerate(self.findings) if f.kind == self.KIND and self.wants(f)
        }
        self.function = function
        self.function_line = function_line
        self.style = style
        self.defer_imports = defer_imports
        self.outcomes: dict[int, str | None] = {}
        self.imports: ModuleImports | None = None

    @classmethod
    def wants(cls, finding: Finding) -> bool:
        """Whether this finding asks for a source edit (by default: it was applied)."""
        return finding.applied

    # --- running ------------------------------------------------------------------------------

    def transform_module(self, tree: cst.Module) -> cst.Module:
        if not self.defer_imports:
            return super().transform_module(tree)
        return Codemod.transform_module(self, tree)  # imports stay in context.scratch

    def visit_Module(self, node: cst.Module) -> bool:
        if not self.targets:
            raise SkipFile(f"no {self.KIND} findings with a source edit")
        self.imports = ModuleImports(node)
        return True

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        for i, f in self.targets.items():
            if i not in self.outcomes:
                line = finding_line(f)
                self.outcomes[i] = (
                    f"nothing on line {line} that this edit applies to"
                    if line is not None
                    else "the finding has no source line"
                )
        if not any(v is None for v in self.outcomes.values()):
            raise SkipFile("; ".join(sorted({v for v in self.outcomes.values() if v})))
        return updated_node

    # --- helpers for subclasses ---------------------------------------------------------------

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        # no default given: the stub's _UNDEFINED_DEFAULT is never what comes back
        pos = cast(CodeRange, self.get_metadata(PositionProvider, node))
        return pos.start.line, pos.end.line

    def lines_of(self, finding: Finding) -> list[int]:
        """The lines of this file a finding points at (its location's, by default)."""
        line = finding_line(finding)
        return [] if line is None else [line]

    def targets_within(self, node: cst.CSTNode) -> list[int]:
        """Indexes of target findings with a line within ``node``."""
        start, end = self.span(node)
        return [
            i
            for i, f in self.targets.items()
            if any(start <= line <= end for line in self.lines_of(f))
        ]

    def ref(self, qualified: str) -> cst.BaseExpression:
        """An expression naming ``qualified`` as this module spells it (adding an import)."""
        assert self.imports is not None
        spelled, item = self.imports.spell(qualified)
        if item is not None:
            AddImportsVisitor.add_needed_import(
                self.context, item.module_name, item.obj_name, item.alias
            )
        return cst.parse_expression(spelled)

    def code(self, node: cst.CSTNode) -> str:
        return cst.Module(body=[]).code_for_node(node)

    def fit(self, original: cst.CSTNode, new: cst.BaseExpression) -> cst.BaseExpression:
        """``new`` with one argument per line when, put where ``original`` stood, its line
        would pass 100 columns (as a formatter would lay it out)."""
        if not isinstance(new, cst.Call) or not new.args:
            return new
        pos = cast(CodeRange, self.get_metadata(PositionProvider, original))
        line = self.module.code.splitlines()[pos.start.line - 1]
        rest = line[pos.end.column :] if pos.start.line == pos.end.line else ""
        if pos.start.column + len(self.code(new)) + len(rest) <= 100:
            return new

        def newline(extra: str) -> cst.ParenthesizedWhitespace:
            return cst.ParenthesizedWhitespace(
                first_line=cst.TrailingWhitespace(),
                indent=True,
                last_line=cst.SimpleWhitespace(extra),
            )

        args = [
            a.with_changes(
                comma=cst.Comma(whitespace_after=newline("    " if k < len(new.args) - 1 else ""))
            )
            for k, a in enumerate(new.args)
        ]
        return new.with_changes(whitespace_before_args=newline("    "), args=args)
