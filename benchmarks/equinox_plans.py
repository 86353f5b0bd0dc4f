"""The per-call cost of ``eqx.filter_jit`` under ``autoopt.patch()`` (issue 31's loop of small
steps): plain ``eqx.filter_jit``, the patched one (the donation proof at the user's statement,
cached plans per call site), and the expert's hand-written donation, interleaved in one process.

Two loops:

- ``mlp``: an ``eqx.nn.MLP`` of width ``--width`` (16: the loop of small steps) + optax adam,
  ``model, opt_state, loss = make_step(model, opt_state, x, y)``; expert:
  ``filter_jit(donate="all-except-first")`` with the batch first (equinox's idiom); ``direct``:
  ``autoopt.optimize(make_step)`` called directly, without ``eqx.filter_jit``;
- ``gru``: the public equinox GRU (benchmarks/public/equinox_train_rnn.py: its ``RNN``, data and
  dataloader, read from the vendored file; its ``make_step`` written out the same), ``loss,
  model, opt_state = make_step(model, x, y, opt_state)`` and ``loss.item()`` per step as there;
  expert: ``filter_jit(donate="all")`` as the vendored file's expert variant.

Reported per loop and variant: the median time of a step (wall and process CPU), its ratio to
plain, whether the final state is bit-identical to plain's, and the buffers one step reuses
(arrays of at least one dimension whose output lives in its input's buffer).
Run it with ``PYTHONPATH`` at another checkout to measure that tree's patch ("before").

    python benchmarks/equinox_plans.py [--steps 100] [--rounds 9] [--width 16] [--only mlp|gru]
"""

from __future__ import annotations

import argparse
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _harness import (
    buffer_pointers,
    interleave_loops,
    markdown_table,
    reused_buffers,
    same_arrays,
)
from frameworks import equinox_variants

import autoopt

HERE = os.path.dirname(os.path.abspath(__file__))


def mlp_loop(width: int):
    """frameworks.py's equinox MLP + adam loop, patched with the defaults only, and ``direct``:
    ``autoopt.optimize(make_step)`` called directly (no ``eqx.filter_jit``), the model's
    activation functions made static by autoopt's own split (``_jit._static_leaves``)."""
    fns, init, loop = equinox_variants(width, patches={"autoopt.patch()": {}})
    expert = fns.pop("expert")
    fns["direct"] = autoopt.optimize(fns["plain"].__wrapped__)
    fns["expert"] = expert
    return fns, init, loop


def _public_gru() -> types.ModuleType:
    """The vendored GRU program's definitions (everything before ``def main``), ``_bench``
    stubbed: the program itself runs ``main()`` when imported."""
    path = os.path.join(HERE, "public", "equinox_train_rnn.py")
    with open(path) as f:
        source = f.read()
    source = source[: source.index("\ndef main(")].replace("import _bench\n", "")
    module = types.ModuleType("equinox_train_rnn_defs")
    sys.modules[module.__name__] = module  # dataclasses read the class's module
    exec(compile(source, path, "exec"), module.__dict__)
    return module


def gru_loop(width: int):
    import equinox as eqx
    import jax.random as jrandom

    gru = _public_gru()
    # main()'s defaults: dataset_size=10000, batch_size=32, learning_rate=3e-3, hidden_size=16
    data_key, model_key = jrandom.split(jrandom.PRNGKey(5678), 2)
    xs, ys = gru.get_data(10000, key=data_key)
    optim = optax.adam(3e-3)

    def init():
        model = gru.RNN(in_size=2, out_size=1, hidden_size=16, key=model_key)
        return model, optim.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))

    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return loss, model, opt_state

    plain = eqx.filter_jit(make_step)
    with autoopt.patch():
        patched = eqx.filter_jit(make_step)
    expert = eqx.filter_jit(make_step, donate="all")

    def loop(kind, fn):
        def run(box, steps):
            model, opt_state = box.pop()
            np.random.seed(0)  # the same batches in every run, as the vendored program
            batches = gru.dataloader((xs, ys), 32)
            before: set[int] = set()
            for i, (x, y) in zip(range(steps), batches):
                if i == steps - 1:
                    before = buffer_pointers((model, opt_state))
                loss, model, opt_state = fn(model, x, y, opt_state)
                loss = loss.item()
            return (model, opt_state), reused_buffers(before, (model, opt_state))

        return run

    return {"plain": plain, "autoopt.patch()": patched, "expert": expert}, init, loop


def bench(name, make, width, steps, rounds):
    fns, init, loop = make(width)
    t, final, reused = interleave_loops(fns, init, loop, steps, rounds)
    rows = []
    base, base_cpu = t.median("plain"), t.cpu.median("plain")
    for k in fns:
        hit, of, _ = reused[k]
        rows.append(
            [
                name,
                k,
                f"{t.median(k) * 1e6:.0f} us",
                f"{t.median(k) / base:.3f}",
                f"{t.cpu.median(k) / base_cpu:.3f}",
                "bit-identical" if same_arrays(final["plain"], final[k]) else "DIFFERENT",
                f"{hit}/{of}",
            ]
        )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--only", choices=("mlp", "gru"), action="append")
    a = ap.parse_args()
    print(f"autoopt from {os.path.dirname(autoopt.__file__)}")
    rows = []
    loops = {"mlp": mlp_loop, "gru": gru_loop}
    for name in a.only or list(loops):
        rows += bench(name, loops[name], a.width, a.steps, a.rounds)
    print(
        markdown_table(
            ["loop", "variant", "step", "x plain (wall)", "x plain (CPU)", "final", "reused"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
