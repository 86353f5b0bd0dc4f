"""Random JAX programs for differential testing: hypothesis strategies that build programs as data.

A ``Program`` is a short list of ``Op``s, each a statement of Python source binding new
variables; ``Program.source()`` is a complete, readable ``def`` and ``Program.function()``
compiles it. Hypothesis draws every choice (which op, which operands, which index, which
dtype), so a failing case shrinks to the fewest, simplest statements that still fail, and the
failure prints as code you can paste into a regression test.

Programs are valid by construction: the builder tracks the abstract value of every variable
(``jax.eval_shape`` of each statement), so each op picks operands of shapes and dtypes it
accepts, and ``fit`` coerces the rest. What the programs exercise: elementwise ops, broadcasts,
``dot_general``, reductions, reshapes and transposes, ``.at[...]`` updates whose indices are in
and out of bounds, negative, contiguous windows (rows, blocks, 2-D tiles) or strided, static
or traced, dynamic slices and updates, ``cond``/``switch``, ``scan``, ``fori_loop``,
``while_loop``, ``jax.grad`` and ``jax.vmap`` of nested blocks, pytree inputs and outputs, and
the dtypes f32, bf16, i32 and bool.

NB: the analogue is the "random program" half of Csmith/YARPGen-style compiler fuzzing; the
reference is always the same source under plain ``jax.jit``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import linecache
import math
import os
from collections.abc import Callable
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "Aval",
    "Op",
    "Program",
    "FuzzCase",
    "fit",
    "programs",
    "fuzz_cases",
    "program_args",
    "check_program",
]

FUZZ_DTYPES = ("float32", "int32", "bool", "bfloat16")
_FLOATS = ("float32", "bfloat16")
_NUMERIC = ("float32", "bfloat16", "int32")
_MAX_NDIM = 3
_MAX_SIDE = 4


def fit(x: Any, shape: tuple[int, ...], dtype: str) -> jax.Array:
    """``x`` cast to ``dtype`` and tiled or cut (row-major) to ``shape``: how a random program
    makes any variable usable where another shape is needed."""
    x = jnp.asarray(x)
    if x.dtype != jnp.dtype(dtype):
        x = x.astype(dtype)
    if x.shape == tuple(shape):
        return x
    if x.size == 0:
        return jnp.zeros(shape, dtype)
    return jnp.resize(x.ravel(), shape)


@dataclasses.dataclass(frozen=True)
class Aval:
    """Shape and dtype of one variable of a random program."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def special(self) -> bool:
        """A PRNG key array or a float0 value: no op but a program's result takes it."""
        return self.dtype == "float0" or self.dtype.startswith("key<")

    def sds(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, _special_dtype(self.dtype) or jnp.dtype(self.dtype))

    @classmethod
    def of(cls, x: Any) -> Aval:
        if x.dtype == jax.dtypes.float0:
            return cls(tuple(x.shape), "float0")
        if jnp.issubdtype(x.dtype, jax.dtypes.extended):
            return cls(tuple(x.shape), str(x.dtype))
        return cls(tuple(x.shape), jnp.dtype(x.dtype).name)


KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def _special_dtype(name: str):
    """The jax dtype of a special aval's name (``key<fry>``, ``float0``), else None."""
    if name == "float0":
        return jax.dtypes.float0
    if name.startswith("key<"):
        for impl in KEY_IMPLS:
            dtype = jax.eval_shape(functools.partial(jax.random.key, 0, impl=impl)).dtype
            if str(dtype) == name:
                return dtype
    return None


@dataclasses.dataclass(frozen=True)
class Op:
    """One statement of a random program: ``lines`` of source binding ``targets``."""

    kind: str
    targets: tuple[tuple[str, Aval], ...]
    lines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A random program as data. ``in_avals`` is the pytree of input avals, one per parameter."""

    params: tuple[str, ...]
    in_avals: tuple[Any, ...]
    unpack: tuple[str, ...]
    ops: tuple[Op, ...]
    result: str
    name: str = "program"

    def source(self) -> str:
        lines = [f"def {self.name}({', '.join(self.params)}):"]
        lines += ["    " + ln for ln in self.unpack]
        for op in self.ops:
            lines += ["    " + ln for ln in op.lines]
        lines.append(f"    return {self.result}")
        return "\n".join(lines) + "\n"

    def function(self) -> Callable:
        """The program compiled from its source (registered with ``linecache``, so tracebacks
        and autoopt's reports show the generated lines)."""
        return compile_source(self.source(), self.name)

    def __repr__(self) -> str:
        return "Program:\n" + self.source()


_counter = itertools.count()


def compile_source(source: str, name: str) -> Callable:
    """``exec`` the ``def name(...)`` in ``source`` with ``jnp``, ``lax``, ``jax``, ``np`` and
    ``fit`` in scope; the file name is unique and registered with ``linecache``."""
    filename = f"<autoopt-fuzz-{next(_counter)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"jax": jax, "jnp": jnp, "lax": lax, "np": np, "fit": fit}
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace[name]


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """A program and arguments to call it with. Its repr is pasteable into a regression test."""

    program: Program
    args: tuple[Any, ...]

    def __repr__(self) -> str:
        return f"{self.program.source()}\nargs = {_args_repr(self.args)}\n"


def _args_repr(args) -> str:
    def leaf(x):
        a = np.asarray(x)
        dtype = jnp.dtype(x.dtype).name
        values = a.astype(np.float32 if dtype == "bfloat16" else a.dtype).tolist()
        return f"jnp.asarray({values!r}, {dtype!r})"

    def rec(t):
        if isinstance(t, dict):
            return "{" + ", ".join(f"{k!r}: {rec(v)}" for k, v in t.items()) + "}"
        if isinstance(t, tuple):
            return "(" + ", ".join(rec(v) for v in t) + ("," if len(t) == 1 else "") + ")"
        if isinstance(t, list):
            return "[" + ", ".join(rec(v) for v in t) + "]"
        return leaf(t)

    return rec(tuple(args))


# --- the builder --------------------------------------------------------------------------------


def hypothesis_modules():
    """``(hypothesis.strategies, hypothesis.extra.numpy)``, or an ImportError saying what to
    install (hypothesis is in the ``test`` extra, not a dependency of autoopt)."""
    try:
        import hypothesis.extra.numpy as hnp
        import hypothesis.strategies as st
    except ImportError as e:  # pragma: no cover - hypothesis is in the `test` extra
        raise ImportError(
            "autoopt.testing strategies need hypothesis: pip install 'autoopt[test]'"
        ) from e
    return st, hnp


def _aval_of(
    expr: str, env: dict[str, Aval], extra_lines: tuple[str, ...] = ()
) -> tuple[Aval, ...]:
    """Avals of ``expr`` evaluated with ``env``'s variables (after ``extra_lines``, which may
    define helper functions), via ``jax.eval_shape``. A tuple: one per output."""
    names = sorted(env)
    src = "def _shape_of(" + ", ".join(names) + "):\n"
    src += "".join("    " + ln + "\n" for ln in extra_lines)
    src += f"    return {expr}\n"
    ns = {"jax": jax, "jnp": jnp, "lax": lax, "np": np, "fit": fit}
    exec(compile(src, "<autoopt-fuzz-shape>", "exec"), ns)  # noqa: S102
    out = jax.eval_shape(ns["_shape_of"], *[env[n].sds() for n in names])
    return tuple(Aval.of(o) for o in jax.tree_util.tree_leaves(out))


class _Names:
    def __init__(self) -> None:
        self.n = 0

    def var(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def fn(self, kind: str) -> str:
        self.n += 1
        return f"{kind}{self.n}"


class _Builder:
    """Draws the statements of one block. ``env`` holds every variable in scope (outer blocks'
    variables included: nested functions close over them, as user code does)."""

    def __init__(
        self, draw, names: _Names, env: dict[str, Aval], depth: int, under_grad: bool, max_ops: int
    ):
        self.draw = draw
        self.names = names
        self.env = dict(env)
        self.local: list[str] = []  # variables bound in this block, in order
        self.ops: list[Op] = []
        self.depth = depth
        self.under_grad = under_grad
        self.max_ops = max_ops

    # --- drawing helpers ----------------------------------------------------------------------

    @overload
    def pick(self) -> str: ...  # the parameters are always in scope
    @overload
    def pick(self, ok: Callable[[Aval], bool]) -> str | None: ...

    def pick(self, ok: Callable[[Aval], bool] = lambda a: True) -> str | None:
        """A variable in scope satisfying ``ok`` (None when none does); the most recent first
        (shrinks towards it)."""
        order = list(reversed(self.local)) + [
            n for n in reversed(list(self.env)) if n not in self.local
        ]
        cands = [n for n in order if not self.env[n].special and ok(self.env[n])]
        if not cands:
            return None
        st, _ = hypothesis_modules()
        return self.draw(st.sampled_from(cands))

    def pick_result(self) -> str:
        """What a block or program returns: mostly its last statement's value, so that few of
        the drawn statements are dead code that jit would drop."""
        if self.local and self.choice(["last", "any"]) == "last":
            last = self.local[-1]
            if self.depth == 0 or not self.env[last].special:
                return last
        return self.pick()

    def integers(self, lo: int, hi: int) -> int:
        st, _ = hypothesis_modules()
        return self.draw(st.integers(lo, hi))

    def choice(self, options):
        st, _ = hypothesis_modules()
        return self.draw(st.sampled_from(list(options)))

    def boolean(self) -> bool:
        st, _ = hypothesis_modules()
        return self.draw(st.booleans())

    def fit_expr(self, name: str, dst: Aval) -> str:
        src = self.env[name]
        if src == dst:
            return name
        if src.shape == dst.shape:
            return f"{name}.astype({dst.dtype!r})"
        return f"fit({name}, {dst.shape!r}, {dst.dtype!r})"

    def operand(self, dst: Aval, broadcast_ok: bool = False) -> str:
        """An expression of aval ``dst`` (or, with ``broadcast_ok``, one that broadcasts to it)
        built from a variable in scope."""
        name = self.pick()
        src = self.env[name]
        if (
            broadcast_ok
            and src.dtype == dst.dtype
            and (src.shape == () or dst.shape[len(dst.shape) - len(src.shape) :] == src.shape)
        ):
            return name
        return self.fit_expr(name, dst)

    def literal(self, dtype: str) -> str:
        if dtype == "bool":
            return self.choice(["True", "False"])
        if dtype == "int32":
            return str(self.integers(-3, 3))
        return self.choice(["1.5", "-2.0", "0.0", "0.25"])

    def dyn_scalar(self, n: int | None = None) -> str:
        """A traced int32 scalar (or a literal when nothing in scope can make one). Given the
        length ``n`` of the axis it indexes, it may be bounded the ways users bound indices
        (``% n``, ``jnp.clip``), sometimes exactly in bounds and sometimes off by a little."""
        name = self.pick(lambda a: a.dtype in ("int32", "bool") or a.dtype in _FLOATS)
        if name is None:
            return str(self.integers(-3, 3))
        a = self.env[name]
        elem = name if a.ndim == 0 else f"{name}.ravel()[{self.integers(0, a.size - 1)}]"
        if a.dtype != "int32":
            elem = f"{elem}.astype('int32')"
        forms = [elem, f"({elem} + {self.integers(-3, 3)})"]
        if n is not None:
            forms += [
                f"({elem} % {n})",
                f"jnp.clip({elem}, 0, {n - self.integers(0, 1)})",
                f"jnp.clip({elem}, {self.integers(-1, 0)}, {n - 1})",
                f"jnp.abs({elem})",
                f"({n - 1} - {elem})",
            ]
        return self.choice(forms)

    def bind(self, kind: str, exprs_lines: tuple[str, ...], expr: str, n_out: int = 1) -> None:
        """Bind ``expr`` (after ``exprs_lines``) to fresh variables, typing it with eval_shape."""
        avals = _aval_of(expr, self.env, exprs_lines)
        if n_out == 1 and avals[0].size == 0:
            # Empty arrays make later indexing invalid: keep every variable non-empty.
            a = Aval(tuple(max(n, 1) for n in avals[0].shape), avals[0].dtype)
            expr, avals = f"fit({expr}, {a.shape!r}, {a.dtype!r})", (a,)
        targets = tuple((self.names.var(), a) for a in avals)
        assert len(targets) == n_out, (expr, avals)
        lhs = ", ".join(t for t, _ in targets)
        self.ops.append(Op(kind, targets, exprs_lines + (f"{lhs} = {expr}",)))
        for t, a in targets:
            self.env[t] = a
            self.local.append(t)

    # --- blocks -------------------------------------------------------------------------------

    def block(
        self,
        kind: str,
        params: list[tuple[str, Aval]],
        results: list[Aval | None],
        pre: tuple[str, ...] = (),
        under_grad: bool | None = None,
        returns: Callable[[list[str]], str] | None = None,
        signature: str | None = None,
    ) -> tuple[str, tuple[str, ...]]:
        """A nested ``def`` whose body sees ``params``; returns ``(function name, lines)``. Each
        entry of ``results`` is an aval the block must return (fitted) or None (any variable).
        ``signature`` replaces the parameter list when ``pre`` unpacks the params from it."""
        fname = self.names.fn(kind)
        env = dict(self.env)
        env.update(dict(params))
        sub = _Builder(
            self.draw,
            self.names,
            env,
            self.depth + 1,
            self.under_grad if under_grad is None else under_grad,
            max_ops=max(1, self.max_ops // 2),
        )
        for p, _ in params:
            sub.local.append(p)
        n_ops = self.integers(0, sub.max_ops)
        for _ in range(n_ops):
            sub.step()
        outs = []
        for want in results:
            name = sub.pick_result()
            outs.append(name if want is None else sub.fit_expr(name, want))
        ret = (
            returns(outs)
            if returns is not None
            else (outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")")
        )
        header = [f"def {fname}({signature or ', '.join(p for p, _ in params)}):"]
        body = ["    " + ln for ln in pre]
        for op in sub.ops:
            body += ["    " + ln for ln in op.lines]
        body.append(f"    return {ret}")
        return fname, tuple(header + body)

    # --- ops ------------------------------------------------------------------------------------

    def step(self) -> None:
        # Repeats weight the draw towards what the passes rewrite (in-place updates, loops).
        kinds = [
            "unary",
            "binary",
            "at_update",
            "reduce",
            "reshape",
            "dot",
            "cast",
            "compare",
            "broadcast",
            "transpose",
            "slice",
            "concat",
            "gather",
            "dynamic_slice",
            "dynamic_update_slice",
            "at_update",
            "at_update",
            "dynamic_update_slice",
            "window_chain",
        ]
        if self.depth < 2:
            kinds += [
                "cond",
                "switch",
                "scan",
                "fori_loop",
                "vmap",
                "grad",
                "scan",
                "fill_loop",
                "fill_loop",
            ]
            if not self.under_grad:
                kinds += ["while_loop", "fori_loop_dynamic"]
        kinds += ["prng"]
        if self.depth == 0 and not self.under_grad:
            kinds += ["key_result", "float0"]
        getattr(self, "op_" + self.choice(kinds))()

    def op_unary(self):
        x = self.pick()
        d = self.env[x].dtype
        if d in _FLOATS:
            forms = [
                "jnp.sin({x})",
                "-{x}",
                "jnp.exp({x})",
                "jnp.tanh({x})",
                "jnp.abs({x})",
                "jnp.sqrt(jnp.abs({x}))",
                "jnp.log1p(jnp.abs({x}))",
                "{x} * 0.5 + 1.0",
                "jnp.floor({x})",
                "jnp.clip({x}, -1.0, 2.0)",
            ]
        elif d == "int32":
            forms = [
                "-{x}",
                "{x} * 3 + 1",
                "jnp.abs({x})",
                "{x} // 2",
                "{x} % 5",
                "~{x}",
                "jnp.clip({x}, -2, 3)",
            ]
        else:
            forms = ["~{x}", "jnp.logical_not({x})"]
        self.bind("unary", (), self.choice(forms).format(x=x))

    def op_cast(self):
        x = self.pick()
        to = self.choice([d for d in FUZZ_DTYPES if d != self.env[x].dtype])
        self.bind("cast", (), f"{x}.astype({to!r})")

    def op_binary(self):
        x = self.pick()
        a = self.env[x]
        y = self.operand(a, broadcast_ok=True)
        if a.dtype in _FLOATS:
            forms = [
                "{x} + {y}",
                "{x} * {y}",
                "{x} - {y}",
                "jnp.maximum({x}, {y})",
                "jnp.minimum({x}, {y})",
                "jnp.where({x} > 0, {x}, {y})",
            ]
        elif a.dtype == "int32":
            forms = [
                "{x} + {y}",
                "{x} * {y}",
                "{x} - {y}",
                "jnp.maximum({x}, {y})",
                "jnp.minimum({x}, {y})",
                "{x} & {y}",
                "{x} | {y}",
                "{x} ^ {y}",
                "jnp.where({x} > 0, {x}, {y})",
            ]
        else:
            forms = ["{x} & {y}", "{x} | {y}", "{x} ^ {y}", "jnp.where({x}, {y}, ~{y})"]
        self.bind("binary", (), self.choice(forms).format(x=x, y=y))

    def op_compare(self):
        x = self.pick()
        a = self.env[x]
        y = self.operand(a, broadcast_ok=True)
        form = self.choice(["<", "==", ">=", "!="] if a.dtype != "bool" else ["==", "!="])
        self.bind("compare", (), f"{x} {form} {y}")

    def op_broadcast(self):
        x = self.pick(lambda a: a.ndim < _MAX_NDIM)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        n = self.integers(1, 3)
        if a.ndim >= 1 and self.boolean():
            axis = self.integers(0, a.ndim)
            shape = list(a.shape)
            shape.insert(axis, n)
            self.bind(
                "broadcast", (), f"jnp.broadcast_to(jnp.expand_dims({x}, {axis}), {tuple(shape)!r})"
            )
        else:
            self.bind("broadcast", (), f"jnp.broadcast_to({x}, {(n,) + a.shape!r})")

    def op_dot(self):
        x = self.pick(lambda a: a.ndim >= 1 and a.dtype in _NUMERIC)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        n = self.integers(1, 3)
        form = self.choice(
            ["matmul", "batched", "tensordot"] if a.ndim >= 2 else ["matmul", "tensordot"]
        )
        if form == "matmul":
            y = self.operand(Aval((a.shape[-1], n), a.dtype))
            self.bind("dot", (), f"jnp.matmul({x}, {y})")
        elif form == "tensordot":
            y = self.operand(Aval((a.shape[0], n), a.dtype))
            self.bind("dot", (), f"jnp.tensordot({x}, {y}, axes=((0,), (0,)))")
        else:
            y = self.operand(Aval((a.shape[0], a.shape[-1], n), a.dtype))
            dims = f"((({a.ndim - 1},), (1,)), ((0,), (0,)))"
            self.bind("dot", (), f"lax.dot_general({x}, {y}, {dims})")

    def op_reduce(self):
        x = self.pick()
        a = self.env[x]
        if a.dtype in _FLOATS:
            fns = ["jnp.sum", "jnp.max", "jnp.min", "jnp.mean", "jnp.argmax", "jnp.prod"]
        elif a.dtype == "int32":
            fns = ["jnp.sum", "jnp.max", "jnp.min", "jnp.argmin", "jnp.prod"]
        else:
            fns = ["jnp.any", "jnp.all", "jnp.sum"]
        fn = self.choice(fns)
        axis = "None" if a.ndim == 0 or self.boolean() else str(self.integers(-a.ndim, a.ndim - 1))
        if fn in ("jnp.argmax", "jnp.argmin") and axis == "None":
            self.bind("reduce", (), f"{fn}({x})")
        else:
            self.bind("reduce", (), f"{fn}({x}, axis={axis}, keepdims={self.boolean()})")

    def op_reshape(self):
        x = self.pick(lambda a: a.size > 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        size, dims = a.size, []
        for _ in range(self.integers(0, _MAX_NDIM - 1)):
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            d = self.choice(divisors)
            dims.append(d)
            size //= d
        dims.append(size)
        self.bind("reshape", (), self.choice([f"{x}.reshape({tuple(dims)!r})", f"{x}.ravel()"]))

    def op_transpose(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        st, _ = hypothesis_modules()
        form = self.choice(["transpose", "flip", "roll"] if a.ndim >= 2 else ["flip", "roll"])
        if form == "transpose":
            perm = tuple(self.draw(st.permutations(range(a.ndim))))
            self.bind("transpose", (), f"jnp.transpose({x}, {perm!r})")
        elif form == "flip":
            self.bind("transpose", (), f"jnp.flip({x}, axis={self.integers(0, a.ndim - 1)})")
        else:
            self.bind(
                "transpose",
                (),
                f"jnp.roll({x}, {self.integers(-3, 3)}, axis={self.integers(0, a.ndim - 1)})",
            )

    def _static_slice(self, n: int, allow_empty: bool) -> str:
        """A slice of an axis of length n: a window (step 1) or strided, possibly reversed, with
        bounds that may be negative or past the end."""
        while True:
            start = self.choice([None, *range(-n - 2, n + 2)])
            stop = self.choice([None, *range(-n - 2, n + 3)])
            step = self.choice([None, 2, -1, 3])
            if allow_empty or len(range(n)[slice(start, stop, step)]) > 0:
                break
            if self.boolean():  # give up on this draw quickly: the whole axis
                start, stop, step = None, None, None
                break
        s = ("" if start is None else str(start)) + ":" + ("" if stop is None else str(stop))
        return s + ("" if step is None else f":{step}")

    def op_slice(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        idx = ", ".join(
            self._static_slice(n, allow_empty=False) for n in a.shape[: self.integers(1, a.ndim)]
        )
        self.bind("slice", (), f"{x}[{idx}]")

    def op_concat(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        m = self.integers(1, 3)
        y = self.operand(Aval((m,) + a.shape[1:], a.dtype))
        self.bind("concat", (), f"jnp.concatenate([{x}, {y}], axis=0)")

    def index(self, a: Aval, allow_empty: bool = True) -> str:
        """An index expression for ``x[...]``/``x.at[...]`` on a value of aval ``a``; updates
        may select nothing (``allow_empty``), reads may not."""
        n = a.shape[0]
        form = self.choice(
            ["int", "slice", "dynamic", "array", "block", "tuple", "ellipsis", "tile"]
        )
        if form == "int":
            return str(self.integers(-n - 2, n + 1))
        if form == "slice":
            return self._static_slice(n, allow_empty)
        if form == "dynamic":
            return self.dyn_scalar(n)
        if form == "array":
            st, _ = hypothesis_modules()
            vals = self.draw(st.lists(st.integers(-n - 1, n), min_size=1, max_size=3))
            return f"jnp.array({vals!r})"
        if form == "block":  # a window of k rows at a traced start: x.at[i + jnp.arange(k)]
            return f"{self.dyn_scalar(n)} + jnp.arange({self.integers(1, n + 1)})"
        if form == "tile" and a.ndim >= 2:  # a 2-D tile at traced starts (issue 18)
            m = a.shape[1]
            rows = f"{self.dyn_scalar(n)} + jnp.arange({self.integers(1, n + 1)})[:, None]"
            return f"{rows}, {self.dyn_scalar(m)} + jnp.arange({self.integers(1, m + 1)})"
        if form == "tuple" and a.ndim >= 2:
            m = a.shape[1]
            parts = {
                "int": lambda k: str(self.integers(-k - 1, k)),
                "dynamic": lambda k: self.dyn_scalar(k),
                "slice": lambda k: self._static_slice(k, allow_empty),
            }
            first = self.choice(["int", "dynamic", "slice"])
            second = self.choice(["slice", "dynamic", "int"])
            return f"{parts[first](n)}, {parts[second](m)}"
        return "..."

    def op_at_update(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        methods = (
            ["set", "add", "mul", "min", "max", "get", "apply"]
            if a.dtype != "bool"
            else ["set", "get"]
        )
        if self.under_grad:  # JAX differentiates neither scatter_apply nor non-unique scatter_mul
            methods = [m for m in methods if m not in ("mul", "apply")]
        method = self.choice(methods)
        idx = self.index(a, allow_empty=method != "get")
        if method == "apply":
            fn = self.choice(
                ["jnp.negative", "lambda v: v * 3 + 1"]
                + (["jnp.sin", "jnp.sqrt", "jnp.exp"] if a.dtype in _FLOATS else [])
            )
            mode = self.choice([None, "drop", "clip"])
            extra = f", mode={mode!r}" if mode else ""
            self.bind("at_update", (), f"{x}.at[{idx}].apply({fn}{extra})")
            return
        mode = self.choice([None, "drop", "clip"] if method != "get" else [None, "fill", "clip"])
        window = _aval_of(f"{x}[{idx}]", self.env)[0]
        if method == "get":
            extra = f"mode={mode!r}" if mode else ""
            if mode == "fill":
                extra += f", fill_value={self.literal(a.dtype)}"
            self.bind("at_get", (), f"{x}.at[{idx}].get({extra})")
            return
        if self.boolean():
            val = self.literal(a.dtype)
        else:
            val = self.operand(Aval(window.shape, a.dtype), broadcast_ok=True)
        extra = f", mode={mode!r}" if mode else ""
        self.bind("at_update", (), f"{x}.at[{idx}].{method}({val}{extra})")

    def op_gather(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        form = self.choice(["dynamic", "array", "take"])
        if form == "take":
            st, _ = hypothesis_modules()
            vals = self.draw(
                st.lists(st.integers(-a.shape[0] - 1, a.shape[0]), min_size=1, max_size=3)
            )
            mode = self.choice(["clip", "wrap", "fill"])
            self.bind("gather", (), f"jnp.take({x}, jnp.array({vals!r}), axis=0, mode={mode!r})")
        else:
            index = self.index(a, allow_empty=False) if form == "array" else self.dyn_scalar()
            self.bind("gather", (), f"{x}[{index}]")

    def op_window_chain(self):
        """Floating-point arithmetic feeding a window at a traced start (a read ``t[i +
        jnp.arange(k)]``, a block or row ``.at[...]`` update) feeding more arithmetic: the shape
        in which a rewrite that moves a fusion boundary (a ``lax.cond`` guard, a
        ``dynamic_update_slice`` fused where the scatter is not) changes rounding through
        FMA contraction."""
        x = self.pick(lambda a: a.ndim >= 1 and a.dtype in _FLOATS and a.shape[0] >= 2)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        y = self.operand(a)
        pre = self.choice(["{x} * {y}", "jnp.sin({x}) * {y}", "{x} * {y} + {y}", "{x} + {y}"])
        t = "(" + pre.format(x=x, y=y) + ")"
        n = a.shape[0]
        form = self.choice(["read", "block", "row"])
        k = self.integers(1, n) if form != "row" else 1
        i = self.dyn_scalar(n)
        idx = i if form == "row" else f"{i} + jnp.arange({k})"
        win = Aval(a.shape[1:] if form == "row" else (k,) + a.shape[1:], a.dtype)
        u, v = self.operand(win), self.operand(win)
        if form == "read":
            expr = f"{t}[{idx}] * {u} + {v}"
        else:
            methods = ["set", "add", "min", "max"] + ([] if self.under_grad else ["multiply"])
            method = self.choice(methods)
            out = self.choice(["* {y} + {x}", "+ {x} * {y}", "* {y}"]).format(x=x, y=y)
            expr = f"jnp.sin({t}.at[{idx}].{method}({u} * {v} + {u}) {out})"
        self.bind("window_chain", (), expr)

    def _starts(self, a: Aval) -> str:
        starts = [
            self.dyn_scalar() if self.boolean() else str(self.integers(-2, n + 1)) for n in a.shape
        ]
        return "(" + ", ".join(starts) + ("," if len(starts) == 1 else "") + ")"

    def op_dynamic_slice(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        sizes = tuple(self.integers(1, n) for n in a.shape)
        self.bind("dynamic_slice", (), f"lax.dynamic_slice({x}, {self._starts(a)}, {sizes!r})")

    def op_dynamic_update_slice(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        sizes = tuple(self.integers(1, n) for n in a.shape)
        u = self.operand(Aval(sizes, a.dtype))
        self.bind(
            "dynamic_update_slice", (), f"lax.dynamic_update_slice({x}, {u}, {self._starts(a)})"
        )

    # --- control flow and transformations ------------------------------------------------------

    def predicate(self) -> str:
        p = self.pick()
        a = self.env[p]
        if a.dtype == "bool":
            return f"jnp.any({p})"
        return f"{p}.ravel()[0] > 0" if a.ndim else f"{p} > 0"

    def op_cond(self):
        x = self.pick()
        a = self.env[x]
        pred = self.predicate()
        t, t_lines = self.block("true", [("a", a)], [a])
        f, f_lines = self.block("false", [("a", a)], [a])
        self.bind("cond", t_lines + f_lines, f"lax.cond({pred}, {t}, {f}, {x})")

    def op_switch(self):
        x = self.pick()
        a = self.env[x]
        index = self.dyn_scalar()
        fns, lines = [], ()
        for _ in range(self.integers(1, 3)):
            f, f_lines = self.block("branch", [("a", a)], [a])
            fns.append(f)
            lines += f_lines
        self.bind("switch", lines, f"lax.switch({index}, [{', '.join(fns)}], {x})")

    def op_scan(self):
        c = self.pick()
        xs = self.pick(lambda a: a.ndim >= 1)
        if xs is None:
            return self.op_fori_loop()
        ca, xa = self.env[c], self.env[xs]
        body, lines = self.block(
            "body", [("carry", ca), ("x", Aval(xa.shape[1:], xa.dtype))], [ca, None]
        )
        opts = []
        if self.boolean():
            opts.append("reverse=True")
        unroll = self.choice([1, 2, True])
        if unroll != 1:
            opts.append(f"unroll={unroll}")
        extra = "".join(", " + o for o in opts)
        self.bind("scan", lines, f"lax.scan({body}, {c}, {xs}{extra})", n_out=2)

    def op_fori_loop(self):
        c = self.pick()
        ca = self.env[c]
        body, lines = self.block("body", [("i", Aval((), "int32")), ("carry", ca)], [ca])
        lo = self.integers(0, 2)
        hi = self.integers(lo, 4)
        self.bind("fori_loop", lines, f"lax.fori_loop({lo}, {hi}, {body}, {c})")

    def op_fill_loop(self):
        """The loop autoopt's in-place pass is for: a buffer filled row by row (or block by
        block) at an index made from the loop counter, whose trip count may overrun the buffer."""
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_fori_loop()
        a = self.env[x]
        n = a.shape[0]
        k = self.integers(1, max(1, n // 2))
        hi = self.integers(0, n + 2)
        index = self.choice(
            [
                "i",
                f"i + {self.integers(-1, 1)}",
                f"{n - 1} - i",
                "2 * i",
                f"i * {k} + jnp.arange({k})",
                f"{self.dyn_scalar(n)} + i * {k} + jnp.arange({k})",  # a window at a traced start
                f"(i + {self.integers(0, 2)}) % {n}",
            ]
        )

        def update_method():  # drawn when the block is built, after its body
            return self.choice(["set", "add"] if a.dtype != "bool" else ["set"])

        body, lines = self.block(
            "fill",
            [("i", Aval((), "int32")), ("buf", a)],
            [
                Aval(
                    _aval_of(f"buf[{index}]", {**self.env, "i": Aval((), "int32"), "buf": a})[
                        0
                    ].shape,
                    a.dtype,
                )
            ],
            returns=lambda outs: f"buf.at[{index}].{update_method()}({outs[0]})",
        )
        self.bind("fill_loop", lines, f"lax.fori_loop(0, {hi}, {body}, {x})")

    def op_fori_loop_dynamic(self):
        c = self.pick()
        ca = self.env[c]
        hi = f"jnp.clip({self.dyn_scalar()}, 0, 4)"
        body, lines = self.block("body", [("i", Aval((), "int32")), ("carry", ca)], [ca])
        self.bind("fori_loop", lines, f"lax.fori_loop(0, {hi}, {body}, {c})")

    def op_while_loop(self):
        c = self.pick()
        ca = self.env[c]
        n = self.integers(0, 4) if self.boolean() else f"jnp.clip({self.dyn_scalar()}, 0, 4)"
        cond_name = self.names.fn("cond")
        cond_lines = (f"def {cond_name}(s):", f"    return s[0] < {n}")
        body, body_lines = self.block(
            "body",
            [("i", Aval((), "int32")), ("carry", ca)],
            [ca],
            pre=("i, carry = s",),
            returns=lambda outs: f"(i + 1, {outs[0]})",
            signature="s",
        )
        self.bind(
            "while_loop",
            cond_lines + body_lines,
            f"lax.while_loop({cond_name}, {body}, (jnp.int32(0), {c}))[1]",
        )

    def op_vmap(self):
        x = self.pick(lambda a: a.ndim >= 1)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        f, lines = self.block("per_row", [("a", Aval(a.shape[1:], a.dtype))], [None])
        self.bind("vmap", lines, f"jax.vmap({f})({x})")

    def op_grad(self):
        x = self.pick(lambda a: a.dtype in _FLOATS)
        if x is None:
            return self.op_unary()
        a = self.env[x]
        f, lines = self.block(
            "loss",
            [("a", a)],
            [None],
            under_grad=True,
            returns=lambda outs: f"jnp.sum({outs[0]}.astype('float32'))",
        )
        self.bind("grad", lines, f"jax.grad({f})({x})")

    # --- extended dtypes: PRNG key arrays and float0 ------------------------------------------

    def key_lines(self) -> tuple[str, tuple[str, ...]]:
        """Lines binding a fresh key array (split from a typed key of a random implementation),
        updated the ways programs update key arrays: a scatter at a traced (maybe out of
        bounds) row, or a scan carrying the keys. Returns its name and the lines."""
        k = self.names.fn("k")
        impl = self.choice(KEY_IMPLS)
        n = self.integers(2, 4)
        lines = [
            f"{k} = jax.random.split(jax.random.key({self.integers(0, 9)}, impl={impl!r}), {n})"
        ]
        form = self.choice(["scatter", "scan", "gather", "plain"])
        if form == "scatter":
            i = self.dyn_scalar(n)
            lines.append(
                f"{k} = {k}.at[{i}].set(jax.random.fold_in({k}[0], {self.integers(0, 9)}))"
            )
        elif form == "scan":
            body = (
                f"lambda c, _: (c.at[{self.integers(0, n - 1)}].set("
                f"jax.random.fold_in(c[-1], 3)), None)"
            )
            lines.append(f"{k} = lax.scan({body}, {k}, None, length={self.integers(1, 3)})[0]")
        elif form == "gather":
            i = self.dyn_scalar(n)
            lines.append(f"{k} = jax.random.split({k}[{i}], {n})")
        return k, tuple(lines)

    def op_prng(self):
        """Numbers drawn from a key array: keys flow through the passes to a float result."""
        k, lines = self.key_lines()
        shape = self.env[self.pick()].shape
        row = self.dyn_scalar()
        sample = self.choice(["uniform", "normal", "bits"])
        if sample == "bits":
            expr = f"jax.random.bits({k}[{row} % {k}.shape[0]], {shape!r}).astype('int32')"
        else:
            expr = f"jax.random.{sample}({k}[{row} % {k}.shape[0]], {shape!r})"
        self.bind("prng", lines, expr)

    def op_key_result(self):
        """A key array itself, as a value a program may return (only as a result)."""
        k, lines = self.key_lines()
        self.bind("key", lines, k)

    def op_float0(self):
        """The gradient with respect to an integer input (``allow_int``): a float0 value, as a
        value a program may return (only as a result)."""
        x = self.pick(lambda a: a.dtype in _FLOATS)
        i = self.pick(lambda a: a.dtype == "int32")
        if x is None or i is None:
            return self.op_prng()
        f = self.names.fn("lossi")
        lines = (f"def {f}(a, n):", "    return jnp.sum(a.astype('float32')) * jnp.sum(n)")
        self.bind("float0", lines, f"jax.grad({f}, argnums=1, allow_int=True)({x}, {i})")


# --- strategies ---------------------------------------------------------------------------------


def _in_aval(draw) -> Aval:
    st, hnp = hypothesis_modules()
    dtype = draw(st.sampled_from(FUZZ_DTYPES))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=_MAX_NDIM, min_side=1, max_side=_MAX_SIDE))
    return Aval(tuple(shape), dtype)


# Shapes of the float arrays a window-chain program starts from: long enough that a window at a
# traced start is in bounds, out of bounds and negative, and that FMA contraction shows.
_WINDOW_SHAPES = ((12,), (16, 8), (8,), (6, 4))


def programs(max_ops: int = 6, max_params: int = 3, first: str | None = None):
    """Strategy for random ``Program``s of up to ``max_ops`` top-level statements (nested
    blocks get fewer) over up to ``max_params`` parameters, each an array or a dict/tuple of
    arrays. ``first``: an op every program starts with (``"window_chain"``: its first
    parameter is then a float32 array of one of ``_WINDOW_SHAPES``)."""
    st, _ = hypothesis_modules()

    @st.composite
    def build(draw):
        names = _Names()
        env: dict[str, Aval] = {}
        params, in_avals, unpack = [], [], []
        for p in range(draw(st.integers(1, max_params))):
            pname = f"x{p}"
            params.append(pname)
            form = draw(st.sampled_from(["array", "dict", "tuple"]))
            if first == "window_chain" and p == 0:
                form = "array"
            if form == "array":
                a = _in_aval(draw)
                if first == "window_chain" and p == 0:
                    a = Aval(draw(st.sampled_from(_WINDOW_SHAPES)), "float32")
                v = names.var()
                unpack.append(f"{v} = {pname}")
                env[v] = a
                in_avals.append(a)
            else:
                keys = ["a", "b"][: draw(st.integers(1, 2))]
                avals = [_in_aval(draw) for _ in keys]
                leaves = []
                for k, a in zip(keys, avals):
                    v = names.var()
                    env[v] = a
                    leaves.append(v)
                    unpack.append(
                        f"{v} = {pname}[{k!r}]"
                        if form == "dict"
                        else f"{v} = {pname}[{keys.index(k)}]"
                    )
                in_avals.append(dict(zip(keys, avals)) if form == "dict" else tuple(avals))
        b = _Builder(draw, names, env, depth=0, under_grad=False, max_ops=max_ops)
        if first is not None:
            getattr(b, "op_" + first)()
        for _ in range(draw(st.integers(0 if first else 1, max_ops))):
            b.step()
        # Outputs: a few variables (the last one first, so shrinking keeps it), as a pytree.
        outs = [b.pick_result() for _ in range(draw(st.integers(1, 3)))]
        form = draw(st.sampled_from(["single", "tuple", "dict"]))
        if form == "single" or len(outs) == 1 and form != "dict":
            result = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
        elif form == "tuple":
            result = "(" + ", ".join(outs) + ")"
        else:
            result = "{" + ", ".join(f"'out{i}': {o}" for i, o in enumerate(outs)) + "}"
        return Program(tuple(params), tuple(in_avals), tuple(unpack), tuple(b.ops), result)

    return build()


def _leaf_values(aval: Aval):
    st, hnp = hypothesis_modules()
    if aval.dtype == "bool":
        strat = hnp.arrays(np.bool_, aval.shape)
    elif aval.dtype == "int32":
        # Small integers: used as indices they land in bounds, out of bounds and negative.
        strat = hnp.arrays(np.int32, aval.shape, elements=st.integers(-6, 6))
    else:
        strat = st.one_of(
            hnp.arrays(
                np.float32, aval.shape, elements=st.floats(-4, 4, width=32, allow_subnormal=False)
            ),
            # Random normal values (hypothesis's arrays repeat a few simple ones): every
            # product rounds, so a multiply-add contracted in one program and not the other
            # shows in the last bit.
            st.integers(0, 2**32 - 1).map(
                lambda seed: (
                    np.random.default_rng(seed).standard_normal(aval.shape).astype(np.float32)
                )
            ),
        )
    return strat.map(lambda v: jnp.asarray(v, dtype=aval.dtype))


def program_args(program: Program):
    """Strategy for arguments matching ``program.in_avals``."""
    st, _ = hypothesis_modules()
    leaves, tree = jax.tree_util.tree_flatten(
        program.in_avals, is_leaf=lambda x: isinstance(x, Aval)
    )
    return st.tuples(*[_leaf_values(a) for a in leaves]).map(
        lambda vals: tuple(jax.tree_util.tree_unflatten(tree, list(vals)))
    )


def fuzz_cases(max_ops: int = 6, max_params: int = 3, first: str | None = None):
    """Strategy for ``FuzzCase``: a random program and arguments for it (``first``: see
    ``programs``)."""
    st, _ = hypothesis_modules()
    return programs(max_ops, max_params, first).flatmap(
        lambda p: program_args(p).map(lambda args: FuzzCase(p, args))
    )


def assert_bitwise(expected: Any, got: Any, *, what: str = "optimized result") -> None:
    """Every float leaf of ``got`` has ``expected``'s bits (-0.0 is not 0.0); NaN matches any
    NaN (XLA does not promise which operand's payload a NaN result carries)."""
    for e, g in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
        if not (hasattr(e, "dtype") and jnp.issubdtype(e.dtype, jnp.inexact)):
            continue
        e, g = np.asarray(e), np.asarray(g)
        if e.dtype != g.dtype or e.shape != g.shape:
            raise AssertionError(
                f"{what}: {g.dtype}{g.shape} where jax.jit gives {e.dtype}{e.shape}"
            )
        view = {2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[e.dtype.itemsize]
        eb = e.reshape(-1).view(view) if e.dtype.itemsize != 16 else e.view(np.uint64)
        gb = g.reshape(-1).view(view) if g.dtype.itemsize != 16 else g.view(np.uint64)
        nan = np.isnan(e.reshape(-1)) & np.isnan(g.reshape(-1))
        if nan.shape != eb.shape:  # complex: two words an element
            nan = np.repeat(nan, eb.size // max(nan.size, 1))
        bad = (eb != gb) & ~nan
        if bad.any():
            raise AssertionError(
                f"{what}: {int(bad.sum())} of {bad.size} elements differ from jax.jit's in "
                f"their bits (largest difference {np.max(np.abs(e.astype(np.complex128) - g)):.3g})"
            )


# How many programs ``check_program`` ran in this process, by outcome (tests report it).
RUNS: collections.Counter = collections.Counter()


def _call(f: Callable, args: tuple) -> Any:
    return f(*args)


def check_program(
    case: FuzzCase, *, through: Callable[[Callable, tuple], Any] = _call, **options: Any
) -> Any:
    """Run ``case`` under ``jax.jit`` and under ``autoopt.optimize(fallback="raise", donate="off",
    window_blend_min_bytes=0, **options)`` and assert equal outputs: bit-identical ints and
    bools, floats bit for bit unless a remat plan may apply (then a dtype-aware tolerance).
    ``through(f, args)`` says how each compiled function is
    called (default ``f(*args)``; pass one that wraps ``f`` in
    ``jax.grad``/``jax.vmap``/``jax.jit`` to check composition). A program ``jax.jit`` rejects
    must be rejected by autoopt with the same exception type, unless it is a
    ``NotImplementedError`` (a missing JAX rule that the rewritten program does not need).
    Returns the optimized outputs (None when jax.jit rejected it). With ``remat="off"`` every
    route (``jax.grad`` included) is compared bit for bit."""
    from autoopt._compare import assert_trees_equivalent
    from autoopt._jit import optimize

    log = os.environ.get("AUTOOPT_FUZZ_LOG")
    if log:  # a process abort (an XLA CHECK) leaves no shrunk example; this file names the case
        with open(log, "w") as f:
            f.write(f"{case!r}\noptions = {options!r}\n")
    fn = case.program.function()
    options.setdefault("fallback", "raise")
    options.setdefault("donate", "off")
    # Every unproven block is blended, however small (by default only from 512 KiB up, where
    # it is faster): the fuzzer's arrays are small, and the blend is what needs checking.
    options.setdefault("window_blend_min_bytes", 0)
    try:
        expected = through(jax.jit(fn), case.args)
    except Exception as e:  # noqa: BLE001 - compare against autoopt's behaviour below
        try:
            through(optimize(fn, **options), case.args)
        except type(e):
            RUNS["rejected by both"] += 1
            return None
        if isinstance(e, NotImplementedError):
            # JAX lacks a rule (``x.at[i].apply(f)`` has no JVP) that the rewritten program no
            # longer needs (scatter_to_dus made it a dynamic_update_slice): more, not different.
            RUNS["rejected by jax.jit only"] += 1
            return None
        raise AssertionError(
            f"jax.jit raised {type(e).__name__}: {e}; autoopt did not.\n{case!r}"
        ) from e
    fast = optimize(fn, **options)
    got = through(fast, case.args)
    info = fast.inspect(*case.args)
    # Bit-identical unless a remat plan may reorder floating point: one applied to the plain
    # call, or one planned for a caller that differentiates (another route than ``_call``),
    # which ``remat="off"`` rules out.
    remat = (through is not _call and options.get("remat") != "off") or any(
        f.kind == "remat" and f.applied for f in info.findings
    )
    assert_trees_equivalent(expected, got, what="optimize(program)", exact=not remat)
    if not remat:
        assert_bitwise(expected, got, what=f"optimize(program)\n{case!r}")
    RUNS["equal" if remat else "bit-identical"] += 1
    # Which passes changed the program, so a run says whether the passes had work to do.
    for name in info.changed_by:
        RUNS[f"rewritten by {name}"] += 1
    if any(f.details.get("reason") == "rounding" for f in info.findings):
        RUNS["a rewrite refused for rounding"] += 1
    return got


def main(argv: list[str] | None = None) -> None:
    """``python -m autoopt.testing._fuzz --minutes 10``: random programs (window-chain ones and
    general ones), forward and under ``jax.grad``, against ``jax.jit`` bit for bit with
    ``remat="off"``, until the time is up; prints the counts."""
    import argparse
    import time

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--chunk", type=int, default=25)
    ns = p.parse_args(argv)

    def grad_route(case):
        floats = tuple(
            i
            for i, spec in enumerate(case.program.in_avals)
            if all(
                a.dtype in _FLOATS
                for a in jax.tree_util.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Aval))
            )
        )

        def through(f, args):
            def loss(*a):
                leaves = [
                    x
                    for x in jax.tree_util.tree_leaves(f(*a))
                    if jnp.issubdtype(x.dtype, jnp.floating)
                ]
                return sum((jnp.sum(x.astype(jnp.float32)) for x in leaves), jnp.float32(0))

            if not floats:
                return loss(*args)
            return jax.grad(loss, argnums=floats)(*args)

        return through

    @settings(
        max_examples=ns.chunk,
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=tuple(HealthCheck.all()),
    )
    @given(
        st.one_of(fuzz_cases(max_ops=4, first="window_chain"), fuzz_cases(max_ops=4)),
        st.sampled_from(["plain", "grad"]),
    )
    def one(case, route):
        RUNS["programs"] += 1
        through = _call if route == "plain" else grad_route(case)
        check_program(case, through=through, remat="off")

    end = time.monotonic() + 60 * ns.minutes
    start = time.monotonic()
    failures = 0
    while time.monotonic() < end:
        try:
            one()
        except Exception as e:  # noqa: BLE001 - a finding: report it (shrunk) and go on
            failures += 1
            print(f"FINDING {failures}: {type(e).__name__}: {e}", flush=True)
        print(f"{time.monotonic() - start:7.0f}s {dict(RUNS)}", flush=True)
    print(f"done: {dict(RUNS)}, findings: {failures}")
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
