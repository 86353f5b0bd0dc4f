"""Value facts about integer arrays: ranges, and which index arrays are contiguous windows.

Two small analyses over a whole ClosedJaxpr, keyed by ``Var`` identity so that a rule running
inside ``_jaxpr.rewrite`` (which visits the original equations, sub-jaxprs included) can look up
facts about its operands:

- **Ranges.** An interval ``[lo, hi]`` that holds for every element of an integer or boolean
  value, in every context the value is computed in. Sources: literals and constants, ``iota``,
  loop counters of ``scan`` and ``while`` (what ``fori_loop`` lowers to), and transfer functions
  for the integer ops that index arithmetic uses (``add``, ``clamp``, ``min``/``max``, ``rem``,
  ``select_n`` ...). ``select_n`` refines each case by its predicate, which is how the
  negative-index normalization ``select_n(i < 0, i, i + n)`` and ``jnp.remainder``'s sign fix-up
  keep tight ranges. Anything unknown is the dtype's full range; nothing is ever narrower than
  what holds at run time. NB: the analogue in XLA is ``xla/service/value_range.cc``; LLVM's
  ``LazyValueInfo`` does the branch refinement.
- **Forms.** Whether an integer array is affine in its positions, ``v[p] = base + sum(s_a p_a)``
  with known strides ``s_a`` (``i + jnp.arange(k)`` has stride 1), and, for index arrays, per
  component of the index vector. ``wrapped`` marks a form seen through the negative-index
  normalization, which is affine only when no element wrapped (a run-time check decides).

A sub-jaxpr shared by several equations (a cached ``jit`` body) gets the join of its contexts,
so facts stay sound for every call site.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from jax.extend.core import primitives as P

from autoopt import _jaxpr
from autoopt._jaxpr import shaped as _shaped
from autoopt._jaxpr import subjaxprs as _subjaxprs

Atom = Any  # Var | Literal

# How deep branch refinement follows definitions: index arithmetic is a few ops deep.
_REFINE_DEPTH = 8


@dataclasses.dataclass(frozen=True)
class Interval:
    """Closed integer interval; ``lo > hi`` is the empty interval (an unreachable value)."""

    lo: int
    hi: int

    @property
    def empty(self) -> bool:
        return self.lo > self.hi

    @property
    def exact(self) -> int | None:
        return self.lo if self.lo == self.hi else None

    def within(self, lo: int, hi: int) -> bool:
        return self.empty or (lo <= self.lo and self.hi <= hi)

    def join(self, other: Interval | None) -> Interval | None:
        if other is None:
            return None
        if self.empty:
            return other
        if other.empty:
            return self
        return Interval(min(self.lo, other.lo), max(self.hi, other.hi))

    def meet(self, other: Interval | None) -> Interval:
        if other is None:
            return self
        return Interval(max(self.lo, other.lo), min(self.hi, other.hi))


EMPTY = Interval(1, 0)


def dtype_interval(dtype) -> Interval | None:
    """The full range of an integer or boolean dtype (int4 included); None for anything else
    (floats, PRNG keys and other extended dtypes)."""
    try:
        return _DTYPE_INTERVALS[dtype]
    except KeyError:
        iv = _DTYPE_INTERVALS[dtype] = _dtype_interval(dtype)
        return iv
    except TypeError:  # an unhashable dtype-like: computed each time
        return _dtype_interval(dtype)


# (asked for every value of the program: numpy's issubdtype and iinfo are slow to ask)
_DTYPE_INTERVALS: dict[Any, Interval | None] = {}


def _dtype_interval(dtype) -> Interval | None:
    if _bool_dtype(dtype):
        return Interval(0, 1)
    if _is_plain(dtype) and jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return Interval(int(info.min), int(info.max))
    return None


def _is_plain(dtype) -> bool:
    """A NumPy-describable dtype: not None, not a jax extended dtype (keys, float0 cotangents
    of ints are NumPy void, also excluded by the callers' integer tests)."""
    return dtype is not None and not jnp.issubdtype(dtype, jax.dtypes.extended)


def _bool_dtype(dtype) -> bool:
    return _is_plain(dtype) and np.dtype(dtype) == np.bool_


def _aval_dtype(atom: Atom):
    return getattr(atom.aval, "dtype", None)


def _fit(iv: Interval | None, dtype) -> Interval | None:
    """``iv`` if every value fits ``dtype`` (no wrap-around), else the dtype's full range."""
    top = dtype_interval(dtype)
    if top is None:
        return None
    if iv is None:
        return top
    if iv.empty:
        return iv
    return iv if iv.within(top.lo, top.hi) else top


def _values_interval(value) -> Interval | None:
    dtype = getattr(value, "dtype", None)
    if dtype is not None and dtype_interval(dtype) is None:
        return None  # floats, and key arrays (which NumPy cannot even convert)
    arr = np.asarray(value)
    if dtype_interval(arr.dtype) is None:
        return None
    if arr.size == 0:
        return EMPTY
    return Interval(int(arr.min()), int(arr.max()))


# --- transfer functions: (eqn, input intervals) -> output intervals --------------------------

Transfer = Callable[[JaxprEqn, Sequence[Interval | None]], Sequence[Interval | None]]
_TRANSFER: dict[Any, Transfer] = {}
# Primitives that compute each output element from the input elements at the same position
# (scalars broadcast): branch refinement may follow these, and only these.
_ELEMENTWISE: set[Any] = set()


def _out(eqn: JaxprEqn, iv: Interval | None) -> list[Interval | None]:
    return [_fit(iv, _aval_dtype(eqn.outvars[0]))]


def _arith(fn: Callable[[Interval, Interval], Interval | None]) -> Transfer:
    def rule(eqn, ins):
        a, b = ins
        if a is None or b is None:
            return _out(eqn, None)
        if a.empty or b.empty:
            return [EMPTY]
        return _out(eqn, fn(a, b))

    return rule


def _corners(f, a: Interval, b: Interval) -> Interval:
    vals = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return Interval(min(vals), max(vals))


_TRANSFER[P.add_p] = _arith(lambda a, b: Interval(a.lo + b.lo, a.hi + b.hi))
_TRANSFER[P.sub_p] = _arith(lambda a, b: Interval(a.lo - b.hi, a.hi - b.lo))
_TRANSFER[P.mul_p] = _arith(lambda a, b: _corners(lambda x, y: x * y, a, b))
_TRANSFER[P.max_p] = _arith(lambda a, b: Interval(max(a.lo, b.lo), max(a.hi, b.hi)))
_TRANSFER[P.min_p] = _arith(lambda a, b: Interval(min(a.lo, b.lo), min(a.hi, b.hi)))


def _trunc_div(x: int, y: int) -> int:
    q = abs(x) // abs(y)
    return q if (x >= 0) == (y > 0) else -q


def _div(a: Interval, b: Interval) -> Interval | None:
    if b.lo <= 0 <= b.hi:
        return None  # division by zero is implementation-defined
    return _corners(_trunc_div, a, b)


def _rem(a: Interval, b: Interval) -> Interval | None:
    if b.lo <= 0 <= b.hi:
        return None
    m = max(abs(b.lo), abs(b.hi)) - 1  # |a rem b| < |b|, and the result has a's sign
    lo = 0 if a.lo >= 0 else max(a.lo, -m)
    hi = 0 if a.hi <= 0 else min(a.hi, m)
    return Interval(lo, hi)


_TRANSFER[P.div_p] = _arith(_div)
_TRANSFER[P.rem_p] = _arith(_rem)


def _unary(fn: Callable[[Interval], Interval | None]) -> Transfer:
    def rule(eqn, ins):
        (a,) = ins[:1]
        if a is None:
            return _out(eqn, None)
        return [EMPTY] if a.empty else _out(eqn, fn(a))

    return rule


def _abs(a: Interval) -> Interval:
    if a.lo >= 0:
        return a
    if a.hi <= 0:
        return Interval(-a.hi, -a.lo)
    return Interval(0, max(-a.lo, a.hi))


def _integer_pow(eqn, ins):
    (a,) = ins
    y = eqn.params["y"]
    if a is None or y < 0:
        return _out(eqn, None)
    if a.empty:
        return [EMPTY]
    iv = _corners(lambda x, _: x**y, a, a)
    if y % 2 == 0 and a.lo < 0 < a.hi:
        iv = Interval(0, iv.hi)
    return _out(eqn, iv)


_TRANSFER[P.neg_p] = _unary(lambda a: Interval(-a.hi, -a.lo))
_TRANSFER[P.abs_p] = _unary(_abs)
_TRANSFER[P.sign_p] = _unary(
    lambda a: Interval(
        -1 if a.lo < 0 else (0 if a.lo == 0 else 1), 1 if a.hi > 0 else (0 if a.hi == 0 else -1)
    )
)
_TRANSFER[P.integer_pow_p] = _integer_pow


def _clamp(eqn, ins):
    lo, x, hi = ins
    if lo is None or x is None or hi is None:
        return _out(eqn, None)
    m = Interval(max(x.lo, lo.lo), max(x.hi, lo.hi))  # XLA: min(max(x, lo), hi)
    return _out(eqn, Interval(min(m.lo, hi.lo), min(m.hi, hi.hi)))


_TRANSFER[P.clamp_p] = _clamp


def _compare(decide: Callable[[Interval, Interval], bool | None]) -> Transfer:
    def rule(eqn, ins):
        a, b = ins
        if a is None or b is None:
            return [Interval(0, 1)]
        if a.empty or b.empty:
            return [EMPTY]
        d = decide(a, b)
        return [Interval(0, 1) if d is None else Interval(int(d), int(d))]

    return rule


def _lt(a, b):
    return True if a.hi < b.lo else (False if a.lo >= b.hi else None)


def _le(a, b):
    return True if a.hi <= b.lo else (False if a.lo > b.hi else None)


def _eq(a, b):
    if a.exact is not None and a.exact == b.exact:
        return True
    return False if (a.hi < b.lo or b.hi < a.lo) else None


def _not(d):
    return None if d is None else not d


_TRANSFER[P.lt_p] = _compare(_lt)
_TRANSFER[P.le_p] = _compare(_le)
_TRANSFER[P.gt_p] = _compare(lambda a, b: _lt(b, a))
_TRANSFER[P.ge_p] = _compare(lambda a, b: _le(b, a))
_TRANSFER[P.eq_p] = _compare(_eq)
_TRANSFER[P.ne_p] = _compare(lambda a, b: _not(_eq(a, b)))


def _is_bool(eqn) -> bool:
    return _bool_dtype(_aval_dtype(eqn.outvars[0]))


def _and(eqn, ins):
    a, b = ins
    if a is None or b is None:
        return _out(eqn, None)
    if _is_bool(eqn):
        return [Interval(a.lo & b.lo, a.hi & b.hi)]
    if a.lo >= 0 and b.lo >= 0:
        return _out(eqn, Interval(0, min(a.hi, b.hi)))
    return _out(eqn, None)


def _or(eqn, ins):
    a, b = ins
    if a is None or b is None:
        return _out(eqn, None)
    if _is_bool(eqn):
        return [Interval(a.lo | b.lo, a.hi | b.hi)]
    return _out(eqn, None)


def _bool_not(eqn, ins):
    (a,) = ins
    if a is not None and _is_bool(eqn):
        return [Interval(1 - a.hi, 1 - a.lo)]
    return _out(eqn, None)


_TRANSFER[P.and_p] = _and
_TRANSFER[P.or_p] = _or
_TRANSFER[P.not_p] = _bool_not


def _convert(eqn, ins):
    (a,) = ins
    new = eqn.params["new_dtype"]
    if dtype_interval(new) is None:
        return [None]
    if a is None:
        return _out(eqn, None)
    if _bool_dtype(new):
        return [Interval(0 if a.lo <= 0 <= a.hi else 1, 0 if a.within(0, 0) else 1)]
    return _out(eqn, a)


_TRANSFER[P.convert_element_type_p] = _convert

_ELEMENTWISE.update(_TRANSFER)
_ELEMENTWISE.update({P.select_n_p, P.copy_p})


def _same(eqn, ins):
    """Outputs take their elements from the first input (shape ops)."""
    return [_fit(ins[0], _aval_dtype(v)) for v in eqn.outvars]


def _join_all(eqn, ins):
    acc = EMPTY
    for iv in ins:
        acc = acc.join(iv)
        if acc is None:
            break
    return [_fit(acc, _aval_dtype(eqn.outvars[0]))]


for _p in (
    P.broadcast_in_dim_p,
    P.reshape_p,
    P.squeeze_p,
    P.transpose_p,
    P.rev_p,
    P.slice_p,
    P.dynamic_slice_p,
    P.copy_p,
    P.cummax_p,
    P.cummin_p,
    P.stop_gradient_p,
):
    _TRANSFER[_p] = _same


def _reduction(eqn, ins):
    """A max, min, and or or over ``axes``: each output element is one of its inputs, except
    over an empty axis, where it is the reduction's identity (the dtype's minimum for a max,
    all ones for an and ...), which no input holds: unknown then."""
    shape = eqn.invars[0].aval.shape
    if any(shape[a] == 0 for a in eqn.params["axes"]):
        return _out(eqn, None)
    return _same(eqn, ins)


for _p in (P.reduce_max_p, P.reduce_min_p, P.reduce_and_p, P.reduce_or_p):
    _TRANSFER[_p] = _reduction
for _p in (P.concatenate_p, P.pad_p):
    _TRANSFER[_p] = _join_all
_TRANSFER[P.dynamic_update_slice_p] = lambda eqn, ins: _join_all(eqn, [ins[0], ins[1]])
_TRANSFER[P.sort_p] = lambda eqn, ins: [_fit(iv, _aval_dtype(v)) for iv, v in zip(ins, eqn.outvars)]


def _iota(eqn, ins):
    n = eqn.params["shape"][eqn.params["dimension"]]
    return _out(eqn, Interval(0, n - 1) if n else EMPTY)


def _arg_index(eqn, ins):
    axis = eqn.params["axes"][0]
    n = eqn.invars[0].aval.shape[axis]
    return _out(eqn, Interval(0, max(n - 1, 0)))


def _gather(eqn, ins):
    mode = str(eqn.params["mode"])
    if "FILL_OR_DROP" in mode:
        fill = eqn.params.get("fill_value")
        fill_iv = None if fill is None else _values_interval(fill)
        return [
            _fit(ins[0].join(fill_iv) if ins[0] is not None else None, _aval_dtype(eqn.outvars[0]))
        ]
    return _same(eqn, ins)


def _scatter_set(eqn, ins):
    if eqn.params.get("update_jaxpr") is not None:
        return _out(eqn, None)
    return _join_all(eqn, [ins[0], ins[2]])


_TRANSFER[P.iota_p] = _iota
_TRANSFER[P.argmax_p] = _arg_index
_TRANSFER[P.argmin_p] = _arg_index
_TRANSFER[P.gather_p] = _gather
_TRANSFER[P.scatter_p] = _scatter_set


# --- forms -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Form:
    """``v[p] = base + sum(strides[a] * p[a])`` for some run-time ``base``.

    ``strides[a]`` is 0 on axes of size 1. ``wrapped``: the value passed through the
    negative-index normalization ``select_n(v < 0, v, v + n)`` and is affine only if no element
    wrapped; check ``v[last] == v[first] + (size - 1)`` at run time before relying on it.
    """

    strides: tuple[int, ...]
    wrapped: bool = False
    # Computed by arithmetic that can overflow its dtype: affine only modulo the dtype's span.
    # The scatter/gather reading such indices sees the wrap in its own dtype and handles it
    # there; converted to another dtype first, the wrap is baked in and the form is unknown.
    may_overflow: bool = False
    # With ``wrapped``: the n of ``v + n`` in the normalization (the blend assumes the axis's).
    wrap_n: int | None = None

    @property
    def uniform(self) -> bool:
        return not any(self.strides)


def _uniform(shape) -> Form:
    return Form((0,) * len(shape))


def _form_of_values(arr: np.ndarray) -> Form | None:
    """The form of a concrete integer array, if it is affine."""
    arr = np.asarray(arr)
    if arr.size == 0 or dtype_interval(arr.dtype) is None or arr.dtype == np.bool_:
        return None
    a = arr.astype(np.int64)
    strides = []
    for ax, n in enumerate(a.shape):
        if n == 1:
            strides.append(0)
            continue
        d = np.diff(a, axis=ax)
        if not (d == d.flat[0]).all():
            return None
        strides.append(int(d.flat[0]))
    return Form(tuple(strides))


@dataclasses.dataclass(frozen=True)
class Component:
    """One component of an index array ``(*batch, K)``: its form over the batch axes, its range."""

    form: Form | None
    range: Interval | None


# --- the analysis ----------------------------------------------------------------------------


class Facts:
    """Ranges and forms for every integer value of one program, keyed by ``Var`` identity.

    Build with ``analyze(closed)``. ``range(atom)`` and ``components(indices)`` are what rules
    ask; ``in_loop(eqn)`` says whether an equation runs once per iteration of a scan or while.
    """

    def __init__(self) -> None:
        self._range: dict[Var, Interval | None] = {}
        self._def: dict[Var, JaxprEqn] = {}
        self._const: dict[Var, Any] = {}
        # Results of equations known to run at most once per call (outside every loop body).
        # Anything else, including equations the walk never reached, counts as in a loop.
        self._once: set[Var] = set()
        self.depth = 0  # how many call views deep (a view re-walks one call site's body)
        # Whether a NumPy constant's value may be read (``analyze``).
        self.numpy_values = True

    # -- queries --

    def _resolve(self, atom: Atom) -> Atom:
        return atom

    def value(self, atom: Atom) -> np.ndarray | None:
        """The concrete value of a literal or constant, else None."""
        atom = self._resolve(atom)
        if isinstance(atom, Literal):
            return np.asarray(atom.val)
        if atom in self._const:
            return np.asarray(self._const[atom])
        return None

    def producer(self, atom: Atom) -> JaxprEqn | None:
        atom = self._resolve(atom)
        return None if isinstance(atom, Literal) else self._def.get(atom)

    def range(self, atom: Atom) -> Interval | None:
        """Interval holding every element of ``atom``; None for non-integer values."""
        atom = self._resolve(atom)
        if isinstance(atom, Literal):
            return _values_interval(atom.val)
        if atom in self._range:
            return self._range[atom]
        return dtype_interval(_aval_dtype(atom)) if hasattr(atom, "aval") else None

    def in_loop(self, eqn: JaxprEqn) -> bool:
        """True unless ``eqn`` is known to run at most once per call of the program."""
        return not any(v in self._once for v in eqn.outvars if isinstance(v, Var))

    # -- branch refinement --

    def refine(
        self, pred: Atom, truth: bool, depth: int = _REFINE_DEPTH
    ) -> dict[Var, Interval] | None:
        """What holds for ``pred``'s operands where ``pred == truth``, position by position.

        Returns narrowed intervals (``{}`` when nothing is learned), or None when ``pred`` can
        never equal ``truth`` (the case is unreachable).
        """
        r = self.range(pred)
        if r is not None and not r.empty and r.exact is not None:
            return {} if bool(r.exact) == truth else None
        eqn = self.producer(pred)
        if eqn is None or depth == 0 or eqn.primitive not in _ELEMENTWISE:
            return {}
        prim, ins = eqn.primitive, eqn.invars
        if prim is P.not_p:
            return self.refine(ins[0], not truth, depth - 1)
        if prim in (P.and_p, P.or_p) and _is_bool(eqn):
            both = (prim is P.and_p) == truth
            a = self.refine(ins[0], truth, depth - 1)
            b = self.refine(ins[1], truth, depth - 1)
            return _meet_env(a, b) if both else _join_env(a, b)
        if prim in (P.eq_p, P.ne_p) and _bool_dtype(_aval_dtype(ins[0])):
            equal = (prim is P.eq_p) == truth
            for x, y in ((ins[0], ins[1]), (ins[1], ins[0])):
                c = self.range(y)
                if c is not None and c.exact is not None:
                    return self.refine(x, bool(c.exact) == equal, depth - 1)
            return {}
        if prim in (P.lt_p, P.le_p, P.gt_p, P.ge_p, P.eq_p, P.ne_p):
            return self._refine_compare(prim, ins[0], ins[1], truth)
        return {}

    def _refine_compare(self, prim, a: Atom, b: Atom, truth: bool) -> dict[Var, Interval] | None:
        ra, rb = self.range(a), self.range(b)
        if ra is None or rb is None:
            return {}
        if prim in (P.gt_p, P.ge_p):  # a > b  <=>  b < a
            a, b, ra, rb = b, a, rb, ra
            prim = P.lt_p if prim is P.gt_p else P.le_p
        if prim is P.lt_p:  # a < b when true; a >= b when false
            na, nb = (
                (Interval(ra.lo, rb.hi - 1), Interval(ra.lo + 1, rb.hi))
                if truth
                else (Interval(rb.lo, ra.hi), Interval(rb.lo, ra.hi))
            )
        elif prim is P.le_p:
            na, nb = (
                (Interval(ra.lo, rb.hi), Interval(ra.lo, rb.hi))
                if truth
                else (Interval(rb.lo + 1, ra.hi), Interval(rb.lo, ra.hi - 1))
            )
        else:
            if (prim is P.eq_p) == truth:
                na = nb = ra.meet(rb)
            else:  # a != b: only an exact other side at an end of the range narrows anything
                na = _exclude(ra, rb.exact)
                nb = _exclude(rb, ra.exact)
        env: dict[Var, Interval] = {}
        for atom, base, new in ((a, ra, na), (b, rb, nb)):
            m = base.meet(new)
            if m.empty:
                return None
            atom = self._resolve(atom)
            if isinstance(atom, Var):
                env[atom] = m
        return env

    def range_under(
        self,
        atom: Atom,
        env: dict[Var, Interval],
        depth: int = _REFINE_DEPTH,
        global_env: bool = False,
    ) -> Interval | None:
        """``range(atom)`` recomputed with the narrowed intervals ``env``.

        ``env`` holds position by position, so it is followed through elementwise ops only;
        ``global_env`` (a scalar predicate) lets it through every op with a transfer function.
        """
        atom = self._resolve(atom)
        if isinstance(atom, Literal):
            return self.range(atom)
        if atom in env:
            return env[atom]
        base = self.range(atom)
        eqn = self.producer(atom)
        if not env or depth == 0 or eqn is None or base is None:
            return base
        body = _call_body(eqn) if eqn.primitive not in _TRANSFER else None
        if body is not None and len(body[0].eqns) <= _INLINE_EQNS and self.depth < _INLINE_DEPTH:
            # Follow the narrowed values into a small call (jnp.where is a jit).
            j, consts = body
            view = _call_view(self, eqn, j)
            _walk(view, j, consts, [self.range(v) for v in eqn.invars], False)
            out = j.outvars[list(eqn.outvars).index(atom)]
            new = view.range_under(out, env, depth - 1, global_env)
            return base if new is None else (new if base is None else new.meet(base))
        if eqn.primitive not in _TRANSFER and eqn.primitive is not P.select_n_p:
            return base
        position_kept = (
            eqn.primitive in _ELEMENTWISE
            or global_env
            or (eqn.primitive is P.broadcast_in_dim_p and _shaped(eqn.invars[0]).shape == ())
        )
        if not position_kept:
            return base
        ins = [self.range_under(v, env, depth - 1, global_env) for v in eqn.invars]
        if eqn.primitive is P.select_n_p:
            outs = [self._select_n(eqn, ins)]
        else:
            outs = _TRANSFER[eqn.primitive](eqn, ins)
        new = outs[list(eqn.outvars).index(atom)]
        return base if new is None else (new if base is None else new.meet(base))

    def _select_n(self, eqn: JaxprEqn, ins: Sequence[Interval | None]) -> Interval | None:
        pred, cases = eqn.invars[0], eqn.invars[1:]
        pr = ins[0]
        if len(cases) != 2 or not _bool_dtype(_aval_dtype(pred)):
            acc = EMPTY
            for k, iv in enumerate(ins[1:]):
                if pr is None or pr.lo <= k <= pr.hi:
                    acc = acc.join(iv)
                    if acc is None:
                        return None
            return acc
        scalar = _shaped(pred).shape == ()
        acc = EMPTY
        for truth, case, iv in ((False, cases[0], ins[1]), (True, cases[1], ins[2])):
            env = self.refine(pred, truth)
            if env is None:
                continue
            r = self.range_under(case, env, global_env=scalar) if env else iv
            if r is None:
                return None
            acc = acc.join(r.meet(iv) if iv is not None else r)
            if acc is None:
                return None
        return acc

    # -- forms --

    def form(self, atom: Atom, depth: int = 16) -> Form | None:
        """The affine form of an integer array, or None when unknown."""
        shape = tuple(getattr(atom.aval, "shape", ()))
        if all(n == 1 for n in shape):
            return _uniform(shape)
        val = self.value(atom)
        if val is not None:
            return _form_of_values(val)
        eqn = self.producer(atom)
        if eqn is None or depth == 0 or dtype_interval(_aval_dtype(atom)) is None:
            return None
        prim, ins = eqn.primitive, eqn.invars

        def sub(v):
            return self.form(v, depth - 1)

        if prim is P.iota_p:
            d = eqn.params["dimension"]
            return Form(tuple(int(a == d and n > 1) for a, n in enumerate(shape)))
        if prim is P.broadcast_in_dim_p:
            f = sub(ins[0])
            if f is None:
                return None
            strides = [0] * len(shape)
            for j, a in enumerate(eqn.params["broadcast_dimensions"]):
                if _shaped(ins[0]).shape[j] == shape[a]:
                    strides[a] = f.strides[j]
            return dataclasses.replace(f, strides=tuple(strides))
        if prim in (P.reshape_p, P.squeeze_p):
            f = sub(ins[0])
            if f is None:
                return None
            src = [s for s, n in zip(f.strides, _shaped(ins[0]).shape) if n != 1]
            if [n for n in _shaped(ins[0]).shape if n != 1] != [n for n in shape if n != 1]:
                return None
            it = iter(src)
            return dataclasses.replace(f, strides=tuple(next(it) if n != 1 else 0 for n in shape))
        if prim is P.convert_element_type_p:
            r = self.range(ins[0])
            new = dtype_interval(eqn.params["new_dtype"])
            if r is None or new is None or _bool_dtype(eqn.params["new_dtype"]):
                return None
            f = sub(ins[0])
            src = dtype_interval(_aval_dtype(ins[0]))
            if f is not None and f.may_overflow and not f.uniform and src != new:
                return None  # converted after a wrap: the values' order is baked in
            return f if r.within(new.lo, new.hi) else None
        if prim in (P.add_p, P.sub_p):
            fa, fb = sub(ins[0]), sub(ins[1])
            if fa is None or fb is None:
                return self._uniform_op(eqn, shape)
            fa, fb = _pad(fa, shape), _pad(fb, shape)
            sign = 1 if prim is P.add_p else -1
            # A normalized value is a block only as it comes out of the normalization: its rows
            # run up to n - 1 and go on from 0. Shifted (``select(r < 0, r + n, r) + 1``), the
            # jump falls elsewhere (n, dropped, then 1), which no run-time check of its first
            # and last value tells apart: only adding an exact 0 keeps the form.
            if (fa.wrapped and _exact(self, ins[1]) != 0) or (
                fb.wrapped and (prim is P.sub_p or _exact(self, ins[0]) != 0)
            ):
                return None
            return Form(
                tuple(x + sign * y for x, y in zip(fa.strides, fb.strides)),
                fa.wrapped or fb.wrapped,
                fa.may_overflow or fb.may_overflow or self._overflows(eqn, sign),
                fa.wrap_n if fa.wrapped else fb.wrap_n,
            )
        if prim is P.neg_p:
            f = sub(ins[0])
            if f is None or f.wrapped:
                return None
            return Form(tuple(-s for s in f.strides), False, f.may_overflow or self._overflows(eqn))
        if prim is P.mul_p:
            for x, y in ((ins[0], ins[1]), (ins[1], ins[0])):
                c = self.range(y)
                f = sub(x)
                if c is not None and c.exact is not None and f is not None and not f.wrapped:
                    return Form(
                        tuple(s * c.exact for s in _pad(f, shape).strides),
                        False,
                        f.may_overflow or self._overflows(eqn),
                    )
            return self._uniform_op(eqn, shape)
        if prim is P.select_n_p:
            return self._select_form(eqn, shape, depth)
        return self._uniform_op(eqn, shape)

    def _overflows(self, eqn: JaxprEqn, sign: int = 1) -> bool:
        """The exact result of ``eqn`` (add, sub with ``sign=-1``, mul or neg) may leave its
        dtype, judged from the operands' ranges."""
        out = dtype_interval(_aval_dtype(eqn.outvars[0]))
        ranges = [self.range(v) for v in eqn.invars]
        rs = [r for r in ranges if r is not None]
        if out is None or len(rs) != len(ranges):
            return True
        if eqn.primitive is P.neg_p:
            lo, hi = -rs[0].hi, -rs[0].lo
        elif eqn.primitive is P.mul_p:
            ends = [a * b for a in (rs[0].lo, rs[0].hi) for b in (rs[1].lo, rs[1].hi)]
            lo, hi = min(ends), max(ends)
        elif sign > 0:
            lo, hi = rs[0].lo + rs[1].lo, rs[0].hi + rs[1].hi
        else:
            lo, hi = rs[0].lo - rs[1].hi, rs[0].hi - rs[1].lo
        return not (out.lo <= lo and hi <= out.hi)

    def _uniform_op(self, eqn: JaxprEqn, shape) -> Form | None:
        """An elementwise op of uniform (all-equal) operands is uniform."""
        if eqn.primitive not in _ELEMENTWISE:
            return None
        for v in eqn.invars:
            f = self.form(v, 4)
            if f is None or not f.uniform:
                return None
        return _uniform(shape)

    def _select_form(self, eqn: JaxprEqn, shape, depth: int) -> Form | None:
        """The negative-index normalization ``select_n(x < 0, x, x + n)`` keeps x's form."""
        pred, cases = eqn.invars[0], eqn.invars[1:]
        if len(cases) == 2:
            x, shifted = cases
            lt = self.producer(pred)
            add = self.producer(shifted)
            if (
                lt is not None
                and lt.primitive is P.lt_p
                and lt.invars[0] is x
                and _exact(self, lt.invars[1]) == 0
                and add is not None
                and add.primitive is P.add_p
                and x in add.invars
            ):
                n = _exact(self, add.invars[1] if add.invars[0] is x else add.invars[0])
                f = self.form(x, depth - 1)
                r = self.range(x)
                if n is not None and n > 0 and f is not None:
                    if r is not None and (r.lo >= 0 or r.hi < 0):
                        return f  # never wraps, or always wraps by the same n
                    if f.wrapped and f.wrap_n != n:
                        return None  # normalized twice, by different lengths
                    return dataclasses.replace(f, wrapped=True, wrap_n=n)
        return self._uniform_op(eqn, shape)

    def components(self, indices: Atom) -> list[Component] | None:
        """Per component of an index array ``(*batch, K)``: its form over ``batch`` and range."""
        shape = tuple(indices.aval.shape)
        if not shape:
            return None
        k = shape[-1]
        val = self.value(indices)
        if val is not None:
            return [
                Component(_form_of_values(val[..., c]), _values_interval(val[..., c]))
                for c in range(k)
            ]
        eqn = self.producer(indices)
        if (
            eqn is not None
            and eqn.primitive is P.concatenate_p
            and eqn.params["dimension"] == len(shape) - 1
        ):
            out: list[Component] = []
            for part in eqn.invars:
                sub = self.components(part)
                if sub is None:
                    return None
                out.extend(sub)
            return out
        f = self.form(indices)
        if f is None:  # structure unknown: only the range, shared by every component
            return [Component(None, self.range(indices)) for _ in range(k)]
        # Affine over the index-vector axis too: every component has the batch strides.
        if k > 1 and f.wrapped:
            return None
        batch = dataclasses.replace(f, strides=f.strides[:-1])
        return [Component(batch, self.range(indices)) for _ in range(k)]


class _CallView(Facts):
    """Facts for one call site of a small body: its parameters stand for the caller's values.

    A jnp helper such as ``jnp.where`` is a ``jit`` whose body is shared by every call site, so
    its own facts are the join of all of them and its predicate is an opaque parameter. Walking
    it again in a view where each parameter resolves to the caller's atom gives this call
    site's result ranges, with branch refinement reaching the caller's comparisons.
    """

    def __init__(self, parent: Facts, alias: dict) -> None:
        super().__init__()
        self._parent = parent
        self._alias = alias
        self.depth = parent.depth + 1
        self.numpy_values = parent.numpy_values

    def _resolve(self, atom: Atom) -> Atom:
        if isinstance(atom, Var) and atom in self._alias:
            atom = self._alias[atom]
        return self._parent._resolve(atom)  # an atom of an enclosing call's body

    def value(self, atom):
        atom = self._resolve(atom)
        own = super().value(atom)
        return own if own is not None or isinstance(atom, Literal) else self._parent.value(atom)

    def producer(self, atom):
        atom = self._resolve(atom)
        own = super().producer(atom)
        return own if own is not None else self._parent.producer(atom)

    def range(self, atom):
        atom = self._resolve(atom)
        if isinstance(atom, Var) and atom not in self._range:
            return self._parent.range(atom)
        return super().range(atom)


# Bodies up to this many equations are re-walked per call site (jnp helpers are a handful),
# through at most this many nested calls (each level can double the walk).
_INLINE_EQNS = 32
_INLINE_DEPTH = 3


def _call_body(eqn: JaxprEqn) -> tuple[Jaxpr, Sequence[Any]] | None:
    """The body of a call that takes the equation's operands and returns its results one to
    one (jit, closed_call, checkpoint, custom_jvp_call, custom_vjp_call), or None."""
    if eqn.primitive.name in ("shard_map", "pallas_call", "custom_partitioning"):
        return None
    for s in eqn.params.values():
        if not isinstance(s, _jaxpr.JAXPR_TYPES):
            continue
        j = s.jaxpr if isinstance(s, ClosedJaxpr) else s
        if (
            len(j.invars) == len(eqn.invars)
            and len(j.outvars) == len(eqn.outvars)
            and all(
                getattr(a.aval, "shape", None) == getattr(b.aval, "shape", None)
                for a, b in zip(j.invars, eqn.invars)
            )
        ):
            return j, (s.consts if isinstance(s, ClosedJaxpr) else ())
    return None


def _call_view(facts: Facts, eqn: JaxprEqn, body: Jaxpr) -> _CallView:
    return _CallView(facts, {v: a for v, a in zip(body.invars, eqn.invars) if isinstance(v, Var)})


def _exclude(iv: Interval, c: int | None) -> Interval:
    if c is None:
        return iv
    if iv.lo == c:
        return Interval(c + 1, iv.hi)
    if iv.hi == c:
        return Interval(iv.lo, c - 1)
    return iv


def _exact(facts: Facts, atom: Atom) -> int | None:
    r = facts.range(atom)
    return None if r is None else r.exact


def _pad(f: Form, shape) -> Form:
    """A scalar operand of an elementwise op against an array: uniform over the array."""
    return f if len(f.strides) == len(shape) else dataclasses.replace(f, strides=(0,) * len(shape))


Env = dict[Var, Interval]  # what a branch condition narrows: Var -> its interval there


def _meet_env(a: Env | None, b: Env | None) -> Env | None:
    if a is None or b is None:
        return None
    out = dict(a)
    for v, iv in b.items():
        m = out[v].meet(iv) if v in out else iv
        if m.empty:
            return None
        out[v] = m
    return out


def _join_env(a: Env | None, b: Env | None) -> Env | None:
    if a is None:
        return b
    if b is None:
        return a
    out = {}
    for v in a.keys() & b.keys():
        joined = a[v].join(b[v])
        if joined is not None:  # never None here (both sides are intervals): no bound to keep
            out[v] = joined
    return out


# --- the forward walk ------------------------------------------------------------------------


# A NumPy constant's values are read up to this size: a program the passes rewrite keeps a copy
# of each integer one it could have read (``_program.value_guards_of``), and a copy of a large
# index table per program would cost its size again.
NUMPY_VALUE_MAX_BYTES = 1 << 20


def analyze(
    closed: ClosedJaxpr, numpy_values: bool = True, assume: Mapping[int, tuple[int, int]] = {}
) -> Facts:
    """Ranges and forms for every value of ``closed`` and all its sub-jaxprs.

    ``numpy_values=False``: a NumPy constant (a closed-over array the caller can refill) counts
    as unknown, for a program traced now and lowered later (``jax.jit(f).trace``): jax reads
    its bytes when it lowers, and a rewrite proven from its value now could be wrong then.
    ``assume``: ``{input index: (lo, hi)}``, ranges the inputs are known to hold (a program
    only ever run on such values, which its caller checks: ``value_bounds``)."""
    facts = Facts()
    facts.numpy_values = numpy_values
    ins: list = [None] * len(closed.jaxpr.invars)
    for k, (lo, hi) in assume.items():
        ins[k] = Interval(lo, hi)
    _walk(facts, closed.jaxpr, closed.consts, ins, False)
    return facts


def _walk(
    facts: Facts, jaxpr: Jaxpr, consts: Sequence[Any], in_ranges: Sequence, in_loop: bool
) -> list[Interval | None]:
    for v, c in zip(jaxpr.constvars, consts):
        if isinstance(c, Tracer) or (
            isinstance(c, np.ndarray)
            and (not facts.numpy_values or c.nbytes > NUMPY_VALUE_MAX_BYTES)
        ):
            _set(facts, v, None)  # closed over from an enclosing trace, or read later: unknown
            continue
        facts._const[v] = c
        _set(facts, v, _values_interval(c) if hasattr(c, "dtype") or np.isscalar(c) else None)
    for v, iv in zip(jaxpr.invars, in_ranges):
        _set(facts, v, _fit(iv, _aval_dtype(v)) if iv is not None or _is_int(v) else None)
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if isinstance(v, Var):
                facts._def[v] = eqn
                if not in_loop:
                    facts._once.add(v)
        if not any(_is_int(v) for v in eqn.outvars) and (
            eqn.primitive in _FIRST_ORDER or not _subjaxprs(eqn)
        ):
            continue  # no integer result to record (``_set``), no body to walk
        ins = [facts.range(v) for v in eqn.invars]
        outs = _eqn_ranges(facts, eqn, ins, in_loop)
        for v, iv in zip(eqn.outvars, outs):
            if isinstance(v, Var):
                _set(facts, v, iv)
    return [facts.range(v) for v in jaxpr.outvars]


# Primitives whose rule here reads only the equation and its operands' ranges.
_FIRST_ORDER = frozenset(_TRANSFER) | {P.select_n_p}


def _is_int(v) -> bool:
    return dtype_interval(_aval_dtype(v)) is not None if hasattr(v, "aval") else False


def _set(facts: Facts, v: Var, iv: Interval | None) -> None:
    """Record a fact; a var seen again (a shared sub-jaxpr) gets the join of both contexts."""
    if not _is_int(v):
        return
    iv = _fit(iv, _aval_dtype(v))
    if v in facts._range:
        old = facts._range[v]
        iv = old.join(iv) if old is not None and iv is not None else None
        iv = _fit(iv, _aval_dtype(v))
    facts._range[v] = iv


def _top(v) -> Interval | None:
    return dtype_interval(_aval_dtype(v)) if _is_int(v) else None


def _eqn_ranges(facts: Facts, eqn: JaxprEqn, ins: list, in_loop: bool) -> list:
    prim = eqn.primitive
    if prim is P.select_n_p:
        if not _is_int(eqn.outvars[0]):
            return [None]
        return [_fit(facts._select_n(eqn, ins), _aval_dtype(eqn.outvars[0]))]
    if prim in _TRANSFER:
        return list(_TRANSFER[prim](eqn, ins))
    if prim is P.scan_p:
        return _scan(facts, eqn, ins, in_loop)
    if prim is P.while_p:
        return _while(facts, eqn, ins, in_loop)
    if prim is P.cond_p:
        outs = None
        for branch in eqn.params["branches"]:
            r = _walk(facts, branch.jaxpr, branch.consts, ins[1:], in_loop)
            outs = (
                r
                if outs is None
                else [a.join(b) if a is not None else None for a, b in zip(outs, r)]
            )
        return outs or [_top(v) for v in eqn.outvars]
    body = _call_body(eqn)
    if body is not None:
        j, consts = body
        joined = _walk(facts, j, consts, ins, in_loop)
        if len(j.eqns) > _INLINE_EQNS or facts.depth >= _INLINE_DEPTH:
            return joined
        return _walk(_call_view(facts, eqn, j), j, consts, ins, in_loop)
    # Anything else with a body (linear_solve, custom transposes, ...): walk it knowing
    # nothing about its inputs and assuming it may run many times.
    if prim.name not in ("shard_map", "pallas_call", "custom_partitioning"):
        for _, _, s in _subjaxprs(eqn):
            j = s.jaxpr if isinstance(s, ClosedJaxpr) else s
            _walk(
                facts,
                j,
                s.consts if isinstance(s, ClosedJaxpr) else (),
                [None] * len(j.invars),
                True,
            )
    return [_top(v) for v in eqn.outvars]


def _step(defs: dict, k_in: Var, k_out: Atom) -> int | None:
    """The constant ``c`` when the body computes ``k_out = k_in + c``, else None."""
    if k_out is k_in:
        return 0
    if not isinstance(k_out, Var):
        return None
    eqn = defs.get(k_out)
    if eqn is None or eqn.primitive is not P.add_p:
        return None
    a, b = eqn.invars
    other = b if a is k_in else (a if b is k_in else None)
    if other is None:
        return None
    if isinstance(other, Literal):
        return int(np.asarray(other.val))
    return None


def _local_defs(jaxpr: Jaxpr) -> dict:
    return {v: e for e in jaxpr.eqns for v in e.outvars if isinstance(v, Var)}


def _scan(facts: Facts, eqn: JaxprEqn, ins: list, in_loop: bool) -> list:
    p = eqn.params
    body: ClosedJaxpr = p["jaxpr"]
    nc, ncarry, length = p["num_consts"], p["num_carry"], p["length"]
    j = body.jaxpr
    defs = _local_defs(j)
    carry_in = j.invars[nc : nc + ncarry]
    carry_out = j.outvars[:ncarry]
    body_ranges: list = list(ins[:nc])
    final: list = []
    for k, (vin, vout) in enumerate(zip(carry_in, carry_out)):
        init = ins[nc + k]
        c = _step(defs, vin, vout) if _is_int(vin) else None
        if init is None or init.empty or c is None or length == 0:
            body_ranges.append(init if c == 0 else _top(vin))
            final.append(init if c == 0 or length == 0 else _top(vin))
            continue
        span = c * (length - 1)
        inside = Interval(init.lo + min(span, 0), init.hi + max(span, 0))
        body_ranges.append(inside)
        last = c * length
        final.append(Interval(init.lo + min(last, 0), init.hi + max(last, 0)))
    body_ranges.extend(ins[nc + ncarry :])  # xs: each slice's elements come from the operand
    outs = _walk(facts, j, body.consts, body_ranges, True)
    ys = outs[ncarry:]
    return [_fit(iv, _aval_dtype(v)) for iv, v in zip(final, eqn.outvars[:ncarry])] + [
        _fit(iv, _aval_dtype(v)) for iv, v in zip(ys, eqn.outvars[ncarry:])
    ]


def _while(facts: Facts, eqn: JaxprEqn, ins: list, in_loop: bool) -> list:
    p = eqn.params
    cond: ClosedJaxpr = p["cond_jaxpr"]
    body: ClosedJaxpr = p["body_jaxpr"]
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    bj, cj = body.jaxpr, cond.jaxpr
    bdefs = _local_defs(bj)
    b_carry, b_out = bj.invars[bn:], bj.outvars
    steps = [
        (_step(bdefs, vin, vout) if _is_int(vin) else None) for vin, vout in zip(b_carry, b_out)
    ]
    # The loop bound: cond computes `lt(carry[k], bound)` (fori_loop), bound loop-invariant.
    body_in: list = [init[k] if steps[k] == 0 else _top(v) for k, v in enumerate(b_carry)]
    final: list = list(body_in)
    cdefs = _local_defs(cj)
    pred = cdefs.get(cj.outvars[0])
    c_carry = cj.invars[cn:]
    if pred is not None and pred.primitive in (P.lt_p, P.le_p):
        a, b = pred.invars
        if a in c_carry:
            k = c_carry.index(a)
            if b in c_carry:
                bound = init[c_carry.index(b)] if steps[c_carry.index(b)] == 0 else None
            elif b in cj.invars[:cn]:
                bound = cconsts[cj.invars.index(b)]
            else:
                bound = _values_interval(b.val) if isinstance(b, Literal) else None
            c = steps[k]
            top = _top(b_carry[k])
            if (
                bound is not None
                and not bound.empty
                and c is not None
                and c > 0
                and init[k] is not None
                and not init[k].empty
                and top is not None
            ):
                hi = bound.hi - (1 if pred.primitive is P.lt_p else 0)
                if hi + c <= top.hi:  # the increment cannot wrap around
                    body_in[k] = Interval(init[k].lo, max(hi, init[k].lo))
                    final[k] = Interval(init[k].lo, max(init[k].hi, hi + c))
    _walk(facts, cj, cond.consts, list(cconsts) + final, True)
    _walk(facts, bj, body.consts, list(bconsts) + body_in, True)
    return [_fit(iv, _aval_dtype(v)) for iv, v in zip(final, eqn.outvars)]


__all__ = ["Interval", "Form", "Component", "Facts", "analyze", "dtype_interval"]
