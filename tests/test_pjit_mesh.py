"""A ``pjit``-made function under a legacy ``with Mesh(...)``: optimize must not rebuild it as a
``jax.jit`` from its options (its PartitionSpecs resolve against the mesh context of its call).
Found running jax's own ``pjit_test.py`` under ``autoopt run`` (``testJitOfPjitDisallowed``).
Two CPU devices, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import numpy as np
    from functools import partial
    from jax.experimental.pjit import pjit
    from jax.sharding import Mesh, PartitionSpec as P
    import autoopt

    @partial(pjit, in_shardings=(P("x"), P("x")), out_shardings=None)
    def f(x, y):
        return x + y

    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    with Mesh(np.array(jax.devices()[:2]), ("x",)):
        want = np.asarray(jax.jit(f)(x, x + 1))
        got = np.asarray(autoopt.optimize(f)(x, x + 1))
        again = np.asarray(autoopt.optimize(f)(x, x + 1))
        with autoopt.patch():
            patched = np.asarray(jax.jit(f)(x, x + 1))
    assert np.array_equal(want, x + x + 1)
    for out in (got, again, patched):
        assert np.array_equal(out, want)
    print("ok")
    """
)


def test_optimize_of_a_pjit_under_a_legacy_mesh_runs_as_jax_jit_of_it():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
