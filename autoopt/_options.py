"""Options of ``optimize``: validation, defaults, and the keywords passed through to ``jax.jit``.

Every bad option fails here, when ``optimize`` is called, with a message that says what to pass
instead; nothing is half-built when it does.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable, Mapping
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

DONATE_POLICIES = ("safe", "auto", "off")
FALLBACKS = ("warn", "raise")
TRANSFER_GUARDS = (None, "log", "disallow", "allow")
PLACEMENTS = ("auto", "pack", "off")
# jax.checkpoint_policies names a user may force; "auto" and "off" are ours.
REMAT_CHOICES = ("auto", "off")


def _remat_policy_names() -> tuple[str, ...]:
    import jax

    return tuple(
        n
        for n in dir(jax.checkpoint_policies)
        if not n.startswith("_") and callable(getattr(jax.checkpoint_policies, n))
    )


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
        raise TypeError(f"{name}={value!r} is not a size; pass bytes (an int) or a string like '2GB'.")
    if isinstance(value, int | float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name}={value!r} is not a size; pass bytes (a finite number) or "
                             "a string like '2GB', or None for no budget.")
        if value <= 0:
            raise ValueError(f"{name}={value!r} must be positive; pass bytes or a string like '2GB'.")
        if value < 1:  # a fraction would silently round to 0 bytes
            raise ValueError(f"{name}={value!r} is less than one byte: it is a number of bytes, "
                             "not a fraction of the original's memory; pass bytes or a string "
                             "like '2GB'.")
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n >= 1:
                return int(n)
            raise ValueError(f"{name}={value!r} must be at least one byte; pass a string like "
                             "'2GB'.")
        raise ValueError(
            f"{name}={value!r} is not a size. Pass bytes (an int) or a string such as '2GB', "
            "'512MiB' or '1.5 GB'."
        )
    raise TypeError(f"{name} must be None, an int of bytes or a string like '2GB', got {type(value).__name__}.")


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
class Options:
    """Validated options of one ``optimize`` call. Immutable, so one object is shared by threads."""

    donate: str = "safe"
    remat: str = "auto"
    memory_budget: int | None = None
    placement: str = "auto"
    explain: bool = False
    verify: bool = False
    fallback: str = "warn"
    transfer_guard: str | None = None
    canonicalize_scalars: bool = False
    passes: tuple[str, ...] | None = None  # None: every registered pass, in the manager's order
    jit_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

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


_OUR_KEYWORDS = tuple(f.name for f in dataclasses.fields(Options) if f.name != "jit_kwargs")


def unknown_option_error(name: str) -> TypeError:
    known = _OUR_KEYWORDS + JIT_KEYWORDS
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return TypeError(
        f"optimize() got an unknown option {name!r}.{hint} Options are: {', '.join(known)}."
    )


def make_options(**kwargs: Any) -> Options:
    ours: dict[str, Any] = {}
    jit_kwargs: dict[str, Any] = {}
    for k, v in kwargs.items():
        if k in JIT_KEYWORDS:
            if v is not None or k in ("static_argnums", "static_argnames"):
                jit_kwargs[k] = v
        elif k in _OUR_KEYWORDS:
            ours[k] = v
        else:
            raise unknown_option_error(k)

    donate = ours.get("donate", "safe")
    if donate not in DONATE_POLICIES:
        raise ValueError(
            f"donate={donate!r} is not a donation policy. Use 'safe' (default: donate what is "
            "provably dead after the call), 'auto' (donate every aliasable argument), 'off', or "
            "pass donate_argnums=/donate_argnames= for exactly jax.jit's behaviour."
        )
    remat = ours.get("remat", "auto")
    policies = _remat_policy_names()
    if not isinstance(remat, str) or (remat not in REMAT_CHOICES and remat not in policies):
        close = difflib.get_close_matches(str(remat), REMAT_CHOICES + policies, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        import jax

        named = [n for n in policies if getattr(jax.checkpoint_policies, n, None) is remat]
        if named:  # the policy object itself: the option takes its name
            hint = (" Pass the policy's name as a string: "
                    + " or ".join(f"remat={n!r}" for n in named) + ".")
        raise ValueError(
            f"remat={remat!r} is not a remat policy.{hint} Use 'auto', 'off', or one of "
            f"jax.checkpoint_policies: {', '.join(policies)}."
        )
    if remat == "off" and ours.get("memory_budget") is not None:
        raise ValueError("memory_budget is only met by rematerialization, which remat='off' turns "
                         "off: drop one of the two (remat='auto' with the budget recomputes to "
                         "meet it).")
    placement = ours.get("placement", "auto")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: use 'auto' (cache read-only host constants, "
                         "pass large constants as arguments, pack many small NumPy leaves into "
                         "one transfer where measured faster), 'pack' (always pack) or 'off'.")
    fallback = ours.get("fallback", "warn")
    if fallback not in FALLBACKS:
        raise ValueError(
            f"fallback={fallback!r}: use 'warn' (fall back to plain jax.jit with one warning) or "
            "'raise' (turn any internal error into an exception; for tests)."
        )
    guard = ours.get("transfer_guard")
    if guard not in TRANSFER_GUARDS:
        raise ValueError(f"transfer_guard={guard!r}: use None, 'log', 'disallow' or 'allow'.")
    passes = ours.get("passes")
    if passes is not None:
        passes = tuple(_norm_tuple(passes, str, "passes"))
        from autoopt.passes import registered_pass_names

        known = registered_pass_names()
        for p in passes:
            if p not in known:
                close = difflib.get_close_matches(p, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"passes: unknown pass {p!r}.{hint} Known passes: {', '.join(known)}.")

    if "static_argnums" in jit_kwargs:
        _norm_tuple(jit_kwargs["static_argnums"], int, "static_argnums")
    if "static_argnames" in jit_kwargs:
        _norm_tuple(jit_kwargs["static_argnames"], str, "static_argnames")
    if "donate_argnums" in jit_kwargs:
        _norm_tuple(jit_kwargs["donate_argnums"], int, "donate_argnums")
    if "donate_argnames" in jit_kwargs:
        _norm_tuple(jit_kwargs["donate_argnames"], str, "donate_argnames")

    return Options(
        donate=donate,
        remat=remat,
        memory_budget=parse_bytes(ours.get("memory_budget")),
        placement=placement,
        explain=bool(ours.get("explain", False)),
        verify=bool(ours.get("verify", False)),
        fallback=fallback,
        transfer_guard=guard,
        canonicalize_scalars=bool(ours.get("canonicalize_scalars", False)),
        passes=passes,
        jit_kwargs=jit_kwargs,
    )
