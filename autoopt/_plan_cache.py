"""Measured decisions kept on disk, beside JAX's persistent compilation cache (issue 29, item 3).

A remat decision is measured by compiling candidate programs; a second process planning the
same program on the same kind of device with the same options and versions takes the
decision from here and compiles none of them: only the chosen program, which JAX's own cache
then answers too.

Where: ``<jax_compilation_cache_dir>/autoopt-plans/``, only when that option names a local
folder (nothing is written otherwise: a user who configured no cache asked for none). One JSON
file a decision, named by the SHA-256 of its key: the kind of decision, the program's
fingerprint (its jaxpr's text), what the measurement depends on (the candidates proposed,
the budget, the compiler options), the backend and device kind, and the versions of jax,
jaxlib and autoopt (with a digest of autoopt's source). A joint remat decision is kept whole
with the chosen plan's recomputed equations (``passes.remat._pass._plan_joint``), so a later
process rebuilds that plan without enumerating candidates. Files are written whole (a
temporary file renamed), so a concurrent reader sees a decision or none. An unreadable or
stale entry is a miss: the decision is measured again and the entry replaced.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("autoopt")

T = TypeVar("T")

_FOLDER = "autoopt-plans"
_FORMAT = 1


def directory() -> str | None:
    """The folder decisions are kept in, or None when JAX's persistent compilation cache is not
    configured to a local folder."""
    import jax

    try:
        base = jax.config.jax_compilation_cache_dir  # pyright: ignore[reportAttributeAccessIssue]
    except AttributeError:
        return None
    if not base or "://" in str(base):
        return None
    return os.path.join(str(base), _FOLDER)


@functools.cache
def _source_digest() -> str:
    """autoopt's own source (a plan is only as current as the code that measured it: a
    development tree keeps one version number across edits)."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as fh:
                    digest.update(name.encode() + b"\0" + fh.read())
    return digest.hexdigest()


@functools.cache
def _versions() -> tuple[str, ...]:
    """(Read once a process: asking the installed distributions costs a millisecond a key.)"""
    import importlib.metadata

    import jax
    import jaxlib

    try:
        ours = importlib.metadata.version("autoopt")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        ours = "?"
    return (jax.__version__, getattr(jaxlib, "__version__", "?"), ours, _source_digest())


def _device_kind(backend: str | None) -> str:
    import jax

    try:
        return str(jax.devices(backend)[0].device_kind)
    except Exception:  # noqa: BLE001 - no such backend: the key still names it
        return "?"


def key(kind: str, backend: str | None, parts: list) -> str:
    """The file name of a decision: ``parts`` must be JSON-serializable (``repr`` is used for
    what is not) and say everything the measurement depends on besides the device."""
    payload = json.dumps(
        [_FORMAT, kind, backend, _device_kind(backend), list(_versions()), parts],
        default=repr,
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


_UNREAD: Any = object()


def stored(kind: str, backend: str | None, parts: list) -> Any:
    """The value stored for this key as it was written (JSON), or None: for a caller that can
    skip analyses when it knows the decision before making it (then it passes the value to
    ``cached`` as ``found``, which does not read the file again)."""
    folder = directory()
    if folder is None:
        return None
    return _read(os.path.join(folder, key(kind, backend, parts) + ".json"))


def _read(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError, RecursionError):  # (a deeply nested file: not ours)
        return None


def cached(
    kind: str,
    backend: str | None,
    parts: list,
    compute: Callable[[], T],
    encode: Callable[[T], Any],
    decode: Callable[[Any], T | None],
    found: Any = _UNREAD,
) -> T:
    """``compute()``, or the decision stored for the same key. ``decode`` returns None for a
    stored value this process cannot use (then it is computed again). ``found``: what
    ``stored`` returned for the same key, if the caller read it already."""
    folder = directory()
    if folder is None:
        return compute()
    path = os.path.join(folder, key(kind, backend, parts) + ".json")
    value = _read(path) if found is _UNREAD else found
    if value is not None:
        try:
            got = decode(value)
        except Exception as e:  # noqa: BLE001 - a stale entry is a miss
            log.debug("autoopt: plan cache entry %s unusable: %s", path, e)
            got = None
        if got is not None:
            return got
    value = compute()
    _store(folder, path, encode(value))
    return value


def _store(folder: str, path: str, encoded: Any) -> None:
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(encoded, fh)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:  # a read-only cache: the decision still holds
        log.debug("autoopt: could not write plan cache entry %s: %s", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
