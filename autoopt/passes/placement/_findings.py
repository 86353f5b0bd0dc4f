"""Placement findings for the report (``Report``), from one call's concrete arguments.

Host arrays and scalars the call passes (named by argument and the caller's line), recompile
triggers (programs that differ only in the type of scalar leaves), large closed-over constants
(hoisted by ``_hoist`` or embedded into the program), and the transfer counts the placer
(``_placement``) measured. Nothing here runs on the call path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax import tree_util

from autoopt import _jaxpr, _trace
from autoopt._finding import Finding
from autoopt._memory import format_bytes
from autoopt.passes.placement._hoist import large_consts, splat_consts
from autoopt.passes.placement._host_arrays import SCALAR_TYPES, is_aligned, is_read_only
from autoopt.passes.placement._placer import PACK_MIN_LEAVES, ZERO_COPY_MIN_BYTES

__all__ = ["findings_for"]

# Closed-over constants at least this large are reported (they are embedded into the HLO).
_LARGE_CONSTANT_BYTES = 1 << 20

_PY_SCALARS = frozenset({bool, int, float, complex})


def findings_for(inspection, args: tuple, kwargs: dict) -> list:
    """Placement findings for one call's concrete arguments (``inspection``: the
    ``OptimizedFunction.inspect`` of them): host arrays and scalars (with the argument name and
    the caller's line), recompile triggers, large closed-over constants, and the transfer counts
    the placer measured."""
    out: list[Finding] = []
    o = inspection.options
    stats = inspection.placement.stats if inspection.placement is not None else None
    site = (stats.first_host_site if stats is not None else None) or inspection.location
    fn = inspection.function
    dyn, statics = _trace.split_args(args, kwargs, o.static_argnums, o.static_argnames)
    leaves = tree_util.tree_leaves(dyn)
    names, _ = _trace.leaf_names_and_args(fn, dyn, statics, len(args))
    on = o.placement in ("auto", "pack")
    # placement="auto" packs a layout only where its first calls measured packing faster
    pack_on = o.placement == "pack" or bool(
        stats is not None and stats.last is not None and stats.last.packed_leaves
    )
    cpu = inspection.backend == "cpu"

    arrays = [i for i, x in enumerate(leaves) if isinstance(x, np.ndarray)]
    scalars = [i for i, x in enumerate(leaves) if type(x) in SCALAR_TYPES]
    read_only = [i for i in arrays if is_read_only(leaves[i])]
    # Every NumPy leaf is transferred on every call, read-only or not (a read-only flag proves
    # nothing: see _host_constants); packing may merge the transfers.
    writeable = arrays
    for i in read_only:
        x = leaves[i]
        out.append(
            Finding(
                kind="placement",
                applied=False,
                location=site,
                bytes_saved=None,
                transfers_avoided=0,
                message=(
                    f"`{names[i]}` ({_describe(x)}, {format_bytes(x.nbytes)}) is read-only, but "
                    "it is still transferred on every call: the flag can be switched back on "
                    "and a base or file under it written, so autoopt cannot prove its bytes "
                    "unchanged. If it never changes, pass autoopt.constant(x) (made once, "
                    "outside the loop) to place it once."
                ),
                details={"leaf": names[i], "strategy": "constant", "bytes": int(x.nbytes)},
            )
        )
    if writeable:
        small = [
            i
            for i in writeable
            if not (cpu and leaves[i].nbytes >= ZERO_COPY_MIN_BYTES and is_aligned(leaves[i]))
        ]
        nbytes = sum(int(leaves[i].nbytes) for i in writeable)
        shown = ", ".join(f"`{names[i]}`" for i in writeable[:4]) + (
            " ..." if len(writeable) > 4 else ""
        )
        if pack_on and len(small) >= PACK_MIN_LEAVES:
            msg = (
                f"{len(writeable)} NumPy argument leaves ({shown}; {format_bytes(nbytes)}) are "
                f"transferred on every call: packed into one aligned host buffer per dtype, "
                f"one transfer instead of {len(small)}."
            )
            avoided = len(small) - len({leaves[i].dtype for i in small})
        else:
            msg = (
                f"NumPy argument leaves {shown} ({format_bytes(nbytes)}) are transferred on "
                "every call by jit" + ("" if on else " (placement='off')") + ". Place them "
                "ahead with autoopt.prefetch(batches) in the loop that feeds this call. "
                "placement='auto' packs 4+ small leaves of a dtype into one transfer where "
                "its first calls measure that faster (it was not, or not yet measured, here); "
                "placement='pack' always packs."
            )
            avoided = 0
        big = [i for i in writeable if leaves[i].nbytes >= _LARGE_CONSTANT_BYTES]
        if big:
            msg += (
                f" `{names[big[0]]}` is large: if it never changes, wrap it in "
                "autoopt.constant(x) (made once, outside the loop) to place it once."
            )
        out.append(
            Finding(
                kind="placement",
                applied=pack_on and avoided > 0,
                location=site,
                transfers_avoided=avoided,
                message=msg,
                details={"leaves": [names[i] for i in writeable], "strategy": "pack"},
            )
        )
    if scalars:
        shown = ", ".join(f"`{names[i]}` ({_describe(leaves[i])})" for i in scalars[:4])
        out.append(
            Finding(
                kind="placement",
                applied=False,
                location=site,
                message=(
                    f"scalar arguments {shown} are transferred by jit on every call, and each "
                    "distinct scalar type (2.0, 2, True, np.float32(2)) compiles a new program, "
                    "as under jax.jit (each gives the result its own dtype); pass one type "
                    "every call, or jax arrays."
                ),
                details={"leaves": [names[i] for i in scalars], "strategy": "scalar"},
            )
        )
    out.extend(_recompile_findings(inspection.programs, site))
    out.extend(_closed_constant_findings(inspection.program, hoist=on))
    if stats is not None and stats.last is not None:
        last = stats.last
        out.append(
            Finding(
                # transfers_avoided stays None: the placement findings above already count them.
                kind="transfer",
                applied=last.implicit < last.before,
                location=site,
                message=(
                    f"host-to-device transfers in the last scanned call: {last.before} host "
                    f"values passed, {last.implicit} transferred implicitly by jit, "
                    f"{last.explicit} placed explicitly ({stats.calls_scanned} calls scanned)."
                ),
                details=dataclasses.asdict(last),
            )
        )
    return out


def _recompile_findings(programs, site) -> list:
    """Programs of this function that differ only in the type of scalar leaves."""
    groups: dict[tuple, list] = {}
    for key, program in list(programs.items()):
        if not program.compiled:  # traced for a report only (explain's own arguments)
            continue
        shapes = tuple(getattr(t, "shape", None) for t in key.types)  # key: _trace.Signature
        groups.setdefault(key._replace(types=shapes), []).append((key.types, program))
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        types0, program = members[0]
        differ = [
            i
            for i in range(len(types0))
            if len(
                {
                    (str(getattr(t[i], "dtype", t[i])), getattr(t[i], "weak_type", False))
                    for t, _ in members
                }
            )
            > 1
        ]
        names = program.traced.in_leaf_names
        shown = ", ".join(f"`{names[i]}`" if i < len(names) else f"leaf {i}" for i in differ[:4])
        out.append(
            Finding(
                kind="placement",
                applied=False,
                location=site,
                message=(
                    f"compiled {len(members)} programs that differ only in the dtype or weak type "
                    f"of {shown}: a recompile trigger (Python scalars of different types, or "
                    "NumPy scalars). Pass one scalar type every call, or jax arrays of one dtype."
                ),
                details={
                    "leaves": [names[i] for i in differ if i < len(names)],
                    "programs": len(members),
                    "strategy": "recompile",
                },
            )
        )
    return out


def _closed_constant_findings(program, hoist: bool = False) -> list:
    """Large constants closed over by the function: passed as device arguments placed once
    (``hoist``: placement on, and at least ``HOIST_MIN_BYTES``) or embedded into the program."""
    closed = program.traced.closed
    # What the placer decided for the program it runs (on its first look: a constant refilled
    # since does not change it)
    passed = {id(c) for c in large_consts(program.final)}
    splats = {id(c) for c in splat_consts(program.final)}
    out = []
    for var, c in zip(closed.jaxpr.constvars, closed.consts):
        nbytes = int(getattr(c, "nbytes", 0) or 0)
        if nbytes < _LARGE_CONSTANT_BYTES or id(c) in splats:
            continue  # (a splat costs nothing embedded: XLA knows its value, see is_splat)
        where = None
        for site in _jaxpr.iter_eqns(closed):
            if any(v is var for v in site.eqn.invars):
                where = _jaxpr.user_location(site.eqn)
                break
        what = f"a closed-over constant {getattr(c, 'dtype', '')}{list(getattr(c, 'shape', ()))}"
        hoisted = hoist and id(c) in passed
        out.append(
            Finding(
                kind="placement",
                applied=hoisted,
                location=where,
                bytes_saved=None,
                message=(
                    f"{what} ({format_bytes(nbytes)}) is passed to the compiled program as a "
                    "device argument, placed once, instead of being embedded into it (calls "
                    "that reach jit without autoopt's placer still embed it)."
                    if hoisted
                    else f"{what} ({format_bytes(nbytes)}) is embedded into the compiled "
                    "program: it slows compilation and is copied into every executable. Pass "
                    "it as an argument (wrapped in autoopt.constant(...) so it is placed once)."
                ),
                details={"bytes": nbytes, "strategy": "closed_constant"},
            )
        )
    return out


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"NumPy {x.dtype}{list(x.shape)}"
    if type(x) in _PY_SCALARS:
        return f"Python {type(x).__name__}"
    if isinstance(x, np.generic):
        return f"NumPy scalar {x.dtype}"
    return type(x).__name__
