"""The ``autoopt`` command: ``explain``, ``rewrite``, ``demo`` and ``run``.

    autoopt explain FILE.py:FUNCTION [--args FILE.py:MAKE_ARGS]
    autoopt rewrite FILE.py:FUNCTION [--args FILE.py:MAKE_ARGS] [--write] [--style jax|autoopt]
    autoopt demo
    autoopt run [--report FILE.json] [--option KEY=VALUE] SCRIPT.py|-m MODULE [ARGS...]

``MAKE_ARGS()`` returns a tuple of arguments, or ``{"args": (...), "kwargs": {...}}``. Bad input
(a missing file or function, a syntax error, ``MAKE_ARGS`` raising, a function that fails to
trace) ends with one line on stderr and exit status 1; usage errors exit with 2.

``run`` runs a script or module as ``python`` does (``sys.argv``, ``__main__``, ``sys.path[0]``,
its exceptions and exit status unchanged) under ``autoopt.patch()``; a missing script or module
is one line and exit status 2, as from ``python``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import runpy
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
    from autoopt.codemod import CheckCall, effectful_callbacks

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
        inspection = optimized.inspect(*args, **kwargs)
    except CliError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function failed to trace
        raise CliError(f"tracing {name} failed: {_one_line(e)}") from None
    options_used = inspection.options
    call = CheckCall(
        args,
        kwargs,
        options_used.static_argnums,
        options_used.static_argnames,
        effectful_callbacks=effectful_callbacks(inspection.traced),
    )
    return report, fn, path, call


# --- commands ------------------------------------------------------------------------------------


def _color(choice: str) -> bool | None:
    return {"auto": None, "always": True, "never": False}[choice]


def cmd_explain(ns) -> int:
    report, _, _ = build_report(ns.target, ns.args, _options(ns))
    sys.stdout.write(report.render(color=_color(ns.color), verbose=ns.diff))
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


RUN_USAGE = (
    "usage: autoopt run [--report FILE.json] [--option KEY=VALUE]... SCRIPT.py [ARGS...]\n"
    "       autoopt run [--report FILE.json] [--option KEY=VALUE]... -m MODULE [ARGS...]\n"
    "\nRun unmodified code as `python` would, with every jax.jit going through autoopt.optimize;\n"
    "a summary per jitted function goes to stderr at exit (--report: also as JSON).\n"
)


def _parse_run(argv: Sequence[str]) -> argparse.Namespace:
    """``run``'s own options come before the script or ``-m MODULE``; everything after belongs
    to the program (as for ``python``), so argparse does not see it."""
    ns = argparse.Namespace(report=None, option=[], module=None, script=None, args=[])
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            sys.stdout.write(RUN_USAGE)
            raise SystemExit(0)
        key, eq, value = a.partition("=")
        if key in ("--report", "--option"):
            if not eq:
                if i + 1 >= len(argv):
                    raise CliError(f"{key} needs a value (autoopt run --help)")
                i += 1
                value = argv[i]
            if key == "--report":
                ns.report = value
            else:
                ns.option.append(value)
        elif a == "-m" or a.startswith("-m") and len(a) > 2:
            module = a[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not module:
                raise CliError("-m needs a module name (autoopt run -m pytest ...)")
            ns.module, ns.args = module, list(argv[i + 1 + (a == "-m") :])
            return ns
        elif a == "--":
            i += 1
            break
        elif a.startswith("-"):
            raise CliError(f"unknown option {a!r} of autoopt run (autoopt run --help)")
        else:
            break
        i += 1
    if i >= len(argv):
        raise CliError("name a script or -m MODULE to run (autoopt run --help)")
    ns.script, ns.args = argv[i], list(argv[i + 1 :])
    return ns


def _user_traceback(tb):
    """The traceback from the user's first frame on: python shows none of its runner's frames."""
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in ("runpy", __name__):
        tb = tb.tb_next
    return tb


def cmd_run(argv: Sequence[str]) -> int:
    import traceback

    from autoopt.patch import format_summary, patch, summary

    try:
        ns = _parse_run(argv)
        options = _options(ns)
    except CliError as e:
        print(f"autoopt run: error: {e}", file=sys.stderr)
        return 2
    if ns.module is not None:
        try:
            spec = importlib.util.find_spec(ns.module)
        except Exception as e:  # noqa: BLE001 - a parent package failing to import
            spec, why = None, _one_line(e)
        else:
            why = f"No module named {ns.module}"
        if spec is None or spec.origin is None and spec.submodule_search_locations is None:
            print(f"autoopt run: error: {why}", file=sys.stderr)
            return 2
    elif not os.path.isfile(ns.script) and not os.path.isdir(ns.script):
        print(
            f"autoopt run: error: can't open file {os.path.abspath(ns.script)!r}: "
            "[Errno 2] No such file or directory",
            file=sys.stderr,
        )
        return 2

    # As python: argv[0] is the script (or, under -m, the module's file, which runpy sets);
    # sys.path[0] is the script's folder (symbolic links resolved), or under -m the current
    # directory. The report's path is the one given here, whatever folder the script moves to.
    report = os.path.abspath(ns.report) if ns.report else None
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [ns.script or "-m", *ns.args]
    path0 = os.path.dirname(os.path.realpath(ns.script)) if ns.script else os.getcwd()
    if sys.path:
        sys.path[0] = path0
    else:
        sys.path.insert(0, path0)
    status, interrupted = 0, False
    handle = patch(**options)
    try:
        with _jax_environment_read_at_import():
            if ns.module is not None:
                runpy.run_module(ns.module, run_name="__main__", alter_sys=True)
            elif os.path.isfile(ns.script):
                _run_script(ns.script)
            else:  # a folder or zip with __main__.py
                runpy.run_path(ns.script, run_name="__main__")
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException as e:  # noqa: BLE001 - the program's own exception, reported as python does
        tb = _user_traceback(e.__traceback__)
        e.with_traceback(tb)  # (python's own hook prints the exception's traceback, not tb)
        try:  # (its own hook, if it set one: rich's, absl's)
            sys.excepthook(type(e), e, tb)
        except BaseException:  # noqa: BLE001 - a hook that fails: python prints the exception
            traceback.print_exception(type(e), e, tb)
        status = 130 if isinstance(e, KeyboardInterrupt) else 1
        interrupted = isinstance(e, KeyboardInterrupt)
    finally:
        _join_threads()  # (python waits for them before it exits; their jits count too)
        handle.undo()
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
    data = summary()
    try:
        sys.stderr.write(format_summary(data))
    except (AttributeError, OSError, ValueError):  # the script closed or dropped stderr
        pass
    if report:
        import json

        data = {**data, "command": [*(["-m", ns.module] if ns.module else [ns.script]), *ns.args]}
        data["exit_status"] = status
        try:
            with open(report, "w") as fh:
                json.dump(data, fh, indent=1, default=str)
        except OSError as e:
            print(f"autoopt run: error: cannot write {report}: {_one_line(e)}", file=sys.stderr)
            return status or 1
    if interrupted:
        _die_of_sigint()
    return status


def _die_of_sigint() -> None:
    """End as python ends on an uncaught KeyboardInterrupt: killed by SIGINT (a parent sees
    the signal, not an exit status), once the summary is written."""
    import signal

    if not hasattr(signal, "SIGINT") or os.name != "posix":
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _join_threads() -> None:
    """Wait for the script's non-daemon threads, as python does before it exits."""
    import threading

    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon and thread.is_alive():
            try:
                thread.join()
            except RuntimeError:  # (a thread that never started, or the main one)
                pass


class _jax_environment_read_at_import:
    """While the script runs: at its first ``import jax`` (its own, or a library's), the
    ``JAX_*`` environment variables it set or changed before it are applied to jax's
    configuration, as if jax read them then. ``autoopt run`` imported jax before the script
    ran, so under plain python a script's ``os.environ["JAX_ENABLE_X64"] = "1"`` before ``import
    jax`` takes effect and here it would not: float64 results became float32. A variable set
    after that import is left alone there as here (jax has read its environment)."""

    def __enter__(self):
        import builtins

        self._environ = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}
        self._import = builtins.__import__
        outer = self._import

        def importing(name, *args, **kwargs):
            if name == "jax" or name.startswith("jax."):
                self.__exit__()
                _apply_jax_environment(self._environ)
            return outer(name, *args, **kwargs)

        builtins.__import__ = importing
        self._installed = importing
        return self

    def __exit__(self, *exc) -> None:
        import builtins

        if getattr(self, "_installed", None) is not None:
            if builtins.__import__ is self._installed:
                builtins.__import__ = self._import
            self._installed = None


def _apply_jax_environment(before: dict) -> None:
    """``jax.config.update`` for each ``JAX_*`` variable set or changed since ``before``, read
    as jax reads its environment at import (``jax._src.config``'s ``bool_env``/``int_env``);
    one jax does not know, or a value it refuses, is left as jax would have left it unread."""
    import jax

    known = jax.config.values
    for var, value in os.environ.items():
        if not var.startswith("JAX_") or before.get(var) == value:
            continue
        name = var.lower()
        if name not in known:
            continue
        current = known[name]
        try:
            if isinstance(current, bool):
                flag = value.lower()
                if flag in ("y", "yes", "t", "true", "on", "1"):
                    parsed: Any = True
                elif flag in ("n", "no", "f", "false", "off", "0"):
                    parsed = False
                else:
                    continue
            elif isinstance(current, int):
                parsed = int(value)
            else:
                parsed = value
            jax.config.update(name, parsed)
        except Exception:  # noqa: BLE001 - as jax would have refused it at import
            continue


def _run_script(path: str) -> None:
    """Run a file as ``python FILE`` does: a fresh ``__main__`` whose ``__file__`` is absolute
    while ``sys.argv[0]`` stays as given (``runpy.run_path`` sets both to the path it gets)."""
    import builtins
    import importlib.machinery
    import types

    file = os.path.abspath(path)
    with open(file, "rb") as fh:  # bytes: compile() honours the file's coding declaration
        code = compile(fh.read(), file, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=file,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", file),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    # (left as the script's after it ends, as python leaves it: its atexit handlers and
    # threads still pickle its classes by ``__main__.Name``)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _exit_status(code) -> int:
    """``sys.exit(code)`` as python turns it into a status: None is 0, an int is itself, anything
    else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


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
    sub = p.add_subparsers(dest="command", metavar="{explain,rewrite,demo,run}")
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
    e.add_argument(
        "--diff",
        action="store_true",
        help="print every finding and the whole program diff (by default a long diff is "
        "summarized by source line)",
    )
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

    # Listed for --help only: main() hands `run` its arguments before argparse sees them.
    sub.add_parser(
        "run", help="run SCRIPT.py or -m MODULE with every jax.jit optimized", add_help=False
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return cmd_run(argv[1:])
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
