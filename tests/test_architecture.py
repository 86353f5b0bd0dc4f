"""The package's shape: the import graph of ``autoopt`` has no cycles, no module reaches into
another package's private names or private modules, every package ships, and importing
autoopt touches no device.

The graph is read from the source with ``ast``, so it sees every import, including those inside
functions (a lazy import still ties the two modules together; it only hides the cycle until
the call). Edges:

- ``import autoopt.a.b`` and ``from autoopt.a import b`` where ``b`` is a submodule import
  ``autoopt.a.b``; ``from autoopt.a import name`` where ``name`` is not a submodule imports
  ``autoopt.a``; relative imports are resolved against the importing module's package;
  ``importlib.import_module("literal")`` counts like ``import literal``.
- Importing ``autoopt.a.b`` also runs the ``__init__`` of ``autoopt.a``, so that is an edge
  too, except to the importing module's own enclosing packages: Python has already started
  those before the module runs, so they are not a dependency the module adds.

Private modules: a ``_x`` module may be imported from its own package and that package's
subpackages (``passes/donation/_pass.py`` may use ``passes/_base.py``). From elsewhere only the
top-level infrastructure below may be imported; everything else goes through the package's
public names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autoopt"

# Top-level private modules every layer may import: the bottom of the graph (errors, options,
# findings, the jax._src shim, tracing, the interpreter, memory figures, comparison, decisions
# shared between processes or kept on disk) and the call path.
INFRASTRUCTURE = frozenset(
    f"autoopt.{name}"
    for name in (
        "_compat",
        "_jaxpr",
        "_trace",
        "_memory",
        "_options",
        "_errors",
        "_finding",
        "_compare",
        "_format",
        "_jit",
        "_multiprocess",
        "_plan_cache",
        "_reporting",
    )
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    line: int
    names: tuple[str, ...] = ()  # names taken from `target` with `from target import ...`
    implicit: bool = False  # a parent package's __init__, run on the way to `target`

    def where(self) -> str:
        path = module_path(self.source).relative_to(ROOT)
        how = " (its package __init__)" if self.implicit else ""
        return f"{path}:{self.line}: {self.source} -> {self.target}{how}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_path(name: str) -> Path:
    base = ROOT.joinpath(*name.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return module_path(name).name == "__init__.py"


def package_of(name: str) -> str:
    """The package a module lives in (a package's ``__init__`` lives in the package itself)."""
    return name if is_package(name) else name.rpartition(".")[0]


def ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def is_private(name: str) -> bool:
    last = name.rpartition(".")[2]
    return last.startswith("_") and not (last.startswith("__") and last.endswith("__"))


def resolve(source: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = package_of(source).split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:``: imports for annotations, never executed."""
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            hidden.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return hidden


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []
    hidden = type_checking_only(tree)
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(name, alias.name, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(name, node.module, node.level)
            taken = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    found.append(Import(name, sub, node.lineno))
                else:
                    taken.append(alias.name)
            if taken:
                found.append(Import(name, base, node.lineno, tuple(taken)))
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(Import(name, node.args[0].value, node.lineno))
    internal = [i for i in found if i.target == "autoopt" or i.target.startswith("autoopt.")]
    implied = []
    for imp in internal:
        for parent in ancestors(imp.target):
            if parent not in ancestors(name) and parent != name:
                implied.append(Import(name, parent, imp.line, implicit=True))
    return [i for i in internal + implied if i.target != name]


def import_graph() -> list[Import]:
    known = modules()
    return [imp for name, path in known.items() for imp in imports_of(name, path, known)]


def strongly_connected(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_import_graph_has_no_cycles():
    graph = import_graph()
    known = modules()
    edges: dict[str, set[str]] = {}
    for imp in graph:
        if imp.target in known:
            edges.setdefault(imp.source, set()).add(imp.target)
    report = []
    for component in strongly_connected(set(known), edges):
        members = set(component)
        lines = sorted(
            {imp.where() for imp in graph if imp.source in members and imp.target in members}
        )
        report.append(f"cycle among {', '.join(component)}:\n    " + "\n    ".join(lines))
    assert not report, "import cycles:\n  " + "\n  ".join(report)


def test_no_private_names_imported_across_modules():
    known = modules()
    bad = [
        f"{imp.where()}: {', '.join(n for n in imp.names if is_private(n))}"
        for imp in import_graph()
        if imp.target in known and any(is_private(n) for n in imp.names)
    ]
    assert not bad, "private names imported from another module:\n  " + "\n  ".join(bad)


def private_module_allowed(source: str, target: str) -> bool:
    """Each private module on ``target``'s path is either infrastructure or owned by a package
    that ``source`` lives in (top-level private modules: infrastructure only)."""
    home = package_of(source)
    for module in [*ancestors(target), target]:
        if not is_private(module) or module in INFRASTRUCTURE:
            continue
        owner = module.rpartition(".")[0]
        if owner == "autoopt" and home != owner:
            return False
        if not (home == owner or home.startswith(owner + ".")):
            return False
    return True


def test_no_private_modules_imported_from_another_package():
    known = modules()
    bad = [
        f"{imp.where()}: use the public names of {package_of(imp.target)}"
        for imp in import_graph()
        if imp.target in known
        and not imp.implicit
        and not private_module_allowed(imp.source, imp.target)
    ]
    assert not bad, "private modules imported from another package:\n  " + "\n  ".join(bad)


def test_every_package_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    on_disk = {module_name(p.parent / "__init__.py") for p in PACKAGE.rglob("*.py")}
    missing = sorted(on_disk - listed)
    assert not missing, (
        f"packages not in pyproject's [tool.setuptools] packages (they would not ship): {missing}"
    )


def test_importing_autoopt_initializes_no_backend():
    """A user must be able to configure devices after ``import autoopt``: nothing at import time
    or when a function is wrapped may start a JAX backend."""
    script = textwrap.dedent(
        """
        import jax
        import autoopt

        autoopt.optimize(lambda x: x)
        jax.config.update("jax_num_cpu_devices", 4)
        assert len(jax.devices()) == 4, jax.devices()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_environ(), "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _environ() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # a --xla_force_host_platform_device_count would mask the check
    return env


@pytest.mark.parametrize(
    ("source", "target", "allowed"),
    [
        ("autoopt.passes.placement._placer", "autoopt.passes.placement._hoist", True),
        ("autoopt.passes.donation._pass", "autoopt.passes._base", True),
        ("autoopt._jit._function", "autoopt.passes.placement._placer", False),
        ("autoopt._jit._function", "autoopt.passes.placement", True),
        ("autoopt.report._report", "autoopt._compat", True),
        ("autoopt.cli", "autoopt._jit", True),
        ("autoopt.cli", "autoopt._jit._function", False),
        ("autoopt.passes.remat._pass", "autoopt.passes.in_place._ranges", False),
    ],
)
def test_private_module_rule(source, target, allowed):
    assert private_module_allowed(source, target) == allowed
