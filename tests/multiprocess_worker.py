"""One process of a 2-process ``jax.distributed`` job on this machine (2 CPU devices each, gloo
collectives), run by ``test_multiprocess.py``: ``python multiprocess_worker.py SCENARIO
PROCESS_ID PORT``. Prints one JSON line starting with ``RESULT`` that the test compares across
the two processes.

Scenarios:

- ``train``: a data-parallel training step over the global mesh (a batch split over the four
  devices, replicated parameters) with donation at the rebinding call, a remat plan (a memory
  budget), and batches fed from process-local NumPy through ``autoopt.prefetch``; its numbers
  against ``jax.jit``'s in the same job.
- ``disagree``: the same step, with process 1's remat measurements forced to disagree with
  process 0's (its compiles report no temporary memory) and its call site keeping the state (it must
  not donate where process 0 donates): the executables must still be the same.
- ``mismatch``: process 1 passes a batch of another shape: both processes must raise an error
  naming the argument instead of hanging.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import traceback

import jax

import autoopt  # before jax.distributed.initialize(): it must not start a backend

SCENARIO, PID, PORT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def loss(w, x, y):
    h = x
    for i in range(4):
        h = jnp.tanh(jnp.sin(h @ w[f"w{i}"]))
    return jnp.mean((h - y) ** 2)


def step(w, x, y):
    value, g = jax.value_and_grad(loss)(w, x, y)
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, w, g), value


# autoopt's functions are made (and may be configured) before initialize(), as in a script
# whose imports decorate their steps
fast = autoopt.optimize(step, remat="auto", memory_budget="1MiB")  # the planner, opted in
early_metric = autoopt.optimize(lambda v: (v * v).sum())  # (the "local" scenario's)

jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2, process_id=PID)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MESH = Mesh(np.array(jax.devices()), ("data",))
REPLICATED = NamedSharding(MESH, P())
BY_ROWS = NamedSharding(MESH, P("data"))
D, ROWS = 64, 256  # rows per process: the global batch is 512 rows


def init():
    ks = jax.random.split(jax.random.key(0), 4)
    w = {f"w{i}": jax.random.normal(ks[i], (D, D)) / math.sqrt(D) for i in range(4)}
    return jax.device_put(w, REPLICATED)


def local_batches(n: int, rows: int = ROWS):
    for i in range(n):
        rng = np.random.default_rng(1000 * i + PID)
        yield (
            rng.standard_normal((rows, D), dtype=np.float32),
            rng.standard_normal((rows, D), dtype=np.float32),
        )


def train(f, keep_state: bool, steps: int = 4):
    w = init()
    kept = None
    donated = []
    losses = []
    for x, y in autoopt.prefetch(local_batches(steps), sharding=BY_ROWS, process_local=True):
        # an int, not the array: a reference to a leaf would forbid its donation
        before = w["w0"].addressable_data(0).unsafe_buffer_pointer()
        if keep_state:
            kept = w
            w, value = f(kept, x, y)
        else:
            w, value = f(w, x, y)
        # the old buffer holds the new value: donated (and reused by the output)
        donated.append(w["w0"].addressable_data(0).unsafe_buffer_pointer() == before)
        losses.append(float(value))
    assert kept is None or not kept["w0"].is_deleted()
    return w, losses, donated


def local(a) -> np.ndarray:
    return np.asarray(a.addressable_data(0))


def main() -> dict:
    out: dict = {"pid": PID}
    if SCENARIO == "mismatch":
        w = init()
        rows = ROWS if PID == 0 else ROWS // 2
        x, y = next(local_batches(1, rows))
        x = jax.make_array_from_process_local_data(BY_ROWS, x)
        y = jax.make_array_from_process_local_data(BY_ROWS, y)
        try:
            fast(w, x, y)
        except autoopt.ProcessMismatchError as e:
            out["error"] = str(e)
        return out
    if SCENARIO == "local":
        # Process-local work, as jax.jit runs it on one process alone: a metric process 0
        # alone computes (a warm-up, a log line, a report), one on arrays whose shapes differ
        # per process (an uneven evaluation split); then a global step both call.
        # (jax.nn.relu is a nested jit: its equation names the empty context mesh)
        metric = autoopt.optimize(lambda v: jax.nn.relu(v * v).mean())
        dev = jax.local_devices()[0]
        if PID == 0:
            report = metric.explain(jax.device_put(np.ones(3, np.float32), dev))
            out["report"] = type(report).__name__
            out["alone"] = float(metric(jax.device_put(np.arange(3, dtype=np.float32), dev)))
            lowered = metric.lower(jax.device_put(np.ones(7, np.float32), dev))
            out["lowered"] = float(lowered.compile()(jax.device_put(np.ones(7, np.float32), dev)))
        out["metrics"] = [
            float(metric(jax.device_put(np.arange(n, dtype=np.float32), dev)))
            for n in ([6, 6, 4] if PID == 0 else [6, 5])
        ]
        # made before initialize(), called from one site with a new shape: a call that runs
        # the function's plain program, on process 0 alone
        if PID == 0:
            out["early"] = [
                float(early_metric(jax.device_put(np.arange(n, dtype=np.float32), dev)))
                for n in (3, 3, 4)
            ]
        w_jit, losses_jit, _ = train(jax.jit(step), keep_state=False, steps=2)
        w_fast, losses_fast, _ = train(fast, keep_state=False, steps=2)
        out["losses_equal"] = losses_jit == losses_fast
        return out
    if SCENARIO == "disagree" and PID == 1:
        # fault injection: this process's compiles report no temporary memory, so every
        # program would fit the budget here and no plan would be needed
        from autoopt.passes.remat import _pass

        measured = _pass._compile

        def skewed(*a, **k):
            got = measured(*a, **k)
            if got is None:
                return None
            m = got.memory
            return _pass.Measured(
                type(m)(m.argument_bytes, m.output_bytes, m.alias_bytes, 0),
                got.flops,
                got.seconds,
            )

        _pass._compile = skewed
    keep = SCENARIO == "disagree" and PID == 1
    w_jit, losses_jit, _ = train(jax.jit(step), keep_state=False)
    w_fast, losses_fast, donated = train(fast, keep_state=keep)
    x, y = next(local_batches(1))
    x = jax.make_array_from_process_local_data(BY_ROWS, x)
    y = jax.make_array_from_process_local_data(BY_ROWS, y)
    info = fast.inspect(init(), x, y)
    remat = [f for f in info.findings if f.kind == "remat" and f.applied]
    out.update(
        losses_equal=losses_jit == losses_fast,
        max_abs_diff=max(float(np.max(np.abs(local(w_jit[k]) - local(w_fast[k])))) for k in w_jit),
        losses=losses_fast,
        donated=donated,
        remat_applied=bool(remat),
        program=hashlib.sha1(str(info.optimized).encode()).hexdigest(),
        executable_donates=[list(d) for d in info.program.donates],
    )
    return out


if __name__ == "__main__":
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = main()
        result["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
        result = {"pid": PID, "crash": traceback.format_exc()}
    print("RESULT " + json.dumps(result), flush=True)
    jax.distributed.shutdown()
