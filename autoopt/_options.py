"""Options of ``optimize``: validation, defaults, and the keywords passed through to ``jax.jit``.

Every bad option fails when ``optimize`` is called, with a message that says what to pass
instead; nothing is half-built when it does. The options of a pass (``remat``, ``donate``, ...)
are declared by the pass itself (``Pass(options=(Option(...), ...))``) and checked by the
manager's ``make_options`` (``autoopt.passes``); this module is the bottom of the import graph
and knows nothing of the passes.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# jax.jit keywords we pass through unchanged (jax 0.10.x signature).
JIT_KEYWORDS = (
    "in_shardings",
    "out_shardings",
    "static_argnums",
    "static_argnames",
    "donate_argnums",
    "donate_argnames",
    "keep_unused",
    "device",
    "backend",
    "inline",
    "compiler_options",
)

FALLBACKS = ("warn", "raise")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(value: Any, name: str = "memory_budget") -> int | None:
    """``None``, an int of bytes, or a string such as ``"2GB"``/``"512 MiB"`` -> bytes."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(
            f"{name}={value!r} is not a size; pass bytes (an int) or a string like '2GB'."
        )
    if isinstance(value, numbers.Integral) and not isinstance(value, int):
        value = int(value)  # a NumPy integer (np.int64(2**30), a size computed with NumPy)
    elif isinstance(value, numbers.Real) and not isinstance(value, int | float):
        value = float(value)
    if isinstance(value, int | float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(
                f"{name}={value!r} is not a size; pass bytes (a finite number) or "
                "a string like '2GB', or None for no budget."
            )
        if value <= 0:
            raise ValueError(
                f"{name}={value!r} must be positive; pass bytes or a string like '2GB'."
            )
        if value < 1:  # a fraction would silently round to 0 bytes
            raise ValueError(
                f"{name}={value!r} is less than one byte: it is a number of bytes, "
                "not a fraction of the original's memory; pass bytes or a string "
                "like '2GB'."
            )
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n >= 1:
                return int(n)
            raise ValueError(
                f"{name}={value!r} must be at least one byte; pass a string like '2GB'."
            )
        raise ValueError(
            f"{name}={value!r} is not a size. Pass bytes (an int) or a string such as '2GB', "
            "'512MiB' or '1.5 GB'."
        )
    raise TypeError(
        f"{name} must be None, an int of bytes or a string like '2GB', got {type(value).__name__}."
    )


def _norm_tuple(value: Any, kind: type, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind):
        return (value,)
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        out = tuple(value)
        if all(isinstance(v, kind) for v in out):
            return out
    raise TypeError(f"{name} must be a {kind.__name__} or a sequence of them, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of ``optimize`` that a pass declares (``Pass(options=...)``).

    ``check(value)`` returns the value to keep (``"2GB"`` -> bytes) or raises an error that says
    what to pass instead; it runs only on values the user gave (``default`` is kept as it is).
    """

    name: str
    default: Any = None
    check: Callable[[Any], Any] | None = None
    doc: str = ""


# The options that are not a pass's: how optimize behaves around the passes.
CORE_KEYWORDS = ("explain", "verify", "fallback", "passes")


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options of one ``optimize`` call. Immutable, so one object is shared by threads.

    The options passes declare (``remat``, ``donate``, ...) are in ``pass_options`` and read as
    attributes: ``options.remat``.
    """

    explain: bool = False
    verify: bool = False
    fallback: str = "warn"
    passes: tuple[str, ...] | None = None  # None: every registered pass, in the manager's order
    jit_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pass_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails; "pass_options" itself is absent while copy or
        # pickle rebuild the object, which must not recurse.
        if name.startswith("__") or name == "pass_options":
            raise AttributeError(name)
        try:
            return self.pass_options[name]
        except KeyError:
            raise AttributeError(
                f"Options has no option {name!r}: no registered pass declares it."
            ) from None

    @property
    def static_argnums(self) -> tuple[int, ...]:
        return _norm_tuple(self.jit_kwargs.get("static_argnums"), int, "static_argnums")

    @property
    def static_argnames(self) -> tuple[str, ...]:
        return _norm_tuple(self.jit_kwargs.get("static_argnames"), str, "static_argnames")

    @property
    def explicit_donation(self) -> bool:
        """True when the user gave donate_argnums/argnames: they mean exactly what jax.jit means."""
        return bool(self.jit_kwargs.get("donate_argnums") is not None) or bool(
            self.jit_kwargs.get("donate_argnames") is not None
        )


def unknown_option_error(name: str, known: Sequence[str]) -> TypeError:
    """``known``: every option name, the passes' and the core ones, then jax.jit's keywords."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return TypeError(
        f"optimize() got an unknown option {name!r}.{hint} Options are: {', '.join(known)}."
    )


def split_keywords(
    kwargs: Mapping[str, Any], pass_option_names: Sequence[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``optimize``'s keywords -> (core options, pass options, jax.jit keywords), unvalidated.

    An unknown name raises with the closest known one.
    """
    core: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    jit_kwargs: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in JIT_KEYWORDS:
            if v is not None or k in ("static_argnums", "static_argnames"):
                jit_kwargs[k] = v
        elif k in CORE_KEYWORDS:
            core[k] = v
        elif k in pass_option_names:
            ours[k] = v
        else:
            raise unknown_option_error(k, (*pass_option_names, *CORE_KEYWORDS, *JIT_KEYWORDS))
    return core, ours, jit_kwargs


def build_options(
    core: Mapping[str, Any],
    pass_options: Mapping[str, Any],
    jit_kwargs: Mapping[str, Any],
    known_passes: Sequence[str],
) -> Options:
    """Validate the core options and jax.jit's argnums; ``pass_options`` are already checked by
    their passes' declarations (the manager's ``make_options`` does that)."""
    fallback = core.get("fallback", "warn")
    if fallback not in FALLBACKS:
        raise ValueError(
            f"fallback={fallback!r}: use 'warn' (fall back to plain jax.jit with one warning) or "
            "'raise' (turn any internal error into an exception; for tests)."
        )
    passes = core.get("passes")
    if passes is not None:
        passes = tuple(_norm_tuple(passes, str, "passes"))
        known = tuple(known_passes)
        for p in passes:
            if p not in known:
                close = difflib.get_close_matches(p, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"passes: unknown pass {p!r}.{hint} Known passes: {', '.join(known)}."
                )

    for name, kind in (
        ("static_argnums", int),
        ("static_argnames", str),
        ("donate_argnums", int),
        ("donate_argnames", str),
    ):
        if name in jit_kwargs:
            _norm_tuple(jit_kwargs[name], kind, name)

    return Options(
        explain=bool(core.get("explain", False)),
        verify=bool(core.get("verify", False)),
        fallback=fallback,
        passes=passes,
        jit_kwargs=dict(jit_kwargs),
        pass_options=dict(pass_options),
    )
