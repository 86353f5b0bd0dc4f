"""The ``autoopt`` command: ``explain``, ``rewrite`` and ``demo``.

    autoopt explain FILE.py:FUNCTION [--args FILE.py:MAKE_ARGS]
    autoopt rewrite FILE.py:FUNCTION [--args FILE.py:MAKE_ARGS] [--write] [--style jax|autoopt]
    autoopt demo

``MAKE_ARGS()`` returns a tuple of arguments, or ``{"args": (...), "kwargs": {...}}``. Bad input
(a missing file or function, a syntax error, ``MAKE_ARGS`` raising, a function that fails to
trace) ends with one line on stderr and exit status 1; usage errors exit with 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import stat
import sys
import tokenize
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]

USAGE_ARGS = (
    "autoopt needs example arguments to trace {fn}: write a function that returns them, e.g. "
    "`def make_args(): return (jnp.zeros((8, 4)), 3)` (or {{'args': (...), 'kwargs': {{...}}}}), "
    "and pass --args {path}:make_args"
)


class CliError(Exception):
    """Bad input: printed as one line, exit status 1."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    first = first if len(first) <= 300 else first[:297] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


# --- loading the user's file -------------------------------------------------------------------

_MODULES: dict[str, Any] = {}


def _split_spec(spec: str, default_path: str | None = None) -> tuple[str, str]:
    """``"path/to/file.py:name"`` -> (path, name); ``"name"`` or ``":name"`` use
    ``default_path``."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path:
        if default_path is None:
            raise CliError(
                f"{spec!r} is not FILE.py:NAME (for example examples/row_updates.py:write_row)"
            )
        path = default_path
    if not name:
        raise CliError(f"{spec!r} names no function after the ':' (write FILE.py:NAME)")
    return path, name


def load_module(path: str):
    """Import the user's file as a module (its folder first on sys.path, as ``python FILE``)."""
    real = os.path.realpath(path)
    if real in _MODULES:
        return _MODULES[real]
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise CliError(f"{path}: not a file")
    from autoopt.codemod import read_source

    try:
        source = read_source(path)
        compile(source, path, "exec")
    except SyntaxError as e:
        raise CliError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"{path}: cannot read it ({_one_line(e)})") from None
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    stem = os.path.splitext(os.path.basename(path))[0]
    name = (
        stem
        if stem.isidentifier() and stem not in sys.modules
        else f"__autoopt_cli_{len(_MODULES)}"
    )
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CliError(f"cannot import {path}: name a Python source file (FILE.py:FUNCTION)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit:
        raise CliError(
            f"{path} called sys.exit() while being imported; guard its script part "
            "with `if __name__ == '__main__':`"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's import error, reported as one line
        del sys.modules[name]
        raise CliError(f"importing {path} failed: {_one_line(e)}") from None
    _MODULES[real] = module
    return module


def _lookup(module, path: str, name: str) -> Any:
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            defined = sorted(
                k
                for k, v in vars(module).items()
                if callable(v)
                and not k.startswith("_")
                and getattr(v, "__module__", module.__name__) == module.__name__
            )
            hint = f" (it defines: {', '.join(defined[:12])})" if defined else ""
            raise CliError(f"{path} has no function {name!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"{path}:{name} is a {type(obj).__name__}, not a function")
    return obj


def load_function(spec: str) -> tuple[Callable, str, str]:
    path, name = _split_spec(spec)
    return _lookup(load_module(path), path, name), path, name


def load_args(spec: str | None, target_path: str, target_name: str) -> tuple[tuple, dict]:
    if spec is None:
        raise CliError(USAGE_ARGS.format(fn=target_name, path=target_path))
    path, name = _split_spec(spec, default_path=target_path)
    make_args = _lookup(load_module(path), path, name)
    try:
        made = make_args()
    except Exception as e:  # noqa: BLE001
        raise CliError(f"{path}:{name}() raised {_one_line(e)}") from None
    if isinstance(made, dict) and set(made) <= {"args", "kwargs"} and made:
        args, kwargs = made.get("args", ()), made.get("kwargs", {})
        if not isinstance(args, tuple | list) or not isinstance(kwargs, dict):
            raise CliError(f"{path}:{name}() must return {{'args': tuple, 'kwargs': dict}}")
        return tuple(args), dict(kwargs)
    if isinstance(made, tuple | list):
        return tuple(made), {}
    raise CliError(
        f"{path}:{name}() returned a {type(made).__name__}; return a tuple of "
        "arguments, or {'args': (...), 'kwargs': {...}}"
    )


def build_report(target: str, args_spec: str | None, options: dict):
    report, fn, path, _ = _explained(target, args_spec, options)
    return report, fn, path


def _explained(target: str, args_spec: str | None, options: dict):
    """``(report, fn, path, call)``: ``call`` is what the source edits were checked on."""
    import autoopt
    from autoopt.codemod import CheckCall

    fn, path, name = load_function(target)
    args, kwargs = load_args(args_spec, path, name)
    # A function already under @autoopt.optimize keeps its own options unless --option is given.
    optimized = (
        fn
        if isinstance(fn, autoopt.OptimizedFunction) and not options
        else autoopt.optimize(fn, **options)
    )
    try:
        report = optimized.explain(*args, **kwargs)
        jit_options = optimized.inspect(*args, **kwargs).options
    except CliError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function failed to trace
        raise CliError(f"tracing {name} failed: {_one_line(e)}") from None
    call = CheckCall(args, kwargs, jit_options.static_argnums, jit_options.static_argnames)
    return report, fn, path, call


# --- commands ------------------------------------------------------------------------------------


def _color(choice: str) -> bool | None:
    return {"auto": None, "always": True, "never": False}[choice]


def cmd_explain(ns) -> int:
    report, _, _ = build_report(ns.target, ns.args, _options(ns))
    sys.stdout.write(report.render(color=_color(ns.color)))
    if ns.plot:
        report.plot_memory(ns.plot)
        print(f"memory picture written to {ns.plot}")
    return 0


def cmd_rewrite(ns) -> int:
    from autoopt.codemod import plan_source_edits, read_source

    path, _ = _split_spec(ns.target)
    snapshot = read_source(path) if os.path.isfile(path) else None
    report, fn, path, call = _explained(ns.target, ns.args, _options(ns))
    # The report planned (and checked) the jax-style edits already.
    plan = (
        report.source_plan
        if ns.style == "jax" and report.source_plan is not None
        else plan_source_edits(fn, report.findings, style=ns.style, call=call)
    )
    if not plan.edits:
        print(f"no source edits for {report.function}.")
        for i, note in sorted(plan.notes.items()):
            f = report.findings[i]
            print(f"  {f.kind} at {f.location or '-'}: {note}")
        return 0
    for i, note in sorted(plan.notes.items()):
        f = report.findings[i]
        print(f"# not rewritten: {f.kind} at {f.location or '-'}: {note}", file=sys.stderr)
    if not ns.write:
        sys.stdout.write(plan.diff)
        return 0
    target_real = os.path.realpath(path)
    for edit in plan.edits:
        if (
            os.path.realpath(edit.path) == target_real
            and snapshot is not None
            and snapshot != edit.original
        ):
            raise CliError(f"{path} changed while it was being analysed; run autoopt rewrite again")
    for edit in plan.edits:  # every file is checked before any is written
        refuse_unwritable(edit.path)
    for edit in plan.edits:
        write_in_place(edit.path, edit.new, expected=edit.original)
        changed = sum(
            1
            for line in edit.diff.splitlines()
            if line[:1] in "+-" and line[:3] not in ("+++", "---")
        )
        print(f"rewrote {edit.display_path} ({changed} lines changed)")
    return 0


def refuse_unwritable(path: str) -> None:
    """Raise CliError when the file ``path`` resolves to is read-only (no owner write bit, or
    not writable by this process): a read-only file is a choice, made by someone, to keep."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except OSError as e:
        raise CliError(f"{path}: cannot read it back ({_one_line(e)})") from None
    if not mode & stat.S_IWUSR or not os.access(real, os.W_OK):
        shown = path if real == os.path.abspath(path) else f"{path} (-> {real})"
        raise CliError(
            f"{shown} is read-only; not written. Make it writable (chmod u+w {real}) and run "
            "autoopt rewrite --write again, or apply the diff that autoopt rewrite prints"
        )


def write_in_place(path: str, text: str, *, expected: str) -> None:
    """Write ``text`` into the file ``path`` resolves to, in place: the same inode, so symbolic
    and hard links, owner and permissions stay as they were. Refused when the file is read-only
    (``refuse_unwritable``) or no longer holds ``expected`` (someone edited it since it was
    read). The new text is encoded before the file is opened; should the write itself fail,
    the old text is put back."""
    from autoopt.codemod import read_source

    refuse_unwritable(path)
    real = os.path.realpath(path)
    try:
        current = read_source(real)
    except OSError as e:
        raise CliError(f"{path}: cannot read it back ({_one_line(e)})") from None
    if current != expected:
        raise CliError(
            f"{path} changed since autoopt read it; not written (run autoopt rewrite again)"
        )
    with open(real, "rb") as fh:
        old = fh.read()
        fh.seek(0)
        encoding, _ = tokenize.detect_encoding(fh.readline)
    new = text.encode(encoding)
    with open(real, "r+b") as fh:
        try:
            fh.write(new)
            fh.truncate()
            fh.flush()
            os.fsync(fh.fileno())
        except BaseException:
            fh.seek(0)
            fh.write(old)
            fh.truncate()
            raise


def cmd_demo(ns) -> int:
    # autoopt.examples is examples/ (package-dir in pyproject), which pyright cannot map.
    from autoopt.examples.demo import run_demo  # pyright: ignore[reportMissingImports]

    return run_demo(
        steps_scale=ns.scale,
        repeats=ns.repeats,
        reports=not ns.no_reports,
        color=_color(ns.color),
        only=ns.example,
    )


def _options(ns) -> dict:
    out: dict = {}
    for item in ns.option or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--option {item!r} is not KEY=VALUE (for example --option donate=auto)")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    try:
        from autoopt.passes import make_options

        make_options(**out)
    except Exception as e:  # noqa: BLE001 - a bad option is bad input
        raise CliError(f"bad --option: {_one_line(e)}") from None
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoopt", description="Explain and apply what autoopt finds in a JAX function."
    )
    sub = p.add_subparsers(dest="command", metavar="{explain,rewrite,demo}")
    sub.required = True

    def common(q):
        q.add_argument("target", metavar="FILE.py:FUNCTION", help="the function to analyse")
        q.add_argument(
            "--args",
            metavar="FILE.py:MAKE_ARGS",
            help="a function returning example arguments: a tuple, or "
            "{'args': ..., 'kwargs': ...} (FILE.py may be left out: same file)",
        )
        q.add_argument(
            "--option",
            action="append",
            metavar="KEY=VALUE",
            help="an option of autoopt.optimize, e.g. donate=auto (repeatable)",
        )

    e = sub.add_parser(
        "explain", help="print the report: findings, memory, program and source diffs"
    )
    common(e)
    e.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    e.add_argument("--plot", metavar="PNG", help="also draw live memory before/after to this file")
    e.set_defaults(run=cmd_explain)

    r = sub.add_parser("rewrite", help="print the suggested source edits; --write applies them")
    common(r)
    r.add_argument(
        "--write",
        action="store_true",
        help="apply the edits to the file(s) the paths resolve to, in place (links and "
        "permissions kept; read-only files refused)",
    )
    r.add_argument(
        "--style",
        choices=("jax", "autoopt"),
        default="jax",
        help="jax: partial(jax.jit, donate_argnums=...); autoopt: @autoopt.optimize",
    )
    r.set_defaults(run=cmd_rewrite)

    d = sub.add_parser("demo", help="run the bundled examples: reports and measured times")
    d.add_argument("--example", action="append", help="run only this example (repeatable)")
    d.add_argument("--repeats", type=int, default=7, help="interleaved timed runs per variant")
    d.add_argument("--scale", type=float, default=1.0, help="multiply each example's step count")
    d.add_argument("--no-reports", action="store_true", help="print only the timing table")
    d.add_argument("--color", choices=("auto", "always", "never"), default="auto")
    d.set_defaults(run=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return ns.run(ns)
    except CliError as e:
        print(f"autoopt: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("autoopt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
