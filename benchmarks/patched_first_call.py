"""First calls of library code under ``autoopt.patch()`` (what ``autoopt run`` does), whose
traces run some ops eagerly at trace time (diffrax's and equinox's
``jax.ensure_compile_time_eval``), as under jax.jit: a diffrax solve inside ``jax.jit``, and the
training step of diffrax's documented steady-state example under ``eqx.filter_jit``.

Each sample is a fresh process (jax's caches and autoopt's empty) timing one first call:
plain, with ``autoopt.patch()`` begun before diffrax is imported (as ``autoopt run`` does), and
begun after ("late"); the variants alternate, and every process counts XLA compiles
(jax.monitoring's backend_compile event). There is no hand-written expert here: the expert of a
first call is plain jax.jit.

    python benchmarks/patched_first_call.py [--rounds 5]

Needs diffrax (a test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, sys, time
import jax, jax.numpy as jnp
from jax import monitoring
compiles = []
monitoring.register_event_duration_secs_listener(
    lambda event, d, **kw: compiles.append(1)
    if event == "/jax/core/compile/backend_compile_duration" else None
)
variant, workload = sys.argv[1], sys.argv[2]
if variant == "patched late":  # the library imported before the patch began
    import diffrax, equinox, optax
if variant != "plain":
    import autoopt
    autoopt.patch().__enter__()
import diffrax, equinox as eqx, optax

if workload == "solve":
    def solve(y0):
        term = diffrax.ODETerm(lambda t, y, args: -y)
        return diffrax.diffeqsolve(term, diffrax.Tsit5(), 0, 1, 0.1, y0).ys

    f, args = jax.jit(solve), (jnp.float32(1.0),)
else:  # diffrax's documented steady-state example: its training step, under eqx.filter_jit
    class Decay(eqx.Module):
        steady_state: jax.Array

        def __call__(self, t, y, args):
            return self.steady_state - y

    def loss(model, target):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(model), diffrax.Tsit5(), 0, jnp.inf, None, 1.0, max_steps=None,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-6),
            event=diffrax.Event(diffrax.steady_state_event()), adjoint=diffrax.ImplicitAdjoint(),
        )
        (y1,) = sol.ys
        return (y1 - target) ** 2

    optim = optax.sgd(1e-2, momentum=0.7, nesterov=True)
    model = Decay(jnp.array(0.0))

    @eqx.filter_jit
    def f(model, opt_state, target):
        grads = eqx.filter_grad(loss)(model, target)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    args = (model, optim.init(model), jnp.array(0.76))
t = time.perf_counter()
jax.block_until_ready(f(*args))
print(json.dumps({"seconds": time.perf_counter() - t, "compiles": len(compiles)}))
"""


def _sample(variant: str, workload: str) -> dict:
    import autoopt

    # (the autoopt this process imports, first on the child's path: run from a folder of its
    # own, so that the current directory's checkout cannot stand in for it)
    here = os.path.dirname(os.path.dirname(os.path.abspath(autoopt.__file__)))
    path = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {
        **os.environ,
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
        "PYTHONPATH": path,
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, variant, workload],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    print(f"{'first call':<40} {'median s':>9} {'/ plain':>8} {'compiles':>9}")
    for workload in ("solve", "steady state"):
        samples: dict[str, list[dict]] = {"plain": [], "patched": [], "patched late": []}
        for _ in range(rounds):
            for variant in samples:
                samples[variant].append(_sample(variant, workload))
        plain = statistics.median(s["seconds"] for s in samples["plain"])
        for variant, got in samples.items():
            t = statistics.median(s["seconds"] for s in got)
            counts = sorted({s["compiles"] for s in got})
            name = f"{workload}, {variant}"
            print(f"{name:<40} {t:>9.3f} {t / plain:>7.2f}x {str(counts):>9}")


if __name__ == "__main__":
    main()
