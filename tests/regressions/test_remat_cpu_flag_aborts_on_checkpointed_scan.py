"""Fuzzer find: XLA:CPU aborts the process on a checkpointed scan body under autoopt's remat flag.

The remat pass compiles every CPU program with ``xla_disable_hlo_passes=cse_barrier_expander``
(``autoopt/passes/remat.py``: ``CPU_FLAGS``, returned by ``jit_options`` whenever remat != "off",
so for every function under the default options). XLA:CPU then keeps the optimization barriers
that ``jax.checkpoint`` emits; a barrier inside a scan body's nested computation reaches the CPU
IR emitter, which dies with ``shape.h:843] Check failed: buffer != nullptr`` in
``IrEmitter::DefaultAction`` <- ``HandleOptimizationBarrier`` (a C++ CHECK: the Python process
aborts, so fallback cannot catch it). Plain ``jax.jit`` of the same program works.

Minimal programs: the gradient of a scan whose body is ``jax.checkpoint``-ed (the user's own
checkpoint, default options), and the fuzzer's shrunk case (a scan over a ``cond``, with
``memory_budget=1``, where the remat pass itself checkpoints the body).

Each program runs in a subprocess, since the failure is a process abort. Fixed: the remat pass no
longer forces the flag (``jit_options`` returns nothing; a user may opt in with
``compiler_options=CPU_FLAGS``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

USER_CHECKPOINT = """
import jax, jax.numpy as jnp
from jax import lax
import autoopt

def loss(x):
    def layer(h, _):
        return jnp.sin(h), None
    return lax.scan(jax.checkpoint(layer), x, None, length=2)[0].sum()

x = jnp.asarray([-1.6, 0.47, -3.03], 'float32')
expected = jax.jit(jax.grad(loss))(x)
got = autoopt.optimize(jax.grad(loss), fallback="raise")(x)
assert (expected == got).all(), (expected, got)
print("OK")
"""

FUZZ_SHRUNK = """
import jax, jax.numpy as jnp
from jax import lax
import autoopt

def program(x):
    def body(carry, _):
        y = lax.cond(carry[0] > 0, lambda a: a, lambda a: a * 2, carry)
        return carry, y
    return lax.scan(body, x, None, length=2)[1]

x = jnp.asarray([-1.6, 0.47, -3.03], 'float32')
autoopt.testing.assert_trees_equivalent(
    jax.jit(program)(x),
    autoopt.optimize(program, fallback="raise", donate="off", memory_budget=1)(x))
print("OK")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_gradient_of_a_users_checkpointed_scan_does_not_abort_under_default_options():
    proc = _run(USER_CHECKPOINT)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]


def test_scan_over_cond_with_a_memory_budget_does_not_abort():
    proc = _run(FUZZ_SHRUNK)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-2000:]
