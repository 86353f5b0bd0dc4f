# Vendored from https://github.com/google-deepmind/optax, docs/getting_started.ipynb at commit
# 2edbcbe2390da13983b92cbef94ac0460ecde1c5: the code cells of its "Custom optimizers" training example (from
# `BATCH_SIZE = 5` to the first `fit(initial_params, optimizer)` with adam), in order, as one
# script: plain `jax.jit` + optax, no framework. The notebook's earlier and later cells (other
# optimizers, schedules) are left out.
# Changed for benchmarks/public_programs.py, nothing else:
# - `np.random.seed(0)` before the data is drawn (the same data in every run);
# - `import _bench`; `_bench.tick()` at the top of the loop's body; `_bench.finish(...)` on the
#   result of `fit` (final parameters' checksum, time per step, peak RSS: see _bench.py); fit
#   also returns its `step` and last batch for the epilogue's alias figure;
# - expert variant (AUTOOPT_PUBLIC_EXPERT=1): `jax.jit(step, donate_argnums=(0, 1))` (params and
#   opt_state, which the loop rebinds), with `import functools` for it.
# Steps unchanged (1,000 steps of a (8, 32) + (32, 2) network: the loop of small steps).
# fmt: off
# ruff: noqa
import functools

import optax
import jax.numpy as jnp
import jax
import numpy as np

import _bench

BATCH_SIZE = 5
NUM_TRAIN_STEPS = 1_000
np.random.seed(0)
RAW_TRAINING_DATA = np.random.randint(255, size=(NUM_TRAIN_STEPS, BATCH_SIZE, 1))

TRAINING_DATA = np.unpackbits(RAW_TRAINING_DATA.astype(np.uint8), axis=-1)
LABELS = jax.nn.one_hot(RAW_TRAINING_DATA % 2, 2).astype(jnp.float32).reshape(NUM_TRAIN_STEPS, BATCH_SIZE, 2)

initial_params = {
    'hidden': jax.random.normal(shape=[8, 32], key=jax.random.PRNGKey(0)),
    'output': jax.random.normal(shape=[32, 2], key=jax.random.PRNGKey(1)),
}


def net(x: jnp.ndarray, params: optax.Params) -> jnp.ndarray:
  x = jnp.dot(x, params['hidden'])
  x = jax.nn.relu(x)
  x = jnp.dot(x, params['output'])
  return x


def loss(params: optax.Params, batch: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
  y_hat = net(batch, params)

  # optax also provides a number of common loss functions.
  loss_value = optax.sigmoid_binary_cross_entropy(y_hat, labels).sum(axis=-1)

  return loss_value.mean()


def fit(params: optax.Params, optimizer: optax.GradientTransformation) -> optax.Params:
  opt_state = optimizer.init(params)

  @(functools.partial(jax.jit, donate_argnums=(0, 1)) if _bench.EXPERT else jax.jit)
  def step(params, opt_state, batch, labels):
    loss_value, grads = jax.value_and_grad(loss)(params, batch, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss_value

  for i, (batch, labels) in enumerate(zip(TRAINING_DATA, LABELS)):
    _bench.tick()
    params, opt_state, loss_value = step(params, opt_state, batch, labels)
    if i % 100 == 0:
      print(f'step {i}, loss: {loss_value}')

  return params, opt_state, step, (params, opt_state, batch, labels)

# Finally, we can fit our parametrized function using the Adam optimizer
# provided by optax.
optimizer = optax.adam(learning_rate=1e-2)
_ = fit(initial_params, optimizer)
_bench.finish(_[:2], _[2], _[3])
