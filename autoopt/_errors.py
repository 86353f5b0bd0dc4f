"""Warnings and errors autoopt raises: the bottom of the import graph (no autoopt imports)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["AutooptWarning", "HostTransferError", "PassError", "ProcessMismatchError"]


class AutooptWarning(UserWarning):
    """autoopt fell back to plain ``jax.jit``, or could not apply something it found."""


class HostTransferError(RuntimeError):
    """An implicit host-to-device transfer under ``transfer_guard="disallow"``."""


class ProcessMismatchError(RuntimeError):
    """The processes of a ``jax.distributed`` job did not call, decide or build alike (their
    executables would mismatch their collectives and hang). Never turned into a fall-back: a
    process falling back alone would hang the job."""


class PassError(RuntimeError):
    """An exception inside a pass, with the pass name, the passes before it and the user's line."""

    def __init__(
        self, pass_name: str, before: Sequence[str], location: str | None, cause: BaseException
    ):
        self.pass_name = pass_name
        self.before = tuple(before)
        self.location = location
        where = f" while optimizing the function at {location}" if location else ""
        after = f" (after passes {list(before)})" if before else ""
        super().__init__(
            f"autoopt pass {pass_name!r} failed{where}{after}: {type(cause).__name__}: {cause}. "
            f"Run with passes=[...] without {pass_name!r} to skip it, and please report this "
            "with the function that triggers it."
        )


class ControlSignal(BaseException):
    """A signal raised out of jax's trace of the wrapper to a catcher of autoopt's own, never to
    the user (``FitCheck``, the placer's ``HoistConstants``). Not an ``Exception``, as
    KeyboardInterrupt is not: jax's API boundaries filter the traceback of every ``Exception``
    that crosses them, comparing each frame's file with each of jax's own modules (``os.stat``
    calls), which costs a first call milliseconds per boundary where jax is installed on a slow
    filesystem; and no ``except Exception`` on the way, of jax's or autoopt's, takes a signal
    for an error."""


class FitCheck(ControlSignal):
    """Raised out of jit's trace of an optimized function on a signature's first top-level call
    under remat="fit" (``autoopt/_jit/_fit.py``), before anything is lowered: whoever called the
    jit object calls ``standin(jit)`` instead, with the same arguments, which compiles, checks
    the executable against the device's memory, and runs it. Never reaches the user."""

    def __init__(self, program, standin):
        super().__init__("autoopt: a first call to check against the device's memory")
        self.program = program
        self.standin = standin
